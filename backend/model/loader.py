"""Strict safetensors loader: headers validated first, memory-mapped reads, one tensor at a time.

The checkpoint keeps the official names. Packed parameters are filled from several checkpoint tensors:

    checkpoint tensor (per layer prefix)           -> model parameter [shape]
    self_attn.{q,k,v,f_a,g_a,b}_proj.weight (KDA)  -> self_attn.in_proj.weight [3*H*K + 2*K + H, D],
                                                      rows q | k | v | f_a | g_a | b
    self_attn.{f_b,g_b}_proj.weight    (KDA)       -> self_attn.fg_b_proj [2, H*K, K] (f_b, then g_b)
    self_attn.q_proj / kv_a_proj_with_mqa.weight (MLA) -> self_attn.in_proj.weight [H*(nope+R) + L+R, D], q rows first
    mlp.{gate,up}_proj.weight (and unfolded shared_experts.*) -> gate_up_proj.weight [2*I, D], gate rows first
    self_attn.{q,k,v}_conv1d.weight    [C, 1, W]   -> self_attn.conv_weight [3*C, W] fp32, rows q | k | v
    self_attn.A_log                    [1, 1, H, 1] -> self_attn.A_log [H] fp32
    self_attn.dt_bias                  [H*K]       -> self_attn.dt_bias fp32
    block_sparse_moe.experts.{e}.w1/w3.weight      -> block_sparse_moe.w13 [E, 2I, D] (w1 rows, then w3 rows)
    block_sparse_moe.experts.{e}.w2.weight         -> block_sparse_moe.w2 [E, D, I]
    block_sparse_moe.shared_experts.{gate,up}_proj.weight -> block_sparse_moe.w13[E] (gate rows, then up rows)
    block_sparse_moe.shared_experts.down_proj.weight       -> block_sparse_moe.w2[E]
        (unsharded only, parallel.folds_shared_expert: w13 [E+1, 2I, D], w2 [E+1, D, I]; with W > 1 the shared
        expert stays block_sparse_moe.shared_experts.*, 1/W of it per rank)
    block_sparse_moe.gate.e_score_correction_bias  -> same name, fp32
Every other tensor maps to the parameter of the same name.

Tensor parallel (backend/model/parallel.py): each rank reads only its part of each tensor (`Target.src`, sliced
while reading) and skips the experts of other ranks (`Target.param` None). A packed parameter holds each component's
shard (H, I above are per rank; f_a, g_a and kv_a are replicated), so its row ranges are per-rank sizes.
"""
import json
import logging
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open

from backend.config import ModelConfig
from backend.model.parallel import TP, check_divisible, folds_shared_expert

log = logging.getLogger(__name__)

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
_MAX_HEADER = 100 << 20
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Target:
    shape: tuple[int, ...]  # shape in the checkpoint
    param: str | None       # model parameter it fills (None: another rank's)
    index: tuple = ()       # where in the parameter (() = the whole parameter)
    src: tuple = ()         # this rank's part of the checkpoint tensor (() = all of it)


def read_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Validate a safetensors header without reading tensor data -> {name: (dtype, shape)}."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            # the length is checked before anything of that size is read
            raw = f.read(n) if 0 <= n <= min(_MAX_HEADER, size - 8) else None
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e}") from e
    if n < 0:
        raise CheckpointError(f"{name}: truncated file (no header length)")
    if raw is None:
        raise CheckpointError(f"{name}: header length {n} is larger than allowed or than the file")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{name}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: header is not a JSON object")
    header.pop("__metadata__", None)
    return _check_entries(name, header, size - 8 - n)


def _check_entries(file: str, header: dict, data_size: int) -> dict:
    out, spans = {}, []
    for key, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{file}: tensor {key}: malformed header entry")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{file}: tensor {key}: dtype {dtype!r} not in {sorted(_ITEMSIZE)}")
        if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 1 << 40 for s in shape):
            raise CheckpointError(f"{file}: tensor {key}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointError(f"{file}: tensor {key}: bad data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = _ITEMSIZE[dtype]
        for s in shape:
            nbytes *= s
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{file}: tensor {key}: data_offsets {offsets} do not match shape {shape}")
        if end > data_size:
            raise CheckpointError(f"{file}: tensor {key}: data ends at {end}, past the end of the file "
                                  f"({data_size} data bytes): truncated?")
        spans.append((begin, end, key))
        out[key] = (dtype, tuple(shape))
    spans.sort()
    for (_, end0, k0), (begin1, _, k1) in zip(spans, spans[1:]):
        if begin1 < end0:
            raise CheckpointError(f"{file}: tensors {k0} and {k1} overlap")
    return out


def checkpoint_files(path: str) -> dict[str, dict]:
    """{file path: {tensor name: (dtype, shape)}} for a single file or an index + shards, all headers checked."""
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{_INDEX}: unreadable or no weight_map: {e}") from e
        by_file = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or os.path.basename(file) != file:
                raise CheckpointError(f"{_INDEX}: tensor {name}: bad shard name {file!r}")
            by_file.setdefault(file, set()).add(name)
    elif os.path.exists(os.path.join(path, _SINGLE)):
        by_file = {_SINGLE: None}
    else:
        raise CheckpointError(f"no {_INDEX} or {_SINGLE} in {path}")
    missing = sorted(f for f in by_file if not os.path.isfile(os.path.join(path, f)))
    if missing:  # before any header: the index names a shard that is not there
        raise CheckpointError(f"missing shard file {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                    if len(missing) > 1 else ""))
    files = {}
    for file, listed in sorted(by_file.items()):
        full = os.path.join(path, file)
        header = read_header(full)
        if listed is not None and set(header) != listed:
            absent, extra = sorted(listed - set(header)), sorted(set(header) - listed)
            raise CheckpointError(f"{file}: index lists tensors {absent[:5]} not in the file, "
                                  f"file holds tensors {extra[:5]} not in the index")
        files[full] = header
    return files


def _rows(tp: TP, n: int) -> tuple:
    """src of a tensor sharded along dim 0 (n rows)."""
    return (tp.part(n),) if tp.world > 1 else ()


def _cols(tp: TP, n: int) -> tuple:
    """src of a tensor sharded along dim 1 (n columns)."""
    return (slice(None), tp.part(n)) if tp.world > 1 else ()


def _kda_plan(cfg: ModelConfig, p: str, tp: TP) -> dict:
    d, hk, h, w = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_num_heads, cfg.conv_size
    k, hk_local = cfg.kda_head_dim, hk // tp.world
    plan = {}
    for j, x in enumerate("qkv"):
        rows = slice(j * hk_local, (j + 1) * hk_local)
        plan[f"{p}{x}_proj.weight"] = Target((hk, d), p + "in_proj.weight", (rows,), _rows(tp, hk))
        plan[f"{p}{x}_conv1d.weight"] = Target((hk, 1, w), p + "conv_weight", (rows,), _rows(tp, hk))
    c = 3 * hk_local  # then f_a | g_a (replicated) | b (this rank's heads)
    plan[p + "f_a_proj.weight"] = Target((k, d), p + "in_proj.weight", (slice(c, c + k),))
    plan[p + "g_a_proj.weight"] = Target((k, d), p + "in_proj.weight", (slice(c + k, c + 2 * k),))
    plan[p + "b_proj.weight"] = Target((h, d), p + "in_proj.weight", (slice(c + 2 * k, c + 2 * k + h // tp.world),),
                                       _rows(tp, h))
    plan[p + "f_b_proj.weight"] = Target((hk, k), p + "fg_b_proj", (0,), _rows(tp, hk))
    plan[p + "g_b_proj.weight"] = Target((hk, k), p + "fg_b_proj", (1,), _rows(tp, hk))
    heads = (slice(None), slice(None), tp.part(h)) if tp.world > 1 else ()
    plan[p + "A_log"] = Target((1, 1, h, 1), p + "A_log", (), heads)
    for name, shape, src in (("dt_bias", (hk,), _rows(tp, hk)), ("o_norm.weight", (k,), ()),
                             ("o_proj.weight", (d, hk), _cols(tp, hk))):
        plan[p + name] = Target(shape, p + name, (), src)
    return plan


def _mla_plan(cfg: ModelConfig, p: str, tp: TP) -> dict:
    d, h, lat, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q, kv, o = h * cfg.qk_head_dim, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), h * cfg.v_head_dim
    # q_proj and kv_b_proj rows and o_proj columns are head-major: a rank's heads are one contiguous range
    shapes = {"kv_a_layernorm.weight": ((lat,), ()), "kv_b_proj.weight": ((kv, lat), _rows(tp, kv)),
              "o_proj.weight": ((d, o), _cols(tp, o))}
    plan = {p + n: Target(s, p + n, (), src) for n, (s, src) in shapes.items()}
    q_local = q // tp.world  # in_proj rows: this rank's q heads | the replicated kv_a rows
    plan[p + "q_proj.weight"] = Target((q, d), p + "in_proj.weight", (slice(0, q_local),), _rows(tp, q))
    plan[p + "kv_a_proj_with_mqa.weight"] = Target((lat + rope, d), p + "in_proj.weight",
                                                   (slice(q_local, q_local + lat + rope),))
    return plan


def _mlp_plan(d: int, inter: int, p: str, tp: TP) -> dict:
    i = inter // tp.world  # gate_up_proj rows: this rank's gate rows | its up rows
    return {p + "gate_proj.weight": Target((inter, d), p + "gate_up_proj.weight", (slice(0, i),), _rows(tp, inter)),
            p + "up_proj.weight": Target((inter, d), p + "gate_up_proj.weight", (slice(i, 2 * i),), _rows(tp, inter)),
            p + "down_proj.weight": Target((d, inter), p + "down_proj.weight", (), _cols(tp, inter))}


def _moe_plan(cfg: ModelConfig, p: str, tp: TP) -> dict:
    d, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    plan = {p + "gate.weight": Target((e, d), p + "gate.weight"),
            p + "gate.e_score_correction_bias": Target((e,), p + "gate.e_score_correction_bias")}
    local = tp.part(e)
    for i in range(e):
        # another rank's expert: checked against the plan, not read
        mine, j = local.start <= i < local.stop, i - local.start
        w13, w2 = (p + "w13", p + "w2") if mine else (None, None)
        plan[f"{p}experts.{i}.w1.weight"] = Target((inter, d), w13, (j, slice(0, inter)))
        plan[f"{p}experts.{i}.w3.weight"] = Target((inter, d), w13, (j, slice(inter, 2 * inter)))
        plan[f"{p}experts.{i}.w2.weight"] = Target((d, inter), w2, (j,))
    if folds_shared_expert(cfg, tp):  # stacked after the routed experts, read straight into w13[E] / w2[E]
        s = p + "shared_experts."
        plan[s + "gate_proj.weight"] = Target((inter, d), p + "w13", (e, slice(0, inter)))
        plan[s + "up_proj.weight"] = Target((inter, d), p + "w13", (e, slice(inter, 2 * inter)))
        plan[s + "down_proj.weight"] = Target((d, inter), p + "w2", (e,))
    else:
        plan.update(_mlp_plan(d, inter * cfg.num_shared_experts, p + "shared_experts.", tp))
    return plan


def checkpoint_plan(cfg: ModelConfig, tp: TP = TP()) -> dict[str, Target]:
    """Every tensor the checkpoint must hold -> its shape and where (which part of it) goes in the model."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    plan = {"model.embed_tokens.weight": Target((vocab, d), "model.embed_tokens.weight", (), _rows(tp, vocab)),
            "model.norm.weight": Target((d,), "model.norm.weight")}
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Target((vocab, d), "lm_head.weight", (), _rows(tp, vocab))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            plan[p + n] = Target((d,), p + n)
        plan.update(_kda_plan(cfg, p + "self_attn.", tp) if cfg.is_kda(i) else _mla_plan(cfg, p + "self_attn.", tp))
        if cfg.is_moe(i):
            plan.update(_moe_plan(cfg, p + "block_sparse_moe.", tp))
        else:
            plan.update(_mlp_plan(d, cfg.intermediate_size, p + "mlp.", tp))
    return plan


def _check_names(plan: dict, files: dict):
    seen = {}
    for file, header in files.items():
        for name, (_, shape) in header.items():
            if name in seen:
                raise CheckpointError(f"tensor {name} is in both {os.path.basename(seen[name])} and "
                                      f"{os.path.basename(file)}")
            seen[name] = file
            if name not in plan:
                raise CheckpointError(f"unexpected tensor {name} in {os.path.basename(file)}")
            if shape != plan[name].shape:
                raise CheckpointError(f"tensor {name} has shape {list(shape)}, expected {list(plan[name].shape)}")
    missing = sorted(set(plan) - set(seen))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if
                                                                  len(missing) > 1 else ""))


def check_checkpoint(path: str, plan: dict[str, Target]) -> dict[str, dict]:
    """Every header validated and every tensor name/shape matched against the plan, nothing allocated."""
    files = checkpoint_files(path)
    _check_names(plan, files)
    return files


def load_weights(model: torch.nn.Module, path: str, plan: dict[str, Target], files: dict = None):
    """Copy every checkpoint tensor into its parameter (dtype/device converted); each element written once.

    files: the result of check_checkpoint(path, plan) when the caller already has it."""
    if files is None:
        files = check_checkpoint(path, plan)
    params = dict(model.named_parameters())
    written, parts = {name: 0 for name in params}, set()
    total, done = sum(_nbytes(h) for h in files.values()), 0
    for i, (file, header) in enumerate(files.items()):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in header:
                    target = plan[name]
                    if target.param is None:
                        continue
                    part = (target.param, repr(target.index))
                    assert part not in parts, f"{part} loaded twice"
                    parts.add(part)
                    dst = params[target.param].data[target.index]
                    src = f.get_slice(name)[target.src] if target.src else f.get_tensor(name)
                    dst.copy_(src.reshape(dst.shape))
                    written[target.param] += dst.numel()
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{os.path.basename(file)}: cannot read: {e}") from e
        done += _nbytes(header)
        log.info("loaded shard %d/%d %s (%.1f/%.1f MB)", i + 1, len(files), os.path.basename(file),
                 done / 1e6, total / 1e6)
    bad = [n for n, p in params.items() if written[n] != p.numel()]
    assert not bad, f"parameters not loaded exactly once: {bad[:5]}"


def _nbytes(header: dict) -> int:
    total = 0
    for dtype, shape in header.values():
        n = _ITEMSIZE[dtype]
        for s in shape:
            n *= s
        total += n
    return total


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.bfloat16, tp: TP = TP(), **options):
    """Build KimiLinearForCausalLM for the checkpoint at `path` (tp: this rank's shard) and load it strictly.

    options go to ModelConfig (router_biased_weights, kv_a_layernorm_eps).
    """
    from backend.model.kimi_linear import KimiLinearForCausalLM

    cfg = ModelConfig.from_dir(path, **options)
    check_divisible(cfg, tp.world)
    plan = checkpoint_plan(cfg, tp)
    # a hostile or corrupt checkpoint is refused here, before the parameters are allocated
    files = check_checkpoint(path, plan)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, dtype, tp)
    model.to_empty(device=device)
    model.tie_weights()
    load_weights(model, path, plan, files)
    return model.eval().requires_grad_(False)
