import copy
import json

import pytest

from backend.config import ConfigError, ModelConfig

# the official Kimi-Linear-48B-A3B-Instruct config.json (kimi-linear.md §1)
OFFICIAL = json.loads("""{
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_kimi.KimiLinearConfig",
        "AutoModel": "modeling_kimi.KimiLinearModel",
        "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"
    },
    "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586, "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4
    },
    "mla_use_nope": true, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": true, "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8,
    "num_hidden_layers": 27, "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "pad_token_id": 163839, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
    "tie_word_embeddings": false, "topk_group": 1, "transformers_version": "4.57.0", "use_cache": true,
    "use_grouped_topk": true, "v_head_dim": 128, "vocab_size": 163840
}""")

REQUIRED = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
    "model_max_length", "linear_attn_config", "first_k_dense_replace", "moe_layer_freq", "moe_intermediate_size",
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_renormalize", "moe_router_activation_func",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_nope", "bos_token_id", "eos_token_id", "dtype",
]


def official(**changes) -> dict:
    d = copy.deepcopy(OFFICIAL)
    d.update(changes)
    return d


def test_official_config_parses():
    cfg = ModelConfig.from_dict(OFFICIAL)
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert len(cfg.kda_layers) == 20 and cfg.kda_layers[:3] == (0, 1, 2)
    assert [cfg.is_kda(i) for i in (0, 3, 25, 26)] == [True, False, True, False]
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, 27))
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_size) == (32, 128, 4)
    assert cfg.qk_head_dim == 192 and cfg.eos_token_ids == (163586,) and cfg.pad_token_id == 163839
    assert cfg.model_max_length == 1 << 20 and cfg.dtype == "bfloat16"
    assert cfg.router_biased_weights is False and cfg.kv_a_layernorm_eps == 1e-6


def test_options_eos_list_and_torch_dtype():
    d = official(eos_token_id=[163586, 163585])
    d["torch_dtype"] = d.pop("dtype")
    cfg = ModelConfig.from_dict(d, router_biased_weights=True, kv_a_layernorm_eps=1e-5)
    assert cfg.eos_token_ids == (163586, 163585) and cfg.dtype == "bfloat16"
    assert cfg.router_biased_weights and cfg.kv_a_layernorm_eps == 1e-5


def test_from_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL))
    assert ModelConfig.from_dir(str(tmp_path)) == ModelConfig.from_dict(OFFICIAL)
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(str(tmp_path / "missing"))


def test_wrong_model_type():
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict(official(model_type="deepseek_v3"))


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_key(key):
    d = official()
    del d[key]
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("key", ["kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"])
def test_missing_linear_attn_key(key):
    d = official()
    del d["linear_attn_config"][key]
    with pytest.raises(ConfigError, match=f"linear_attn_config.{key}"):
        ModelConfig.from_dict(d)


def _with_layers(kda, full, **changes):
    d = official(**changes)
    d["linear_attn_config"].update(kda_layers=kda, full_attn_layers=full)
    return d


@pytest.mark.parametrize("d, message", [
    (_with_layers(list(range(1, 27)), [4, 27]), r"layers \[4\] are in both"),
    (_with_layers(list(range(1, 26)), [27]), r"layers \[26\] are in neither"),
    (_with_layers(list(range(1, 27)), [27, 28]), r"outside 1..27"),
    (_with_layers(list(range(0, 27)), [27]), r"outside 1..27"),
    (_with_layers([1, 1] + list(range(2, 27)), [27]), "duplicate"),
    (_with_layers("1,2", [27]), "list of integers"),
    (official(num_experts_per_token=300), "num_experts_per_token = 300 exceeds"),
    (official(q_lora_rank=1536), "q_lora_rank"),
    (official(mla_use_nope=False), "mla_use_nope"),
    (official(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (official(hidden_size=1 << 30), "hidden_size"),
    (official(kv_lora_rank=0), "kv_lora_rank"),
    (official(v_head_dim=-128), "v_head_dim"),
    (official(num_hidden_layers=10 ** 9), "num_hidden_layers"),
    (official(vocab_size=1000), "bos_token_id"),
    (official(eos_token_id=[]), "eos_token_id"),
    (official(num_attention_heads=1024, qk_nope_head_dim=1000), r"heads \* head_dim"),
    (official(dtype="float64"), "dtype"),
    (official(hidden_size=2304.5), "hidden_size must be an integer"),
    (official(moe_renormalize="yes"), "moe_renormalize"),
    (official(num_expert_group=8, topk_group=4), "grouped top-k"),
    (official(rms_norm_eps=0), "rms_norm_eps"),
    (official(first_k_dense_replace=28), "first_k_dense_replace"),
    (official(num_key_value_heads=5), "num_key_value_heads = 5 does not divide num_attention_heads = 32"),
    (official(num_key_value_heads=0), "num_key_value_heads = 0 does not divide"),
])
def test_inconsistent_config_rejected(d, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)
