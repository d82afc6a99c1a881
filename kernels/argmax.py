"""Row argmax in one launch: the greedy token of each row of the logits (backend/engine/sampler.py `sample()`).

argmax_rows(x) == torch.argmax(x, dim=-1): the first index of the row's maximum, a NaN counting as larger than
everything (the first NaN wins), an all -inf row giving 0. torch's kernel takes 9.0 us for one 163,840-wide fp32 row
on the H200 (one row reduced by few blocks: the b1 decode step's largest piece outside its graph, BENCHMARKS
fourteenth round). Here grid (M, NB): program (row, b) reduces BLOCK columns to (value, index) and stores them; the
last program of the row to arrive (an acq_rel arrival counter, kernels._tensors.arrival_counters) reduces the NB
partials by the same rule (blocks ascend, so the first block holding the maximum holds its first index), writes
out[row] and resets its counter to zero (graph-replay safe). No host sync, no data-dependent shapes.
"""
import torch
import triton
import triton.language as tl

from kernels._tensors import arrival_counters, cdiv, next_pow2, workspace

BLOCK = 4096      # columns per program: V 163840 -> 40 programs per row
NUM_WARPS = 4


@triton.jit
def _first_max(x, offs, BIG: tl.constexpr):
    # (value, index) of the first largest element of x (NaN the largest: value NaN, index of the first NaN);
    # positions to ignore hold -inf and an offset past every real one
    isn = x != x
    any_nan = tl.max(isn.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(isn, float("-inf"), x), axis=0)
    hit = tl.where(any_nan, isn, x == m)
    idx = tl.min(tl.where(hit, offs, BIG), axis=0)
    return tl.where(any_nan, float("nan"), m), idx


@triton.jit
def _argmax_kernel(x_ptr, stride_x, V, val_ptr, idx_ptr, stride_p, cnt_ptr, out_ptr, NB,
                   BLOCK: tl.constexpr, NBP: tl.constexpr):
    # x [M, V] (any float dtype, unit column stride); val / idx [M, >= NB] partials (row stride stride_p); cnt [M]
    # i32, zero between launches; out [M] i64
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    v, i = _first_max(x, offs, 2147483647)
    tl.store(val_ptr + row * stride_p + b, v)
    tl.store(idx_ptr + row * stride_p + b, i)
    tl.debug_barrier()          # every thread's partial stores precede the (release) arrival
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == NB - 1:
        j = tl.arange(0, NBP)
        pv = tl.load(val_ptr + row * stride_p + j, mask=j < NB, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(idx_ptr + row * stride_p + j, mask=j < NB, other=0, cache_modifier=".cg")
        _, jb = _first_max(pv, j, NBP)
        tl.store(out_ptr + row, tl.sum(tl.where(j == jb, pi, 0), axis=0).to(tl.int64))
        tl.store(cnt_ptr + row, 0)


def _partials(M: int, NB: int, device) -> tuple:
    """(values [rows, cols] f32, indices [rows, cols] i32) with rows >= M, cols >= NB: the per-block partials."""
    def make(old):
        rows, cols = max(M, 64, old[0].shape[0] if old else 0), max(NB, 64, old[0].shape[1] if old else 0)
        return (torch.empty(rows, cols, dtype=torch.float32, device=device),
                torch.empty(rows, cols, dtype=torch.int32, device=device))

    return workspace("argmax_partials", device, lambda b: b[0].shape[0] >= M and b[0].shape[1] >= NB, make)


def argmax_rows(x: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [M, V] (V < 2^31) -> [M] i64, one Triton launch (see the module doc).
    block / num_warps: columns per program and its warps (tests, bench/sampling.py)."""
    assert x.dim() == 2 and 0 < x.shape[1] < 2**31, x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, V = x.shape
    out = torch.empty(M, dtype=torch.int64, device=x.device)
    if M == 0:
        return out
    NB = cdiv(V, block)
    vals, idxs = _partials(M, NB, x.device)
    _argmax_kernel[(M, NB)](x, x.stride(0), V, vals, idxs, vals.stride(0),
                            arrival_counters(x.device, M), out, NB,
                            BLOCK=block, NBP=max(16, next_pow2(NB)), num_warps=num_warps)
    return out
