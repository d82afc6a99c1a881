"""store_latent: scatter latent rows [T, L+R] into the paged cache [NB, BS, L+R] at slot_mapping (-1 = skip)."""
import torch
import triton
import triton.language as tl

from kernels._tensors import next_pow2, unit_last_stride


@triton.jit
def _store_latent_kernel(
    lat_ptr,
    cache_ptr,
    slot_ptr,
    D,
    stride_lt,
    stride_cp,
    stride_cr,
    BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        page = slot // BS
        off = slot % BS
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(lat_ptr + t.to(tl.int64) * stride_lt + cols, mask=m)
        dst = cache_ptr + page * stride_cp + off * stride_cr + cols
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=m)


def store_latent_triton(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    T, D = latent.shape
    assert cache.dim() == 3 and cache.shape[2] == D and slot_mapping.shape[0] == T
    assert cache.stride(2) == 1
    if T == 0:
        return
    latent = unit_last_stride(latent)
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    _store_latent_kernel[(T,)](
        latent,
        cache,
        slot_mapping,
        D,
        latent.stride(0),
        cache.stride(0),
        cache.stride(1),
        BS=cache.shape[1],
        BLOCK_D=next_pow2(D),
        num_warps=4,
    )


@triton.jit
def _gather_latent_kernel(
    cache_ptr,
    bt_ptr,
    cuk_ptr,
    out_ptr,
    D,
    s_cp,
    s_cr,
    s_btn,
    s_ot,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (j, p) copies page j of sequence p (its rows below k_len) to out[cu_k[p] + j * BS + r]."""
    j = tl.program_id(0)
    p = tl.program_id(1)
    k_begin = tl.load(cuk_ptr + p)
    k_len = tl.load(cuk_ptr + p + 1) - k_begin
    if j * BS < k_len:
        page = tl.load(bt_ptr + p.to(tl.int64) * s_btn + j).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        for r0 in tl.static_range(0, BS, ROWS):
            r = r0 + tl.arange(0, ROWS)
            rmask = (r < BS) & ((j * BS + r) < k_len)
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(cache_ptr + page * s_cp + r[:, None].to(tl.int64) * s_cr + cols[None, :], mask=m)
            dst = (k_begin + j * BS + r).to(tl.int64)
            tl.store(out_ptr + dst[:, None] * s_ot + cols[None, :], x, mask=m)


def gather_latent_triton(cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         total: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [0, k_len_p) of every sequence p (pages from block_table[p]) packed at cu_seqlens_k[p]: -> [total, L+R].
    ``total`` (host int) = cu_seqlens_k[-1]; read from the device (one sync) when not given."""
    NB, BS, D = cache.shape
    P = cu_seqlens_k.shape[0] - 1
    assert cache.stride(2) == 1 and block_table.shape[0] == P
    if total is None:
        total = int(cu_seqlens_k[-1])
    if out is None:
        out = torch.empty(total, D, dtype=cache.dtype, device=cache.device)
    assert out.shape == (total, D) and out.stride(1) == 1
    if total == 0 or P == 0:
        return out
    block_table = unit_last_stride(block_table, torch.int32)
    cu_seqlens_k = unit_last_stride(cu_seqlens_k, torch.int32)
    block_d = next_pow2(D)
    rows = min(next_pow2(BS), max(1, 4096 // block_d))
    _gather_latent_kernel[(block_table.shape[1], P)](
        cache, block_table, cu_seqlens_k, out, D, cache.stride(0), cache.stride(1), block_table.stride(0),
        out.stride(0), BS=BS, ROWS=rows, BLOCK_D=block_d, num_warps=4,
    )
    return out
