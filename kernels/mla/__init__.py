"""Paged MLA ops (absorbed form over the latent cache). See docs/design.md and kernels/mla/ref.py.

store_latent(latent [T, L+R], cache [NB, BS, L+R], slot_mapping [T] i64)            (in place; -1 = skip)
mla_decode(q_lat [N, H, L], q_pe [N, H, R], cache, block_table [N, MB] i32, seq_lens [N] i32, scale,
           num_splits=None, out=None) -> [N, H, L]
mla_extend(q_lat [T, H, L], q_pe [T, H, R], cache, block_table [P, MB] i32, cu_seqlens [P+1] i32,
           seq_lens [P] i32, scale, max_query_len=None, out=None) -> [T, H, L]

CUDA tensors run Triton, CPU tensors the torch reference unless KIMI_KERNELS=triton (kernels/_dispatch.py).
"""
from kernels._dispatch import use_triton

from .ref import mla_decode_ref, mla_extend_ref, store_latent_ref

__all__ = [
    "store_latent",
    "mla_decode",
    "mla_extend",
    "store_latent_ref",
    "mla_decode_ref",
    "mla_extend_ref",
    "default_num_splits",
]


def default_num_splits(batch: int, max_blocks: int, block_size: int, num_heads: int = 32, num_sms: int = 132) -> int:
    """Split count for mla_decode from shapes only (graph-capturable); re-exported from decode.py."""
    from .decode import default_num_splits as _d

    return _d(batch, max_blocks, block_size, num_heads, num_sms)


def store_latent(latent, cache, slot_mapping):
    if use_triton(cache):
        from .cache import store_latent_triton

        return store_latent_triton(latent, cache, slot_mapping)
    return store_latent_ref(latent, cache, slot_mapping)


def mla_decode(q_lat, q_pe, cache, block_table, seq_lens, scale, num_splits=None, out=None):
    """``num_splits`` (host int): split-KV count; default from N and block_table.shape (graph-capturable).
    ``out`` (optional [N, H, L]): written in full and returned."""
    if use_triton(q_lat):
        from .decode import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, cache, block_table, seq_lens, scale, num_splits=num_splits, out=out)
    res = mla_decode_ref(q_lat, q_pe, cache, block_table, seq_lens, scale)
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
