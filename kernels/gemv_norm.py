"""MoE combine + residual add + RMSNorm in the prologue of the next layer's input projection (one launch for two).

gemv_combine_norm(y, topk_weights, residual, norm_w, eps, w) -> (out [T, N], h [T, D]):
    h   = residual + combine(y)            bitwise kernels.norm.combine_add_rmsnorm_triton's h
    x   = RMSNorm(h) * norm_w              (never materialised for the caller)
    out = x @ w^T                          fp32 accumulation, out in residual.dtype (kernels.gemv's DOT path)
y is kernels.moe.fused's GEMM2 output as combine_add_rmsnorm_triton takes it ([T*k, D] in residual.dtype, or fp32
K partials [S, T*k, D]); topk_weights [T, k] fp32; residual [T, D] (row stride allowed); norm_w [D]; w [N, D]
(nn.Linear layout, residual.dtype).

Why: in the batch-1 decode graph each MoE layer ended with GEMM2, a one-program combine + add + norm kernel, then the
next layer's in_proj gemv (KDA [12576, 2304], MLA [6720, 2304]); the one-program kernel sat on the critical path
between the two (~3 us a layer). Here every program of the gemv grid computes the few normalised rows itself from
GEMM2's output (T x D, L2-resident) and only then streams its W slab (without PDL nothing of W is in flight during
that prologue; with PDL the head of the slab was prefetched into L2 before the wait).

Kernel (_gemv_norm_kernel, grid cdiv(N, BN), one program per BN output columns, the whole K = D range):
  1. prologue, per token row r < T (a constexpr, <= NORM_IN_MAX_T): the statements of kernels.norm's
     _combine_add_rmsnorm_kernel on one [BD = next_pow2(D)] row (combine_row, the residual add, _rms_weighted with
     the norm weight loaded first), so h has its bits and x = bf16(norm_w * bf16(h * rstd)) its roundings; program 0
     stores h; every program stores its x rows into its own scratch rows xs[pid, :T, :D] (L2);
  2. a CTA barrier, then kernels.gemv's _dot_tile over xs and W: the same swap-AB tl.dot loop, W loads, eviction
     hint, BK, num_warps and num_stages as gemv_triton for (x [T, D], w) (gemv_config / SHAPE_CONFIGS), x padded to
     BM = 16 rows by masked loads.
x: the sum of squares is one tl.sum over the [BD] row, as in the one-program kernel, with the same num_warps for
the Kimi shapes (4), so x is expected to be bitwise the two-launch x; a different reduction tree (a compiler layout
change, another warp count) can move x by 1 ulp of the dtype, and out by the bf16 rounding of the GEMV's inputs.
Fused only for 1 <= T <= NORM_IN_MAX_T, CUDA (or TRITON_INTERPRET with use_triton), a DOT config with one K split
and no TMA (both Kimi in_proj shapes at T = 1, SHAPE_CONFIGS, and MLA's at T <= 4; at T = 2..4 gemv_config's balance
rule splits the KDA in_proj's K, so those take the two launches unless a one-split config is added); otherwise, and on CPU without forced Triton, the
two-launch path: kernels.norm.combine_add_rmsnorm then kernels.gemv.skinny_linear (bit for bit what the model ran).
The prologue repeats the (cheap, L2-hit) norm in every program: ~T x D x k FMAs per program. Offline sm_90 (bf16,
BN 64 / BK 128 / 4 warps): 82 registers at T = 1 without PDL, 112-122 with PDL (T <= 4), no spills, y in bf16 (what
GEMM2 writes at decode, split2 = 1); with fp32 K partials (split2 > 1) the unrolled k x S loads of a [BD] row spill
(~850 bytes of stack at S = 3; correct, not tuned).
PDL (kernels._pdl; `pdl` overrides KIMI_PDL): before griddepcontrol.wait only gemv's L2 prefetch of the W slab head
(_prefetch_w_head, _pdl_prefetch's constexprs) and the norm weight load; y, topk_weights and the residual after the
wait, launch_dependents right after it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._pdl import gdc_enter, pdl_launch, pdl_on
from kernels._tensors import unit_last_stride
from kernels.gemv import (
    GEMV_MAX_M, GEMV_WINS, GemvConfig, _dot_tile, _pdl_prefetch, _prefetch_w_head, gemv_config, gemv_ref,
    gemv_triton,
)
from kernels.moe.fused import combine_row
from kernels.moe.router import INTERPRET, cast_to
from kernels.norm import (
    _load_w, _rms_weighted, combine_add_rmsnorm, combine_add_rmsnorm_ref, combine_add_rmsnorm_triton,
)

NORM_IN_MAX_T = 4      # largest T of the fused path (the prologue unrolls one [BD] row per token)
# W bytes the whole grid prefetches into L2 right after the wait, before the prologue (read per call;
# KIMI_NORM_IN_PF_MB): the prologue's dependent loads (y, residual, the x scratch round trip) take a few us in which
# the W stream would otherwise stand still (H200 12-03: the fused launch without it saved nothing over the two
# launches); lines after the PDL head (or from column 0 without PDL), capped by the slab
NORM_IN_PF_MB = float(os.environ.get("KIMI_NORM_IN_PF_MB", "12"))


# --------------------------------------------------------------------------------------------------- reference
def gemv_combine_norm_ref(y: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                          eps: float, w: torch.Tensor):
    """-> (out, h): kernels.norm.combine_add_rmsnorm_ref, then kernels.gemv.gemv_ref of its x (fp32 math)."""
    x, h = combine_add_rmsnorm_ref(y, topk_weights, residual, norm_w, eps)
    return gemv_ref(x, w), h


# --------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _gemv_norm_kernel(
    y_ptr, tw_ptr, r_ptr, nw_ptr, w_ptr, o_ptr, h_ptr, xs_ptr,
    N, D, eps,
    stride_ys, stride_r, stride_h, stride_wn, stride_o,
    T: tl.constexpr, TOP_K: tl.constexpr, SPLIT: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, W_EVICT: tl.constexpr, W_CACHE: tl.constexpr,
    GDC: tl.constexpr = False, PF_N: tl.constexpr = 0, PF_L: tl.constexpr = 1, PF_STEP: tl.constexpr = 64,
    PF2_N: tl.constexpr = 0, PF2_L: tl.constexpr = 1,
):
    # grid (cdiv(N, BN),): program n writes out[:T, n*BN:+BN]; program 0 also h[:T]. y [T*k, D] (or [SPLIT, T*k, D]
    # fp32) and tw [T, k] contiguous, r / h [T, D] row-strided, xs [programs, T, D] this call's scratch.
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    offs = tl.arange(0, BD)
    mask = offs < D
    DT: tl.constexpr = h_ptr.dtype.element_ty
    if GDC:  # PDL: the head of this program's W slab into L2 (as gemv), then the norm weight, then the wait
        _prefetch_w_head(w_ptr, offs_n, n_mask, stride_wn, 0, D, PF_N, PF_L, PF_STEP)
    nw = _load_w(nw_ptr, offs, mask, True)
    gdc_enter(GDC)
    # the next PF2_N lines of the slab into L2 while the prologue's dependent loads run (NORM_IN_PF_MB)
    _prefetch_w_head(w_ptr, offs_n, n_mask, stride_wn, PF_N * PF_STEP if GDC else 0, D, PF2_N, PF2_L, PF_STEP)
    xs = xs_ptr + pid.to(tl.int64) * T * D
    for t in tl.static_range(T):
        # _combine_add_rmsnorm_kernel's statements for token t (EARLY_W order), so h and x round alike
        r = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        acc = combine_row(y_ptr, tw_ptr, t, offs, mask, D, stride_ys, TOP_K, SPLIT, DT, INTERP)
        c = cast_to(acc, DT, INTERP).to(tl.float32)
        h = (r + c).to(DT)
        if pid == 0:
            tl.store(h_ptr + t * stride_h + offs, h, mask=mask)
        x = _rms_weighted(h.to(tl.float32), nw, nw_ptr, offs, mask, D, eps, DT, True)
        tl.store(xs + t * D + offs, x.to(DT), mask=mask)
    tl.debug_barrier()  # the CTA's x rows are in memory before any thread loads them as the dot's operand
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < T
    out = _dot_tile(xs, w_ptr, offs_m, offs_n, m_mask, n_mask, D, stride_wn, 0, D,
                    BK, EVEN_K, PREC, UPCAST, W_EVICT, W_CACHE, None, 0, False)                        # [BM, BN]
    tl.store(o_ptr + offs_m[:, None] * stride_o + offs_n[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------------------- wrappers
def fused_config(T: int, N: int, D: int, device, dtype: torch.dtype, cfg: Optional[GemvConfig] = None,
                 measured_only: bool = False):
    """-> (GemvConfig, k_split) of the fused launch, or None where gemv_combine_norm takes the two-launch path:
    T outside 1..NORM_IN_MAX_T, or gemv_config's choice for (x [T, D], w [N, D]) (cfg overrides, as gemv_triton's)
    not a one-split DOT config without TMA; measured_only: also T > GEMV_WINS[(1, N, D)] (KIMI_GEMV=auto, where
    skinny_linear would run F.linear)."""
    if not 1 <= T <= NORM_IN_MAX_T or (measured_only and T > GEMV_WINS.get((1, N, D), 0)):
        return None
    c, k_split = gemv_config(T, N, D, 1, device, cfg, dtype.itemsize)
    if not c.dot or c.split != 1 or c.tma or min(c.BN, c.BK) < 16:
        return None
    return c, k_split


def _two_launch(y, topk_weights, residual, norm_w, eps, w, pdl, cfg, measured_only):
    """-> (out, h, x) as the model ran it before: the combine + add + norm launch (kernels.norm), then the projection
    as kernels.gemv.skinny_linear(x, w, measured_only) runs it (gemv_triton with `cfg` / `pdl`, or F.linear); on CPU
    without forced Triton combine_add_rmsnorm's torch reference and F.linear."""
    if not use_triton(residual):
        x, h = combine_add_rmsnorm(y, topk_weights, residual, norm_w, eps)
        return F.linear(x, w), h, x
    x, h = combine_add_rmsnorm_triton(y, topk_weights, residual, norm_w, eps, pdl=pdl)
    T = x.shape[0]
    if T <= GEMV_MAX_M and (not measured_only or T <= GEMV_WINS.get((1, w.shape[0], w.shape[1]), 0)):
        return gemv_triton(x, w, cfg, pdl), h, x
    return F.linear(x, w), h, x


def _empty(shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """The fused path's buffers (out, h, the x scratch); tests swap in NaN-filled ones."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def gemv_combine_norm(y: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                      eps: float, w: torch.Tensor, pdl: Optional[bool] = None, cfg: Optional[GemvConfig] = None,
                      measured_only: bool = False, return_x: bool = False):
    """-> (out [T, N], h [T, D]) in residual.dtype (see the module docstring). pdl: PDL launch (None: KIMI_PDL);
    cfg: the GEMV config (tests; None: gemv_config's); measured_only: fuse only where skinny_linear(...,
    measured_only=True) would run our gemv; return_x: also x [T, D] (the fused path's program 0 scratch rows;
    tests)."""
    T, top_k = topk_weights.shape
    D = residual.shape[1]
    N = w.shape[0]
    assert w.shape == (N, D) and w.dtype == residual.dtype, (w.shape, w.dtype, residual.shape, residual.dtype)
    plan = fused_config(T, N, D, residual.device, residual.dtype, cfg, measured_only) if use_triton(residual) else None
    if plan is None:
        out, h, x = _two_launch(y, topk_weights, residual, norm_w, eps, w, pdl, cfg, measured_only)
        return (out, h, x) if return_x else (out, h)
    c, k_split = plan
    assert y.is_contiguous() and y.shape[-2:] == (T * top_k, D), (y.shape, topk_weights.shape, residual.shape)
    assert y.dim() == 2 and y.dtype == residual.dtype or y.dim() == 3 and y.dtype == torch.float32, y.dtype
    residual = unit_last_stride(residual)
    w = unit_last_stride(w)
    grid = triton.cdiv(N, c.BN)
    out, h, xs = _empty((T, N), residual), _empty((T, D), residual), _empty((grid, T, D), residual)
    es = residual.element_size()
    _gemv_norm_kernel[(grid,)](
        y, topk_weights.contiguous(), residual, norm_w, w, out, h, xs,
        N, D, eps, T * top_k * D, residual.stride(0), h.stride(0), w.stride(0), out.stride(0),
        T=T, TOP_K=top_k, SPLIT=y.shape[0] if y.dim() == 3 else 1, BD=triton.next_power_of_2(D), INTERP=INTERPRET,
        BM=max(16, triton.next_power_of_2(T)), BN=c.BN, BK=c.BK, EVEN_K=D % c.BK == 0,
        PREC="ieee" if residual.dtype == torch.float32 else "tf32",
        UPCAST=residual.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET", "0") == "1",
        W_EVICT="evict_first" if c.evict and not c.cg else "", W_CACHE=".cg" if c.cg else "",
        num_warps=c.num_warps, num_stages=c.num_stages,
        **_prefetch_after(N, k_split, es, pdl_on(pdl)),
        **(pdl_launch(pdl, **_pdl_prefetch(1, N, 1, k_split, es)) if pdl_on(pdl) else {}))
    return (out, h, xs[0]) if return_x else (out, h)


def _prefetch_after(N: int, k_split: int, es: int, gdc: bool, interp: bool = INTERPRET) -> dict:
    """PF2_N / PF2_L: W lines per row prefetched after the wait (NORM_IN_PF_MB over the N rows), from the end of the
    PDL head (gdc) or column 0, within the row's k_split columns."""
    if interp:   # prefetch_l2 is inline PTX
        return dict(PF2_N=0, PF2_L=1)
    step = max(1, 128 // es)
    head = _pdl_prefetch(1, N, 1, k_split, es)["PF_N"] if gdc else 0
    n = max(0, min(triton.cdiv(k_split, step) - head, int(NORM_IN_PF_MB * (1 << 20)) // (N * 128)))
    return dict(PF2_N=n, PF2_L=triton.next_power_of_2(max(n, 1)))


# --------------------------------------------------------------------------------------------------- offline check
def compile_report(N: int = 12576, D: int = 2304, T: int = 1, top_k: int = 9, split: int = 1, gdc: bool = False,
                   arch: int = 90, cfg: Optional[GemvConfig] = None) -> dict:
    """Compile _gemv_norm_kernel offline for sm_<arch> (bf16; the config fused_config picks for the shape on an
    H200, or cfg's; Triton's bundled ptxas, no GPU, not under TRITON_INTERPRET) -> dict(regs, stack (spill bytes),
    smem, events (kernels._pdl.PTX_EVENTS in PTX order), wgmma, config)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels._pdl import PTX_EVENTS

    c, k_split = fused_config(T, N, D, "cpu", torch.bfloat16, cfg)
    consts = dict(T=T, TOP_K=top_k, SPLIT=split, BD=triton.next_power_of_2(D), INTERP=False,
                  BM=max(16, triton.next_power_of_2(T)), BN=c.BN, BK=c.BK, EVEN_K=D % c.BK == 0, PREC="tf32",
                  UPCAST=False, W_EVICT="evict_first" if c.evict and not c.cg else "", W_CACHE=".cg" if c.cg else "",
                  GDC=gdc, **(_pdl_prefetch(1, N, 1, k_split, 2) if gdc else {}),
                  **_prefetch_after(N, k_split, 2, gdc, interp=False))
    types = dict(y_ptr="*fp32" if split > 1 else "*bf16", tw_ptr="*fp32", r_ptr="*bf16", nw_ptr="*bf16",
                 w_ptr="*bf16", o_ptr="*bf16", h_ptr="*bf16", xs_ptr="*bf16", eps="fp32")
    fn = _gemv_norm_kernel
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ("D", "stride_ys", "stride_r", "stride_h", "stride_wn")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    cuobjdump = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    ptx = kern.asm["ptx"]
    events = [e for line in ptx.splitlines() for e in PTX_EVENTS if e in line]
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), smem=int(kern.metadata.shared), events=events,
                wgmma="wgmma" in ptx, config=c)
