"""Validated model configuration read from an official Kimi-Linear config.json."""
import json
import os
from dataclasses import dataclass

# keys that must be present in config.json; `linear_attn_config` is checked separately
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
    "model_max_length", "linear_attn_config", "first_k_dense_replace", "moe_layer_freq", "moe_intermediate_size",
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_renormalize", "moe_router_activation_func",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_nope", "bos_token_id", "eos_token_id",
)
_REQUIRED_LINEAR = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")
_DTYPES = ("bfloat16", "float16", "float32")
# upper bounds that reject absurd (hostile or corrupt) configs before anything is allocated
_MAX = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "kda_num_heads": 1024, "kda_head_dim": 1024, "conv_size": 64,
    "moe_intermediate_size": 1 << 16, "num_experts": 4096, "num_shared_experts": 64, "kv_lora_rank": 1 << 13,
    "qk_nope_head_dim": 1024, "qk_rope_head_dim": 1024, "v_head_dim": 1024, "model_max_length": 1 << 24,
}


class ConfigError(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    model_max_length: int
    dtype: str
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tie_word_embeddings: bool
    # KDA (linear_attn_config); layer lists are 0-based here
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    kda_num_heads: int
    kda_head_dim: int
    conv_size: int
    # FFN / MoE
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_renormalize: bool
    routed_scaling_factor: float
    # MLA (NoPE, no q LoRA)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # options that are not in config.json
    router_biased_weights: bool = False  # reproduce the HF remote-code aliasing (experts weighted by biased scores)
    kv_a_layernorm_eps: float = 1e-6

    def __post_init__(self):
        self._validate()

    @classmethod
    def from_dir(cls, path: str, **options) -> "ModelConfig":
        file = os.path.join(path, "config.json")
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {file}: {e}") from e
        return cls.from_dict(d, **options)

    @classmethod
    def from_dict(cls, d: dict, **options) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config must be a JSON object")
        if d.get("model_type") != "kimi_linear":
            raise ConfigError(f"model_type must be 'kimi_linear', got {d.get('model_type')!r}")
        for key in _REQUIRED:
            if key not in d:
                raise ConfigError(f"missing key {key!r}")
        lin = d["linear_attn_config"]
        if not isinstance(lin, dict):
            raise ConfigError("linear_attn_config must be an object")
        for key in _REQUIRED_LINEAR:
            if key not in lin:
                raise ConfigError(f"missing key 'linear_attn_config.{key}'")
        if d["q_lora_rank"] is not None:
            raise ConfigError("q_lora_rank must be null (Kimi-Linear has no q LoRA)")
        if d["mla_use_nope"] is not True:
            raise ConfigError("mla_use_nope must be true (Kimi-Linear MLA has no rotary embedding)")
        if d["moe_router_activation_func"] != "sigmoid":
            raise ConfigError(f"moe_router_activation_func must be 'sigmoid', got {d['moe_router_activation_func']!r}")
        _check_grouped_topk(d)
        _check_kv_heads(d)
        num_layers = _int(d, "num_hidden_layers")
        if not 0 < num_layers <= _MAX["num_hidden_layers"]:
            raise ConfigError(f"num_hidden_layers = {num_layers} is out of range")
        kda, mla = _layer_lists(lin, num_layers)
        return cls(
            vocab_size=_int(d, "vocab_size"), hidden_size=_int(d, "hidden_size"),
            intermediate_size=_int(d, "intermediate_size"), num_hidden_layers=num_layers,
            num_attention_heads=_int(d, "num_attention_heads"), rms_norm_eps=_float(d, "rms_norm_eps"),
            model_max_length=_int(d, "model_max_length"), dtype=_dtype(d),
            bos_token_id=_int(d, "bos_token_id"), eos_token_ids=_eos_ids(d),
            pad_token_id=None if d.get("pad_token_id") is None else _int(d, "pad_token_id"),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            kda_layers=kda, mla_layers=mla, kda_num_heads=_int(lin, "num_heads"), kda_head_dim=_int(lin, "head_dim"),
            conv_size=_int(lin, "short_conv_kernel_size"),
            first_k_dense_replace=_int(d, "first_k_dense_replace"), moe_layer_freq=_int(d, "moe_layer_freq"),
            moe_intermediate_size=_int(d, "moe_intermediate_size"), num_experts=_int(d, "num_experts"),
            num_experts_per_token=_int(d, "num_experts_per_token"), num_shared_experts=_int(d, "num_shared_experts"),
            moe_renormalize=_bool(d, "moe_renormalize"), routed_scaling_factor=_float(d, "routed_scaling_factor"),
            kv_lora_rank=_int(d, "kv_lora_rank"), qk_nope_head_dim=_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(d, "qk_rope_head_dim"), v_head_dim=_int(d, "v_head_dim"),
            **options,
        )

    def is_kda(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _validate(self):
        for name, limit in _MAX.items():
            value = getattr(self, name)
            if not 0 < value <= limit:
                raise ConfigError(f"{name} = {value} is out of range (1..{limit})")
        if self.conv_size < 2:
            raise ConfigError(f"linear_attn_config.short_conv_kernel_size = {self.conv_size} must be >= 2")
        for name, value in (("kda projection", self.kda_num_heads * self.kda_head_dim),
                            ("MLA q projection", self.num_attention_heads * self.qk_head_dim),
                            ("MLA o projection", self.num_attention_heads * self.v_head_dim)):
            if value > 1 << 17:
                raise ConfigError(f"{name} width {value} (heads * head_dim) is absurd")
        if not 0 < self.rms_norm_eps < 1 or not 0 < self.kv_a_layernorm_eps < 1:
            raise ConfigError("rms_norm_eps and kv_a_layernorm_eps must be in (0, 1)")
        if not 0 < self.routed_scaling_factor <= 1e3:
            raise ConfigError(f"routed_scaling_factor = {self.routed_scaling_factor} is out of range")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(f"num_experts_per_token = {self.num_experts_per_token} exceeds "
                              f"num_experts = {self.num_experts}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace = {self.first_k_dense_replace} is out of range")
        if self.moe_layer_freq < 1:
            raise ConfigError("moe_layer_freq must be >= 1")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name} = {value} is outside the vocabulary")
        if not self.eos_token_ids or not all(0 <= e < self.vocab_size for e in self.eos_token_ids):
            raise ConfigError(f"eos_token_id = {list(self.eos_token_ids)} is empty or outside the vocabulary")


def _int(d: dict, key: str) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value


def _float(d: dict, key: str) -> float:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _bool(d: dict, key: str, default: bool | None = None) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _eos_ids(d: dict) -> tuple[int, ...]:
    # eos_token_id may be one id or a list of ids
    value = d["eos_token_id"]
    ids = value if isinstance(value, list) else [value]
    return tuple(_int({"eos_token_id": i}, "eos_token_id") for i in ids)


def _dtype(d: dict) -> str:
    value = d.get("dtype", d.get("torch_dtype"))
    if value is None:
        raise ConfigError("missing key 'dtype' (or 'torch_dtype')")
    if value not in _DTYPES:
        raise ConfigError(f"dtype must be one of {_DTYPES}, got {value!r}")
    return value


def _check_kv_heads(d: dict):
    # unused by MLA (one latent shared by all heads) but a value that does not divide the heads marks a corrupt or
    # foreign config.json
    if d.get("num_key_value_heads") is None:
        return
    kv, heads = _int(d, "num_key_value_heads"), _int(d, "num_attention_heads")
    if kv <= 0 or heads <= 0 or heads % kv:
        raise ConfigError(f"num_key_value_heads = {kv} does not divide num_attention_heads = {heads}")


def _check_grouped_topk(d: dict):
    # with one group the group restriction is a no-op; the router kernels implement only that case
    if not _bool(d, "use_grouped_topk", False):
        return
    groups, top_groups = d.get("num_expert_group", 1), d.get("topk_group", 1)
    if groups != 1 or top_groups != 1:
        raise ConfigError(f"grouped top-k with num_expert_group = {groups}, topk_group = {top_groups} "
                          "is not supported (only 1, 1)")


def _layer_lists(lin: dict, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """1-indexed kda_layers / full_attn_layers -> 0-based tuples, each layer exactly one kind."""
    lists = []
    for key in ("kda_layers", "full_attn_layers"):
        value = lin[key]
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise ConfigError(f"linear_attn_config.{key} must be a list of integers")
        if len(set(value)) != len(value):
            raise ConfigError(f"linear_attn_config.{key} has duplicate layers")
        bad = [i for i in value if not 1 <= i <= num_layers]
        if bad:
            raise ConfigError(f"linear_attn_config.{key} has layers {bad} outside 1..{num_layers}")
        lists.append(value)
    kda, full = lists
    both = sorted(set(kda) & set(full))
    if both:
        raise ConfigError(f"layers {both} are in both kda_layers and full_attn_layers")
    missing = sorted(set(range(1, num_layers + 1)) - set(kda) - set(full))
    if missing:
        raise ConfigError(f"layers {missing} are in neither kda_layers nor full_attn_layers")
    return tuple(sorted(i - 1 for i in kda)), tuple(sorted(i - 1 for i in full))
