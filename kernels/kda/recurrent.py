"""Fused KDA decode: one token per sequence, state pools updated in place at slot indices. Two launches:

K1 `_kda_decode_kernel`, grid (V/BV, H, N), one program per (sequence, head, V tile):
    conv (reads the conv state, does not write it) + SiLU for the head's q, k (all K channels) and its v tile,
    L2 norm (eps 1e-6 inside the sqrt) and scale K^-0.5 on q, gate -exp(A_log) softplus(z + dt_bias) (natural log,
    exp of a value <= 0), sigmoid(b), then on the [K, BV] fp32 state tile (fla layout [S, H, K, V], decay on K rows):
        S = exp(g)[:, None] * S ; u = beta (v - S^T k) ; S += k u^T ; o = S^T q
    The state tile is read once and written once. o (fp32, pre-norm) goes to a scratch [N, H, V].
K2 `_kda_decode_post_kernel`, grid (H, N): gated RMSNorm of o over V (sigmoid gate r) -> out [N, H*V], and the
    conv state shift for the head's q, k, v channels. It runs after K1 so that no program of K1 reads a conv
    state that another has already shifted.

With BV >= V (one program per head) K1 does K2's work itself and the step is one launch.

Lanes whose slot is <= 0 (the null slot, CUDA-graph padding) read and write no state and output zeros, so padded
lanes cost almost no bandwidth and never touch a real slot. No host syncs, no data-dependent shapes: the whole
step is CUDA-graph capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_norm_store(o, r_row, w_ptr, y_row, o_v, m_v, eps, V: tl.constexpr):
    # o [BVF] fp32 (zeros past V) -> y = o * rsqrt(mean(o^2) + eps) * w * sigmoid(r)
    r = tl.load(r_row + o_v, mask=m_v, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    y = o * rstd * w * tl.sigmoid(r)
    tl.store(y_row + o_v, y.to(y_row.dtype.element_ty), mask=m_v)


@triton.jit
def _conv_shift(cs, x_row, c, m, stride_cs_w, W: tl.constexpr):
    # conv state rows (oldest first) of channels c: row j <- row j+1, row W-2 <- x (same layout for every access,
    # so each channel is loaded and stored by the same thread)
    for j in tl.static_range(W - 2):
        tl.store(cs + j * stride_cs_w + c, tl.load(cs + (j + 1) * stride_cs_w + c, mask=m), mask=m)
    tl.store(cs + (W - 2) * stride_cs_w + c, tl.load(x_row + c, mask=m).to(cs.dtype.element_ty), mask=m)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr, convw_ptr, convs_ptr, z_ptr, b_ptr, alog_ptr, dtb_ptr, slot_ptr, state_ptr, o_ptr,
    r_ptr, nw_ptr, y_ptr,
    stride_qkv, stride_z, stride_b, stride_r, stride_y,
    stride_cs_s, stride_cs_w,
    stride_s_s, stride_s_h,
    scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SINGLE: tl.constexpr,
):
    # SINGLE (BV >= V, one program per (sequence, head)): the program owns all of the head's channels, so it also
    # does the gated RMSNorm (y [N, H*V]) and the conv-state shift itself: the whole step is one launch.
    # qkv [N, 2HK+HV]; conv_w [C, W] f32; conv_state [S, W-1, C]; z [N, HK]; b [N, H]; A_log [H]; dt_bias [HK]
    # state [S, H, K, V] f32 (k-row stride V, v contiguous); o [N, H, V] f32 scratch
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)

    o_k = tl.arange(0, BK).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV).to(tl.int64)
    m_k = (o_k < K) & ((o_k * 0 + slot) > 0)                          # slot <= 0: padded lane, no state I/O
    m_v = (o_v < V) & ((o_v * 0 + slot) > 0)

    # ---- short conv + SiLU (fp32), reading the pre-step conv state
    c_q = i_h * K + o_k
    c_k = H * K + i_h * K + o_k
    c_v = 2 * H * K + i_h * V + o_v
    x_row = qkv_ptr + i_n * stride_qkv
    cs = convs_ptr + slot * stride_cs_s
    aq = tl.load(x_row + c_q, mask=m_k, other=0.0).to(tl.float32) * \
        tl.load(convw_ptr + c_q * W + (W - 1), mask=m_k, other=0.0)
    ak = tl.load(x_row + c_k, mask=m_k, other=0.0).to(tl.float32) * \
        tl.load(convw_ptr + c_k * W + (W - 1), mask=m_k, other=0.0)
    av = tl.load(x_row + c_v, mask=m_v, other=0.0).to(tl.float32) * \
        tl.load(convw_ptr + c_v * W + (W - 1), mask=m_v, other=0.0)
    for j in tl.static_range(W - 1):
        aq += tl.load(cs + j * stride_cs_w + c_q, mask=m_k, other=0.0).to(tl.float32) * \
            tl.load(convw_ptr + c_q * W + j, mask=m_k, other=0.0)
        ak += tl.load(cs + j * stride_cs_w + c_k, mask=m_k, other=0.0).to(tl.float32) * \
            tl.load(convw_ptr + c_k * W + j, mask=m_k, other=0.0)
        av += tl.load(cs + j * stride_cs_w + c_v, mask=m_v, other=0.0).to(tl.float32) * \
            tl.load(convw_ptr + c_v * W + j, mask=m_v, other=0.0)
    q = aq * tl.sigmoid(aq)                                           # [BK]
    k = ak * tl.sigmoid(ak)                                           # [BK]
    v = av * tl.sigmoid(av)                                           # [BV]

    # ---- L2 norm (eps inside the sqrt), scale on q
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)

    # ---- gate (natural log, <= 0) and beta
    zz = tl.load(z_ptr + i_n * stride_z + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32) + \
        tl.load(dtb_ptr + i_h * K + o_k, mask=m_k, other=0.0)
    sp = tl.where(zz > 20.0, zz, tl.maximum(zz, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(zz))))   # softplus, exp(<=0)
    g = -tl.exp(tl.load(alog_ptr + i_h)) * sp                         # [BK]
    bb = tl.load(b_ptr + i_n * stride_b + i_h).to(tl.float32)
    beta = tl.sigmoid(bb)

    # ---- delta rule on the [BK, BV] state tile
    s_ptrs = state_ptr + slot * stride_s_s + i_h * stride_s_h + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(s_ptrs, mask=m_s, other=0.0)
    S = S * tl.exp(g)[:, None]                                        # decay K rows
    u = beta * (v - tl.sum(S * k[:, None], axis=0))                   # [BV]
    S = S + k[:, None] * u[None, :]                                   # rank-1 write
    o = tl.sum(S * q[:, None], axis=0)                                # [BV], read the updated state
    tl.store(s_ptrs, S, mask=m_s)
    if SINGLE:
        _gated_norm_store(o, r_ptr + i_n * stride_r + i_h * V, nw_ptr, y_ptr + i_n * stride_y + i_h * V,
                          o_v, o_v < V, eps, V)
        _conv_shift(cs, x_row, c_q, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, c_k, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, c_v, m_v, stride_cs_w, W)
    else:
        tl.store(o_ptr + (i_n * H + i_h) * V + o_v, o, mask=o_v < V)  # padded lanes store zeros


@triton.jit
def _kda_decode_post_kernel(
    o_ptr, r_ptr, w_ptr, y_ptr, qkv_ptr, convs_ptr, slot_ptr,
    stride_r, stride_y, stride_qkv, stride_cs_s, stride_cs_w,
    eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr,
):
    # o [N, H, V] f32 -> y [N, H*V] = o * rsqrt(mean(o^2) + eps) * w * sigmoid(r); conv state shift for head i_h
    i_h = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    o_v = tl.arange(0, BVF).to(tl.int64)
    m_v = o_v < V
    o = tl.load(o_ptr + (i_n * H + i_h) * V + o_v, mask=m_v, other=0.0)
    _gated_norm_store(o, r_ptr + i_n * stride_r + i_h * V, w_ptr, y_ptr + i_n * stride_y + i_h * V, o_v, m_v, eps, V)

    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    cs = convs_ptr + slot * stride_cs_s
    x_row = qkv_ptr + i_n * stride_qkv
    o_k = tl.arange(0, BK).to(tl.int64)
    m_k = (o_k < K) & ((o_k * 0 + slot) > 0)
    m_vv = m_v & ((o_v * 0 + slot) > 0)
    _conv_shift(cs, x_row, i_h * K + o_k, m_k, stride_cs_w, W)
    _conv_shift(cs, x_row, H * K + i_h * K + o_k, m_k, stride_cs_w, W)
    _conv_shift(cs, x_row, 2 * H * K + i_h * V + o_v, m_vv, stride_cs_w, W)


def _pick_bv(N: int, H: int, V: int) -> int:
    # enough programs to fill an H200 (132 SMs, several programs each) at small N; 32-wide rows at large N
    progs = N * H
    if progs >= 2048:
        bv = 32
    elif progs >= 512:
        bv = 16
    else:
        bv = 8
    return min(bv, triton.next_power_of_2(V))


def kda_decode_triton(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state, state_slots,
                      BV: Optional[int] = None, num_warps: Optional[int] = None,
                      o_scratch: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """Fused KDA decode step (see module doc). Shapes as kernels.kda.kda_decode. Returns [N, H*V] (qkv.dtype),
    written into `out` when given (every element is written, padded lanes get zeros)."""
    N = qkv.shape[0]
    H = b.shape[-1]
    K = z.shape[-1] // H
    V = r.shape[-1] // H
    W = conv_w.shape[1]
    C = 2 * H * K + H * V
    assert qkv.shape[1] == C and conv_w.shape[0] == C and conv_state.shape[1:] == (W - 1, C), \
        (qkv.shape, conv_w.shape, conv_state.shape)
    assert rec_state.shape[1:] == (H, K, V) and rec_state.dtype == torch.float32
    assert rec_state.stride(3) == 1 and rec_state.stride(2) == V and conv_state.stride(2) == 1
    assert conv_w.is_contiguous() and conv_w.dtype == torch.float32
    assert A_log.numel() == H and dt_bias.numel() == H * K
    A_log = A_log.reshape(H)
    assert A_log.dtype == torch.float32 and dt_bias.dtype == torch.float32
    for t in (qkv, z, b, r):
        assert t.stride(-1) == 1
    if out is None:
        out = torch.empty(N, H * V, dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (N, H * V) and out.stride(1) == 1
    if N == 0:
        return out
    BK = triton.next_power_of_2(K)
    if BV is None:
        BV = _pick_bv(N, H, V)
    BV = min(BV, triton.next_power_of_2(V))
    single = BV >= V
    if num_warps is None:
        num_warps = 1 if BV <= 8 else (2 if BV <= 16 else (4 if BV <= 32 else 8))
    if o_scratch is None and not single:
        o_scratch = torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)
    _kda_decode_kernel[(triton.cdiv(V, BV), H, N)](
        qkv, conv_w, conv_state, z, b, A_log, dt_bias, state_slots, rec_state, o_scratch if not single else out,
        r, o_norm_w, out,
        qkv.stride(0), z.stride(0), b.stride(0), r.stride(0), out.stride(0),
        conv_state.stride(0), conv_state.stride(1),
        rec_state.stride(0), rec_state.stride(1),
        K ** -0.5, eps,
        H=H, K=K, V=V, W=W, BK=BK, BV=BV, SINGLE=single, num_warps=num_warps,
    )
    if single:
        return out
    _kda_decode_post_kernel[(H, N)](
        o_scratch, r, o_norm_w, out, qkv, conv_state, state_slots,
        r.stride(0), out.stride(0), qkv.stride(0), conv_state.stride(0), conv_state.stride(1),
        eps,
        H=H, K=K, V=V, W=W, BK=BK, BVF=triton.next_power_of_2(V), num_warps=4,
    )
    return out
