"""Fused KDA decode: one token per sequence, state pools updated in place at slot indices. One launch by default.

`_kda_decode_kernel`, grid (V/BV, H, N), one program per (sequence, head, V tile):
    the [K, BV] fp32 state tile (fla layout [S, H, K, V], decay on K rows) is read once and written once, in
    16-byte vectors with evict_first (issued before the prologue when EARLY); conv (reads the conv state) + SiLU
    for the head's q, k (all K channels) and its v tile, L2 norm (eps 1e-6 inside the sqrt) and scale K^-0.5 on q,
    gate -exp(A_log) softplus(z + dt_bias) (natural log, exp of a value <= 0), sigmoid(b), then
        S = exp(g)[:, None] * S ; u = beta (v - S^T k) ; S += k u^T ; o = S^T q
The head's tail (gated RMSNorm of o over V with sigmoid gate r -> out [N, H*V]; the conv-state shift of its q, k
channels) needs all V tiles and must follow every tile's conv read. Three ways (TAIL):
    TAIL_SINGLE  BV >= V: the one program of the head does it.
    TAIL_LAST    o tile -> scratch [N, H, V]; a per-(sequence, head) arrival counter (atomic, acq_rel) elects the
                 last tile's program, which normalises the whole row and shifts the head's q, k, v conv state, then
                 resets the counter to 0 (so the counter buffer stays zero between launches: graph-replay safe).
                 One launch.
    TAIL_POST    o tile -> scratch; a second kernel `_kda_decode_post_kernel`, grid (H, N), does the tail (kept
                 for comparison in bench/kda.py --sweep).
    TAIL_LOOP    `_kda_decode_loop_kernel`, persistent grid (G,) sized for a few programs per SM: each program walks
                 whole heads, tile by tile, with the next tile's state load (the next head's first tile after the
                 last) issued before the current tile's math, so a program never waits on HBM with nothing in flight
                 and no program starts cold; the head's tail runs in the program after a barrier (o via scratch).
Launch config (`decode_config`): BV, warps, tail and the state-load position as a function of N, H, V and the SM
count; see there. `bench/kda.py --sweep` times the alternatives.

PDL (KIMI_PDL=1, kernels._pdl; `pdl` overrides): the kernels take GDC and are launched with programmatic
dependent launch; before griddepcontrol.wait they only compute offsets and (the per-tile kernel) prefetch the head's
conv weights, dt_bias and norm weight into L2; every activation (qkv, b: in_proj outputs; z / r: skinny_bmm_nt's)
is read after it.

Early state (per-tile kernel, EARLY_STATE; _EARLY_STATE / KIMI_KDA_EARLY_STATE, kda_decode_triton(early_state=)):
the exception to kernels._pdl's contract for this layer's state. Under PDL the decode's CTAs start while the
layer's f_b|g_b skinny_bmm_nt (after the in_proj) still runs, so its slot -> state -> compute latency chain can start
there:
    1: before the wait, the slot load and L2 prefetches of the program's state tile and conv-state rows;
      the tile and rows are loaded after the wait (L2 hits instead of HBM misses, no slot round trip after it).
    2: also the state tile load into registers before the wait (Triton 3.6 sm_90: N=1 254 regs, N=8 125, no spills).
    0 (default): slot and state after the wait.
Why the slot may be read before the wait: state_slots is written only by host -> device copies issued before the
step's forward (runner._fill_and_replay's stage copy before graph replay; ForwardBatch of an eager step; TP:
_fill_graph's copies before replay), never by a kernel of the step. The prefetches are hints (L2 is the coherence
point): correct whoever writes the lines meanwhile. Mode 2 also needs: the conv / recurrent state pools of this
layer are written only by this layer's KDA kernels (kda_decode of an earlier step; kda_prefill of an earlier step,
or of this step for other slots, launched after the decode: KimiDeltaAttention.forward), never by the kernel
launched just before the decode (in the model the layer's f_b|g_b skinny_bmm_nt). In a PDL chain, when kernel N starts,
kernel N-1 has passed its griddepcontrol.wait (launch_dependents follows it), so every kernel before N-1 has
completed and flushed; non-PDL launches start after their predecessor completed. So the state read before the wait
is the one the previous step wrote. Two decode launches on the same pools back to back (tests, benchmarks timing
one kernel in a loop) break that premise: mode 2 would read the state before the earlier launch writes it; modes
0 / 1 stay correct there.

Low-rank gates (kda_decode_triton(fg_a=, fg_b=), the model's decode path): f_a, g_a [N, R] and f_b [HK, R],
g_b [HV, R] instead of z, r; the wrapper forms z = f_a f_b^T and r = g_a g_b^T with one skinny_bmm_nt (bf16 out)
and then runs the plain kernel. (Removed after H200 runs: the up-projections inside the decode kernels, FG, 6 us
per step slower at batch 1 and 171 us per step slower at batch 8 than the separate skinny_bmm_nt.)

Lanes whose slot is <= 0 (the null slot, CUDA-graph padding) read and write no state and output zeros, so padded
lanes cost almost no bandwidth and never touch a real slot. No host syncs, no data-dependent shapes: the whole
step is CUDA-graph capturable.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kernels._pdl import gdc_enter, pdl_launch, pdl_on, prefetch_l2
from kernels._tensors import arrival_counters, cdiv, next_pow2, num_sms
from kernels.gemv import skinny_bmm_nt

TAIL_SINGLE, TAIL_LAST, TAIL_POST, TAIL_LOOP = 0, 1, 2, 3


@triton.jit
def _gated_norm_store(o, r_row, w_ptr, y_row, o_v, m_v, eps, V: tl.constexpr):
    # o [BVF] fp32 (zeros past V) -> y = o * rsqrt(mean(o^2) + eps) * w * sigmoid(r)
    r = tl.load(r_row + o_v, mask=m_v, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    y = o * rstd * w * tl.sigmoid(r)
    tl.store(y_row + o_v, y.to(y_row.dtype.element_ty), mask=m_v)


@triton.jit
def _prefetch_span(ptr, n, BX: tl.constexpr, slot):
    # L2 prefetch of elements [0, min(n, BX)) from ptr: one hint per 32 elements (2-4 per 128-byte line), none when
    # slot <= 0
    o = tl.arange(0, (BX + 31) // 32).to(tl.int64) * 32
    prefetch_l2(ptr + o, (o < BX) & (o < n) & (slot > 0))


@triton.jit
def _conv_shift(cs, x_row, c, m, stride_cs_w, W: tl.constexpr):
    # conv state rows (oldest first) of channels c: row j <- row j+1, row W-2 <- x (same layout for every access,
    # so each channel is loaded and stored by the same thread)
    for j in tl.static_range(W - 2):
        tl.store(cs + j * stride_cs_w + c, tl.load(cs + (j + 1) * stride_cs_w + c, mask=m), mask=m)
    tl.store(cs + (W - 2) * stride_cs_w + c, tl.load(x_row + c, mask=m).to(cs.dtype.element_ty), mask=m)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr, convw_ptr, convs_ptr, z_ptr, b_ptr, alog_ptr, dtb_ptr, slot_ptr, state_ptr, o_ptr, cnt_ptr,
    r_ptr, nw_ptr, y_ptr,
    stride_qkv, stride_z, stride_b, stride_r, stride_y,
    stride_cs_s, stride_cs_w,
    stride_s_s, stride_s_h,
    scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, BVF: tl.constexpr, TAIL: tl.constexpr,
    EARLY: tl.constexpr, STORE_AFTER: tl.constexpr = False, GDC: tl.constexpr = False,
    EARLY_STATE: tl.constexpr = 0,
):
    # qkv [N, 2HK+HV]; conv_w [C, W] f32; conv_state [S, W-1, C]; z [N, HK]; b [N, H]; A_log [H]; dt_bias [HK]
    # state [S, H, K, V] f32 (k-row stride V, v contiguous); o [N, H, V] f32 scratch (TAIL_LAST / TAIL_POST);
    # cnt [N*H] i32 arrival counters, zero between launches (TAIL_LAST); y [N, H*V]
    # EARLY_STATE (module doc "Early state"): 1: the slot load, the L2 prefetch of the state tile and of the conv
    # state rows go before gdc_wait; 2: also the state tile load into registers (before the wait under GDC). 0: all
    # after it. The same values either way: only the position of the loads changes
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2).to(tl.int64)
    o_k = tl.arange(0, BK).to(tl.int64)                              # int64 offsets: fewer registers (ptxas)
    o_v = i_v.to(tl.int64) * BV + tl.arange(0, BV).to(tl.int64)
    if GDC:
        # PDL: the weights this program reads (conv taps of its q, k, v channels, dt_bias, the o_norm weight) into
        # L2 while the previous kernel (the projection writing qkv, z, b, r) finishes; then wait for it
        prefetch_l2(convw_ptr + (i_h * K + o_k) * W, o_k < K)
        prefetch_l2(convw_ptr + (H * K + i_h * K + o_k) * W, o_k < K)
        prefetch_l2(convw_ptr + (2 * H * K + i_h * V + o_v) * W, o_v < V)
        prefetch_l2(dtb_ptr + i_h * K + o_k, o_k < K)
        prefetch_l2(nw_ptr + o_v, o_v < V)
        if EARLY_STATE == 0:
            gdc_enter(GDC)
    # EARLY_STATE > 0: before the wait. state_slots is written by a host -> device copy before the step, never by
    # the kernel just before this one (the layer's f_b|g_b skinny_bmm_nt)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    s_head = state_ptr + (slot * stride_s_s + i_h * stride_s_h)
    cs = convs_ptr + slot * stride_cs_s
    if GDC and EARLY_STATE > 0:
        # L2 prefetch of the state tile (one hint per 32 fp32: a 128-byte line) and of the W-1 conv state rows of
        # the q, k channels and the v tile (one hint per 32 elements) while the previous kernel runs; hints, so
        # correct whoever writes these lines meanwhile (L2 is the coherence point). Only the slot and these
        # addresses are computed here: the tile's pointers and masks after the wait (fewer live registers)
        o_l = tl.arange(0, (BV + 31) // 32).to(tl.int64) * 32
        m_l = (o_l < BV) & (i_v * BV + o_l < V) & (slot > 0)
        prefetch_l2(s_head + (o_k[:, None] * V + i_v * BV + o_l[None, :]),
                    ((o_k < K) & (slot > 0))[:, None] & m_l[None, :])
        for j in tl.static_range(W - 1):
            _prefetch_span(cs + j * stride_cs_w + i_h * K, K, BK, slot)
            _prefetch_span(cs + j * stride_cs_w + H * K + i_h * K, K, BK, slot)
            _prefetch_span(cs + j * stride_cs_w + 2 * H * K + i_h * V + i_v * BV, V - i_v * BV, BV, slot)

    # slot <= 0: padded lane, no state I/O. The slot test is a splat, constant along v: the masked state tile
    # moves in 16-byte vectors (ld/st.global.v4 in the PTX)
    m_k = (o_k < K) & ((tl.zeros([BK], dtype=tl.int64) + slot) > 0)
    m_v = (o_v < V) & ((tl.zeros([BV], dtype=tl.int64) + slot) > 0)
    s_ptrs = s_head + (o_k[:, None] * V + o_v[None, :])
    m_s = m_k[:, None] & m_v[None, :]
    # state tile load first (EARLY_STATE 2: before the wait, in registers across it; EARLY: right after it): its
    # latency overlaps the conv / norm / gate prologue below, at the price of the tile's registers being live
    # through it (ptxas 3.6, sm_90a, K = 128: BV 8 / 1 warp 87 regs vs 72 late, BV 32 / 4 warps 88 vs 80: fewer
    # resident programs)
    if EARLY_STATE == 2:
        S = tl.load(s_ptrs, mask=m_s, other=0.0, eviction_policy="evict_first")
    if GDC and EARLY_STATE > 0:
        gdc_enter(GDC)
    if EARLY and EARLY_STATE != 2:
        S = tl.load(s_ptrs, mask=m_s, other=0.0, eviction_policy="evict_first")
    c_q = i_h * K + o_k
    c_k = H * K + i_h * K + o_k
    c_v = 2 * H * K + i_h * V + o_v
    x_row = qkv_ptr + i_n * stride_qkv

    # ---- short conv + SiLU (fp32), reading the pre-step conv state
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
    if not EARLY and EARLY_STATE != 2:
        S = tl.load(s_ptrs, mask=m_s, other=0.0, eviction_policy="evict_first")
    S = S * tl.exp(g)[:, None]                                        # decay K rows
    u = beta * (v - tl.sum(S * k[:, None], axis=0))                   # [BV]
    S = S + k[:, None] * u[None, :]                                   # rank-1 write
    o = tl.sum(S * q[:, None], axis=0)                                # [BV], read the updated state
    if not (STORE_AFTER and TAIL == 1):
        tl.store(s_ptrs, S, mask=m_s, eviction_policy="evict_first")

    y_row = y_ptr + i_n * stride_y + i_h * V
    o_row = o_ptr + (i_n * H + i_h) * V
    if TAIL == 0:
        # one program owns the head: norm here; the barrier orders every thread's conv reads before the shift
        _gated_norm_store(o, r_ptr + i_n * stride_r + i_h * V, nw_ptr, y_row, o_v, o_v < V, eps, V)
        tl.debug_barrier()
        _conv_shift(cs, x_row, c_q, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, c_k, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, c_v, m_v, stride_cs_w, W)
    elif TAIL == 1:
        tl.store(o_row + o_v, o, mask=o_v < V)                        # padded lanes store zeros
        # barrier: all threads' o stores and conv reads precede the (release) arrival
        tl.debug_barrier()
        n_arrived = tl.atomic_add(cnt_ptr + i_n * H + i_h, 1, sem="acq_rel", scope="gpu")
        if STORE_AFTER:
            # state tile written after the arrival: the release then waits for the o stores only, not for the
            # tile's 16-32 KB of stores to be acknowledged, so the program frees its SM slot sooner
            tl.store(s_ptrs, S, mask=m_s, eviction_policy="evict_first")
        if n_arrived == NV - 1:                                       # last tile of (sequence, head): the tail
            o_f = tl.arange(0, BVF).to(tl.int64)
            m_f = o_f < V
            of = tl.load(o_row + o_f, mask=m_f, other=0.0, cache_modifier=".cg")   # other tiles' o, from L2
            _gated_norm_store(of, r_ptr + i_n * stride_r + i_h * V, nw_ptr, y_row, o_f, m_f, eps, V)
            # the whole head's conv shift here too (shifting v per tile, before the arrival, cost ~15 registers)
            m_fs = m_f & ((tl.zeros([BVF], dtype=tl.int64) + slot) > 0)
            _conv_shift(cs, x_row, c_q, m_k, stride_cs_w, W)
            _conv_shift(cs, x_row, c_k, m_k, stride_cs_w, W)
            _conv_shift(cs, x_row, 2 * H * K + i_h * V + o_f, m_fs, stride_cs_w, W)
            tl.store(cnt_ptr + i_n * H + i_h, 0)                      # every tile has arrived: reset for the next step
    else:
        tl.store(o_row + o_v, o, mask=o_v < V)                        # padded lanes store zeros


@triton.jit
def _kda_decode_post_kernel(
    o_ptr, r_ptr, w_ptr, y_ptr, qkv_ptr, convs_ptr, slot_ptr,
    stride_r, stride_y, stride_qkv, stride_cs_s, stride_cs_w,
    eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, GDC: tl.constexpr = False,
):
    # TAIL_POST: o [N, H, V] f32 -> y [N, H*V] = o * rsqrt(mean(o^2) + eps) * w * sigmoid(r); conv shift of head i_h
    gdc_enter(GDC)
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


@triton.jit
def _conv_silu(x_row, convw_ptr, cs, c, m, stride_cs_w, W: tl.constexpr):
    # short conv over (conv state rows, new x) of channels c, fp32, then SiLU -> [len(c)]
    a = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32) * tl.load(convw_ptr + c * W + (W - 1), mask=m, other=0.0)
    for j in tl.static_range(W - 1):
        a += tl.load(cs + j * stride_cs_w + c, mask=m, other=0.0).to(tl.float32) * \
            tl.load(convw_ptr + c * W + j, mask=m, other=0.0)
    return a * tl.sigmoid(a)


@triton.jit
def _kda_decode_loop_kernel(
    qkv_ptr, convw_ptr, convs_ptr, z_ptr, b_ptr, alog_ptr, dtb_ptr, slot_ptr, state_ptr, o_ptr,
    r_ptr, nw_ptr, y_ptr, n_units,
    stride_qkv, stride_z, stride_b, stride_r, stride_y,
    stride_cs_s, stride_cs_w,
    stride_s_s, stride_s_h,
    scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, BVF: tl.constexpr, GDC: tl.constexpr = False,
):
    # TAIL_LOOP: persistent grid (G,), G <= n_units = N*H. Program p owns the heads (units) u = p, p+G, ... (unit u =
    # sequence u // H, head u % H) and walks each head's NV state tiles [K, BV] in order; the state load of the next
    # tile (the next unit's first tile after a unit's last) is issued before the current tile's math and store, so
    # each program always has one tile read in flight (one tile of registers more than the per-tile kernel).
    # The head's tail (gated RMSNorm over V, conv shift) runs in the same program: no arrival counter, no second
    # launch. Shapes as _kda_decode_kernel; o [N, H, V] f32 scratch (the head's o tiles, re-read after a barrier).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_k = tl.arange(0, BK).to(tl.int64)
    o_b = tl.arange(0, BV).to(tl.int64)
    o_f = tl.arange(0, BVF).to(tl.int64)
    zk = tl.zeros([BK], dtype=tl.int64)
    zb = tl.zeros([BV], dtype=tl.int64)
    zf = tl.zeros([BVF], dtype=tl.int64)
    s_rows = o_k[:, None] * V                                       # [BK, 1] k-row offsets in a head's state
    gdc_enter(GDC)                                                  # PDL: nothing read before the wait

    # first tile of the first unit (slot <= 0 or no unit: masked, no traffic)
    u_n = pid.to(tl.int64)
    slot_n = tl.load(slot_ptr + u_n // H, mask=u_n < n_units, other=0).to(tl.int64)
    m_n = ((o_k < K) & (zk + slot_n > 0))[:, None] & ((o_b < V) & (zb + slot_n > 0))[None, :]
    S_n = tl.load(state_ptr + (slot_n * stride_s_s + (u_n % H) * stride_s_h) + (s_rows + o_b[None, :]), mask=m_n,
                  other=0.0, eviction_policy="evict_first")
    u = pid.to(tl.int64) - G                                        # this program's unit, int64 (loop-carried)
    for _ in range(pid, n_units, G):
        u += G
        i_n = u // H
        i_h = u % H
        slot = slot_n
        # the next unit's slot, loaded a whole unit before its first tile load needs it
        u_n = u + G
        slot_n = tl.load(slot_ptr + u_n // H, mask=u_n < n_units, other=0).to(tl.int64)

        m_k = (o_k < K) & (zk + slot > 0)
        x_row = qkv_ptr + i_n * stride_qkv
        cs = convs_ptr + slot * stride_cs_s
        c_q = i_h * K + o_k
        c_k = H * K + i_h * K + o_k
        # q's norm (a cross-warp reduction: a barrier ptxas does not hoist loads over) before k's conv loads: half
        # the prologue's loads in flight at once, next to the prefetched tile (Triton 3.6, BV16/w4: 118 -> ? regs)
        q = _conv_silu(x_row, convw_ptr, cs, c_q, m_k, stride_cs_w, W)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = _conv_silu(x_row, convw_ptr, cs, c_k, m_k, stride_cs_w, W)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        zz = tl.load(z_ptr + i_n * stride_z + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        zz += tl.load(dtb_ptr + i_h * K + o_k, mask=m_k, other=0.0)
        sp = tl.where(zz > 20.0, zz, tl.maximum(zz, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(zz))))
        decay = tl.exp(-tl.exp(tl.load(alog_ptr + i_h)) * sp)           # [BK] exp(g), g <= 0
        beta = tl.sigmoid(tl.load(b_ptr + i_n * stride_b + i_h).to(tl.float32))

        s_head = state_ptr + (slot * stride_s_s + i_h * stride_s_h) + s_rows
        o_row = o_ptr + u * V
        h_n = u_n % H
        for iv in range(NV):                                            # not unrolled: ptxas would hoist loads
            S = S_n
            o_v = iv * BV + o_b
            m_v = (o_v < V) & (zb + slot > 0)
            # prefetch: this head's next tile, or after its last the next unit's first (masked: no unit / null slot)
            last = iv + 1 == NV
            p_slot = tl.where(last, slot_n, slot)
            p_ptr = state_ptr + (p_slot * stride_s_s + tl.where(last, h_n, i_h) * stride_s_h) + \
                (s_rows + (tl.where(last, 0, (iv + 1) * BV) + o_b)[None, :])
            m_p = ((o_k < K) & (zk + p_slot > 0))[:, None] & ((o_b < V) & (zb + p_slot > 0))[None, :]
            S_n = tl.load(p_ptr, mask=m_p, other=0.0, eviction_policy="evict_first")
            v = _conv_silu(x_row, convw_ptr, cs, 2 * H * K + i_h * V + o_v, m_v, stride_cs_w, W)
            S = S * decay[:, None]
            d = beta * (v - tl.sum(S * k[:, None], axis=0))             # [BV]
            S = S + k[:, None] * d[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(s_head + o_v[None, :], S, mask=m_k[:, None] & m_v[None, :], eviction_policy="evict_first")
            tl.store(o_row + o_v, o, mask=o_v < V)
        # barrier: every thread's o stores and conv reads of this head precede the norm's reads and the shift
        tl.debug_barrier()
        m_f = o_f < V
        of = tl.load(o_row + o_f, mask=m_f, other=0.0)
        _gated_norm_store(of, r_ptr + i_n * stride_r + i_h * V, nw_ptr, y_ptr + i_n * stride_y + i_h * V, o_f,
                          m_f, eps, V)
        _conv_shift(cs, x_row, c_q, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, c_k, m_k, stride_cs_w, W)
        _conv_shift(cs, x_row, 2 * H * K + i_h * V + o_f, m_f & (zf + slot > 0), stride_cs_w, W)


# ------------------------------------------------------------------------------------------------- launch config
_BV_NARROW = 32               # decode_config: V tile while the grid is small (BV 32 / 4 warps, late state load)
_BV_WIDE = 64                 # ... and once there are >= _WIDE_PER_SM programs per SM at this tile (early load)
_WIDE_PER_SM = 16             # H200 sweep 12-02 (graph us/step, copy BW 4.25 TB/s): N=1 BV32 late 5.97 (BV8 7.49),
                              # N=8 BV32 late 14.15 (BV64 14.53), N=64 BV64 early 82.5 = 76.6% (BV32 late 88.9),
                              # N=256 BV64 early 346 (BV32 late 371)
_WIDE_MAXNREG = 128           # register cap of the wide config (0: none; 128: BV64/w4 fits 4 programs per SM, not 3;
                              # H200 12-03 sweep, N=64: 78.89 us = 80.1% of copy BW vs 81.41 uncapped)
_STORE_AFTER = False          # TAIL_LAST configs write the state after the arrival (DecodeConfig.store_after)
# Early state (module doc), per-tile kernel under PDL: 0 off, 1 slot load + L2 prefetch of the state tile and conv
# state rows before gdc_wait (default), 2 also the state tile into registers before it (needs the caller's
# guarantee in the module doc; A/B on the H200). KIMI_KDA_EARLY_STATE overrides; kda_decode_triton(early_state=).
# default 0 (opt-in). H200 12-03 (bench/ablate.py --set, BENCHMARKS.md ninth round): with the f_b|g_b skinny_bmm_nt
# between the in_proj and this kernel, mode 1 was 21-25 us per step faster at b1 with the (since removed) combine +
# norm in the in_proj's prologue, 1 us without it (the default chain), and 22-37 us slower at b8; mode 2 slower at
# b1 and b8
_EARLY_STATE = int(os.environ.get("KIMI_KDA_EARLY_STATE", "0"))


class DecodeConfig(NamedTuple):
    BV: int            # V tile per program; grid (V/BV, H, N)
    num_warps: int
    tail: int          # TAIL_SINGLE (BV >= V) / TAIL_LAST / TAIL_POST / TAIL_LOOP (persistent `_kda_decode_loop_kernel`)
    early: bool        # issue the state load before the prologue (the loop kernel always prefetches one tile ahead)
    pps: int = 0       # TAIL_LOOP: resident programs per SM the grid is sized for (grid = loop_grid(N * H, ...))
    maxnreg: int = 0   # ptxas register cap (0: none), to fit more programs per SM
    store_after: bool = False  # TAIL_LAST: write the state tile after the arrival atomic, not before its release


# TAIL_LOOP candidate for large grids, (BV, num_warps, programs per SM, maxnreg); the default picker takes it only
# when _LOOP_DEFAULT (set from the H200 sweep in bench/kda.py --sweep). KIMI_KDA_DECODE_LOOP="BV,warps,pps,maxnreg"
# (or "0") overrides both for A/B runs of the whole model. Offline sm_90 registers, Triton 3.6 (3.9), K = V = 128,
# no spills: BV16/w4 118 (96) -> 4 programs per SM; BV32/w4 157 (142) -> 3; BV32/w8 176 (128); with maxnreg 96
# BV16/w4 spills 16 B on 3.6 (0 on 3.9) -> 5 per SM; BV32/w4 at 128: 48 B (16 B) -> 4 per SM.
_LOOP = (16, 4, 4, 0)
_LOOP_DEFAULT = False
_env = os.environ.get("KIMI_KDA_DECODE_LOOP")
if _env:
    _LOOP_DEFAULT = _env != "0"
    if _LOOP_DEFAULT:
        _LOOP = tuple(int(x) for x in _env.split(","))
        _LOOP = _LOOP + (0,) * (4 - len(_LOOP))
        assert len(_LOOP) == 4, _env


def loop_grid(n_units: int, pps: int, n_sm: int) -> int:
    """Programs of the persistent loop kernel: n_units heads over at most pps * n_sm programs, every program taking
    the same number of heads (cdiv) so none finishes a whole head early (N=64, H=32, 132 SMs, pps 4: 512 programs x 4
    heads rather than 528 programs, 16 of them with 3)."""
    per = cdiv(n_units, max(1, pps * n_sm))
    return cdiv(n_units, per)


def warps_for(BV: int, BK: int) -> int:
    # 32 fp32 state elements per thread up to 4 warps, 64 beyond (ptxas 3.6 sm_90a, K = 128: BV 8-32 -> 72-96
    # regs, BV 64 at 4 warps 141); a [128, 128] tile spills heavily at 4 or 8 warps and takes 16 (128 regs)
    if BV * BK >= 16384:
        return 16
    return max(1, min(4, BV * BK // 1024))


def decode_config(N: int, H: int, K: int, V: int, n_sm: int = 132, BV: Optional[int] = None) -> DecodeConfig:
    """Launch config for N sequences (BV given: that tile, the rest derived). Programs = N * H * V/BV. Small grids
    (latency-bound: N * H * V/64 < _WIDE_PER_SM * n_sm) take BV 32 with the state loaded after the prologue (fewer
    live registers); large grids take BV 64 with the state load issued first (more bytes in flight per program).
    Kimi (H = 32, V = 128) on 132 SMs: N <= 32 -> BV 32 / 4 warps late, N >= 33 -> BV 64 / 4 warps early."""
    BK = next_pow2(K)
    VP = next_pow2(V)
    wide = BV is None and N * H * cdiv(V, _BV_WIDE) >= _WIDE_PER_SM * n_sm
    if wide and _LOOP_DEFAULT:
        bv, nw, pps, maxnreg = _LOOP
        return DecodeConfig(min(bv, VP), nw, TAIL_LOOP, True, pps, maxnreg, False)
    if BV is None:
        BV = _BV_WIDE if wide else _BV_NARROW
    BV = min(BV, VP)
    tail = TAIL_SINGLE if BV >= V else TAIL_LAST
    return DecodeConfig(BV, warps_for(BV, BK), tail, wide, 0, _WIDE_MAXNREG if wide else 0,
                        _STORE_AFTER and tail == TAIL_LAST)


def _fg_parts(fg_a, fg_b):
    """(f_a [N, R], g_a [N, R], f_b [HK, R], g_b [HV, R]) from fg_a [2, N, R] (or a pair) and fg_b [2, HK, R] (or a
    pair)."""
    return fg_a[0], fg_a[1], fg_b[0], fg_b[1]


def kda_decode_triton(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state, state_slots,
                      BV: Optional[int] = None, num_warps: Optional[int] = None, tail: Optional[int] = None,
                      early: Optional[bool] = None, o_scratch: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, counters: Optional[torch.Tensor] = None,
                      pps: Optional[int] = None, grid: Optional[int] = None, maxnreg: Optional[int] = None,
                      store_after: Optional[bool] = None, pdl: Optional[bool] = None,
                      fg_a=None, fg_b=None, early_state: Optional[int] = None):
    """Fused KDA decode step (see module doc). Shapes as kernels.kda.kda_decode. Returns [N, H*V] (qkv.dtype),
    written into `out` when given (every element is written, padded lanes get zeros). BV / num_warps / tail / early
    override `decode_config` (tail TAIL_LAST or TAIL_POST when BV < V; TAIL_LOOP: the persistent loop kernel at any
    BV, sized for `pps` programs per SM, or exactly `grid` programs); `maxnreg` caps the registers. `counters` (i32,
    >= N*H, zeroed) replaces the module's shared arrival-counter buffer. pdl: launch with PDL (kernels._pdl; None:
    KIMI_PDL).

    Low-rank gates: z = r = None and fg_a [2, N, R] (f_a | g_a rows, any row / batch strides, unit column stride;
    or a pair of [N, R]) with fg_b [2, HK, R] (f_b | g_b, rows contiguous; or a pair f_b [HK, R], g_b [HV, R]):
    z = f_a f_b^T and r = g_a g_b^T by kernels.gemv.skinny_bmm_nt (fp32 sums rounded to fg_a's dtype) before the
    decode kernel.

    early_state (per-tile kernel; None: _EARLY_STATE under PDL, 0 without): what goes before griddepcontrol.wait
    (module doc, "Early state"). 2 requires that the kernel launched just before this one does not write
    conv_state / rec_state (in the model: the f_b|g_b skinny_bmm_nt); two decode launches on the same pools back to back
    break that. Without PDL it only moves the loads (same results)."""
    N = qkv.shape[0]
    H = b.shape[-1]
    low_rank = fg_a is not None
    assert low_rank == (fg_b is not None) and low_rank == (z is None) and (z is None) == (r is None), \
        "pass z and r, or fg_a and fg_b"
    if low_rank:
        fa, ga, fb, gb = _fg_parts(fg_a, fg_b)
        K, V, Rk = fb.shape[0] // H, gb.shape[0] // H, fb.shape[1]
        assert fa.shape == ga.shape == (N, Rk) and fb.shape == (H * K, Rk) and gb.shape == (H * V, Rk), \
            (fa.shape, ga.shape, fb.shape, gb.shape)
        assert fb.is_contiguous() and gb.is_contiguous() and fa.stride(-1) == 1 and ga.stride(-1) == 1
        assert fa.dtype == ga.dtype and fb.dtype == gb.dtype
    else:
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
    for t in (qkv, b) if low_rank else (qkv, z, b, r):
        assert t.stride(-1) == 1
    if out is None:
        out = torch.empty(N, H * V, dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (N, H * V) and out.stride(1) == 1
    if N == 0:
        return out
    cfg = decode_config(N, H, K, V, num_sms(qkv.device), BV)
    if num_warps is not None:
        cfg = cfg._replace(num_warps=num_warps)
    if early is not None:
        cfg = cfg._replace(early=bool(early))
    if tail == TAIL_LOOP:
        cfg = cfg._replace(tail=tail, pps=cfg.pps or _LOOP[2])
    elif tail is not None and cfg.tail != TAIL_SINGLE:
        assert tail in (TAIL_LAST, TAIL_POST), tail
        cfg = cfg._replace(tail=tail)
    if pps is not None:
        cfg = cfg._replace(pps=pps)
    if maxnreg is not None:
        cfg = cfg._replace(maxnreg=maxnreg)
    if store_after is not None:
        cfg = cfg._replace(store_after=bool(store_after))
    es = (_EARLY_STATE if pdl_on(pdl) else 0) if early_state is None else int(early_state)
    assert es in (0, 1, 2), es
    if low_rank:
        # the batched f_b | g_b matmul (bf16 out), then the plain kernel
        if isinstance(fg_a, torch.Tensor) and isinstance(fg_b, torch.Tensor):
            z, r = skinny_bmm_nt(fg_a, fg_b).unbind(0)
        else:
            z, r = skinny_bmm_nt(fa[None], fb[None])[0], skinny_bmm_nt(ga[None], gb[None])[0]
    z_stride, r_stride = z.stride(0), r.stride(0)
    BK = next_pow2(K)
    NV = cdiv(V, cfg.BV)
    opt = dict(maxnreg=cfg.maxnreg) if cfg.maxnreg else {}
    opt.update(pdl_launch(pdl))
    if cfg.tail == TAIL_LOOP:
        if o_scratch is None:
            o_scratch = torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)
        G = grid or loop_grid(N * H, cfg.pps, num_sms(qkv.device))
        _kda_decode_loop_kernel[(min(G, N * H),)](
            qkv, conv_w, conv_state, z, b, A_log, dt_bias, state_slots, rec_state, o_scratch, r, o_norm_w, out, N * H,
            qkv.stride(0), z_stride, b.stride(0), r_stride, out.stride(0),
            conv_state.stride(0), conv_state.stride(1),
            rec_state.stride(0), rec_state.stride(1),
            K ** -0.5, eps,
            H=H, K=K, V=V, W=W, BK=BK, BV=cfg.BV, NV=NV, BVF=next_pow2(V), num_warps=cfg.num_warps,
            **opt,
        )
        return out
    if cfg.tail != TAIL_SINGLE and o_scratch is None:
        o_scratch = torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)
    if cfg.tail == TAIL_LAST:
        if counters is None:
            counters = arrival_counters(qkv.device, N * H)
        assert counters.dtype == torch.int32 and counters.numel() >= N * H
    _kda_decode_kernel[(NV, H, N)](
        qkv, conv_w, conv_state, z, b, A_log, dt_bias, state_slots, rec_state,
        o_scratch if cfg.tail != TAIL_SINGLE else out, counters if cfg.tail == TAIL_LAST else state_slots,
        r, o_norm_w, out,
        qkv.stride(0), z_stride, b.stride(0), r_stride, out.stride(0),
        conv_state.stride(0), conv_state.stride(1),
        rec_state.stride(0), rec_state.stride(1),
        K ** -0.5, eps,
        H=H, K=K, V=V, W=W, BK=BK, BV=cfg.BV, NV=NV, BVF=next_pow2(V), TAIL=cfg.tail,
        EARLY=cfg.early, STORE_AFTER=cfg.store_after, EARLY_STATE=es, num_warps=cfg.num_warps, **opt,
    )
    if cfg.tail == TAIL_POST:
        _kda_decode_post_kernel[(H, N)](
            o_scratch, r, o_norm_w, out, qkv, conv_state, state_slots,
            r_stride, out.stride(0), qkv.stride(0), conv_state.stride(0), conv_state.stride(1),
            eps,
            H=H, K=K, V=V, W=W, BK=BK, BVF=next_pow2(V), num_warps=4, **pdl_launch(pdl),
        )
    return out
