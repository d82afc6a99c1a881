"""Short causal depthwise conv + SiLU (KDA q|k|v), varlen prefill and single-token decode over a slot pool.

x holds the pre-conv channels [T, C] (C = q | k | v), w [C, W] fp32 with w[:, W-1] multiplying the current token
and w[:, 0] the token W-1 steps back. conv_state [S, W-1, C] holds the last W-1 *pre-conv* inputs of each
sequence, oldest first; slot 0 is the null slot. has_initial_state False -> the history is zeros.

short_conv_prefill(x [T, C], w, conv_state, cu_seqlens [P+1], state_slots [P], has_initial_state [P]) -> [T, C]
short_conv_decode(x [N, C], w, conv_state, state_slots [N]) -> [N, C]   (state shifted in place)
Outputs have x.dtype; math is fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._tensors import unit_last_stride


# --------------------------------------------------------------------------------------------------- references
def short_conv_prefill_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    T, C = x.shape
    W = w.shape[1]
    cu = [int(i) for i in cu_seqlens.tolist()]
    slots = [int(i) for i in state_slots.tolist()]
    his = [True] * len(slots) if has_initial_state is None else [bool(i) for i in has_initial_state.tolist()]
    wf = w.float()
    y = torch.zeros(T, C, dtype=x.dtype, device=x.device)
    for p, slot in enumerate(slots):
        bos, eos = cu[p], cu[p + 1]
        hist = conv_state[slot].float() if his[p] else torch.zeros(W - 1, C, dtype=torch.float32, device=x.device)
        xs = torch.cat([hist, x[bos:eos].float()], 0)                 # [W-1+L, C]
        L = eos - bos
        if L > 0:
            win = xs.unfold(0, W, 1)                                   # [L, C, W]
            y[bos:eos] = F.silu((win * wf).sum(-1)).to(x.dtype)
        conv_state[slot] = xs[xs.shape[0] - (W - 1):].to(conv_state.dtype)
    return y


def short_conv_decode_ref(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor,
                          state_slots: torch.Tensor) -> torch.Tensor:
    slots = state_slots.long()
    hist = conv_state[slots].float()                                   # [N, W-1, C]
    xs = torch.cat([hist, x.float()[:, None]], 1)                      # [N, W, C]
    y = F.silu((xs * w.float().t()[None]).sum(1)).to(x.dtype)
    conv_state[slots] = xs[:, 1:].to(conv_state.dtype)
    return y


# --------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, cu_ptr, slot_ptr, his_ptr,
    T, C, P,
    stride_x, stride_y, stride_ss, stride_sw,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOG_P: tl.constexpr,
):
    # grid (cdiv(T, BT), cdiv(C, BC)); x, y [T, C]; state [S, W-1, C] (read only here)
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT).to(tl.int64)                        # [BT]
    c = i_c * BC + tl.arange(0, BC).to(tl.int64)                        # [BC]
    mc = c < C
    cu0 = tl.load(cu_ptr).to(tl.int64)
    cuP = tl.load(cu_ptr + P).to(tl.int64)
    mt = (t >= cu0) & (t < cuP)                                         # tokens outside every sequence -> 0
    # sequence of each token: largest p with cu[p] <= t (binary search over cu_seqlens[0..P])
    lo = tl.zeros([BT], dtype=tl.int64)
    hi = tl.zeros([BT], dtype=tl.int64) + (P - 1)                       # answer in [0, P-1]
    for _ in tl.static_range(LOG_P):
        mid = (lo + hi + 1) // 2
        cm = tl.load(cu_ptr + mid, mask=mt, other=0).to(tl.int64)
        go = cm <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    p = lo
    bos = tl.load(cu_ptr + p, mask=mt, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + p, mask=mt, other=0).to(tl.int64)
    his = tl.load(his_ptr + p, mask=mt, other=0) != 0
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j                                           # [BT] input position
        in_seq = src >= bos
        xv = tl.load(x_ptr + src[:, None] * stride_x + c[None, :],
                     mask=(mt & in_seq)[:, None] & mc[None, :], other=0.0).to(tl.float32)
        hidx = (W - 1) + src - bos                                      # history row, oldest first
        sv = tl.load(state_ptr + slot[:, None] * stride_ss + hidx[:, None] * stride_sw + c[None, :],
                     mask=(mt & (~in_seq) & his)[:, None] & mc[None, :], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * W + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t[:, None] * stride_y + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & mc[None, :])


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, cu_ptr, slot_ptr, his_ptr,
    C,
    stride_x, stride_ss, stride_sw,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    # grid (P, cdiv(C, BC)): new_state[i] = input at position eos-(W-1)+i (x, or the shifted old state)
    i_p = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    c = i_c * BC + tl.arange(0, BC).to(tl.int64)
    mc = c < C
    bos = tl.load(cu_ptr + i_p).to(tl.int64)
    eos = tl.load(cu_ptr + i_p + 1).to(tl.int64)
    slot = tl.load(slot_ptr + i_p).to(tl.int64)
    his = tl.load(his_ptr + i_p).to(tl.int32)
    i = tl.arange(0, BW).to(tl.int64)                                   # [BW] new state row
    hisv = (tl.zeros([BW], dtype=tl.int32) + his) != 0
    mi = i < (W - 1)
    src = eos - (W - 1) + i
    in_seq = src >= bos
    xv = tl.load(x_ptr + src[:, None] * stride_x + c[None, :],
                 mask=(mi & in_seq)[:, None] & mc[None, :], other=0.0)
    hidx = (W - 1) + src - bos                                          # = i + len, > i: reads ahead of writes
    sv = tl.load(state_ptr + slot * stride_ss + hidx[:, None] * stride_sw + c[None, :],
                 mask=(mi & (~in_seq) & hisv)[:, None] & mc[None, :], other=0.0)
    new = tl.where(in_seq[:, None], xv.to(tl.float32), sv.to(tl.float32))
    tl.store(state_ptr + slot * stride_ss + i[:, None] * stride_sw + c[None, :],
             new.to(state_ptr.dtype.element_ty), mask=mi[:, None] & mc[None, :])


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, slot_ptr,
    C,
    stride_x, stride_y, stride_ss, stride_sw,
    W: tl.constexpr, BC: tl.constexpr,
):
    # grid (N, cdiv(C, BC)); x, y [N, C]; state [S, W-1, C] shifted in place (each program owns its channels)
    i_n = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    c = i_c * BC + tl.arange(0, BC).to(tl.int64)
    mc = c < C
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    base = state_ptr + slot * stride_ss
    xv = tl.load(x_ptr + i_n * stride_x + c, mask=mc, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w_ptr + c * W + (W - 1), mask=mc, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        sv = tl.load(base + j * stride_sw + c, mask=mc, other=0.0)
        acc += sv.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=mc, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * stride_sw + c, sv, mask=mc)
    tl.store(base + (W - 2) * stride_sw + c, xv.to(state_ptr.dtype.element_ty), mask=mc)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + i_n * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mc)


# --------------------------------------------------------------------------------------------------- wrappers
def _check_state(x, w, conv_state):
    C = x.shape[1]
    W = w.shape[1]
    assert w.shape[0] == C and conv_state.shape[1] == W - 1 and conv_state.shape[2] == C, \
        (x.shape, w.shape, conv_state.shape)
    assert conv_state.stride(2) == 1 and w.is_contiguous()


def short_conv_prefill_triton(x, w, conv_state, cu_seqlens, state_slots, has_initial_state=None, out=None):
    """Triton varlen prefill; `out` [T, C] (optional) is fully written (zeros outside the sequences)."""
    x = unit_last_stride(x)
    _check_state(x, w, conv_state)
    T, C = x.shape
    W = w.shape[1]
    P = state_slots.shape[0]
    y = torch.empty_like(x) if out is None else out
    assert y.shape == (T, C) and y.stride(1) == 1
    if has_initial_state is None:
        has_initial_state = torch.ones(P, dtype=torch.bool, device=x.device)
    his = has_initial_state.to(torch.int8)
    if P == 0:
        return y.zero_()
    BT, BC = 32, 128
    LOG_P = max(1, (P).bit_length())
    if T > 0:
        _conv_prefill_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            x, w, conv_state, y, cu_seqlens, state_slots, his, T, C, P,
            x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
            W=W, BT=BT, BC=BC, LOG_P=LOG_P, num_warps=4)
    # second launch: the state write must not race with the reads above
    BCs = 256
    _conv_prefill_state_kernel[(P, triton.cdiv(C, BCs))](
        x, conv_state, cu_seqlens, state_slots, his, C,
        x.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=W, BW=triton.next_power_of_2(W - 1), BC=BCs, num_warps=4)
    return y


def short_conv_decode_triton(x, w, conv_state, state_slots, out=None):
    x = unit_last_stride(x)
    _check_state(x, w, conv_state)
    N, C = x.shape
    W = w.shape[1]
    y = torch.empty_like(x) if out is None else out
    assert y.shape == (N, C) and y.stride(1) == 1
    if N == 0:
        return y
    BC = 256
    _conv_decode_kernel[(N, triton.cdiv(C, BC))](
        x, w, conv_state, y, state_slots, C,
        x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=W, BC=BC, num_warps=2)
    return y


def short_conv_prefill(x, w, conv_state, cu_seqlens, state_slots, has_initial_state=None):
    if use_triton(x):
        return short_conv_prefill_triton(x, w, conv_state, cu_seqlens, state_slots, has_initial_state)
    return short_conv_prefill_ref(x, w, conv_state, cu_seqlens, state_slots, has_initial_state)


def short_conv_decode(x, w, conv_state, state_slots):
    if use_triton(x):
        return short_conv_decode_triton(x, w, conv_state, state_slots)
    return short_conv_decode_ref(x, w, conv_state, state_slots)
