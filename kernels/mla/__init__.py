"""Paged MLA ops (absorbed form over the latent cache). See docs/design.md and kernels/mla/ref.py.

store_latent(latent [T, L+R], cache [NB, BS, L+R], slot_mapping [T] i64)            (in place; -1 = skip)
mla_decode(q_lat [N, H, L], q_pe [N, H, R], cache, block_table [N, MB] i32, seq_lens [N] i32, scale,
           num_splits=None, out=None, w_uv=None) -> [N, H, L], or [N, H, V] = einsum("nhl,hvl->nhv", ., w_uv) with
           w_uv [H, V, L] (the merge fused with the W_UV product: kernels/mla/absorb.py)
mla_decode_prep(y [T, q_dim + L + R], q_dim, kv_norm_w [L], eps, w_uk [H, nope, L], cache, slot_mapping [T] i64)
           -> q_lat [T, H, L] = einsum("thn,hnl->thl", q_nope, w_uk), q_nope = y[:, :q_dim].view(T, H, -1)[..., :nope];
           and, in the same launch, store_latent(rmsnorm_head(y[:, q_dim:], kv_norm_w, eps), cache, slot_mapping)
mla_extend(q_lat [T, H, L], q_pe [T, H, R], cache, block_table [P, MB] i32, cu_seqlens [P+1] i32,
           seq_lens [P] i32, scale, max_query_len=None, out=None) -> [T, H, L]

Expanded form (large prefill chunks; kernels/mla/prefill.py):
gather_latent(cache, block_table [P, MB] i32, cu_seqlens_k [P+1] i32, total=None) -> [S_total, L+R]
mla_prefill_expanded(q [T, H, nope+R], k_nope [S, H, nope], k_pe [S, R], v [S, H, V], cu_seqlens_q [P+1] i32,
                     cu_seqlens_k [P+1] i32, scale, max_query_len=None, out=None, q_pe=None) -> [T, H, V]
mla_prefill(q_nope [T, H, nope], q_pe [T, H, R], cache, block_table, cu_seqlens, seq_lens, kv_b_weight
            [H*(nope+V), L], scale, max_query_len=None, total_keys=None, cu_seqlens_k=None) -> [T, H, V]
            (gather + kv_b_proj + mla_prefill_expanded; total_keys = seq_lens.sum() as a host int: no sync;
            cu_seqlens_k = key_offsets(seq_lens), computed once per step by the model)

CUDA tensors run Triton, CPU tensors the torch reference unless KIMI_KERNELS=triton (kernels/_dispatch.py).
"""
import torch
import torch.nn.functional as F

from kernels._dispatch import use_triton

from .absorb import mla_decode_prep_ref, mla_decode_uv_ref
from .ref import (gather_latent_batch_ref, mla_decode_ref, mla_extend_ref, mla_prefill_expanded_ref,
                  store_latent_ref)

__all__ = [
    "store_latent",
    "mla_decode",
    "mla_decode_prep",
    "mla_decode_prep_ref",
    "mla_decode_uv_ref",
    "mla_extend",
    "gather_latent",
    "mla_prefill_expanded",
    "mla_prefill",
    "key_offsets",
    "gather_latent_batch_ref",
    "mla_prefill_expanded_ref",
    "store_latent_ref",
    "mla_decode_ref",
    "mla_extend_ref",
    "default_num_splits",
]


def default_num_splits(batch: int, max_blocks: int, block_size: int, num_heads: int = 32, num_sms: int = 132,
                       programs_per_sm: int | None = None) -> int:
    """Split count mla_decode picks from shapes only (graph-capturable); decode.py's heuristic with, by default, the
    16-bit default config's resident programs per SM (what a bf16 cache runs; the fp32 test config differs)."""
    from .decode import DECODE_CFG
    from .decode import default_num_splits as _d

    if programs_per_sm is None:
        programs_per_sm = DECODE_CFG["16bit"].get("programs_per_sm", 1)
    return _d(batch, max_blocks, block_size, num_heads, num_sms, programs_per_sm)


def store_latent(latent, cache, slot_mapping):
    if use_triton(cache):
        from .cache import store_latent_triton

        return store_latent_triton(latent, cache, slot_mapping)
    return store_latent_ref(latent, cache, slot_mapping)


def mla_decode(q_lat, q_pe, cache, block_table, seq_lens, scale, num_splits=None, out=None, w_uv=None):
    """``num_splits`` (host int): split-KV count; default from N and block_table.shape (graph-capturable).
    ``out`` (optional [N, H, L], [N, H, V] with w_uv): written in full and returned. ``w_uv`` (optional [H, V, L],
    e.g. kv_b_proj.weight.view(H, nope + V, L)[:, nope:]): return the W_UV product of the attention latent (rounded
    to q_lat.dtype first, like the einsum after a plain mla_decode); PDL launches per KIMI_PDL."""
    if use_triton(q_lat):
        from .decode import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, cache, block_table, seq_lens, scale, num_splits=num_splits, out=out,
                                 w_uv=w_uv)
    if w_uv is not None:
        res = mla_decode_uv_ref(q_lat, q_pe, cache, block_table, seq_lens, scale, w_uv)
    else:
        res = mla_decode_ref(q_lat, q_pe, cache, block_table, seq_lens, scale)
    if out is None:
        return res
    out.copy_(res)
    return out


def mla_decode_prep(y, q_dim, kv_norm_w, eps, w_uk, latent_cache, slot_mapping, out=None):
    """Decode-step head of the absorbed MLA layer in one launch (kernels/mla/absorb.py; PDL per KIMI_PDL): writes the
    cache rows of the T tokens (slot -1: nothing) and returns q_lat [T, H, L] (y.dtype). Meant for decode batches
    (T up to a few hundred: every program loops over all tokens); ``out`` (optional [T, H, L])."""
    if use_triton(y):
        from .absorb import mla_decode_prep_triton

        return mla_decode_prep_triton(y, q_dim, kv_norm_w, eps, w_uk, latent_cache, slot_mapping, out=out)
    res = mla_decode_prep_ref(y, q_dim, kv_norm_w, eps, w_uk, latent_cache, slot_mapping)
    if out is None:
        return res
    out.copy_(res)
    return out


def mla_extend(q_lat, q_pe, cache, block_table, cu_seqlens, seq_lens, scale, max_query_len=None, out=None):
    """``max_query_len`` (optional host int, e.g. ForwardBatch.max_query_len) only sizes the Triton grid.
    ``out`` (optional [T, H, L]): written on the rows covered by cu_seqlens and returned."""
    if use_triton(q_lat):
        from .extend import mla_extend_triton

        return mla_extend_triton(
            q_lat, q_pe, cache, block_table, cu_seqlens, seq_lens, scale, max_query_len=max_query_len, out=out
        )
    res = mla_extend_ref(q_lat, q_pe, cache, block_table, cu_seqlens, seq_lens, scale)
    if out is None:
        return res
    n = int(cu_seqlens[-1])
    out[:n].copy_(res[:n])
    return out


def gather_latent(cache, block_table, cu_seqlens_k, total=None):
    """``total`` (host int) = cu_seqlens_k[-1]; read from the device (one sync) when not given."""
    if use_triton(cache):
        from .cache import gather_latent_triton

        return gather_latent_triton(cache, block_table, cu_seqlens_k, total=total)
    return gather_latent_batch_ref(cache, block_table, cu_seqlens_k.diff())


def mla_prefill_expanded(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale, max_query_len=None, out=None,
                         q_pe=None):
    """``out`` (optional [T, H, V]): written on the rows covered by cu_seqlens_q and returned."""
    if use_triton(q):
        from .prefill import mla_prefill_expanded_triton

        return mla_prefill_expanded_triton(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale,
                                           max_query_len=max_query_len, out=out, q_pe=q_pe)
    res = mla_prefill_expanded_ref(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale, q_pe=q_pe)
    if out is None:
        return res
    n = int(cu_seqlens_q[-1])
    out[:n].copy_(res[:n])
    return out


# Cap on the up-projected keys/values mla_prefill materialises at once (bytes); above it the heads go in groups.
PREFILL_KV_BYTES = 2 << 30


def key_offsets(seq_lens: torch.Tensor) -> torch.Tensor:
    """seq_lens [P] i32 -> cu_seqlens_k [P+1] i32 (on the device: no sync; a step computes it once for its layers)."""
    cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    return cu_k


def mla_prefill(q_nope, q_pe, cache, block_table, cu_seqlens, seq_lens, kv_b_weight, scale, max_query_len=None,
                total_keys=None, cu_seqlens_k=None):
    """Prefill chunks in expanded form, straight from the paged latent cache (new tokens already stored):
    gather each sequence's ``seq_lens[p]`` latent rows, up-project them with ``kv_b_weight`` ([H*(nope+V), L],
    kv_b_proj's weight: per head k_nope | v), attend causally. Same semantics as mla_extend followed by the W_UV
    product. ``total_keys`` (host int) = seq_lens.sum(): it sizes the gather; without it it is read from the device
    (one host sync, not allowed in a CUDA graph capture). ``cu_seqlens_k``: key_offsets(seq_lens), if known.
    Transient memory: the gathered latent plus S_total * H * (nope + V) elements (16 KiB per key at H=32, bf16),
    capped at PREFILL_KV_BYTES by running the heads in groups (one GEMM + one kernel launch per group)."""
    T, H, DN = q_nope.shape
    HD, L = kv_b_weight.shape
    per_head = HD // H
    cu_k = key_offsets(seq_lens) if cu_seqlens_k is None else cu_seqlens_k
    total = int(cu_k[-1]) if total_keys is None else int(total_keys)
    lat = gather_latent(cache, block_table, cu_k, total=total)          # [S, L+R]
    head_bytes = max(1, total * per_head * kv_b_weight.element_size())
    g = max([d for d in range(1, H + 1) if H % d == 0 and d * head_bytes <= PREFILL_KV_BYTES] or [1])
    if g == H:
        kv = F.linear(lat[:, :L], kv_b_weight).view(total, H, per_head)  # [S, H, nope+V]
        return mla_prefill_expanded(q_nope, kv[..., :DN], lat[:, L:], kv[..., DN:], cu_seqlens, cu_k, scale,
                                    max_query_len=max_query_len, q_pe=q_pe)
    out = q_nope.new_empty(T, H, per_head - DN)
    w = kv_b_weight.view(H, per_head, L)
    for h0 in range(0, H, g):
        kv = F.linear(lat[:, :L], w[h0:h0 + g].reshape(g * per_head, L)).view(total, g, per_head)
        mla_prefill_expanded(q_nope[:, h0:h0 + g], kv[..., :DN], lat[:, L:], kv[..., DN:], cu_seqlens, cu_k, scale,
                             max_query_len=max_query_len, out=out[:, h0:h0 + g], q_pe=q_pe[:, h0:h0 + g])
        del kv
    return out
