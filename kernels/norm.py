"""RMSNorm and the KDA output gated RMSNorm (sigmoid gate), Triton kernels + torch references.

rmsnorm(x [T, D], w [D], eps) -> [T, D]:     y = w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)
rmsnorm_head(x [T, D + P], w [D], eps) -> [T, D + P]: rmsnorm of the first D columns, the last P copied (MLA: the
                                               normed latent and its rope key, one cache row, one launch)
add_rmsnorm(x, res [T, D], w, eps) -> (rmsnorm(h), h) with h = res + x in x.dtype: the decoder's residual add and
                                               the next norm in one launch (same rounding as the two torch ops)
combine_add_rmsnorm(y [T*k, D], tw [T, k], res [T, D], w, eps) -> add_rmsnorm(x, res, w, eps) with
                                               x = sum_j tw[t, j] * y[t*k + j] (fp32, j ascending) in res.dtype: the
                                               MoE combine (kernels.moe.fused) folded into it, one launch for two
gated_rmsnorm(o [T, H, V], r [T, H, V], w [V], eps) -> [T, H, V]:
                                               y = o_f32 * rsqrt(mean(o_f32^2) + eps) * w * sigmoid(r_f32)  (fp32 math)
PDL (KIMI_PDL=1, kernels._pdl; `pdl` overrides): the row kernels (all but gated_rmsnorm, which decode does not run)
are launched with programmatic dependent launch and load only the norm weight before griddepcontrol.wait.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._pdl import gdc_enter, pdl_launch
from kernels._tensors import next_pow2, unit_last_stride
from kernels.moe.fused import combine_row
from kernels._jit import INTERPRET, cast_to

# Row kernels load the norm weight first (A/B switch: KIMI_NORM_EARLY_W=0 loads it where it is used, the old order)
EARLY_W = os.environ.get("KIMI_NORM_EARLY_W", "1") != "0"
# launch configs (num_warps, early weight load) that bench/router.py times for the row kernels; None -> row_config
NORM_CONFIGS = [(4, False), (4, True), (2, True), (8, True)]


def row_config(BD: int, cfg=None):
    """-> (num_warps, early_w) for one program per row of BD (padded) columns; cfg overrides (bench)."""
    return cfg if cfg is not None else (4 if BD <= 4096 else 8, EARLY_W)


# --------------------------------------------------------------------------------------------------- references
def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w * xn).to(x.dtype)


def rmsnorm_head_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    d = w.shape[0]
    return torch.cat([rmsnorm_ref(x[:, :d], w, eps), x[:, d:]], dim=-1)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    h = residual + x
    return rmsnorm_ref(h, w, eps), h


def combine_add_rmsnorm_ref(y: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                            eps: float):
    """y [T*k, D] expert outputs (or fp32 K partials [S, T*k, D], summed in order and rounded per row first)."""
    T, k = topk_weights.shape
    if y.dim() == 3:
        part = y[0].clone()
        for s in range(1, y.shape[0]):
            part += y[s]
        y = part.to(residual.dtype)
    acc = torch.zeros(T, residual.shape[1], dtype=torch.float32, device=residual.device)
    yk = y.view(T, k, -1).float()
    for j in range(k):
        acc += topk_weights[:, j:j + 1].float() * yk[:, j]
    return add_rmsnorm_ref(acc.to(residual.dtype), residual, w, eps)


def gated_rmsnorm_ref(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * w.float() * torch.sigmoid(r.float())
    return y.to(o.dtype)


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _load_w(w_ptr, offs, mask, EARLY: tl.constexpr):
    # the norm weight [BD] fp32; EARLY (EARLY_W): loaded by the row kernels before anything else. Loaded where it is
    # used, it is issued after the reduction and the h store (which the compiler may not move it across): its cold
    # HBM read is then a second round trip per launch (PTX/SASS checked, sm_90)
    if EARLY:
        return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        return offs


@triton.jit
def _rms_weighted(x, w, w_ptr, offs, mask, D, eps, OUT_TY: tl.constexpr, EARLY: tl.constexpr):
    # x [BD] fp32 (0 where masked), w from _load_w -> w * (x / rms(x)) in fp32, x / rms(x) rounded to OUT_TY first
    # like the reference's (x/rms).to(x.dtype)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    xn = (x * rstd).to(OUT_TY).to(tl.float32)
    if not EARLY:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return w * xn


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, y_ptr,
    stride_x, stride_y,
    D, eps,
    BD: tl.constexpr, EARLY_W: tl.constexpr, GDC: tl.constexpr = False,
):
    # one program per row; x [T, D], w [D], y [T, D]. GDC (PDL launch): the weight load precedes the wait
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    w = _load_w(w_ptr, offs, mask, EARLY_W)
    gdc_enter(GDC)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _rms_weighted(x, w, w_ptr, offs, mask, D, eps, y_ptr.dtype.element_ty, EARLY_W)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_head_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, C, eps, BC: tl.constexpr,
                         EARLY_W: tl.constexpr, GDC: tl.constexpr = False):
    # one program per row of C = D + P columns: the first D normalised like _rmsnorm_kernel, the rest copied
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BC)
    head = offs < D
    w = _load_w(w_ptr, offs, head, EARLY_W)
    gdc_enter(GDC)
    xr = tl.load(x_ptr + row * stride_x + offs, mask=offs < C, other=0.0)
    x = tl.where(head, xr.to(tl.float32), 0.0)
    y = _rms_weighted(x, w, w_ptr, offs, head, D, eps, y_ptr.dtype.element_ty, EARLY_W)
    y = tl.where(head, y.to(y_ptr.dtype.element_ty), xr.to(y_ptr.dtype.element_ty))
    tl.store(y_ptr + row * stride_y + offs, y, mask=offs < C)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    stride_x, stride_r, stride_y, stride_h,
    D, eps,
    BD: tl.constexpr, EARLY_W: tl.constexpr, GDC: tl.constexpr = False,
):
    # one program per row: h = r + x (rounded to the dtype like the torch add), y = rmsnorm(h) as _rmsnorm_kernel
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    w = _load_w(w_ptr, offs, mask, EARLY_W)
    gdc_enter(GDC)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (r + x).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    y = _rms_weighted(h.to(tl.float32), w, w_ptr, offs, mask, D, eps, y_ptr.dtype.element_ty, EARLY_W)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_add_rmsnorm_kernel(
    y_ptr, tw_ptr, r_ptr, w_ptr, o_ptr, h_ptr,
    stride_ys, stride_r, stride_o, stride_h,
    D, eps,
    TOP_K: tl.constexpr, SPLIT: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr, EARLY_W: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # one program per token t: y [T*k, D] (or [SPLIT, T*k, D] fp32) contiguous, tw [T, k] fp32, r/o/h [T, D].
    # The combine is _moe_combine_kernel's (combine_row) and the rest _add_rmsnorm_kernel's, op for op, so the bits
    # match the two-launch sequence (keep them in step if either changes)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    w = _load_w(w_ptr, offs, mask, EARLY_W)
    gdc_enter(GDC)   # PDL launch: only the weight before the wait (y, tw and the residual are activations)
    if EARLY_W:  # the residual too: after the combine's loads and FMAs, its latency was exposed
        r = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    acc = combine_row(y_ptr, tw_ptr, t, offs, mask, D, stride_ys, TOP_K, SPLIT, h_ptr.dtype.element_ty, INTERP)
    x = cast_to(acc, h_ptr.dtype.element_ty, INTERP).to(tl.float32)     # the combine's store + add_rmsnorm's load
    if not EARLY_W:
        r = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (r + x).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + t * stride_h + offs, h, mask=mask)
    o = _rms_weighted(h.to(tl.float32), w, w_ptr, offs, mask, D, eps, o_ptr.dtype.element_ty, EARLY_W)
    tl.store(o_ptr + t * stride_o + offs, o.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rmsnorm_kernel(
    o_ptr, r_ptr, w_ptr, y_ptr,
    stride_o, stride_r, stride_y,       # row (token*head) strides; the last dim is contiguous
    V, eps,
    BV: tl.constexpr, ROWS: tl.constexpr,
):
    # o, r, y viewed as [T*H, V]; ROWS rows per program
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BV)
    n_rows = tl.num_programs(0).to(tl.int64) * ROWS
    cmask = cols < V
    mask = cmask[None, :] & (rows[:, None] < n_rows)
    o = tl.load(o_ptr + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / V + eps)                 # [ROWS]
    y = o * rstd[:, None] * w[None, :] * tl.sigmoid(r)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------- wrappers
def rmsnorm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, cfg=None, pdl=None) -> torch.Tensor:
    shape = x.shape
    D = shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y.reshape(shape)
    BD = next_pow2(D)
    warps, early = row_config(BD, cfg)
    _rmsnorm_kernel[(x2.shape[0],)](x2, w, y, x2.stride(0), y.stride(0), D, eps, BD=BD, EARLY_W=early,
                                     num_warps=warps, **pdl_launch(pdl))
    return y.reshape(shape)


def rmsnorm_head_triton(x: torch.Tensor, w: torch.Tensor, eps: float, pdl=None) -> torch.Tensor:
    """x [T, D + P] (row stride allowed) -> contiguous [T, D + P] in x.dtype."""
    T, C = x.shape
    x = unit_last_stride(x)
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T:
        BC = next_pow2(C)
        warps, early = row_config(BC)
        _rmsnorm_head_kernel[(T,)](x, w, y, x.stride(0), y.stride(0), w.shape[0], C, eps, BC=BC, EARLY_W=early,
                                   num_warps=warps, **pdl_launch(pdl))
    return y


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, cfg=None, pdl=None):
    """x, residual [T, D] (row strides allowed) -> (y, h) contiguous [T, D] in x.dtype."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype, (x.shape, residual.shape)
    T, D = x.shape
    x, residual = unit_last_stride(x), unit_last_stride(residual)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y)
    if T:
        BD = next_pow2(D)
        warps, early = row_config(BD, cfg)
        _add_rmsnorm_kernel[(T,)](x, residual, w, y, h, x.stride(0), residual.stride(0), y.stride(0), h.stride(0),
                                  D, eps, BD=BD, EARLY_W=early, num_warps=warps, **pdl_launch(pdl))
    return y, h


def combine_add_rmsnorm_triton(y: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                               eps: float, cfg=None, pdl=None):
    """y: kernels.moe.fused.moe_gemm2's output ([T*k, D] in residual.dtype, or fp32 partials [S, T*k, D]),
    topk_weights [T, k] fp32, residual [T, D] (row stride allowed) -> (y, h) contiguous [T, D] in residual.dtype."""
    T, top_k = topk_weights.shape
    D = residual.shape[1]
    assert y.is_contiguous() and y.shape[-2:] == (T * top_k, D), (y.shape, topk_weights.shape, residual.shape)
    assert y.dim() == 2 and y.dtype == residual.dtype or y.dim() == 3 and y.dtype == torch.float32, y.dtype
    residual = unit_last_stride(residual)
    out = torch.empty(T, D, dtype=residual.dtype, device=residual.device)
    h = torch.empty_like(out)
    if T:
        BD = next_pow2(D)
        split = y.shape[0] if y.dim() == 3 else 1
        # num_warps as add_rmsnorm_triton: the same reduction tree for the norm's sum of squares
        warps, early = row_config(BD, cfg)
        _combine_add_rmsnorm_kernel[(T,)](y, topk_weights.contiguous(), residual, w, out, h, T * top_k * D,
                                          residual.stride(0), out.stride(0), h.stride(0), D, eps, TOP_K=top_k,
                                          SPLIT=split, BD=BD, INTERP=INTERPRET, EARLY_W=early, num_warps=warps,
                                          **pdl_launch(pdl))
    return out, h


def gated_rmsnorm_triton(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    shape = o.shape
    V = w.numel()
    o2 = o.reshape(-1, V)
    r2 = r.reshape(-1, V)
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    if out is None:
        y = torch.empty(o2.shape, dtype=o.dtype, device=o.device)
    else:
        y = out.view(o2.shape)
        assert y.stride(-1) == 1 and y.stride(0) == V
    R = o2.shape[0]
    if R == 0:
        return y.reshape(shape)
    BV = next_pow2(V)
    ROWS = 1
    while ROWS < 8 and R % (ROWS * 2) == 0 and ROWS * 2 * BV <= 2048:
        ROWS *= 2
    _gated_rmsnorm_kernel[(R // ROWS,)](o2, r2, w, y, o2.stride(0), r2.stride(0), y.stride(0), V, eps,
                                        BV=BV, ROWS=ROWS, num_warps=4)
    return y.reshape(shape) if out is None else out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rmsnorm_triton(x, w, eps)
    return rmsnorm_ref(x, w, eps)


def rmsnorm_head(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """-> cat(rmsnorm(x[:, :D]), x[:, D:]) with D = w.numel()."""
    if use_triton(x):
        return rmsnorm_head_triton(x, w, eps)
    return rmsnorm_head_ref(x, w, eps)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    """-> (rmsnorm(residual + x), residual + x)."""
    if use_triton(x):
        return add_rmsnorm_triton(x, residual, w, eps)
    return add_rmsnorm_ref(x, residual, w, eps)


def combine_add_rmsnorm(y: torch.Tensor, topk_weights: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                        eps: float):
    """-> add_rmsnorm(combine(y, topk_weights), residual, w, eps) (see combine_add_rmsnorm_triton for y)."""
    if use_triton(residual):
        return combine_add_rmsnorm_triton(y, topk_weights, residual, w, eps)
    return combine_add_rmsnorm_ref(y, topk_weights, residual, w, eps)


def gated_rmsnorm(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(o):
        return gated_rmsnorm_triton(o, r, w, eps)
    return gated_rmsnorm_ref(o, r.reshape(o.shape), w, eps)
