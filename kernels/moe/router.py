"""Triton MoE router: fp32 logits (x @ gate_w.T) -> sigmoid -> +bias (selection only) -> top-k -> renorm -> scale.

Two kernels, no host sync (CUDA-graph capturable):
  1. logits [T, E] fp32 = x @ gate_w.T with fp32 accumulation. For bf16/fp16 inputs the products are exact in fp32,
     so this equals the reference ``x.float() @ gate_w.float().T`` up to summation order; fp32 inputs use
     ``input_precision="ieee"`` (no TF32). T <= GEMV_MAX_T (decode): ``_router_logits_gemv_kernel``, one program per
     (token, 2 experts) with the whole D row in one tile (E/2 programs stream the gate weight in one round trip);
     larger T: ``_router_logits_kernel`` (tl.dot tiles).
  2. ``_router_topk_kernel``: per token row, k rounds of "take the max of (sigmoid + bias), lowest expert index on
     ties" -- one int64 max per round over keys (order-preserving int32 of the fp32 score) << 32 | (BLOCK_E-1-e) --,
     then weights from the unbiased (or, with ``biased_weights``, biased) scores at the picked ids, renormalised and
     scaled. Small T: one warp per row (the reductions are warp shuffles, no shared-memory round trips).

Decode (T <= GEMV_MAX_T) runs in one launch: logits programs, then one program per token selects (the last to arrive
on an arrival counter, v1 / v2, or the last in launch order spinning on flag-carrying logit slots, v3); see
ROUTER_DECODE. v2 / v3 route 16 < T <= TOPK_ROW_MAX_T through split-K logits and a one-warp-per-token top-k.

Tie-breaking matches ``moe_router_ref``: descending selection score, equal scores -> lower expert index first;
``topk_ids[:, 0]`` is the best expert.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._jit import INTERPRET
from kernels._pdl import gdc_enter, gdc_wait, l2_span_args, pdl_launch, pdl_on, prefetch_span_l2

from kernels._tensors import arrival_counters, cdiv, next_pow2, unit_last_stride, workspace

# Largest T routed by the GEMV logits kernel and single-row top-k programs (decode batches)
GEMV_MAX_T = 16
# T <= GEMV_MAX_T: logits and top-k in one launch (the last-arriving logits program of a token selects its top-k);
# KIMI_ROUTER_FUSED=0 keeps two launches (A/B switch)
FUSED_DECODE = os.environ.get("KIMI_ROUTER_FUSED", "1") != "0"
# which one-launch decode kernel (A/B switch, read per call so bench/router.py can flip it): "v1"
# _router_fused_gemv_kernel (2 experts x one 4096-wide K tile per 4-warp program); "v2" _router_decode_kernel
# (DECODE_BE experts per DECODE_WARPS-warp program, pow2 K chunks + tail, bias loaded up front, warp-local 32-bit
# top-k without the L2 re-gather; arrival counter); "v3" the same with the flag-in-data handshake (POLL)
ROUTER_DECODE = os.environ.get("KIMI_ROUTER_DECODE", "v3")   # v3 default since H200 12-03 (e2e b1)
DECODE_BE = int(os.environ.get("KIMI_ROUTER_BE", "1"))
DECODE_WARPS = int(os.environ.get("KIMI_ROUTER_WARPS", "1"))
# ptxas register cap for v2/v3 (0: none). Left alone, ptxas gave the 1-warp program 80 registers and issued most of
# the row's loads only after the first chunk's data was in use (serial HBM round trips); with a cap of 168 it
# takes 94 and issues every gate/x load before the first FMA (Triton 3.9 sm_90 SASS)
DECODE_MAXNREG = int(os.environ.get("KIMI_ROUTER_MAXNREG", "168"))
# v2 / v3 also route up to this many tokens in two launches of their own: split-K logits partials
# (_router_logits_splitk_kernel) and a top-k of one token per 1-warp program (_router_topk_row_kernel) summing them,
# instead of _router_logits_kernel + _router_topk_kernel (rows per 4-warp program)
TOPK_ROW_MAX_T = int(os.environ.get("KIMI_ROUTER_TOPK_ROW_MAX_T", "256"))
# v2 / v3 decode: every program signals griddepcontrol.launch_dependents first (not under the interpreter)
DECODE_GDC = os.environ.get("KIMI_ROUTER_GDC", "1") != "0" and not INTERPRET
# moe_router_add_norm: the post-attention residual add + RMSNorm computed inside the one-launch decode router (v2 /
# v3, T <= GEMV_MAX_T) instead of a kernels.norm.add_rmsnorm launch before it; KIMI_ROUTER_NORM=0 keeps the two
# launches (A/B switch, read per call like ROUTER_DECODE)
ROUTER_NORM = os.environ.get("KIMI_ROUTER_NORM", "1") != "0"
# ... for T <= ROUTER_NORM_MAX_T tokens (KIMI_ROUTER_NORM_MAX_T): H200 12-03 e2e b1 measured it neutral (-2 us per
# step) and e2e b8 / b64 got slower with all decode fusions on, so the cap keeps it to the batches it was timed at
ROUTER_NORM_MAX_T = int(os.environ.get("KIMI_ROUTER_NORM_MAX_T", "4"))
# its decode config (experts per program, warps; bench/router.py --sweep): 2 warps, as with 1 warp the program keeps
# gate, norm weight, attn, residual and h chunks of 64 elements per thread live and spills (offline sm_90, maxnreg
# 168, D 2304, pointers / strides 16-divisible as at run time; Triton 3.9 / 3.6: BE 1 w1 168 regs + 192 B stack both,
# BE 1 w2 132 / 123 regs, BE 2 w2 157 / 141, no stack; the plain router BE 1 w1: 142 on 3.9)
NORM_BE = int(os.environ.get("KIMI_ROUTER_NORM_BE", "1"))
NORM_WARPS = int(os.environ.get("KIMI_ROUTER_NORM_WARPS", "2"))
# KIMI_PDL=1 (kernels._pdl): the decode routers (v1, v2 / v3) are launched with PDL and wait for the previous kernel
# (the post-attention norm) after loading their gate rows


def dot_mode(dtype: torch.dtype) -> int:
    """0: native tensor-core dot (bf16/fp16, fp32 accumulate); 1: fp32 operands, exact IEEE fp32 dot."""
    return 1 if (dtype == torch.float32 or INTERPRET) else 0


@triton.jit
def dot_acc(a, b, acc, MODE: tl.constexpr):
    """acc += a @ b with fp32 accumulation (MODE from ``dot_mode``)."""
    if MODE == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, T, E, D,
    stride_xt, stride_we, stride_ot,
    BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_e = pid_e * BE + tl.arange(0, BE)
    offs_k = tl.arange(0, BK)
    t_ok = offs_t < T
    e_ok = offs_e < E
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_we + offs_k[:, None]  # [BK, BE]
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for k0 in range(0, D, BK):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=e_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < D - k0
            a = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        acc = dot_acc(a, b, acc, MODE)
        x_ptrs += BK
        w_ptrs += BK
    o_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_e[None, :]
    tl.store(o_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_logits_gemv_kernel(
    x_ptr, w_ptr, out_ptr, E, D, stride_xt, stride_we, stride_ot,
    BE: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr = False,
):
    # program (t, e-block): out[t, e] = sum_d x[t, d] * w[e, d] in fp32 (bf16/fp16 products are exact in fp32).
    # GDC (PDL launch): the first K tile of the gate rows is loaded before griddepcontrol.wait, x after it (the
    # first step peeled: the same sums in the same order)
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BE + tl.arange(0, BE)
    offs_k = tl.arange(0, BK)
    e_ok = offs_e < E
    acc = tl.zeros((BE,), dtype=tl.float32)
    k_first = 0
    if GDC:
        k_ok = offs_k < D
        b = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        gdc_enter(GDC)
        a = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
        k_first = BK
    for k0 in range(k_first, D, BK):
        k_ok = offs_k < D - k0
        a = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + k0 + offs_k[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + offs_e, acc, mask=e_ok)


@triton.jit
def _select_topk(logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, offs_t, T, E, stride_lt, scale, extra_id,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr, OUT_K: tl.constexpr,
                 CG: tl.constexpr):
    """Top-k of the logits rows offs_t [BT] -> weights / ids rows. Output rows (OUT_K = TOP_K + HAS_EXTRA) hold TOP_K
    routed columns, then (HAS_EXTRA) one always-on column: id extra_id, weight 1.0. CG: load the logits from L2
    (.cg), for rows other programs of the same launch have just written."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    e_ok = offs_e < E
    mask = t_ok[:, None] & e_ok[None, :]
    l_ptrs = logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :]
    if CG:
        logits = tl.load(l_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        logits = tl.load(l_ptrs, mask=mask, other=0.0)
    scores = tl.sigmoid(logits)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
        sel = scores + b[None, :]
    else:
        sel = scores
    # unique int64 keys: order-preserving int32 image of the fp32 score (negatives: flip the magnitude bits; NaN sorts
    # above +inf, like torch.sort), then BLOCK_E-1-e so that the max over equal scores is the lowest expert index
    bits = sel.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = ordered.to(tl.int64) * 4294967296 + (BLOCK_E - 1 - offs_e[None, :]).to(tl.int64)
    lowest = -9223372036854775807 - 1
    key = tl.where(mask, key, lowest)
    top_i = tl.zeros((offs_t.shape[0], BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(key, axis=1)
        idx = (BLOCK_E - 1 - (m - ((m >> 32) << 32))).to(tl.int32)   # the low 32 bits of the winning key
        idx = tl.minimum(tl.maximum(idx, 0), E - 1)                      # padding rows: keep ids in range
        top_i = tl.where(offs_k[None, :] == j, idx[:, None], top_i)
        key = tl.where(offs_e[None, :] == idx[:, None], lowest, key)
    # weights at the picked ids, read back from the logits (the same fp32 values as above -> the same sigmoid)
    kmask = t_ok[:, None] & (offs_k[None, :] < TOP_K)
    k_ptrs = logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + top_i
    if CG:
        lg = tl.load(k_ptrs, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        lg = tl.load(k_ptrs, mask=kmask, other=0.0)
    top_w = tl.sigmoid(lg)
    if BIASED_WEIGHTS:
        if HAS_BIAS:
            top_w = top_w + tl.load(bias_ptr + top_i, mask=kmask, other=0.0).to(tl.float32)
    top_w = tl.where(kmask, top_w, 0.0)
    if RENORM:
        denom = tl.sum(top_w, axis=1) + 1e-20
        top_w = top_w / denom[:, None]
    top_w = top_w * scale
    optr = offs_t[:, None].to(tl.int64) * OUT_K + offs_k[None, :]
    tl.store(w_out_ptr + optr, top_w, mask=kmask)
    tl.store(id_out_ptr + optr, top_i, mask=kmask)
    if HAS_EXTRA:
        eptr = offs_t.to(tl.int64) * OUT_K + TOP_K
        tl.store(w_out_ptr + eptr, tl.zeros(offs_t.shape, dtype=tl.float32) + 1.0, mask=t_ok)
        tl.store(id_out_ptr + eptr, tl.zeros(offs_t.shape, dtype=tl.int32) + extra_id, mask=t_ok)


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, T, E, stride_lt, scale, extra_id,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr,
    OUT_K: tl.constexpr,
):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    _select_topk(logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, offs_t, T, E, stride_lt, scale, extra_id,
                 TOP_K, BLOCK_K, BLOCK_E, HAS_BIAS, BIASED_WEIGHTS, RENORM, HAS_EXTRA, OUT_K, False)


@triton.jit
def _router_fused_gemv_kernel(
    x_ptr, w_ptr, logits_ptr, cnt_ptr, bias_ptr, w_out_ptr, id_out_ptr, T, E, D, stride_xt, stride_we, stride_lt,
    scale, extra_id, BE: tl.constexpr, BK: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr, OUT_K: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # decode (T <= GEMV_MAX_T): program (t, e-block) computes BE logits of token t like _router_logits_gemv_kernel;
    # the last of the token's cdiv(E, BE) programs to arrive (acq_rel counter, reset to 0 by it: graph-replay safe)
    # selects the token's top-k, so the router is one launch instead of two. GDC: PDL launch (gate tile loaded
    # before the wait, see _router_logits_gemv_kernel; the counter and logits only after it)
    t = tl.program_id(0)
    _router_logits_gemv_kernel(x_ptr, w_ptr, logits_ptr, E, D, stride_xt, stride_we, stride_lt, BE, BK, GDC)
    tl.debug_barrier()  # every thread's logit stores precede the (release) arrival
    n_arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if n_arrived == tl.num_programs(1) - 1:
        _select_topk(logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, t + tl.arange(0, 1), T, E, stride_lt, scale,
                     extra_id, TOP_K, BLOCK_K, BLOCK_E, HAS_BIAS, BIASED_WEIGHTS, RENORM, HAS_EXTRA, OUT_K, True)
        tl.store(cnt_ptr + t, 0)


@triton.jit
def _load_row_chunk(x_ptr, w_ptr, offs_e, e_ok, k0, D, stride_we, BK: tl.constexpr, MASK_K: tl.constexpr):
    # x[k0 : k0 + BK] [BK] and the gate rows offs_e over those columns [BE, BK] (raw dtype; MASK_K: some >= D)
    offs_k = k0 + tl.arange(0, BK)
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :]
    if MASK_K:
        a = tl.load(x_ptr + offs_k, mask=offs_k < D, other=0.0)
        b = tl.load(w_ptrs, mask=e_ok[:, None] & (offs_k < D)[None, :], other=0.0)
    else:
        a = tl.load(x_ptr + offs_k)
        b = tl.load(w_ptrs, mask=e_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _load_w_chunk(w_ptr, offs_e, e_ok, k0, D, stride_we, BK: tl.constexpr, MASK_K: tl.constexpr):
    # _load_row_chunk's gate rows alone (loaded before the PDL wait)
    offs_k = k0 + tl.arange(0, BK)
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :]
    if MASK_K:
        return tl.load(w_ptrs, mask=e_ok[:, None] & (offs_k < D)[None, :], other=0.0)
    return tl.load(w_ptrs, mask=e_ok[:, None], other=0.0)


@triton.jit
def _load_x_chunk(x_ptr, k0, D, BK: tl.constexpr, MASK_K: tl.constexpr):
    # _load_row_chunk's x part (after the PDL wait)
    offs_k = k0 + tl.arange(0, BK)
    if MASK_K:
        return tl.load(x_ptr + offs_k, mask=offs_k < D, other=0.0)
    return tl.load(x_ptr + offs_k)


@triton.jit
def _add_chunk(a_row, r_row, k0, D, BK: tl.constexpr, MASK_K: tl.constexpr):
    # h = residual + attn over columns [k0, k0 + BK), rounded to the activation dtype, and its fp32 sum of squares:
    # kernels.norm._add_rmsnorm_kernel's add, op for op (0 where masked)
    a = _load_x_chunk(a_row, k0, D, BK, MASK_K).to(tl.float32)
    r = _load_x_chunk(r_row, k0, D, BK, MASK_K).to(tl.float32)
    h = (r + a).to(a_row.dtype.element_ty)
    hf = h.to(tl.float32)
    return h, tl.sum(hf * hf, axis=0)


@triton.jit
def _norm_chunk(h, nw, rstd, x_row, h_row, k0, D, BK: tl.constexpr, MASK_K: tl.constexpr, writer):
    # nw: the norm weight chunk as loaded (kept narrow in registers until here) -> x = nw * (h * rstd rounded to the
    # dtype), rounded to the dtype (kernels.norm._rms_weighted + the store's
    # cast); writer (the token's program 0) stores x and h for the rest of the layer
    xn = (h.to(tl.float32) * rstd).to(x_row.dtype.element_ty).to(tl.float32)
    x = (nw.to(tl.float32) * xn).to(x_row.dtype.element_ty)
    if writer:
        offs_k = k0 + tl.arange(0, BK)
        if MASK_K:
            tl.store(x_row + offs_k, x, mask=offs_k < D)
            tl.store(h_row + offs_k, h, mask=offs_k < D)
        else:
            tl.store(x_row + offs_k, x)
            tl.store(h_row + offs_k, h)
    return x


@triton.jit
def _dot_rows(a, b):
    # [BE] fp32 sums of b [BE, BK] * a [BK] (bf16/fp16 products exact in fp32)
    return tl.sum(b.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _select_topk_row(logits, b, w_out_ptr, id_out_ptr, t, E, scale, extra_id,
                     TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr,
                     OUT_K: tl.constexpr):
    """_select_topk for one token on 1-D tensors in registers: logits [BLOCK_E] fp32, b [BLOCK_E] the bias (unused
    without HAS_BIAS). Same order and tie rule (descending score, then lowest expert), but 32-bit keys: per round
    m = max(key), the pick = min expert with key == m (with one warp each is a local tree + one redux.sync instead of
    a 64-bit shuffle tree), and the pick's weight is read out of the registers (an OR over the experts of its bits,
    one nonzero term: exact) instead of a dependent L2 gather of the picked logits."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    e_ok = offs_e < E
    scores = tl.sigmoid(logits)
    if HAS_BIAS:
        sel = scores + b
    else:
        sel = scores
    if BIASED_WEIGHTS and HAS_BIAS:
        src = sel.to(tl.int32, bitcast=True)      # the reference's s + bias: the same fp32 add as the selection
    else:
        src = scores.to(tl.int32, bitcast=True)
    # order-preserving int32 image of the fp32 score (negatives: flip the magnitude bits; NaN above +inf as in
    # _select_topk); INT32_MIN is kept for "taken / padding" (the one score mapping there, a negative NaN with every
    # payload bit set, is merged with its neighbour)
    bits = sel.to(tl.int32, bitcast=True)
    key = tl.maximum(bits ^ ((bits >> 31) & 0x7FFFFFFF), -2147483647)
    taken = -2147483647 - 1
    key = tl.where(e_ok, key, taken)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    top_b = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(key, axis=0)
        idx = tl.min(tl.where(key == m, offs_e, BLOCK_E), axis=0)
        hit = offs_e == idx
        # the weight's bits: off the next round's dependency chain (that needs key only)
        top_b = tl.where(offs_k == j, tl.reduce(tl.where(hit, src, 0), 0, _bit_or), top_b)
        top_i = tl.where(offs_k == j, idx, top_i)
        key = tl.where(hit, taken, key)
    kmask = offs_k < TOP_K
    top_w = tl.where(kmask, top_b.to(tl.float32, bitcast=True), 0.0)
    if RENORM:
        denom = tl.sum(top_w, axis=0) + 1e-20
        top_w = top_w / denom
    top_w = top_w * scale
    optr = t.to(tl.int64) * OUT_K + offs_k
    tl.store(w_out_ptr + optr, top_w, mask=kmask)
    tl.store(id_out_ptr + optr, top_i, mask=kmask)
    if HAS_EXTRA:
        tl.store(w_out_ptr + t.to(tl.int64) * OUT_K + TOP_K, 1.0)
        tl.store(id_out_ptr + t.to(tl.int64) * OUT_K + TOP_K, extra_id)


@triton.jit
def _hint_spans(pf0_ptr, pf1_ptr, PF0_N: tl.constexpr, PF1_N: tl.constexpr, PF_LINE: tl.constexpr):
    # the grid's programs (all tokens' expert blocks) share the spans' lines
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    nprog = tl.num_programs(0) * tl.num_programs(1)
    if PF0_N > 0:
        prefetch_span_l2(pf0_ptr, PF0_N, pid, nprog, PF_LINE, 128)
    if PF1_N > 0:
        prefetch_span_l2(pf1_ptr, PF1_N, pid, nprog, PF_LINE, 128)


@triton.jit
def _router_decode_kernel(
    x_ptr, w_ptr, logits_ptr, cnt_ptr, bias_ptr, w_out_ptr, id_out_ptr, E, D, stride_xt, stride_we, stride_lt,
    scale, extra_id, a_ptr, r_ptr, nw_ptr, h_ptr, stride_at, stride_rt, stride_ht, eps,
    BE: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BK_TAIL: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr, OUT_K: tl.constexpr,
    POLL: tl.constexpr, MAX_SPINS: tl.constexpr, GDC: tl.constexpr = False, WAIT: tl.constexpr = False,
    NORM: tl.constexpr = False, pf0_ptr=None, pf1_ptr=None, PF0_N: tl.constexpr = 0, PF1_N: tl.constexpr = 0,
    PF_LINE: tl.constexpr = 64,
):
    # ROUTER_DECODE v2 / v3 (T <= GEMV_MAX_T): program (t, e-block of BE experts), meant for 1 warp. D = NK * BK +
    # tail (BK a power of two, tail < BK masked to BK_TAIL): no masked lanes beyond the tail (D 2304 = 2048 + 256,
    # where v1's one 4096 tile idles 44% of its lanes), the loads of up to two chunks and the tail issued together.
    # Every program also loads the bias (1 KB, cold in HBM; ptxas places it after the dot products, so in v3 it
    # overlaps the spin instead of following the arrival). Then one program per token selects (_select_topk_row):
    #   v2 (not POLL): logits to logits_ptr, acq_rel arrival counter; the last to arrive reads them back (L2)
    #   v3 (POLL): each logit goes to a persistent zeroed slot row [BLOCK_E] int64 as (1 << 32 | its fp32 bits),
    #     data and ready flag in one single-copy-atomic store (no release fence, no counter atomic); the token's
    #     last program in launch order spins on volatile loads of the row until every flag is set, then zeroes it
    #     (the next launch finds it clear). The spinner is dispatched after the programs it waits for (blocks go out
    #     in linear order; the interpreter runs them in order), so it cannot starve them; MAX_SPINS bounds the wait
    # WAIT (PDL launch, KIMI_PDL=1): the bias and the gate rows of the first chunks (and the tail) are loaded
    # before griddepcontrol.wait, x after it (same products and sums)
    # NORM (moe_router_add_norm): x is not an input but rmsnorm(h), h = residual + attn (a_ptr, r_ptr [T, D], norm
    # weight nw_ptr [D]); every program recomputes h and the token's rstd with the same code (bit-identical x in all
    # of them: _norm_row), the token's program 0 stores x to x_ptr and h to h_ptr. The norm weight chunks are
    # loaded with the gate rows (before the wait under WAIT), attn / residual after it
    # PF0_N / PF1_N > 0 (WAIT only; l2_hint): once its logit is out, each program hints its share of up to two weight
    # spans (the next kernel's: the MoE GEMM1's always-selected shared expert) into L2, after every load of its own,
    # while HBM idles through the top-k handshake
    if GDC:
        # a PDL-launched dependent (the MoE GEMM1, KIMI_MOE_PDL=...,gemm1) may start its CTAs now: it reads nothing
        # of ours before its griddepcontrol.wait, which waits for this whole grid; a no-op without PDL
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BE + tl.arange(0, BE)
    e_ok = offs_e < E
    offs_all = tl.arange(0, BLOCK_E)
    all_ok = offs_all < E
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_all, mask=all_ok, other=0.0).to(tl.float32)
    else:
        b = tl.zeros((BLOCK_E,), dtype=tl.float32)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    a_row = a_ptr + t.to(tl.int64) * stride_at
    r_row = r_ptr + t.to(tl.int64) * stride_rt
    h_row = h_ptr + t.to(tl.int64) * stride_ht
    writer = tl.program_id(1) == 0
    # every load of the row before the first product: consumed chunk by chunk, ptxas issued the next chunk's loads
    # only after the previous chunk's data had arrived (two to three serial HBM round trips, SASS checked)
    if NORM:
        b0 = _load_w_chunk(w_ptr, offs_e, e_ok, 0, D, stride_we, BK, False)
        n0 = _load_x_chunk(nw_ptr, 0, D, BK, False)
        if NK > 1:
            b1 = _load_w_chunk(w_ptr, offs_e, e_ok, BK, D, stride_we, BK, False)
            n1 = _load_x_chunk(nw_ptr, BK, D, BK, False)
        if BK_TAIL > 0:
            bt = _load_w_chunk(w_ptr, offs_e, e_ok, NK * BK, D, stride_we, BK_TAIL, True)
            nt = _load_x_chunk(nw_ptr, NK * BK, D, BK_TAIL, True)
        if WAIT:
            gdc_wait()
        # pass 1: h chunk by chunk and the fp32 sum of squares in chunk order (chunks 2.. recomputed in pass 2)
        h0, ss = _add_chunk(a_row, r_row, 0, D, BK, False)
        if NK > 1:
            h1, s1 = _add_chunk(a_row, r_row, BK, D, BK, False)
            ss += s1
        for i in tl.static_range(2, NK):
            _, s2 = _add_chunk(a_row, r_row, i * BK, D, BK, False)
            ss += s2
        if BK_TAIL > 0:
            ht, st = _add_chunk(a_row, r_row, NK * BK, D, BK_TAIL, True)
            ss += st
        rstd = 1.0 / tl.sqrt(ss / D + eps)                 # kernels.norm._rms_weighted's, op for op
        a0 = _norm_chunk(h0, n0, rstd, x_row, h_row, 0, D, BK, False, writer)
        if NK > 1:
            a1 = _norm_chunk(h1, n1, rstd, x_row, h_row, BK, D, BK, False, writer)
        if BK_TAIL > 0:
            at = _norm_chunk(ht, nt, rstd, x_row, h_row, NK * BK, D, BK_TAIL, True, writer)
    elif WAIT:
        b0 = _load_w_chunk(w_ptr, offs_e, e_ok, 0, D, stride_we, BK, False)
        if NK > 1:
            b1 = _load_w_chunk(w_ptr, offs_e, e_ok, BK, D, stride_we, BK, False)
        if BK_TAIL > 0:
            bt = _load_w_chunk(w_ptr, offs_e, e_ok, NK * BK, D, stride_we, BK_TAIL, True)
        gdc_wait()
        a0 = _load_x_chunk(x_row, 0, D, BK, False)
        if NK > 1:
            a1 = _load_x_chunk(x_row, BK, D, BK, False)
        if BK_TAIL > 0:
            at = _load_x_chunk(x_row, NK * BK, D, BK_TAIL, True)
    else:
        a0, b0 = _load_row_chunk(x_row, w_ptr, offs_e, e_ok, 0, D, stride_we, BK, False)
        if NK > 1:
            a1, b1 = _load_row_chunk(x_row, w_ptr, offs_e, e_ok, BK, D, stride_we, BK, False)
        if BK_TAIL > 0:
            at, bt = _load_row_chunk(x_row, w_ptr, offs_e, e_ok, NK * BK, D, stride_we, BK_TAIL, True)
    acc = _dot_rows(a0, b0)
    if NK > 1:
        acc += _dot_rows(a1, b1)
    for i in tl.static_range(2, NK):   # D >= 3 BK (only when BE * BK is capped by decode_k_split): chunk by chunk
        if NORM:   # pass 2: h again (L1 / L2), the same rstd
            h2, _ = _add_chunk(a_row, r_row, i * BK, D, BK, False)
            n2 = _load_x_chunk(nw_ptr, i * BK, D, BK, False)
            a2 = _norm_chunk(h2, n2, rstd, x_row, h_row, i * BK, D, BK, False, writer)
            b2 = _load_w_chunk(w_ptr, offs_e, e_ok, i * BK, D, stride_we, BK, False)
        else:
            a2, b2 = _load_row_chunk(x_row, w_ptr, offs_e, e_ok, i * BK, D, stride_we, BK, False)
        acc += _dot_rows(a2, b2)
    if BK_TAIL > 0:
        acc += _dot_rows(at, bt)
    if POLL:
        slot_row = cnt_ptr + t.to(tl.int64) * BLOCK_E
        word = (acc.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | 0x100000000
        tl.store(slot_row + offs_e, word, mask=e_ok)
        _hint_spans(pf0_ptr, pf1_ptr, PF0_N, PF1_N, PF_LINE)
        if tl.program_id(1) == tl.num_programs(1) - 1:
            words = tl.load(slot_row + offs_all, mask=all_ok, other=0x100000000, volatile=True)
            spins = 0
            while (tl.min((words >> 32).to(tl.int32), axis=0) == 0) & (spins < MAX_SPINS):
                words = tl.load(slot_row + offs_all, mask=all_ok, other=0x100000000, volatile=True)
                spins += 1
            tl.store(slot_row + offs_all, tl.zeros((BLOCK_E,), dtype=tl.int64), mask=all_ok)
            logits = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            _select_topk_row(logits, b, w_out_ptr, id_out_ptr, t, E, scale, extra_id, TOP_K, BLOCK_K, BLOCK_E,
                             HAS_BIAS, BIASED_WEIGHTS, RENORM, HAS_EXTRA, OUT_K)
    else:
        l_row = logits_ptr + t.to(tl.int64) * stride_lt
        tl.store(l_row + offs_e, acc, mask=e_ok)
        tl.debug_barrier()  # every thread's logit stores precede the (release) arrival
        n_arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
        _hint_spans(pf0_ptr, pf1_ptr, PF0_N, PF1_N, PF_LINE)
        if n_arrived == tl.num_programs(1) - 1:
            logits = tl.load(l_row + offs_all, mask=all_ok, other=0.0, cache_modifier=".cg")
            _select_topk_row(logits, b, w_out_ptr, id_out_ptr, t, E, scale, extra_id, TOP_K, BLOCK_K, BLOCK_E,
                             HAS_BIAS, BIASED_WEIGHTS, RENORM, HAS_EXTRA, OUT_K)
            tl.store(cnt_ptr + t, 0)


@triton.jit
def _router_logits_splitk_kernel(
    x_ptr, w_ptr, out_ptr, T, E, D, stride_xt, stride_we, stride_os, stride_ot, KS,
    BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
):
    # program (t-block, e-block, K split s): out[s, t, e] = sum over d in [s KS, (s + 1) KS) of x[t, d] w[e, d], fp32.
    # v2 / v3 for GEMV_MAX_T < T <= TOPK_ROW_MAX_T: _router_logits_kernel ran cdiv(T, 32) x 16 programs over all
    # 18 K tiles of D 2304 (T = 64: 32 programs, 9.1 us on the H200); here 9 splits of 2 tiles -> 9x the programs
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    s = tl.program_id(2)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_e = pid_e * BE + tl.arange(0, BE)
    offs_k = s * KS + tl.arange(0, BK)
    t_ok = offs_t < T
    e_ok = offs_e < E
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_we + offs_k[:, None]  # [BK, BE]
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for k0 in range(0, KS, BK):
        k_ok = offs_k < D - k0
        a = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        acc = dot_acc(a, b, acc, MODE)
        x_ptrs += BK
        w_ptrs += BK
    o_ptrs = out_ptr + s * stride_os + offs_t[:, None].to(tl.int64) * stride_ot + offs_e[None, :]
    tl.store(o_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_topk_row_kernel(
    logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, E, stride_ls, stride_lt, scale, extra_id,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIASED_WEIGHTS: tl.constexpr, RENORM: tl.constexpr, HAS_EXTRA: tl.constexpr, OUT_K: tl.constexpr,
    NS: tl.constexpr,
):
    # ROUTER_DECODE v2 / v3, T <= TOPK_ROW_MAX_T: one token per (1-warp) program, _select_topk_row; the logits are
    # the sum of NS split-K partials [NS, T, E], added in split order (deterministic)
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    l_ptrs = logits_ptr + t.to(tl.int64) * stride_lt + offs_e
    logits = tl.load(l_ptrs, mask=e_ok, other=0.0)
    for i in tl.static_range(1, NS):
        logits += tl.load(l_ptrs + i * stride_ls, mask=e_ok, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    else:
        b = logits
    _select_topk_row(logits, b, w_out_ptr, id_out_ptr, t, E, scale, extra_id, TOP_K, BLOCK_K, BLOCK_E,
                     HAS_BIAS, BIASED_WEIGHTS, RENORM, HAS_EXTRA, OUT_K)


def router_logits_triton(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ gate_w[E, D].T -> fp32 [T, E], fp32 accumulation (no TF32)."""
    T, D = x.shape
    E = gate_w.shape[0]
    x = x.contiguous()
    gate_w = gate_w.contiguous()
    if gate_w.dtype != x.dtype:
        gate_w = gate_w.to(x.dtype)
    out = torch.empty(T, E, device=x.device, dtype=torch.float32)
    if T == 0:
        return out
    if T <= GEMV_MAX_T:
        BK = min(4096, next_pow2(D))
        _router_logits_gemv_kernel[(T, cdiv(E, 2))](
            x, gate_w, out, E, D, x.stride(0), gate_w.stride(0), out.stride(0), BE=2, BK=BK, num_warps=4,
        )
        return out
    is_fp32 = x.dtype == torch.float32
    BT = 16 if T <= 16 else (32 if T <= 256 else 64)
    # decode: many small expert tiles so that the gate weight is streamed by many SMs
    BE = 16 if T <= 64 else 64
    BE = min(BE, max(16, next_pow2(E)))
    BK = min(64 if is_fp32 else 128, max(16, next_pow2(D)))
    grid = (cdiv(T, BT), cdiv(E, BE))
    _router_logits_kernel[grid](
        x, gate_w, out, T, E, D, x.stride(0), gate_w.stride(0), out.stride(0),
        BT=BT, BE=BE, BK=BK, EVEN_K=D % BK == 0, MODE=dot_mode(x.dtype), num_warps=4, num_stages=2 if is_fp32 else 3,
    )
    return out


def router_topk_triton(logits, bias, top_k, routed_scaling_factor=1.0, renormalize=True, biased_weights=False,
                       append_expert=None):
    """logits [T, E] fp32 -> (topk_weights [T, k] fp32, topk_ids [T, k] int32); with append_expert a last column
    (id append_expert, weight 1.0) is written by the same kernel -> [T, k + 1]."""
    T, E = logits.shape
    has_extra = append_expert is not None
    out_k = top_k + int(has_extra)
    w = torch.empty(T, out_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(T, out_k, device=logits.device, dtype=torch.int32)
    if T == 0:
        return w, ids
    assert 1 <= top_k <= E
    logits = logits.contiguous()
    BLOCK_E = next_pow2(E)
    has_bias = bias is not None
    if ROUTER_DECODE in ("v2", "v3") and T <= TOPK_ROW_MAX_T and BLOCK_E <= 1024:
        _topk_rows(logits[None], bias, w, ids, top_k, routed_scaling_factor, renormalize, biased_weights,
                   append_expert)
        return w, ids
    # decode: one row per single-warp program (shuffle reductions); many rows: a few rows per 4-warp program
    small = T <= GEMV_MAX_T
    BT = 1 if small else max(1, min(16, 2048 // BLOCK_E))
    bias_arg = bias.contiguous() if has_bias else logits
    _router_topk_kernel[(cdiv(T, BT),)](
        logits, bias_arg, w, ids, T, E, logits.stride(0), float(routed_scaling_factor),
        int(append_expert) if has_extra else 0,
        TOP_K=top_k, BLOCK_K=next_pow2(top_k), BT=BT, BLOCK_E=BLOCK_E,
        HAS_BIAS=has_bias, BIASED_WEIGHTS=bool(biased_weights), RENORM=bool(renormalize), HAS_EXTRA=has_extra,
        OUT_K=out_k, num_warps=1 if small and BLOCK_E <= 1024 else 4,
    )
    return w, ids


def _topk_rows(parts, bias, w, ids, top_k, scale, renormalize, biased_weights, append_expert):
    """_router_topk_row_kernel over parts [NS, T, E] fp32 (row-contiguous logits partials) -> w, ids."""
    NS, T, E = parts.shape
    has_bias, has_extra = bias is not None, append_expert is not None
    _router_topk_row_kernel[(T,)](
        parts, bias.contiguous() if has_bias else parts, w, ids, E, parts.stride(0), parts.stride(1), float(scale),
        int(append_expert) if has_extra else 0,
        TOP_K=top_k, BLOCK_K=next_pow2(top_k), BLOCK_E=next_pow2(E), HAS_BIAS=has_bias,
        BIASED_WEIGHTS=bool(biased_weights), RENORM=bool(renormalize), HAS_EXTRA=has_extra, OUT_K=w.shape[1], NS=NS,
        num_warps=1,
    )


# K split of the v2 / v3 logits for GEMV_MAX_T < T <= TOPK_ROW_MAX_T (two BK = 128 tiles per split: 9 for D 2304)
SPLITK_KS = 256


def router_logits_splitk(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ gate_w[E, D].T as fp32 partials [S, T, E] over S = cdiv(D, SPLITK_KS) K ranges (sum them in
    order for the logits)."""
    T, D = x.shape
    E = gate_w.shape[0]
    x = x.contiguous()
    gate_w = gate_w.contiguous()
    if gate_w.dtype != x.dtype:
        gate_w = gate_w.to(x.dtype)
    is_fp32 = x.dtype == torch.float32
    BK = 64 if is_fp32 else 128
    KS = max(BK, SPLITK_KS // BK * BK)
    S = cdiv(D, KS)
    out = torch.empty(S, T, E, device=x.device, dtype=torch.float32)
    BT = 16 if T <= 16 else (32 if T <= 128 else 64)
    BE = min(16 if T <= 128 else 32, max(16, next_pow2(E)))
    _router_logits_splitk_kernel[(cdiv(T, BT), cdiv(E, BE), S)](
        x, gate_w, out, T, E, D, x.stride(0), gate_w.stride(0), out.stride(0), out.stride(1), KS,
        BT=BT, BE=BE, BK=BK, MODE=dot_mode(x.dtype), num_warps=4, num_stages=2,
    )
    return out


def moe_router_triton(x, gate_w, bias, top_k, routed_scaling_factor=1.0, renormalize=True, biased_weights=False,
                      append_expert=None, pdl=None):
    """Same contract as ``moe_router_ref``. T <= GEMV_MAX_T (decode) with FUSED_DECODE: one launch (ROUTER_DECODE
    picks the kernel; pdl: launched with PDL, kernels._pdl, None: KIMI_PDL); v2 / v3 with T <= TOPK_ROW_MAX_T:
    split-K logits, then the row top-k; else the logits kernel, then the top-k kernel."""
    if FUSED_DECODE and 0 < x.shape[0] <= GEMV_MAX_T:
        return _router_fused(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights, append_expert,
                             pdl)
    T, E = x.shape[0], gate_w.shape[0]
    if ROUTER_DECODE in ("v2", "v3") and GEMV_MAX_T < T <= TOPK_ROW_MAX_T and E <= 1024:
        assert 1 <= top_k <= E
        out_k = top_k + int(append_expert is not None)
        w = torch.empty(T, out_k, device=x.device, dtype=torch.float32)
        ids = torch.empty(T, out_k, device=x.device, dtype=torch.int32)
        _topk_rows(router_logits_splitk(x, gate_w), bias, w, ids, top_k, routed_scaling_factor, renormalize,
                   biased_weights, append_expert)
        return w, ids
    logits = router_logits_triton(x, gate_w)
    return router_topk_triton(logits, bias, top_k, routed_scaling_factor, renormalize, biased_weights, append_expert)


def decode_k_split(D: int, BE: int, num_warps: int):
    """-> (BK, NK, BK_TAIL): D = NK * BK + tail, BK the largest power of two <= D with BE * BK / threads <= 64
    elements per thread and chunk; the tail (< BK) is one masked BK_TAIL = next_power_of_2(tail) chunk (0: none)."""
    BK = 1 << (D.bit_length() - 1)
    while BK > 16 and BE * BK > 64 * 32 * num_warps:
        BK //= 2
    NK, tail = D // BK, D % BK
    return BK, NK, next_pow2(tail) if tail else 0


def _router_fused(x, gate_w, bias, top_k, scale, renormalize, biased_weights, append_expert, pdl=None):
    """One-launch decode router (T <= GEMV_MAX_T); ROUTER_DECODE picks the kernel."""
    if ROUTER_DECODE in ("v2", "v3"):
        return _router_decode_v2(x, gate_w, bias, top_k, scale, renormalize, biased_weights, append_expert, pdl=pdl)
    return _router_decode_v1(x, gate_w, bias, top_k, scale, renormalize, biased_weights, append_expert, pdl)


def _router_decode_v1(x, gate_w, bias, top_k, scale, renormalize, biased_weights, append_expert, pdl=None):
    T, D = x.shape
    E = gate_w.shape[0]
    assert 1 <= top_k <= E
    x = x.contiguous()
    gate_w = gate_w.contiguous()
    if gate_w.dtype != x.dtype:
        gate_w = gate_w.to(x.dtype)
    has_extra = append_expert is not None
    out_k = top_k + int(has_extra)
    logits = torch.empty(T, E, device=x.device, dtype=torch.float32)
    w = torch.empty(T, out_k, device=x.device, dtype=torch.float32)
    ids = torch.empty(T, out_k, device=x.device, dtype=torch.int32)
    has_bias = bias is not None
    _router_fused_gemv_kernel[(T, cdiv(E, 2))](
        x, gate_w, logits, arrival_counters(x.device, T), bias.contiguous() if has_bias else logits, w, ids,
        T, E, D, x.stride(0), gate_w.stride(0), logits.stride(0), float(scale),
        int(append_expert) if has_extra else 0,
        BE=2, BK=min(4096, next_pow2(D)), TOP_K=top_k, BLOCK_K=next_pow2(top_k),
        BLOCK_E=next_pow2(E), HAS_BIAS=has_bias, BIASED_WEIGHTS=bool(biased_weights),
        RENORM=bool(renormalize), HAS_EXTRA=has_extra, OUT_K=out_k, num_warps=4, **pdl_launch(pdl),
    )
    return w, ids


def _router_decode_v2(x, gate_w, bias, top_k, scale, renormalize, biased_weights, append_expert,
                      BE=None, num_warps=None, poll=None, maxnreg=None, pdl=None, norm=None, l2_hint=None):
    """One launch of _router_decode_kernel (T <= GEMV_MAX_T); BE / num_warps default to DECODE_BE / DECODE_WARPS,
    poll (the v3 handshake) to ROUTER_DECODE == "v3"; pdl: PDL launch, WAIT (None: KIMI_PDL). norm = (attn,
    residual, norm_w, h, eps): x [T, D] (contiguous, written) = rmsnorm(h), h [T, D] (contiguous, written) =
    residual + attn, computed by the router programs themselves (NORM). l2_hint: up to two contiguous tensors the
    programs hint into L2 once their logits are out (PDL launches only: the hint sits after the wait)."""
    T, D = x.shape
    E = gate_w.shape[0]
    assert 1 <= top_k <= E
    BE = min(BE or DECODE_BE, next_pow2(E))
    num_warps = num_warps or DECODE_WARPS
    poll = ROUTER_DECODE == "v3" if poll is None else poll
    maxnreg = DECODE_MAXNREG if maxnreg is None else maxnreg
    extra = {"maxnreg": maxnreg} if maxnreg and not INTERPRET else {}
    if norm is None:
        x = x.contiguous()
        attn = residual = norm_w = h = x
        eps = 0.0
    else:
        attn, residual, norm_w, h, eps = norm
        assert x.is_contiguous() and h.is_contiguous() and attn.stride(1) == 1 and residual.stride(1) == 1
    gate_w = gate_w.contiguous()
    if gate_w.dtype != x.dtype:
        gate_w = gate_w.to(x.dtype)
    has_extra = append_expert is not None
    out_k = top_k + int(has_extra)
    BLOCK_E = next_pow2(E)
    # v3 exchanges the logits through the slot rows; the (unused) logits argument then points at them too
    sync = _poll_slots(x.device, T * BLOCK_E) if poll else arrival_counters(x.device, T)
    logits = sync if poll else torch.empty(T, E, device=x.device, dtype=torch.float32)
    w = torch.empty(T, out_k, device=x.device, dtype=torch.float32)
    ids = torch.empty(T, out_k, device=x.device, dtype=torch.int32)
    has_bias = bias is not None
    BK, NK, BK_TAIL = decode_k_split(D, BE, num_warps)
    _router_decode_kernel[(T, cdiv(E, BE))](
        x, gate_w, logits, sync, bias.contiguous() if has_bias else w, w, ids,
        E, D, x.stride(0), gate_w.stride(0), E, float(scale), int(append_expert) if has_extra else 0,
        attn, residual, norm_w, h, attn.stride(0), residual.stride(0), h.stride(0), float(eps),
        BE=BE, BK=BK, NK=NK, BK_TAIL=BK_TAIL, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
        BLOCK_E=BLOCK_E, HAS_BIAS=has_bias, BIASED_WEIGHTS=bool(biased_weights),
        RENORM=bool(renormalize), HAS_EXTRA=has_extra, OUT_K=out_k, POLL=bool(poll), MAX_SPINS=1 << 20,
        GDC=DECODE_GDC, NORM=norm is not None, num_warps=num_warps, **extra,
        # the L2 hint goes with PDL launches only (after the wait; no inline asm under the interpreter)
        **(dict(WAIT=True, launch_pdl=True, **(l2_span_args(l2_hint, w) if l2_hint else {})) if pdl_on(pdl) else {}),
    )
    return w, ids


def norm_fused(T: int) -> bool:
    """Does moe_router_add_norm_triton run T tokens in one launch? (the module switches, read per call)"""
    return ROUTER_NORM and FUSED_DECODE and ROUTER_DECODE in ("v2", "v3") and 0 < T <= min(GEMV_MAX_T, ROUTER_NORM_MAX_T)


def moe_router_add_norm_triton(attn, residual, norm_w, eps, gate_w, bias, top_k, routed_scaling_factor=1.0,
                               renormalize=True, biased_weights=False, append_expert=None, pdl=None, l2_hint=None):
    """attn, residual [T, D] (row strides allowed), norm_w [D] -> (x, h, topk_weights, topk_ids): (x, h) =
    kernels.norm.add_rmsnorm(attn, residual, norm_w, eps) (contiguous [T, D] in attn.dtype), then (topk_weights,
    topk_ids) = moe_router(x, gate_w, ...). norm_fused(T) (decode under v2 / v3): one _router_decode_kernel launch
    that computes h and x itself (NORM); its sum of squares runs in D chunks (decode_k_split) in another order than
    _add_rmsnorm_kernel's 4-warp tree, so x may differ from add_rmsnorm's in the last bit of a few elements (the
    routing always uses the x it returns); else add_rmsnorm_triton, then moe_router_triton (two launches).
    l2_hint (fused launch under PDL only): weight tensors hinted into L2 after the logits (_router_decode_v2)."""
    assert attn.dim() == 2 and residual.shape == attn.shape and residual.dtype == attn.dtype, \
        (attn.shape, residual.shape)
    T, D = attn.shape
    if not norm_fused(T):
        from kernels.norm import add_rmsnorm_triton   # kernels.norm imports this module

        x, h = add_rmsnorm_triton(attn, residual, norm_w, eps, pdl=pdl)
        w, ids = moe_router_triton(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights,
                                   append_expert, pdl=pdl)
        return x, h, w, ids
    attn, residual = unit_last_stride(attn), unit_last_stride(residual)
    x = torch.empty(T, D, dtype=attn.dtype, device=attn.device)
    h = torch.empty_like(x)
    w, ids = _router_decode_v2(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights,
                               append_expert, BE=NORM_BE, num_warps=NORM_WARPS, pdl=pdl,
                               norm=(attn, residual, norm_w.contiguous(), h, eps), l2_hint=l2_hint)
    return x, h, w, ids


def _poll_slots(device, n: int) -> torch.Tensor:
    """A zeroed int64 buffer of >= n logit slots for the v3 handshake; every launch leaves its slots at zero (one
    stream at a time, like kernels._tensors.arrival_counters)."""
    return workspace("router_poll_slots", device, lambda b: b.numel() >= n,
                     lambda _: torch.zeros(max(n, GEMV_MAX_T * 1024), dtype=torch.int64, device=device))
