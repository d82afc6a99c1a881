"""Write a tiny random-weight Kimi-Linear checkpoint in the official layout (names, config keys, two shards).

    python tools/tiny_checkpoint.py OUT_DIR [--tokenizer tiktoken|json|none] [--seed N] [--dtype bfloat16]
                                    [--layers KKKMK]

`--layers` spells the mixer of each layer: K = KDA, M = MLA (full attention). Layer 0 is a dense MLP, the rest MoE.
"""
import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# vocabulary used with tokenizer=None (no tokenizer files written)
_BARE_VOCAB = {"vocab_size": 256, "bos_token_id": 250, "eos_token_id": 252, "pad_token_id": 255}


def tiny_config(layers: str = "KKKMK", vocab: dict = _BARE_VOCAB, dtype: str = "bfloat16", **overrides) -> dict:
    """config.json for a tiny model, with every key of the official file."""
    if not layers or set(layers) - {"K", "M"}:
        raise ValueError(f"layers must be a non-empty string of K and M, got {layers!r}")
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": vocab["bos_token_id"], "dtype": dtype, "eos_token_id": vocab["eos_token_id"],
        "first_k_dense_replace": 1, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "kv_lora_rank": 32,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, c in enumerate(layers) if c == "M"], "head_dim": 16,
            "kda_layers": [i + 1 for i, c in enumerate(layers) if c == "K"], "num_heads": 4,
            "short_conv_kernel_size": 4},
        "mla_use_nope": True, "model_max_length": 4096, "model_type": "kimi_linear", "moe_intermediate_size": 32,
        "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 4, "num_expert_group": 1, "num_experts": 8, "num_experts_per_token": 2,
        "num_hidden_layers": len(layers), "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
        "num_shared_experts": 1, "pad_token_id": vocab["pad_token_id"], "q_lora_rank": None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
        "transformers_version": "4.57.0", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 16,
        "vocab_size": vocab["vocab_size"],
    }
    cfg.update(overrides)
    return cfg


class _Init:
    """Random tensors with scales that keep activations O(1)."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def randn(self, *shape, std=1.0, mean=0.0, dtype=None) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, dtype=torch.float64) * std + mean
        return t.to(dtype or self.dtype)

    def linear(self, out_dim, in_dim, gain=1.0) -> torch.Tensor:
        return self.randn(out_dim, in_dim, std=gain / math.sqrt(in_dim))

    def uniform(self, *shape, low, high) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, dtype=torch.float64) * (high - low) + low

    def norm(self, dim) -> torch.Tensor:
        return self.randn(dim, std=0.1, mean=1.0)


def _kda_tensors(c: dict, init: _Init) -> dict:
    lin = c["linear_attn_config"]
    d, h, k, w = c["hidden_size"], lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    hk = h * k
    # FLA init: A in [1, 16), dt in [1e-3, 0.1) stored as inverse softplus; gate params fp32 as in the HF module
    dt = torch.exp(init.uniform(hk, low=math.log(1e-3), high=math.log(0.1)))
    t = {f"{p}_proj.weight": init.linear(hk, d) for p in "qkv"}
    t.update({f"{p}_conv1d.weight": init.randn(hk, 1, w, std=0.5, dtype=torch.float32) for p in "qkv"})
    t.update({
        "A_log": torch.log(init.uniform(1, 1, h, 1, low=1.0, high=16.0)).float(),
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).float(),
        "f_a_proj.weight": init.linear(k, d), "f_b_proj.weight": init.linear(hk, k),
        "b_proj.weight": init.linear(h, d), "g_a_proj.weight": init.linear(k, d),
        "g_b_proj.weight": init.linear(hk, k), "o_norm.weight": init.norm(k), "o_proj.weight": init.linear(d, hk),
    })
    return t


def _mla_tensors(c: dict, init: _Init) -> dict:
    d, h, lat = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    return {
        "q_proj.weight": init.linear(h * (nope + rope), d), "kv_a_proj_with_mqa.weight": init.linear(lat + rope, d),
        "kv_a_layernorm.weight": init.norm(lat), "kv_b_proj.weight": init.linear(h * (nope + v), lat),
        "o_proj.weight": init.linear(d, h * v),
    }


def _mlp_tensors(d: int, inter: int, init: _Init) -> dict:
    return {"gate_proj.weight": init.linear(inter, d), "up_proj.weight": init.linear(inter, d),
            "down_proj.weight": init.linear(d, inter)}


def _moe_tensors(c: dict, init: _Init) -> dict:
    d, e, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    t = {"gate.weight": init.linear(e, d, gain=2.0),
         "gate.e_score_correction_bias": init.randn(e, std=0.1, dtype=torch.float32)}
    for i in range(e):
        t.update({f"experts.{i}.w1.weight": init.linear(inter, d), f"experts.{i}.w2.weight": init.linear(d, inter),
                  f"experts.{i}.w3.weight": init.linear(inter, d)})
    shared = _mlp_tensors(d, inter * c["num_shared_experts"], init)
    t.update({f"shared_experts.{n}": w for n, w in shared.items()})
    return t


def tiny_tensors(c: dict, seed: int = 0) -> dict:
    """All tensors of the checkpoint, official names, in checkpoint order."""
    init = _Init(seed, _DTYPES[c["dtype"]])
    d, kda = c["hidden_size"], c["linear_attn_config"]["kda_layers"]
    tensors = {"model.embed_tokens.weight": init.randn(c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn = _kda_tensors(c, init) if i + 1 in kda else _mla_tensors(c, init)
        tensors.update({p + "self_attn." + n: w for n, w in attn.items()})
        if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0:
            tensors.update({p + "block_sparse_moe." + n: w for n, w in _moe_tensors(c, init).items()})
        else:
            tensors.update({p + "mlp." + n: w for n, w in _mlp_tensors(d, c["intermediate_size"], init).items()})
        tensors[p + "input_layernorm.weight"] = init.norm(d)
        tensors[p + "post_attention_layernorm.weight"] = init.norm(d)
    tensors["model.norm.weight"] = init.norm(d)
    if not c["tie_word_embeddings"]:
        # gain 4 makes the next-token distribution peaked enough for varied greedy output
        tensors["lm_head.weight"] = init.linear(c["vocab_size"], d, gain=4.0)
    return tensors


def _write_shards(out_dir: str, tensors: dict):
    names = list(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map, total = {}, 0
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(out_dir, file), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, obj: dict):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _tokenizer_vocab(out_dir: str, tokenizer: str | None) -> dict:
    if tokenizer is None:
        return _BARE_VOCAB
    from tools.tiny_tokenizer import write_tokenizer_files

    return write_tokenizer_files(out_dir, kind=tokenizer)


def write_tiny_checkpoint(out_dir: str, tokenizer: str | None = "tiktoken", seed: int = 0, dtype: str = "bfloat16",
                          layers: str = "KKKMK", **overrides) -> str:
    """Write config, generation config, two weight shards + index and tokenizer files (none if tokenizer=None)."""
    os.makedirs(out_dir, exist_ok=True)
    vocab = _tokenizer_vocab(out_dir, tokenizer)
    cfg = tiny_config(layers, vocab, dtype, **overrides)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "transformers_version": "4.57.0"})
    _write_shards(out_dir, tiny_tensors(cfg, seed))
    return out_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer", default="tiktoken", choices=["tiktoken", "json", "none"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    ap.add_argument("--layers", default="KKKMK", help="mixer per layer, K = KDA, M = MLA")
    args = ap.parse_args(argv)
    tokenizer = None if args.tokenizer == "none" else args.tokenizer
    print(write_tiny_checkpoint(args.out_dir, tokenizer, args.seed, args.dtype, args.layers))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
