"""Short causal depthwise conv + SiLU (KDA q|k|v), varlen prefill and single-token decode over a slot pool.

x holds the pre-conv channels [T, C] (C = q | k | v), w [C, W] fp32 with w[:, W-1] multiplying the current token
and w[:, 0] the token W-1 steps back. conv_state [S, W-1, C] holds the last W-1 *pre-conv* inputs of each
sequence, oldest first; slot 0 is the null slot. has_initial_state False -> the history is zeros.

short_conv_prefill(x [T, C], w, conv_state, cu_seqlens [P+1], state_slots [P], has_initial_state [P]) -> [T, C]
    (Triton: one streaming launch; each program runs BT rows of one sequence x BC channels through a register window,
    so x is read once and y written once; the first chunk's program reads and then writes the sequence's state)
short_conv_decode(x [N, C], w, conv_state, state_slots [N]) -> [N, C]   (state shifted in place)
Outputs have x.dtype; math is fp32.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._dispatch import use_triton
from kernels._tensors import cdiv, next_pow2, unit_last_stride


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
def _conv_rows4(x0, x1, x2, x3, h1, h2, h3, wx, wa, wb, wc, FAST: tl.constexpr):
    # four consecutive rows [BC] fp32 and the three inputs before them (h1 newest) -> silu(conv) of each row;
    # same tap order as the decode kernel (current, then oldest to newest)
    a0 = x0 * wx + h3 * wc + h2 * wb + h1 * wa
    a1 = x1 * wx + h2 * wc + h1 * wb + x0 * wa
    a2 = x2 * wx + h1 * wc + x0 * wb + x1 * wa
    a3 = x3 * wx + x0 * wc + x1 * wb + x2 * wa
    return _silu(a0, FAST), _silu(a1, FAST), _silu(a2, FAST), _silu(a3, FAST)


@triton.jit
def _silu(a, FAST: tl.constexpr):
    # FAST (compiled only; the interpreter lacks these): ex2.approx.ftz and div.approx, 5 instructions instead of
    # ~13 (no denormal / range fix-ups); a -> -inf gives a / inf = -0, the limit
    if FAST:
        return libdevice.fast_dividef(a, 1.0 + libdevice.fast_expf(-a))
    else:
        return a * tl.sigmoid(a)


@triton.jit
def _conv_new_state(pe, ps, i, L, stride_x, stride_sw, mw, ms, zc, W: tl.constexpr):
    # new state row i [BC] fp32 = input at eos-(W-1)+i: the x row (pe = row eos-(W-1)) when the sequence has it
    # (L = min(len, W-1) >= W-1-i), else old state row i+L (zeros without initial state: ms is false)
    inx = zc + L >= W - 1 - i
    xv = tl.load(pe + i * stride_x, mask=mw & inx, other=0.0).to(tl.float32)
    ov = tl.load(ps + (i + L) * stride_sw, mask=ms & ~inx, other=0.0).to(tl.float32)
    return tl.where(inx, xv, ov)


@triton.jit
def _conv_load_rows(px, r, j, n, stride_x, live):
    # rows r + j (j = arange(RS)) of the chunk -> [BC, RS] in x's dtype; rows >= n and dead channels read as 0
    return tl.load(px[:, None] + (r + j)[None, :] * stride_x, mask=live[:, None] & ((r + j) < n)[None, :], other=0.0)


@triton.jit
def _conv_prefill_stream_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, cu_ptr, slot_ptr, his_ptr,
    T, C, P,
    stride_x, stride_y, stride_ss, stride_sw,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NS: tl.constexpr, RS: tl.constexpr,
    PF: tl.constexpr, FAST: tl.constexpr,
):
    # grid (cdiv(T, BT) + P + 2, cdiv(C, BC)); x, y [T, C] (x may be a row view of a wider projection);
    # state [S, W-1, C]. Segments: 0 = [0, cu[0]) and P+1 = [cu[P], T) are written as zeros, 1..P are the sequences.
    # Program i_n streams chunk i_n of the segments cut into BT-row chunks (a sequence gets >= 1 chunk, so an empty
    # one still writes its state); programs past the last chunk do nothing. Rows run through a register window of
    # the W-1 previous inputs: every x row is read once (plus a W-1 row halo per chunk), every y row written once.
    i_n = tl.program_id(0)
    i_c = tl.program_id(1)
    s = tl.arange(0, NS)                                                # [NS] segment
    lo = tl.load(cu_ptr + s - 1, mask=(s >= 1) & (s <= P + 1), other=0)
    hi = tl.where(s == P + 1, T, tl.load(cu_ptr + s, mask=s <= P, other=0))
    nch = tl.where(s <= P + 1, (hi - lo + BT - 1) // BT, 0)
    nch = tl.where((s >= 1) & (s <= P), tl.maximum(nch, 1), nch)
    cum = tl.cumsum(nch, 0)                                             # inclusive chunk count
    seg = tl.sum((cum <= i_n).to(tl.int32), 0)                          # NS past the last chunk
    sel = s == seg
    bos = tl.sum(tl.where(sel, lo, 0), 0)
    eos = tl.sum(tl.where(sel, hi, 0), 0)
    k = i_n - tl.sum(tl.where(sel, cum - nch, 0), 0)                    # chunk within the segment
    is_seq = (seg >= 1) & (seg <= P)
    first = is_seq & (k == 0)                                           # owns the sequence's state: reads, then writes
    t0 = bos + k * BT
    n = tl.minimum(eos - t0, BT)                                        # rows here (<= 0 past the last chunk)
    slot = tl.load(slot_ptr + seg - 1, mask=is_seq, other=0).to(tl.int64)
    his = tl.load(his_ptr + seg - 1, mask=is_seq, other=0) != 0

    c = i_c * BC + tl.arange(0, BC)                                     # [BC]
    mc = c < C
    zc = tl.zeros([BC], dtype=tl.int32)                                 # scalar flags -> [BC] masks (interpreter)
    live = mc & (zc + is_seq.to(tl.int32) != 0)                         # zero segments read nothing
    wx = tl.load(w_ptr + c * W + (W - 1), mask=mc, other=0.0).to(tl.float32)   # current token
    wa = tl.load(w_ptr + c * W + (W - 2), mask=mc, other=0.0).to(tl.float32)   # 1 back
    wb = tl.load(w_ptr + c * W + (W - 3), mask=mc & (W >= 3), other=0.0).to(tl.float32)
    wc = tl.load(w_ptr + c * W + (W - 4), mask=mc & (W >= 4), other=0.0).to(tl.float32)

    # window h1, h2, h3 = inputs 1, 2, 3 rows before t0: x rows inside the sequence, else the state (or zeros)
    px = x_ptr + t0.to(tl.int64) * stride_x + c
    ps = state_ptr + slot * stride_ss + c
    mx = live & (zc + k > 0)
    ms = live & (zc + (first & his).to(tl.int32) != 0)
    h1 = (tl.load(px - stride_x, mask=mx, other=0.0).to(tl.float32)
          + tl.load(ps + (W - 2) * stride_sw, mask=ms, other=0.0).to(tl.float32))
    h2 = (tl.load(px - 2 * stride_x, mask=mx & (W >= 3), other=0.0).to(tl.float32)
          + tl.load(ps + (W - 3) * stride_sw, mask=ms & (W >= 3), other=0.0).to(tl.float32))
    h3 = (tl.load(px - 3 * stride_x, mask=mx & (W >= 4), other=0.0).to(tl.float32)
          + tl.load(ps + (W - 4) * stride_sw, mask=ms & (W >= 4), other=0.0).to(tl.float32))

    # rows t0 .. t0+n-1, RS (4 or 8) per step: one [BC, RS] load (RS 16-B loads per thread in flight together),
    # split into [BC] rows in registers (the row dim stays within each thread: no shared memory)
    py = y_ptr + t0.to(tl.int64) * stride_y + c
    j = tl.arange(0, RS)
    if PF:
        nxt = _conv_load_rows(px, 0, j, n, stride_x, live)
    for r in range(0, n, RS):
        mr = (r + j) < n                                                # [RS]
        if PF:                                                          # next step's rows in flight during this one
            xt = nxt.to(tl.float32)
            nxt = _conv_load_rows(px, r + RS, j, n, stride_x, live)
        else:
            xt = _conv_load_rows(px, r, j, n, stride_x, live).to(tl.float32)
        if RS == 4:
            xe, xo = tl.split(tl.reshape(xt, [BC, 2, 2]))              # rows {0, 2}, {1, 3}
            x0, x2 = tl.split(xe)
            x1, x3 = tl.split(xo)
            y0, y1, y2, y3 = _conv_rows4(x0, x1, x2, x3, h1, h2, h3, wx, wa, wb, wc, FAST)
            yt = tl.reshape(tl.join(tl.join(y0, y2), tl.join(y1, y3)), [BC, 4])
            h1, h2, h3 = x3, x2, x1
        else:
            xa, xb = tl.split(tl.reshape(xt, [BC, 4, 2]))              # rows {0, 2, 4, 6}, {1, 3, 5, 7}
            xa0, xa1 = tl.split(tl.reshape(xa, [BC, 2, 2]))            # {0, 4}, {2, 6}
            xb0, xb1 = tl.split(tl.reshape(xb, [BC, 2, 2]))            # {1, 5}, {3, 7}
            x0, x4 = tl.split(xa0)
            x2, x6 = tl.split(xa1)
            x1, x5 = tl.split(xb0)
            x3, x7 = tl.split(xb1)
            y0, y1, y2, y3 = _conv_rows4(x0, x1, x2, x3, h1, h2, h3, wx, wa, wb, wc, FAST)
            y4, y5, y6, y7 = _conv_rows4(x4, x5, x6, x7, x3, x2, x1, wx, wa, wb, wc, FAST)
            ya = tl.reshape(tl.join(tl.join(y0, y4), tl.join(y2, y6)), [BC, 4])
            yb = tl.reshape(tl.join(tl.join(y1, y5), tl.join(y3, y7)), [BC, 4])
            yt = tl.reshape(tl.join(ya, yb), [BC, 8])
            h1, h2, h3 = x7, x6, x5
        tl.store(py[:, None] + (r + j)[None, :] * stride_y, yt.to(y_ptr.dtype.element_ty),
                 mask=mc[:, None] & mr[None, :])

    # the sequence's new state, written by its first chunk's program after the rows (off the streaming path)
    L = tl.minimum(eos - bos, W - 1)
    mw = live & (zc + first.to(tl.int32) != 0)
    pe = x_ptr + (eos - (W - 1)).to(tl.int64) * stride_x + c
    n0 = _conv_new_state(pe, ps, 0, L, stride_x, stride_sw, mw, ms, zc, W)
    n1 = n0
    n2 = n0
    if W >= 3:
        n1 = _conv_new_state(pe, ps, 1, L, stride_x, stride_sw, mw, ms, zc, W)
    if W >= 4:
        n2 = _conv_new_state(pe, ps, 2, L, stride_x, stride_sw, mw, ms, zc, W)
    tl.debug_barrier()                                                  # every state read above precedes the writes
    tl.store(ps, n0.to(state_ptr.dtype.element_ty), mask=mw)
    if W >= 3:
        tl.store(ps + stride_sw, n1.to(state_ptr.dtype.element_ty), mask=mw)
    if W >= 4:
        tl.store(ps + 2 * stride_sw, n2.to(state_ptr.dtype.element_ty), mask=mw)


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


class PrefillConfig(NamedTuple):
    """Streaming prefill launch: BT-row chunks x BC channels per program."""
    BT: int = 64
    BC: int = 1024
    num_warps: int = 4
    RS: int = 8                  # rows per loop step (4 or 8)
    PF: bool = False             # True: load step i+1's rows before computing step i (more registers)


PREFILL_CONFIG = PrefillConfig()


def short_conv_prefill_triton(x, w, conv_state, cu_seqlens, state_slots, has_initial_state=None, out=None,
                              impl: str = "stream", cfg: Optional[PrefillConfig] = None):
    """Triton varlen prefill; `out` [T, C] (optional) is fully written (zeros outside the sequences).
    impl "stream": one launch, sequence-aligned row chunks through a register window (2 <= W <= 4);
    "tile": the earlier token-tile kernel + a state launch (any W; kept for comparison, bench/conv.py)."""
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
    if impl == "stream" and W <= 4:
        cfg = cfg or PREFILL_CONFIG
        BC = min(cfg.BC, max(32, next_pow2(C)))
        assert cfg.BT >= W - 1 and cfg.BT % cfg.RS == 0 and cfg.RS in (4, 8)
        _conv_prefill_stream_kernel[(cdiv(T, cfg.BT) + P + 2, cdiv(C, BC))](
            x, w, conv_state, y, cu_seqlens, state_slots, his, T, C, P,
            x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
            W=W, BT=cfg.BT, BC=BC, NS=next_pow2(P + 2), RS=cfg.RS, PF=cfg.PF,
            FAST=os.environ.get("TRITON_INTERPRET") != "1",
            num_warps=max(1, min(cfg.num_warps, BC // 256)), num_stages=1)
        return y
    BT, BC = 32, 128
    LOG_P = max(1, (P).bit_length())
    if T > 0:
        _conv_prefill_kernel[(cdiv(T, BT), cdiv(C, BC))](
            x, w, conv_state, y, cu_seqlens, state_slots, his, T, C, P,
            x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
            W=W, BT=BT, BC=BC, LOG_P=LOG_P, num_warps=4)
    # second launch: the state write must not race with the reads above
    BCs = 256
    _conv_prefill_state_kernel[(P, cdiv(C, BCs))](
        x, conv_state, cu_seqlens, state_slots, his, C,
        x.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=W, BW=next_pow2(W - 1), BC=BCs, num_warps=4)
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
    _conv_decode_kernel[(N, cdiv(C, BC))](
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


# --------------------------------------------------------------------------------------------------- offline check
def compile_report(arch: int = 90, cfg: Optional[PrefillConfig] = None, W: int = 4, dtype: str = "bf16",
                   fast: bool = True) -> dict:
    """Compile the streaming prefill kernel offline for sm_<arch> (kernels/_offline.py: Triton's bundled ptxas; no
    GPU, no TRITON_INTERPRET) -> {"regs", "spill" (stack bytes), "shared" (bytes), "ptx", "sass"}. Triton 3.6 (H200
    device) and 3.9 (CI) both give 128 registers, no spills, no shared memory for the default config at W = 4, bf16."""
    from kernels._offline import compile_offline

    cfg = cfg or PREFILL_CONFIG
    fn = _conv_prefill_stream_kernel
    names = fn.arg_names
    types = dict(x_ptr=f"*{dtype}", w_ptr="*fp32", state_ptr=f"*{dtype}", y_ptr=f"*{dtype}", cu_ptr="*i32",
                 slot_ptr="*i32", his_ptr="*i8", T="i32", C="i32", P="i32", stride_x="i32", stride_y="i32",
                 stride_ss="i32", stride_sw="i32")
    consts = dict(W=W, BT=cfg.BT, BC=cfg.BC, NS=4, RS=cfg.RS, PF=cfg.PF, FAST=fast)
    # divisibility by 16 as Triton specializes it at the Kimi shape (C = 12288, row stride 12576, 16-B aligned rows)
    div = [n for n in names if n in types and (types[n].startswith("*") or n.startswith("stride") or n == "C")]
    b = compile_offline(fn, types, consts, num_warps=cfg.num_warps, num_stages=1, arch=arch, divisible=div)
    return dict(regs=b.regs, spill=b.stack, shared=b.smem, ptx=b.ptx, sass=b.sass)
