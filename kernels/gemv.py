"""Skinny GEMM for decode (M <= 16 rows): bandwidth-bound on the weight, one pass over it.

gemv(x [M, K], w [N, K]) -> y [M, N]                y = x @ w^T (nn.Linear layout), fp32 accumulation, out x.dtype
gemv(x [B, M, K], w [B, N, K]) -> y [B, M, N]      batched (the KDA f_b / g_b pair), x's batch/row strides allowed
skinny_linear(x [M, K], w [N, K]) -> y [M, N]      gemv for M <= GEMV_MAX_M where use_triton(x), else F.linear

Each program streams a [BN, k_split] slab of W once (rows contiguous along K: wide coalesced loads, evict_first)
and re-reads the few rows of x from L2. Two inner products:
  * DOT=True (the default): tl.dot(W tile [BN, BK], x^T [BK, 16]) -> [BN, 16] ("swap AB": W is the big MMA
    operand, x padded to 16 columns by masked loads, so padding costs no bytes). On sm_90 (Triton 3.9, offline):
    wgmma fed by 16-byte cp.async loads, num_stages deep; 48 registers, 80 KB shared at BN 64 / BK 128 / 4 stages;
  * DOT=False (M <= FMA_MAX_M): fp32 FMAs. M = 1: W as [BN, BK/8, 8] (one 16-byte load per 8 elements), reduced
    over the 8 in registers each step into a [BN, BK/8] accumulator; optional register prefetch of step k+1;
    78 registers at BN 16 / BK 512 / 4 warps, no shared memory or barriers in the loop. M > 1: a [BM, BN, BK]
    accumulator reduced once at the end.
K splits S (gemv_config's balance model, or the config's) write fp32 partials [S, B, M, N]; the last of a tile's S
programs to arrive sums them in split order and writes y (one launch, deterministic, no atomics on data; or, with
fused=False, a second launch does the sum).
Grid and buffers depend on shapes only: CUDA-graph capturable, no host sync.
PDL (KIMI_PDL=1, kernels._pdl; `pdl` overrides): launched with programmatic dependent launch, each program first
prefetches the head of its W slab into L2 (PDL_L2_MB over the whole grid, at most PDL_MAX_LINES 128-byte lines per
row), then waits for the previous kernel: the weight stream starts while the previous kernel (a norm, the KDA
decode) still runs; x and everything after come after the wait, so the bits are the same.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._jit import INTERPRET, cast_to
from kernels._pdl import L2_LINE_BYTES, gdc_enter, pdl_launch, pdl_on, prefetch_l2
from kernels._tensors import arrival_counters, cdiv, max_shared_mem, next_pow2, num_sms

GEMV_MAX_M = 16
# PDL launch: W bytes the whole grid prefetches into L2 before griddepcontrol.wait (KIMI_PDL_L2_MB) and its cap in
# lines per row. 4 MB since H200 12-04 (bench/ablate.py --batch 1 --set kernels.gemv.PDL_L2_MB=...: b1 step 2.27 ms
# at 3-6 MB (or 1-4 lines per row) vs 2.32-2.35 at 16 MB and 2.29 at 0; b8 unchanged): a larger head competes with
# the still-running previous kernel's own HBM stream
PDL_L2_MB = float(os.environ.get("KIMI_PDL_L2_MB", "4"))
PDL_MAX_LINES = 64
# (Removed in session 25: in-loop L2 hints of W's K slice n steps ahead on the dot path, KIMI_GEMV_L2_AHEAD; H200,
# session 19, BENCHMARKS.md: the b1 step 24-90 us slower in the graph. Last present in cb00f87.)


# --------------------------------------------------------------------------------------------------- reference
def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [(B,) M, K], w [(B,) N, K] -> (x @ w^T) in fp32, cast to x.dtype."""
    return torch.matmul(x.float(), w.float().transpose(-1, -2)).to(x.dtype)


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _dot_tile(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi,
              BK: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
              W_EVICT: tl.constexpr, W_CACHE: tl.constexpr, w_desc, w_row0, TMA: tl.constexpr):
    # -> fp32 [BM, BN] = x[:, k_lo:k_hi] @ W[n-tile, k_lo:k_hi]^T as tl.dot(W [BN, BK], x^T [BK, BM]) ("swap AB":
    # W is the MMA's big operand, x padded to BM >= 16 columns by masked loads).
    # TMA: W boxes [BN, BK] from w_desc over W viewed as [B * N, K] at rows w_row0.. (rows past this batch's N are
    # the next batch's or zero fill: their outputs are masked; K past the end is zero fill; splits end on BK steps)
    offs_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]                         # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]                                      # [BM, BK]
    acc = tl.zeros((offs_n.shape[0], offs_m.shape[0]), dtype=tl.float32)                               # [BN, BM]
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:      # K and k_split are multiples of BK: no mask along K keeps the loads 16-byte vectors
            if TMA:
                w = w_desc.load([w_row0, k0])
            else:
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0, cache_modifier=W_CACHE,
                            eviction_policy=W_EVICT)
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_hi
            if TMA:
                w = w_desc.load([w_row0, k0])
            else:
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0, cache_modifier=W_CACHE,
                            eviction_policy=W_EVICT)
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:      # the Triton interpreter multiplies bf16 dot operands as raw uint16 (kernels/mla/decode.py)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    return tl.trans(acc)


@triton.jit
def _fma_load(x_ptrs, w_ptrs, offs_k, n_mask, k0, k_hi,
              EVEN_K: tl.constexpr, W_EVICT: tl.constexpr, W_CACHE: tl.constexpr):
    # W [BN, G, R] and x [BN, G, R] (row 0 of x broadcast over BN by its pointers: the same layout as W, so the
    # product needs no layout conversion; a [G, R] x load converts through shared memory with barriers every step)
    # at K offset k0; zeros past k_hi (the prefetch after the last step)
    if EVEN_K:          # masks constant along K: 16-byte loads
        x_mask = (tl.zeros((1, offs_k.shape[0], offs_k.shape[1]), tl.int32) + k0) < k_hi                   # [1, G, R]
    else:
        x_mask = (k0 + offs_k < k_hi)[None, :, :]
    w_mask = n_mask[:, None, None] & x_mask
    w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
    return x, w


@triton.jit
def _fma_tile(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi,
              BK: tl.constexpr, R: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
              W_EVICT: tl.constexpr, W_CACHE: tl.constexpr):
    # -> fp32 [BM, BN] by fp32 FMAs (no MMA, so no padding of M to 16).
    # BM = 1: W as [BN, BK/R, R] with R contiguous elements (R = 8 bf16: one 16-byte load) per thread, reduced over R
    # in registers every step: the accumulator is [BN, BK/R] (R x fewer registers than [BN, BK]), the registers go
    # to bytes in flight. PREFETCH: step k+1's tiles are loaded before step k's FMAs (two W tiles live per thread).
    # BM > 1: elementwise into a [BM, BN, BK] accumulator, reduced over K once at the end (a 4-d [BM, BN, BK/R, R]
    # product gets a different layout from the loads' and converts through shared memory every step).
    if offs_m.shape[0] == 1:
        G: tl.constexpr = BK // R
        offs_k = tl.arange(0, G)[:, None] * R + tl.arange(0, R)[None, :]                                # [G, R]
        w_ptrs = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]           # [BN, G, R]
        x_ptrs = x_ptr + offs_k[None, :, :] + 0 * offs_n[:, None, None]                                # [BN, G, R]
        acc = tl.zeros((offs_n.shape[0], G), dtype=tl.float32)                                         # [BN, G]
        if PREFETCH:
            x, w = _fma_load(x_ptrs, w_ptrs, offs_k, n_mask, k_lo, k_hi, EVEN_K, W_EVICT, W_CACHE)
            for k0 in range(k_lo, k_hi, BK):
                x_nxt, w_nxt = _fma_load(x_ptrs, w_ptrs, offs_k, n_mask, k0 + BK, k_hi, EVEN_K, W_EVICT, W_CACHE)
                acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=2)
                x, w = x_nxt, w_nxt
        else:
            for k0 in range(k_lo, k_hi, BK):
                x, w = _fma_load(x_ptrs, w_ptrs, offs_k, n_mask, k0, k_hi, EVEN_K, W_EVICT, W_CACHE)
                acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=2)
        return tl.sum(acc, axis=1)[None, :]
    else:
        offs_k = tl.arange(0, BK)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]                    # [BN, BK]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]                                 # [BM, BK]
        acc3 = tl.zeros((offs_m.shape[0], offs_n.shape[0], BK), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            if EVEN_K:
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0, cache_modifier=W_CACHE,
                            eviction_policy=W_EVICT)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < k_hi
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0, cache_modifier=W_CACHE,
                            eviction_policy=W_EVICT)
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]                       # [BM, BN, BK]
        return tl.sum(acc3, axis=2)


@triton.jit
def _prefetch_w_head(w_ptr, offs_n, n_mask, stride_wn, k_lo, k_hi,
                     PF_N: tl.constexpr, PF_L: tl.constexpr, PF_STEP: tl.constexpr):
    # PDL, before the wait: prefetch into L2 the first PF_N lines (PF_STEP elements each, _pdl_prefetch) of the BN
    # rows offs_n of W from column k_lo (below k_hi); the K loop then finds that head of the slab in L2
    if PF_N > 0:
        lines = tl.arange(0, PF_L)
        cols = k_lo + lines * PF_STEP                                                                 # [PF_L]
        pf = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]                          # [BN, PF_L]
        prefetch_l2(pf, n_mask[:, None] & ((lines < PF_N) & (cols < k_hi))[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_split,
    stride_xb, stride_xm, stride_wb, stride_wn, stride_yb, stride_ym, stride_ps, stride_pb, stride_pm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, W_EVICT: tl.constexpr, W_CACHE: tl.constexpr, R: tl.constexpr, PREFETCH: tl.constexpr,
    w_desc=None, TMA: tl.constexpr = False,
    GDC: tl.constexpr = False, PF_N: tl.constexpr = 0, PF_L: tl.constexpr = 1, PF_STEP: tl.constexpr = 64,
    RAGGED: tl.constexpr = False, NT=1,
    GLU: tl.constexpr = False, INTERP: tl.constexpr = False,
):
    # grid (cdiv(N, BN), S, B): program (n, s, b) reads W[b, n*BN:+BN, s*k_split:+k_split] once (streamed: W_EVICT
    # / W_CACHE hints keep it from evicting x, partials and other kernels' data from L2) and
    #   SPLIT 0 (S = 1): writes y[b, :M, n*BN:+BN] in y's dtype;
    #   SPLIT 1: writes the fp32 partial p[s, b, :M, n*BN:+BN] (summed by _split_reduce_kernel, a second launch);
    #   SPLIT 2: writes the partial, then the last of the tile's S programs to arrive (acq_rel counter, left at 0:
    #            graph-replay safe) sums p[0..S-1] in that order and writes y (deterministic, one launch)
    # RAGGED: N cut into NT even tiles [n*N//NT, (n+1)*N//NT) of <= BN rows (masked rows cost no bytes), so that the
    # grid can be whole waves of the SMs (_ragged_tiles) instead of cdiv(N, BN) BN-row tiles with a partial wave
    pid_n, pid_s, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if RAGGED:
        n_lo = pid_n * N // NT
        n_hi = (pid_n + 1) * N // NT
    else:
        n_lo = pid_n * BN
        n_hi = N
    offs_n = n_lo + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    n_mask, m_mask = offs_n < n_hi, offs_m < M
    k_lo = pid_s * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    xb, wb = x_ptr + pid_b * stride_xb, w_ptr + pid_b * stride_wb
    if GDC:
        # PDL: prefetch the head of this program's W slab into L2, then wait for the previous kernel (x is its output)
        _prefetch_w_head(wb, offs_n, n_mask, stride_wn, k_lo, k_hi, PF_N, PF_L, PF_STEP)
        if GLU:
            _prefetch_w_head(wb, offs_n + N, n_mask, stride_wn, k_lo, k_hi, PF_N, PF_L, PF_STEP)
        gdc_enter(GDC)
    out = _w_tile(xb, wb, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi, BK, EVEN_K, DOT, PREC,
                  UPCAST, W_EVICT, W_CACHE, w_desc, (pid_b * N + pid_n * BN).to(tl.int32), TMA, R,
                  PREFETCH)  # [BM, BN]
    if GLU:     # W = [gate | up] rows: y = silu(x . gate_n) * (x . up_n), rounded as torch's bf16 silu and product
        up = _w_tile(xb, wb, offs_m, offs_n + N, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi, BK, EVEN_K, DOT,
                     PREC, UPCAST, W_EVICT, W_CACHE, w_desc, 0, False, R, PREFETCH)
        XT: tl.constexpr = x_ptr.dtype.element_ty
        g = cast_to(out, XT, INTERP).to(tl.float32)
        act = cast_to(g / (1.0 + tl.exp(-g)), XT, INTERP).to(tl.float32)
        out = act * cast_to(up, XT, INTERP).to(tl.float32)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + pid_b * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 0:
        tl.store(y_ptrs, out.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mn_mask)
    else:
        p_ptrs = p_ptr + pid_b * stride_pb + offs_m[:, None] * stride_pm + offs_n[None, :]        # [BM, BN]
        tl.store(p_ptrs + pid_s.to(tl.int64) * stride_ps, out, mask=mn_mask)
        if SPLIT == 2:
            S = tl.num_programs(1)
            cnt = cnt_ptr + pid_b * tl.num_programs(0) + pid_n
            tl.debug_barrier()      # every thread's partial stores precede the (release) arrival
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == S - 1:
                tot = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(S):  # fixed order: the same bits whichever program arrives last
                    tot += tl.load(p_ptrs + s * stride_ps, mask=mn_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, tot.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mn_mask)
                tl.store(cnt, 0)


@triton.jit
def _w_tile(xb, wb, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi, BK: tl.constexpr,
            EVEN_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, W_EVICT: tl.constexpr,
            W_CACHE: tl.constexpr, w_desc, row0, TMA: tl.constexpr, R: tl.constexpr, PREFETCH: tl.constexpr):
    # fp32 [BM, BN] = x[:, k_lo:k_hi] @ W[offs_n, k_lo:k_hi]^T by the tl.dot or the FMA path
    if DOT:
        return _dot_tile(xb, wb, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi,
                         BK, EVEN_K, PREC, UPCAST, W_EVICT, W_CACHE, w_desc, row0, TMA)
    else:
        return _fma_tile(xb, wb, offs_m, offs_n, m_mask, n_mask, stride_xm, stride_wn, k_lo, k_hi,
                         BK, R, EVEN_K, PREFETCH, W_EVICT, W_CACHE)


@triton.jit
def _split_reduce_kernel(p_ptr, y_ptr, x_ptr, S, R, N, BR: tl.constexpr):
    # partials p [S, R, N] fp32 (R = B*M rows) -> y [R, N] = sum over s in order 0..S-1, rounded to x's dtype, then
    # y's (x_ptr: only its dtype)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BR + tl.arange(0, BR)
    mask = offs < N
    acc = tl.zeros((BR,), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + (s * R + row) * N + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + offs, acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------- launch config
@dataclass(frozen=True)
class GemvConfig:
    BN: int = 64
    BK: int = 128
    split: Optional[int] = None     # K splits; None: picked by gemv_config's fill rule
    dot: Optional[bool] = None      # None: FMA for M <= FMA_MAX_M, tl.dot above
    num_warps: int = 4
    num_stages: int = 4
    fused: bool = True              # split > 1: the last-arriving program reduces (one launch) / a reduce launch
    evict: bool = True              # W loads evict_first (read once per call; leave L2 to x, partials, neighbours)
    cg: bool = False                # W loads .cg (L2 only, bypass L1; ptxas takes no evict_first with it)
    prefetch: bool = False          # FMA: next step's tiles loaded before this step's FMAs
    tma: bool = False               # dot: W by TMA boxes (host TensorDescriptor) where W's layout allows
    l2_mb: Optional[float] = None   # PDL: W MB prefetched into L2 before the wait (None: PDL_L2_MB)
    ragged: bool = False            # N in even tiles of <= BN rows filling whole waves of SMs (_ragged_tiles)


FMA_R = 8                # FMA path: contiguous K elements per thread and load (8 bf16 = 16 bytes)
FMA_MAX_M = 0            # FMA path for M <= this by default; 0: tl.dot everywhere until the H200 sweep says otherwise
DOT_CONFIG = GemvConfig(BN=64, BK=128, num_warps=4, num_stages=4)
FMA_CONFIG = GemvConfig(BN=16, BK=512, num_warps=4, num_stages=1)
MAX_SPLIT = 32           # K splits the balance rule (_pick_split) considers
SM_PEAK_OVER_HBM = 1.15  # one SM streams ~15% more than its 1/SMs share of HBM bandwidth (so idle SMs cost little)
PROGRAM_OVERHEAD = 1.0   # per program, in BK steps: first-load latency, epilogue, partial write / reduce
# per-shape overrides {(B, N, K, M) or (B, N, K): config} (exact M first), filled from bench/gemv.py --sweep
# H200 sweep 2026-12-03 (bench/gemv.py --m 1 --sweep --shapes KDA,o_proj,MLA; L2 flushed, us ours vs cuBLAS):
# in_proj 16.82 vs 18.71, f_b|g_b 2.76 vs 3.33, o_proj 8.30 vs 9.88, q|kv_a 10.03 vs 11.27, w_uv 3.62 vs 4.11.
# Ragged tiles (whole waves of SMs), H200 2026-12-04 (bench/gemv.py --m 1 --ragged, us ragged vs BN-wide vs cuBLAS):
# in_proj 15.62 / 17.92 / 20.22, o_proj 7.24 / 8.02 / 10.05, q|kv_a 9.29 / 9.93 / 11.64, MLP gate|up 22.66 / 27.34 /
# 28.17, MLP down 13.09 / 14.07 / 16.22, lm_head 188.0 / 194.9 / 199.3
SHAPE_CONFIGS: dict = {
    # KDA in_proj
    (1, 12576, 2304, 1): GemvConfig(BN=64, BK=128, split=1, dot=True, num_warps=4, num_stages=4, ragged=True),
    (2, 4096, 128, 1): GemvConfig(BN=8, BK=128, split=1, dot=False, num_warps=2, num_stages=1, prefetch=True),
    (1, 2304, 4096, 1): GemvConfig(BN=64, BK=128, split=3, dot=True, num_warps=4, num_stages=6, ragged=True),  # o_proj
    (1, 6720, 2304, 1): GemvConfig(BN=64, BK=128, split=1, dot=True, num_warps=4, num_stages=6, ragged=True),  # q|kv_a
    (32, 128, 512, 1): GemvConfig(BN=64, BK=128, split=1, dot=True, num_warps=4, num_stages=4),       # MLA w_uv
    (1, 18432, 2304, 1): GemvConfig(BN=128, BK=128, split=1, dot=True, num_warps=4, num_stages=3, ragged=True),  # MLP
    (1, 2304, 9216, 1): GemvConfig(BN=64, BK=128, split=4, dot=True, num_warps=4, num_stages=4, ragged=True),   # down
    # the dense MLP's gate|up as gemv_triton(glu=True) (N = I outputs, 2 x 35 rows per program: the bytes per
    # program of the gate|up entry above); untimed
    (1, 9216, 2304, 1): GemvConfig(BN=64, BK=128, split=1, dot=True, num_warps=4, num_stages=3, ragged=True),
    # lm_head
    (1, 163840, 2304, 1): GemvConfig(BN=128, BK=64, split=1, dot=True, num_warps=4, num_stages=6, ragged=True),
}
# field overrides of SHAPE_CONFIGS' entries, {(B, N, K[, M]): {GemvConfig field: value}}: plain literals, so that
# `bench/ablate.py --set "kernels.gemv.SHAPE_OVERRIDES={(1, 2304, 4096): {'split': 4}}"` tries a config inside the
# decode graph (where the standalone sweep's L2-flushed optimum need not hold); empty by default
SHAPE_OVERRIDES: dict = {}
# {(B, N, K): largest M} where ours beat cuBLAS on the H200 (skinny_linear(measured_only=True), KIMI_GEMV=auto)
GEMV_WINS: dict = {(1, 12576, 2304): 1, (1, 2304, 4096): 1, (1, 6720, 2304): 1, (1, 18432, 2304): 1, (1, 2304, 9216): 1,
                   (1, 163840, 2304): 1}


def _block_k(K: int, BK: int) -> int:
    """Largest BK' <= BK (power of 2, >= 16) dividing K, so that EVEN_K holds; BK itself when none does."""
    bk = BK
    while bk >= 16 and K % bk:
        bk //= 2
    return bk if bk >= 16 else BK


def _pick_split(tiles: int, steps: int, sms: int) -> int:
    """K splits S minimising the modelled time of the busiest SM: programs P = tiles * S are dealt round-robin
    (ceil(P / SMs) on the busiest), each streams cdiv(steps, S) BK steps, bounded below by HBM bandwidth over all
    SMs, plus a fixed cost per program. E.g. 197 in_proj tiles x 18 steps: S = 2 (394 programs, <= 3 x 9 steps per
    SM) instead of S = 1 (<= 2 x 18); 36 o_proj tiles x 32 steps: S = 11."""
    best = None
    for s in range(1, min(steps, MAX_SPLIT) + 1):
        k = -(-steps // s)
        s_eff = -(-steps // k)
        per_sm = -(-tiles * s_eff // sms)
        t = max(per_sm * k, tiles * steps / sms * SM_PEAK_OVER_HBM) + PROGRAM_OVERHEAD * per_sm
        if best is None or t < best[0] - 1e-9:
            best = (t, s_eff)
    return best[1]


def gemv_config(M: int, N: int, K: int, B: int, device, cfg: Optional[GemvConfig] = None,
                es: int = 2) -> tuple[GemvConfig, int]:
    """-> (config with dot, BK and split resolved, k_split). Without cfg: SHAPE_CONFIGS' entry, else the FMA / dot
    default by M; split None: _pick_split. es: element bytes; a dot config's stages are capped to the device's shared
    memory per block (_dot_stages)."""
    if cfg is None:
        cfg = SHAPE_CONFIGS.get((B, N, K, M), SHAPE_CONFIGS.get((B, N, K)))
        ov = SHAPE_OVERRIDES.get((B, N, K, M), SHAPE_OVERRIDES.get((B, N, K)))
        if ov:
            cfg = replace(cfg or (DOT_CONFIG if M > FMA_MAX_M else FMA_CONFIG), **ov)
    dot = cfg.dot if cfg is not None and cfg.dot is not None else M > FMA_MAX_M
    base = cfg if cfg is not None else (DOT_CONFIG if dot else FMA_CONFIG)
    bk = _block_k(K, base.BK)
    if dot:
        bk = max(bk, 16)
    tiles = B * cdiv(N, base.BN)
    steps = cdiv(K, bk)
    split = base.split if base.split is not None else _pick_split(tiles, steps, num_sms(device))
    split = max(1, min(split, steps))
    k_split = cdiv(steps, split) * bk                          # a multiple of BK
    stages = _dot_stages(base, bk, es, max_shared_mem(device)) if dot else base.num_stages
    return replace(base, BK=bk, dot=dot, split=cdiv(K, k_split), num_stages=stages), k_split


def _ragged_tiles(N: int, BN: int, B: int, S: int, sms: int) -> int:
    """N tiles of a ragged config: the smallest count >= cdiv(N, BN) (so tiles fit BN rows) for which the grid's
    B * S * NT programs are whole waves of the SMs, capped at N (a tile holds at least one row). E.g. in_proj
    (N 12576) on 132 SMs: BN 128 -> 132 tiles of 95-96 rows, one program per SM (BN-wide tiles: 99, or 197 at BN 64,
    65 SMs streaming two); o_proj (N 2304, 3 K splits) at BN 64: 44 tiles of 52-53 rows, 132 programs."""
    step = sms // math.gcd(sms, B * S)
    return min(N, cdiv(cdiv(N, BN), step) * step)


def _dot_stages(c: GemvConfig, bk: int, es: int, smem: int) -> int:
    """num_stages of a dot config within `smem` bytes per block: each stage holds a W tile [BN, BK] and the x tile
    [16, BK] (BN 64 / BK 128 bf16: 20 KB; the H200 sweep's 6 stages = 120 KB fit its 227 KB, not a GB10's 99 KB),
    8 KB kept for the epilogue / barriers."""
    per_stage = (c.BN + 16) * bk * es
    return max(1, min(c.num_stages, (smem - 8192) // per_stage))


# --------------------------------------------------------------------------------------------------- wrappers
def _tma_ok(wb: torch.Tensor) -> bool:
    """W [B, N, K] viewable as [B * N, K] with 16-byte aligned base and row stride (TMA descriptor rules)."""
    B, N, K = wb.shape
    es = wb.element_size()
    return ((B == 1 or wb.stride(0) == N * wb.stride(1)) and wb.stride(2) == 1 and (wb.stride(1) * es) % 16 == 0
            and wb.data_ptr() % 16 == 0 and K * es >= 16)


def _pdl_prefetch(B: int, N: int, S: int, k_split: int, es: int, mb: Optional[float] = None) -> dict:
    """PDL-only constexprs: L2 lines prefetched per W row and K split before the wait (`mb` MB, default PDL_L2_MB,
    over the grid's B * N * S row slabs, at most the slab's k_split columns and PDL_MAX_LINES), their power-of-2 tile
    and the elements per 128-byte line. E.g. bf16 at 4 MB: o_proj (N 2304, S 3) 4 of 22 lines; in_proj (N 12576)
    2 of 36."""
    step = max(1, L2_LINE_BYTES // es)
    mb = PDL_L2_MB if mb is None else mb
    n = min(cdiv(k_split, step), int(mb * (1 << 20)) // (B * N * S * L2_LINE_BYTES), PDL_MAX_LINES)
    return dict(PF_N=n, PF_L=next_pow2(max(n, 1)), PF_STEP=step)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, cfg: Optional[GemvConfig] = None,
                pdl: Optional[bool] = None, out: Optional[torch.Tensor] = None,
                glu: bool = False) -> torch.Tensor:
    """pdl: launch with PDL (kernels._pdl; None: KIMI_PDL). out: y's storage ([M, N] or [B, M, N], unit stride
    along N), of x's dtype or fp32; values are rounded to x's dtype either way (fp32 out = the x.dtype result
    upcast, bit for bit, without a conversion launch: the lm_head's logits).
    glu: w is [gate | up] rows ([2N, K]) and y [M, N] = silu(x gate^T) * (x up^T) with torch's bf16 roundings of the
    projections, the silu and the product (a dense MLP's gate_up_proj + act + mul; one K split, no TMA)."""
    batched = x.dim() == 3
    xb, wb = (x, w) if batched else (x[None], w[None])
    if xb.stride(-1) != 1:
        xb = xb.contiguous()
    if wb.stride(-1) != 1:
        wb = wb.contiguous()
    B, M, K = xb.shape
    N = wb.shape[1] // (2 if glu else 1)
    assert wb.shape == (B, N * (2 if glu else 1), K) and M <= GEMV_MAX_M and x.dtype == w.dtype, \
        (xb.shape, wb.shape, x.dtype, w.dtype)
    if out is None:
        y = torch.empty(B, M, N, dtype=x.dtype, device=x.device)
    else:
        y = out if batched else out[None]
        assert y.shape == (B, M, N) and y.stride(-1) == 1 and y.dtype in (x.dtype, torch.float32), (out.shape, y.dtype)
    res = out if out is not None else (y if batched else y[0])
    if M == 0 or N == 0:
        return res
    if K == 0:
        return res.zero_()
    c, k_split = gemv_config(M, N, K, B, x.device, cfg, x.element_size())
    if glu:                           # an epilogue of the whole dot: one K split
        c, k_split = replace(c, split=1), cdiv(K, c.BK) * c.BK
    S = c.split
    bm = max(16, next_pow2(M)) if c.dot else next_pow2(M)
    split_mode = 0 if S == 1 else (2 if c.fused else 1)
    p = y if S == 1 else torch.empty(S, B, M, N, dtype=torch.float32, device=x.device)   # fp32 partials
    nt = _ragged_tiles(N, c.BN, B, S, num_sms(x.device)) if c.ragged else cdiv(N, c.BN)
    cnt = arrival_counters(x.device, B * nt) if split_mode == 2 else p
    even_k = K % c.BK == 0
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = c.dot and x.dtype != torch.float32 and INTERPRET
    assert not c.dot or min(c.BN, c.BK) >= 16, c                     # tl.dot's GPU lowering needs dims >= 16
    tma = {}
    if c.tma and c.dot and not c.ragged and not glu and _tma_ok(wb):   # ragged: a box would read the next tile's rows
        from triton.tools.tensor_descriptor import TensorDescriptor
        tma = dict(TMA=True, w_desc=TensorDescriptor.from_tensor(wb.view(B * N, K), [c.BN, c.BK]))
    _gemv_kernel[(nt, S, B)](
        xb, wb, y, p, cnt, M, N, K, k_split,
        xb.stride(0), xb.stride(1), wb.stride(0), wb.stride(1), y.stride(0), y.stride(1),
        p.stride(0) if S > 1 else 0, p.stride(-3), p.stride(-2),
        BM=bm, BN=c.BN, BK=c.BK, EVEN_K=even_k, DOT=c.dot, PREC=prec, UPCAST=upcast, SPLIT=split_mode,
        W_EVICT="evict_first" if c.evict and not c.cg else "", W_CACHE=".cg" if c.cg else "", R=min(FMA_R, c.BK),
        PREFETCH=c.prefetch, num_warps=c.num_warps, num_stages=c.num_stages, RAGGED=c.ragged, NT=nt, GLU=glu,
        INTERP=glu and INTERPRET, **tma,
        **(pdl_launch(pdl, **_pdl_prefetch(B, wb.shape[1], S, k_split, wb.element_size(), c.l2_mb)) if pdl_on(pdl)
           else {}))
    if split_mode == 1:
        br = min(1024, next_pow2(N))
        _split_reduce_kernel[(B * M, cdiv(N, br))](p, y, xb, S, B * M, N, BR=br, num_warps=4)
    return res


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemv_triton(x, w) if use_triton(x) else gemv_ref(x, w)


def skinny_linear_takes(M: int, w: torch.Tensor, measured_only: bool = False) -> bool:
    """Does skinny_linear(x [M, K], w, measured_only) run gemv_triton: M <= GEMV_MAX_M rows on a Triton device (and,
    measured_only, M <= GEMV_WINS[(1, N, K)]: the shapes where the H200 sweep had ours faster than cuBLAS)?"""
    return (M <= GEMV_MAX_M and use_triton(w)
            and (not measured_only or M <= GEMV_WINS.get((1, w.shape[0], w.shape[1]), 0)))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, measured_only: bool = False,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x [M, K], w [N, K]) through gemv_triton where skinny_linear_takes, else F.linear.
    out: [M, N] of x's dtype or fp32, filled with the x.dtype result (upcast) and returned."""
    if x.dim() == 2 and skinny_linear_takes(x.shape[0], w, measured_only):
        return gemv_triton(x, w, out=out)
    y = F.linear(x, w)
    return y if out is None else out.copy_(y)


def skinny_bmm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x [B, M, K], w [B, N, K]^T) through gemv_triton when M <= GEMV_MAX_M and use_triton(x)."""
    if x.shape[1] <= GEMV_MAX_M and use_triton(x):
        return gemv_triton(x, w)
    return torch.bmm(x, w.transpose(1, 2))


# --------------------------------------------------------------------------------------------------- offline check
def compile_report(arch: int = 90, configs: Optional[list] = None, M: int = 16, bf16: bool = True,
                   split: int = 0) -> dict:
    """Compile _gemv_kernel offline for sm_<arch> (kernels/_offline.py: Triton's bundled ptxas; no GPU, no
    TRITON_INTERPRET) and return {(config, dot): (registers, spill stack bytes, shared bytes, kernel)} (SPLIT mode
    `split`: 0 / 1 / 2)."""
    from kernels._offline import compile_offline

    configs = configs or [DOT_CONFIG, FMA_CONFIG]
    ty = "*bf16" if bf16 else "*fp32"
    types = dict(x_ptr=ty, w_ptr=ty, y_ptr=ty, p_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32",
                 k_split="i32", stride_xb="i32", stride_xm="i32", stride_wb="i32", stride_wn="i32",
                 stride_yb="i32", stride_ym="i32", stride_ps="i32", stride_pb="i32", stride_pm="i32")
    fn, names, out = _gemv_kernel, _gemv_kernel.arg_names, {}
    for cfg in configs:
        dot = cfg.dot if cfg.dot is not None else cfg is DOT_CONFIG
        consts = dict(BM=max(16, M) if dot else next_pow2(M), BN=cfg.BN, BK=cfg.BK, EVEN_K=True,
                      DOT=dot, PREC="tf32" if bf16 else "ieee", UPCAST=False, SPLIT=split,
                      W_EVICT="evict_first" if cfg.evict and not cfg.cg else "", W_CACHE=".cg" if cfg.cg else "",
                      R=min(FMA_R, cfg.BK), PREFETCH=cfg.prefetch)
        if cfg.tma and dot:
            consts["TMA"] = True
            types["w_desc"] = f"tensordesc<{ty[1:]}[{cfg.BN}, {cfg.BK}]>"
        else:
            consts["TMA"] = False
            consts["w_desc"] = None
        div = [n for n in names
               if n in types and (types[n].startswith("*") or n.startswith("stride") or n in ("K", "k_split"))]
        b = compile_offline(fn, types, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, arch=arch,
                            divisible=div)
        out[(cfg, dot)] = (b.regs, b.stack, b.smem, b.kernel)
    return out
