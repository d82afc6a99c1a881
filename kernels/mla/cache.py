"""store_latent: scatter latent rows [T, L+R] into the paged cache [NB, BS, L+R] at slot_mapping (-1 = skip)."""
import torch
import triton
import triton.language as tl


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
    if latent.stride(1) != 1:
        latent = latent.contiguous()
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
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )
