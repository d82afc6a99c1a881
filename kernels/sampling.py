"""Filtered exponential race without sorting the vocabulary: the fast path of backend/engine/sampler.py `sample()`.

filtered_race(logits, ...) == race_argmax(softmax(apply_filters(logits / T)), seeds, steps) token for token, in ONE
launch, one program per row (greedy rows skip all work; sample() takes their argmax). Per row, x = logits / T (IEEE
division, as torch):
  1. m = max(x) (the max of the raw row, divided once: rounding is monotone).
  2. min-p cut = m + log(min_p) (fp32, as the reference), and a lower bound pre >= cut on the final threshold:
     top-p: m + log((1 - top_p) / V) - 1 (the tokens below hold too little mass to be kept), top-k (k <= KS): the
     k-th largest of KS group maxima from pass 1. One pass compacts {x >= pre, x > -inf} (x, token id, in token
     order) into a per-row workspace G of GCAP entries, and sums exp(x - m) over G and over {x >= cut}. When G
     overflows, or top-k's set is not inside G, the later passes re-read the row instead of G ("full mode": flat
     rows, top-k > KS without min-p / top-p).
  3. top-k and top-p are thresholds on x: with x_1 > x_2 > ... the kept tokens, top-k keeps x >= x_k and top-p
     (keep v iff the mass of strictly better tokens < top_p * S) keeps x >= tau, tau the LARGEST value b with
     f(b) = mass(x >= b) >= top_p * S (count(x >= b) >= k for top-k). Both are found by one search: a bracket
     [lo, hi) of order-preserving int32 keys with f(lo) >= target > f(hi), split NT ways per pass (NT counts, and NT
     masses for top-p, per element), until at most RCAP candidates lie in it; those are gathered, sorted in
     registers (tl.sort) and the threshold read off (a cumulative sum for top-p). top-k runs first (its set is
     the one top-p's S is taken over), then top-p over the survivors.
  4. The race over the kept candidates {x >= tau}: argmax of exp(x - m) / E with E from sampler.py's hash of
     (seed, step, token) and the same series / log formula, IEEE division; the smallest token id wins exact ties
     (as torch.argmax). Normalising by the sum does not change the argmax, so it is skipped.

Exactness. The kept set equals the reference's except (a) exact ties AT a threshold: tokens with the same value as the
k-th best are all kept (the reference keeps exactly k, in sort order), the same for top-p (equal values are kept or
dropped together) and for -0.0 vs +0.0 at a top-k / top-p threshold; (b) top-p boundaries within float rounding:
the reference compares a fp32 cumsum of normalised probabilities with top_p, this kernel fp32 sums of exp(x - m)
with top_p * S, so a token whose better-mass is within ~1e-6 (relative) of top_p may be decided differently;
top_p = 1 is "off" here (the reference can drop tail tokens whose cumsum rounds to >= 1, mass < ~1e-6).
min-p compares exactly as the reference (same m, same fp32 add) up to the log: libdevice's logf where available
(= CUDA's), tl.log otherwise. The winner can differ only where the two largest race keys are within float
rounding (~1e-6 relative; exp is tl.exp here, the reference's expf and normalisation round differently): the same
caveat as the fused race kernel against its reference. Rows whose logits are all -inf return token 0 (the CPU
reference's argmax of a NaN row).

Cost per row: 2 passes over the row (max; compaction), then passes over G only (typically 0-2 search passes of
<= GCAP entries, a gather, the race on the kept entries); full mode: each of those passes re-reads the row.
One program per row (M = 1 uses one SM). No host sync; workspace reused across calls.
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._tensors import cdiv, next_pow2, workspace

# NUCLEUS (default on; KIMI_SAMPLER_NUCLEUS=0: off): the nucleus check (three (row, block) launches, see _nuc_accept)
# settles most rows before the row kernel, which then runs only the rest. Why: one program per row takes 266 us for one
# flat Kimi row on the H200 (BENCHMARKS.md, sixth round: M = 1, logit scale 1), as the whole row's passes run on one SM,
# and one slow row sets the launch's time. H100 A/B (twenty-seventh round, bench/e2e.py, 16 layers, T0.6 top-p 0.95
# min-p 0.01): sampled b1 476 -> 547 tok/s, b64 6,235 -> 7,094 tok/s, greedy rows unchanged. Top-k rows (twenty-eighth
# round, H100, bench/sampling.py): LocalAI's generic T0.9 top-k 40 top-p 0.95 at M = 1 / 8 / 64 38.9 / 54.9 / 196.6 us
# against 230.6 / 232.4 / 270.3 for the row kernel alone (flat logits); end to end (twenty-ninth round, H100, 16
# layers) the generic rows b1 501 -> 526 tok/s, b64 5,672 -> 7,225, the min-p rows b1 482 -> 555, b64 6,365 -> 7,250.
NUCLEUS = os.environ.get("KIMI_SAMPLER_NUCLEUS", "1") == "1"
# rows without min-p / top-k take the kernel path (backend/engine/sampler.py _fast_ok) with the check on when top_p is
# at least this: a row left to the row kernel's full mode (ms on a flat row) has a chance of ~(1 - top_p)^4 <= 0.2%
NUC_TOPP_MIN = 0.8
GCAP = 16384      # candidates kept in the workspace per row (64 rows: 8 MB)
RCAP = 1024       # bracket size resolved in registers (sorted)
NT = 16           # thresholds per search pass: the key bracket shrinks 16x per pass
BLOCK = 2048      # tile of the row passes
SB = 256          # tile of the search passes ([SB, NT] compares)
RB = 1024         # tile of the race
KS = 256          # top-k <= KS: a lower bound on the k-th value from KS group maxima of the row (pass 1)


# The exponential race of backend/engine/sampler.py (its torch reference: exponential_noise / _exp1_from_bits):
# E ~ Exp(1) for token v of a row from the counter hash of (seed, step, v); series near 0, log only where E >= log 2
SERIES_MAX = 0.5
SERIES_TERMS = 22


@triton.jit
def _race_row_key(seed, step):
    """The row's hash key from its seed (i64) and output step (i64), as sampler.exponential_noise."""
    hk = _mix32_tl((step & 0xFFFFFFFF).to(tl.uint32))
    hk = _mix32_tl(hk ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    return _mix32_tl(hk ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _race_exp1(hk, idx, SERIES_TERMS: tl.constexpr, SERIES_MAX: tl.constexpr):
    """E for token ids idx of the row with key hk (sampler._exp1_from_bits: the same formula, fp32)."""
    bits = _mix32_tl(_mix32_tl(hk ^ idx.to(tl.uint32)) ^ tl.full((1,), 0x2545F491, tl.uint32))
    w = (bits.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    s = tl.full(w.shape, 1.0 / SERIES_TERMS, tl.float32)
    for j in tl.static_range(SERIES_TERMS - 1, 0, -1):
        s = s * w + 1.0 / j
    return tl.where(w < SERIES_MAX, w * s, -tl.log(tl.maximum(1.0 - w, 2.3283064365386963e-10)))


@triton.jit
def _row_topk(topk_ptr, row, V):
    """The row's k (int32), capped at V (top_k >= V: off)."""
    return tl.minimum(tl.load(topk_ptr + row), V).to(tl.int32)


@triton.jit
def _mix32_tl(x):
    # the steps of _mix32 on uint32: products wrap, i.e. the "& 0xFFFFFFFF" of the torch version
    x = x ^ (x >> 16)
    x = x * tl.full((1,), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((1,), 0x1B873593, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(p_ptr, stride_p, seeds_ptr, steps_ptr, vals_ptr, idx_ptr, V, NB, BLOCK: tl.constexpr,
                 SERIES_TERMS: tl.constexpr, SERIES_MAX: tl.constexpr):
    """Program (row, block): the best p / E of BLOCK tokens, with E recomputed from (seed, step, token)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m_v = offs < V
    p = tl.load(p_ptr + row * stride_p + offs, mask=m_v, other=0.0)
    hk = _race_row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    q = tl.where(m_v, tl.math.div_rn(p, _race_exp1(hk, offs, SERIES_TERMS, SERIES_MAX)), -1.0)
    best = tl.argmax(q, axis=0)
    tl.store(vals_ptr + row * NB + blk, tl.max(q, axis=0))
    tl.store(idx_ptr + row * NB + blk, (blk * BLOCK + best).to(tl.int64))


def _workspace(M: int, device: torch.device):
    """(G values [M, GCAP] f32, G token ids [M, GCAP] i32, R [M, RCAP] f32), grown on demand, reused across calls.
    Rows grow in powers of two: the outgrown workspaces stay alive (kernels._tensors.workspace), and at ~135 KB per
    row, batches growing one row at a time would otherwise keep every size."""
    rows = next_pow2(max(M, 8))
    return workspace("sampling", device, lambda ws: ws[0].shape[0] >= M,
                     lambda _: (torch.empty(rows, GCAP, dtype=torch.float32, device=device),
                                torch.empty(rows, GCAP, dtype=torch.int32, device=device),
                                torch.empty(rows, RCAP, dtype=torch.float32, device=device)))


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    # CUDA's logf (what torch.log computes) for the min-p cut; tl.log is an approximation on the GPU. The
    # interpreter has no libdevice (there tl.log is numpy's float32 log)
    if LIBDEVICE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _okey(x):
    # fp32 -> int32 with the same order (NaN aside; -0.0 sorts just below +0.0): flip the magnitude of negatives
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _okey_inv(k):
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _src_tile(xrow, g_row, gi_row, start, n, t, cut, compact, TILE: tl.constexpr):
    """Candidates start..start+TILE of a row: from G (compact) or re-read from the logits -> (x, token id, valid)."""
    offs = start + tl.arange(0, TILE)
    inb = offs < n
    if compact:
        x = tl.load(g_row + offs, mask=inb, other=float("-inf"))
        idx = tl.load(gi_row + offs, mask=inb, other=0)
        ok = inb
    else:
        x = tl.math.div_rn(tl.load(xrow + offs, mask=inb, other=float("-inf")), t)
        idx = offs
        ok = inb & (x >= cut) & (x > float("-inf"))
    return x, idx, ok


@triton.jit
def _mass_above(xrow, g_row, gi_row, n, t, cut, m, compact, base, TILE: tl.constexpr):
    """(count, mass exp(x - m)) of the candidates with key >= base."""
    cnt = tl.zeros([TILE], tl.int32)
    ms = tl.zeros([TILE], tl.float32)
    for s in range(0, n, TILE):
        x, idx, ok = _src_tile(xrow, g_row, gi_row, s, n, t, cut, compact, TILE)
        ge = ok & (_okey(x) >= base)
        cnt += ge.to(tl.int32)
        ms += tl.where(ge, tl.exp(x - m), 0.0)
    return tl.sum(cnt, axis=0), tl.sum(ms, axis=0)


@triton.jit
def _select(xrow, g_row, gi_row, r_row, n, t, cut, m, compact, lo, hi, c_lo, c_hi, a_hi, target,
            MASS: tl.constexpr, SB: tl.constexpr, NT: tl.constexpr, RCAP: tl.constexpr):
    """The largest candidate value b with f(b) >= target, f = count(key >= b) (or mass with MASS), as an int32 key.
    Invariant: f(lo) >= target > f(hi); c_lo / c_hi: counts at lo / hi, a_hi: mass at hi."""
    j_ar = tl.arange(0, NT)
    it = tl.full([], 0, tl.int32)
    while (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi > RCAP):   # int64: keys of -x and x are ~2^31 apart
        # NT thresholds lo = th[0] <= ... < hi, nondecreasing: even passes evenly spaced in value (few passes on
        # smooth rows; keys are log-like, most of key space is tiny values), odd passes in key space (>= 16x
        # fewer keys per pass: bounded, ~8 odd passes at most, also where values collapse to a few ulps)
        th_key = (lo.to(tl.int64) + ((hi.to(tl.int64) - lo) * j_ar) // NT).to(tl.int32)
        lo_v = _okey_inv(lo)
        th_val = _okey(lo_v + (_okey_inv(hi) - lo_v) * (j_ar.to(tl.float32) / NT))
        th_val = tl.minimum(tl.maximum(th_val, lo), hi - 1)
        th = tl.where((it % 2 == 1) | (j_ar == 0), th_key, th_val)
        it += 1
        cnt = tl.zeros([NT], tl.int32)
        ms = tl.zeros([NT], tl.float32)
        for s in range(0, n, SB):
            x, idx, ok = _src_tile(xrow, g_row, gi_row, s, n, t, cut, compact, SB)
            ge = ok[:, None] & (_okey(x)[:, None] >= th[None, :])   # [SB, NT]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            if MASS:
                ms += tl.sum(tl.where(ge, tl.exp(x - m)[:, None], 0.0), axis=0)
        if MASS:
            good = ms >= target
        else:
            good = cnt >= target
        j = tl.max(tl.where(good | (j_ar == 0), j_ar, 0), axis=0)   # th[0] = lo holds by the invariant
        sel = j_ar == j
        nxt = j_ar == j + 1
        last = j == NT - 1
        new_lo = tl.sum(tl.where(sel, th, 0), axis=0)
        hi = tl.where(last, hi, tl.sum(tl.where(nxt, th, 0), axis=0))
        c_lo = tl.sum(tl.where(sel, cnt, 0), axis=0)
        c_hi = tl.where(last, c_hi, tl.sum(tl.where(nxt, cnt, 0), axis=0))
        a_hi = tl.where(last, a_hi, tl.sum(tl.where(nxt, ms, 0.0), axis=0))
        lo = new_lo
    nb = c_lo - c_hi
    tau = lo
    if nb <= RCAP:
        # gather the bracket [lo, hi) (nb values) and read the threshold off the sorted values
        r_ar = tl.arange(0, RCAP)
        pos0 = tl.full([], 0, tl.int32)
        for s in range(0, n, SB):
            x, idx, ok = _src_tile(xrow, g_row, gi_row, s, n, t, cut, compact, SB)
            kx = _okey(x)
            inb = ok & (kx >= lo) & (kx < hi)
            pos = pos0 + tl.cumsum(inb.to(tl.int32), axis=0) - 1
            tl.store(r_row + pos, x, mask=inb & (pos < RCAP))
            pos0 += tl.sum(inb.to(tl.int32), axis=0)
        tl.debug_barrier()   # the stores above were made by other threads of this program
        r = tl.load(r_row + r_ar, mask=r_ar < nb, other=float("-inf"))
        srt = tl.sort(r, descending=True)                                     # [RCAP], bracket values first
        if MASS:
            acc = a_hi + tl.cumsum(tl.where(r_ar < nb, tl.exp(srt - m), 0.0), axis=0)   # mass(x >= srt[i])
            at = tl.min(tl.where((acc >= target) & (r_ar < nb), r_ar, nb - 1), axis=0)
        else:
            at = target - c_hi - 1                                            # the k-th best overall
        tau = _okey(tl.sum(tl.where(r_ar == at, srt, 0.0), axis=0))
    return tau


# --- the nucleus check (NUCLEUS): three launches of (row, block) programs before the row kernel, so that a row's
# passes over the vocabulary run on NB blocks instead of one program. The race winner over the final kept set K is the
# best race key q = exp(x - m) / E among K, and K lies inside the min-p survivors {x >= cut}. So walk the survivors'
# NUC_R best keys c_0, c_1, ... (q descending, token ascending on equal q: the row kernel's first max): the first c_i
# that is kept is the answer, because every token with a better key is an earlier c_j, all dropped. c is kept iff
# mass(x > x_c) < top_p S (S the survivors' mass; the row kernel's rule, ties kept together) and count(x > x_c) < top_k.
# With top-k the candidates come from the survivors with x >= x_k, a lower bound on the k-th largest value (the k-th
# largest of the blocks' NUC_T largest, _nuc_kth_kernel): the kept set lies inside them, so the walk stays exact and meets
# top-k members first. top-p's S is then the top-k set's mass S_k: mass(x >= x_k) bounds it from above, and equals it
# when x_k is exact (no block holds more than NUC_T values >= x_k: nearly always for k << NB NUC_T); otherwise a
# candidate inside top-k bounds it from below (_nuc_topk_mass).
# The row kernel is left only the rows where all NUC_R are dropped (a row's chance is about (1 - top_p)^NUC_R), where
# the walk meets a c_i within NUC_MARGIN of the top-p boundary (the kernels sum the masses in different orders) or
# between the bounds of an inexact S_k.
# Partials, per row and block (NBP columns each): [max raw | S | n | q x R | token x R | A x R | C x R | e x R |
# v x T | S_k | exact], fp32 / int32 bits; q / token: the block's R best keys (-1: none), A / C: mass / count of the
# survivors better than each c_i, e: exp(x_c - m) of each c_i (column 0 only, written by block 0); with top-k: v, the
# block's T largest raw logits, S_k: the mass of its survivors with x >= x_k, x (column 0, 1): exact (x_k is the k-th
# largest value itself, so the sum of S_k is top-p's S) and v_k (_nuc_kth_kernel).
NUC_BLOCK = 2048
NUC_R_N = 4
NUC_R = tl.constexpr(NUC_R_N)
NUC_MARGIN_F = 1e-4
# kept only if A < top_p S (1 - NUC_MARGIN), dropped only if A >= top_p S (1 + NUC_MARGIN): fp32 sums of <= V terms,
# in either order, differ by far less (~log2(V) ulps per tree, ~V / BLOCK ulps across tiles)
NUC_MARGIN = tl.constexpr(NUC_MARGIN_F)
NUC_T_N = 8       # top-k rows: each block's NUC_T largest logits (the k-th largest of the row from them, k <= NB NUC_T)
NUC_T = tl.constexpr(NUC_T_N)
NUC_PARTS_N = 5 + 5 * NUC_R_N + NUC_T_N
NUC_PARTS = tl.constexpr(NUC_PARTS_N)
NUC_ROWS = {"q": 3, "id": 3 + NUC_R_N, "a": 3 + 2 * NUC_R_N, "c": 3 + 3 * NUC_R_N, "e": 3 + 4 * NUC_R_N,
            "v": 3 + 5 * NUC_R_N, "sk": 3 + 5 * NUC_R_N + NUC_T_N, "x": 4 + 5 * NUC_R_N + NUC_T_N}   # first rows
NUC_Q, NUC_ID, NUC_A, NUC_C, NUC_E, NUC_V, NUC_SK, NUC_X = (
    tl.constexpr(NUC_ROWS[k]) for k in ("q", "id", "a", "c", "e", "v", "sk", "x"))


@triton.jit
def _nuc_bases(nuc_ptr, rowl, NBP: tl.constexpr):
    """One row's partials: (fp32 base, the same as int32)."""
    base = nuc_ptr + rowl * NUC_PARTS * NBP
    return base, base.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def _nuc_rows(ptr, FIRST: tl.constexpr, NB, NBP: tl.constexpr, R: tl.constexpr, other):
    """Partial rows FIRST .. FIRST + R - 1 of one row ([R, NBP], ``other`` past the NB blocks; ptr: _nuc_bases)."""
    r = tl.arange(0, R)
    j = tl.arange(0, NBP)
    return tl.load(ptr + FIRST * NBP + r[:, None] * NBP + j[None, :], mask=(j < NB)[None, :] & (r >= 0)[:, None],
                   other=other)


@triton.jit
def _nuc_candidates(nuc_ptr, rowl, NB, NBP: tl.constexpr, R: tl.constexpr):
    """The row's R best race keys over its blocks' partials -> (q [R], token [R]): q descending, the smaller token
    first on equal q (q < 0: no such survivor). Each block's R best hold the row's R best."""
    r = tl.arange(0, R)
    base, ib = _nuc_bases(nuc_ptr, rowl, NBP)
    o = r[:, None] * NBP + tl.arange(0, NBP)[None, :]                   # [R, NBP] position of each entry
    q = _nuc_rows(base, NUC_Q, NB, NBP, R, -2.0)
    tok = _nuc_rows(ib, NUC_ID, NB, NBP, R, 2147483647)
    cq = tl.full([R], -1.0, tl.float32)
    ct = tl.zeros([R], tl.int32)
    for i in tl.static_range(R):
        qm = tl.max(tl.max(q, axis=1), axis=0)
        tm = tl.min(tl.min(tl.where(q == qm, tok, 2147483647), axis=1), axis=0)
        pos = tl.min(tl.min(tl.where((q == qm) & (tok == tm), o, R * NBP), axis=1), axis=0)
        cq = tl.where(r == i, qm, cq)
        ct = tl.where(r == i, tm, ct)
        q = tl.where(o == pos, -3.0, q)                                 # taken (by position: ids may repeat)
    return cq, ct


@triton.jit
def _nuc_kth_kernel(nuc_ptr, NB, NBP: tl.constexpr, V, greedy_ptr, topk_ptr, HAS_GREEDY: tl.constexpr):
    """Top-k rows, between phases 0 and 1, one program per row: from the blocks' NUC_T largest raw logits, v_k = the
    k-th largest of them, a lower bound on the row's k-th largest logit (k of its tokens are >= it); exact when no
    block's NUC_T-th value reaches it (every block's values >= v_k are all in its list), so v_k is the k-th largest
    itself. -inf (and not exact) when k > NB NUC_T or fewer than k values are finite. Stored in row NUC_X: column 0
    exact (int32), column 1 v_k. (One program per row: each of the row's block programs sorting the lists was ~200 us
    slower per M = 64 call on an H100.)"""
    row = tl.program_id(0)
    if HAS_GREEDY:
        if tl.load(greedy_ptr + row) != 0:
            return
    base, ib = _nuc_bases(nuc_ptr, row.to(tl.int64), NBP)
    kk = _row_topk(topk_ptr, row, V)
    vk = tl.full([], float("-inf"), tl.float32)
    exact = vk > 0.0                     # False (vk is -inf)
    if kk <= NB * NUC_T:
        v = tl.reshape(_nuc_rows(base, NUC_V, NB, NBP, NUC_T, float("-inf")), [NUC_T * NBP])
        srt = tl.sort(v, descending=True)
        vk = tl.sum(tl.where(tl.arange(0, NUC_T * NBP) == kk - 1, srt, 0.0), axis=0)
        last = _nuc_rows(base, NUC_V + NUC_T - 1, NB, NBP, 1, float("-inf"))          # each block's NUC_T-th
        exact = (tl.max(last) < vk) & (vk > float("-inf"))
    tl.store(ib + NUC_X * NBP, exact.to(tl.int32))
    tl.store(base + NUC_X * NBP + 1, vk)


@triton.jit
def _nuc_block_kernel(x_ptr, stride_x, V, t_ptr, greedy_ptr, minp_ptr, seeds_ptr, steps_ptr, nuc_ptr, NB,
                      NBP: tl.constexpr, PHASE: tl.constexpr, HAS_GREEDY: tl.constexpr, HAS_MINP: tl.constexpr,
                      HAS_TOPK: tl.constexpr, BLOCK: tl.constexpr, SERIES_TERMS: tl.constexpr,
                      SERIES_MAX: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The nucleus check's launches, program (row, block); greedy rows do nothing. PHASE 0: the block's max of the
    raw logits (top-k: and its NUC_T largest). PHASE 1: over the block's min-p survivors (x = raw / t >= cut, m and
    cut as the row kernel forms them), S = sum exp(x - m), their count, and the race: the NUC_R best keys
    exp(x - m) / E and their tokens (the first of equal keys first; -1 when the block has no more survivors; top-k:
    among the survivors with x >= x_k only, and their mass S_k). PHASE 2: for each of the row's NUC_R best
    keys c_i, the mass and count of the block's survivors strictly better than x_c (block 0: also exp(x_c - m))."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    if HAS_GREEDY:
        if tl.load(greedy_ptr + row) != 0:
            return
    rowl = row.to(tl.int64)
    base, ibase = _nuc_bases(nuc_ptr, rowl, NBP)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    raw = tl.load(x_ptr + rowl * stride_x + offs, mask=offs < V, other=float("-inf"))
    if PHASE == 0:
        tl.store(base + blk, tl.max(raw, axis=0))
        if HAS_TOPK:                            # the block's NUC_T largest raw logits, descending
            ar = tl.arange(0, BLOCK)
            for i in tl.static_range(NUC_T):        # one reduction per round: the max and (one of) its positions
                vm, im = tl.max(raw, axis=0, return_indices=True, return_indices_tie_break_left=True)
                tl.store(base + (NUC_V + i) * NBP + blk, vm)
                raw = tl.where(ar == im, float("-inf"), raw)
        return
    t = tl.load(t_ptr + row)
    m = tl.math.div_rn(tl.max(_nuc_rows(base, 0, NB, NBP, 1, float("-inf"))), t)
    cut = tl.full([], float("-inf"), tl.float32)
    if HAS_MINP:
        cut = m + _log(tl.load(minp_ptr + row), LIBDEVICE)
    x = tl.math.div_rn(raw, t)
    ok = (offs < V) & (x >= cut) & (x > float("-inf"))
    e = tl.exp(x - m)
    if PHASE == 1:
        tl.store(base + NBP + blk, tl.sum(tl.where(ok, e, 0.0), axis=0))
        tl.store(ibase + 2 * NBP + blk, tl.sum(ok.to(tl.int32), axis=0))
        if HAS_TOPK:   # the candidates' pool: survivors with x >= x_k (<= the k-th largest value), and its mass
            ok = ok & (x >= tl.math.div_rn(tl.load(base + NUC_X * NBP + 1), t))   # x_k = v_k / t (_nuc_kth_kernel)
            tl.store(base + NUC_SK * NBP + blk, tl.sum(tl.where(ok, e, 0.0), axis=0))
        q = tl.full([BLOCK], -1.0, tl.float32)
        if tl.max(ok.to(tl.int32), axis=0) > 0:
            hk = _race_row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
            q = tl.where(ok, tl.math.div_rn(e, _race_exp1(hk, offs, SERIES_TERMS, SERIES_MAX)), -1.0)
        ar = tl.arange(0, BLOCK)
        for i in tl.static_range(NUC_R):        # the block's NUC_R best keys, first max first (-1: none left)
            bi = tl.argmax(q, axis=0)
            tl.store(base + (NUC_Q + i) * NBP + blk, tl.max(q, axis=0))
            tl.store(ibase + (NUC_ID + i) * NBP + blk, blk * BLOCK + bi)
            q = tl.where(ar == bi, -3.0, q)
    else:
        cq, ct = _nuc_candidates(nuc_ptr, rowl, NB, NBP, NUC_R)
        xc = tl.math.div_rn(tl.load(x_ptr + rowl * stride_x + tl.where(cq >= 0.0, ct, 0)), t)   # [R]
        above = ok[:, None] & (x[:, None] > xc[None, :])                                       # [BLOCK, R]
        r = tl.arange(0, NUC_R)
        tl.store(base + (NUC_A + r) * NBP + blk, tl.sum(tl.where(above, e[:, None], 0.0), axis=0))
        tl.store(ibase + (NUC_C + r) * NBP + blk, tl.sum(above.to(tl.int32), axis=0))
        if blk == 0:
            tl.store(base + (NUC_E + r) * NBP, tl.exp(xc - m))


@triton.jit
def _nuc_topk_mass(base, NBP: tl.constexpr, cq, c_above, a_above, kk):
    """A lower bound on S_k, the mass of the top-k set that top-p acts on when top-k drops survivors: a candidate c
    with count(x > x_c) < k is in the top-k set with every better token, so S_k >= A_c + exp(x_c - m); the largest
    such sum (0 if no candidate is inside top-k)."""
    e = tl.load(base + (NUC_E + tl.arange(0, NUC_R)) * NBP)                                    # [R] exp(x_c - m)
    return tl.max(tl.where((cq >= 0.0) & (c_above < kk), a_above + e, 0.0), axis=0)


@triton.jit
def _nuc_accept(nuc_ptr, rowl, NB, NBP: tl.constexpr, V, topk_ptr, topp_ptr, row, HAS_TOPK: tl.constexpr,
                HAS_TOPP: tl.constexpr):
    """The row kernel's nucleus check -> (settled, token): the walk over the NUC_R best keys c_i (see above) stops at
    the first c_i not clearly dropped; the row is settled if that c_i is clearly kept (inside top-k: count above < k;
    inside top-p: mass above < top_p S, by the margin; with top-k, S is the top-k set's mass S_k, exact or bounded:
    see the section's comment)."""
    r = tl.arange(0, NUC_R)
    base, ib = _nuc_bases(nuc_ptr, rowl, NBP)
    cq, ct = _nuc_candidates(nuc_ptr, rowl, NB, NBP, NUC_R)
    n_all = tl.sum(_nuc_rows(ib, 2, NB, NBP, 1, 0))
    c_above = tl.sum(_nuc_rows(ib, NUC_C, NB, NBP, NUC_R, 0), axis=1)                    # [R]
    kept = cq >= 0.0
    dropped = r < 0
    kk = n_all
    if HAS_TOPK:
        kk = _row_topk(topk_ptr, row, V)
        kept = kept & (c_above < kk)
        dropped = dropped | (c_above >= kk)
    if HAS_TOPP:
        p = tl.load(topp_ptr + row)
        if p < 1.0:
            s_all = tl.sum(_nuc_rows(base, 1, NB, NBP, 1, 0.0))
            a_above = tl.sum(_nuc_rows(base, NUC_A, NB, NBP, NUC_R, 0.0), axis=1)          # [R]
            s_lo = s_all                 # the mass top-p acts on (the survivors', or the top-k set's) lies in
            s_hi = s_all                 # [s_lo, s_hi]
            if HAS_TOPK:
                s_hi = tl.sum(_nuc_rows(base, NUC_SK, NB, NBP, 1, 0.0))                      # mass(x >= x_k)
                if tl.load(ib + NUC_X * NBP) != 0:
                    s_lo = s_hi
                elif kk < n_all:
                    s_lo = _nuc_topk_mass(base, NBP, cq, c_above, a_above, kk)
            kept = kept & (a_above < p * s_lo * (1.0 - NUC_MARGIN))
            dropped = dropped | (a_above >= p * s_hi * (1.0 + NUC_MARGIN))
    dropped = dropped & (cq >= 0.0)
    first = tl.min(tl.where(dropped, NUC_R, r), axis=0)                                    # NUC_R: all dropped
    acc = tl.sum(tl.where((r == first) & kept, 1, 0), axis=0) > 0
    return acc, tl.sum(tl.where(r == first, ct, 0), axis=0)


@triton.jit
def _filtered_race_kernel(x_ptr, stride_x, V, t_ptr, greedy_ptr, minp_ptr, topk_ptr, topp_ptr, seeds_ptr, steps_ptr,
                          g_ptr, gi_ptr, r_ptr, out_ptr, stride_g, stride_r, GCAP,
                          HAS_GREEDY: tl.constexpr, HAS_MINP: tl.constexpr, HAS_TOPK: tl.constexpr,
                          HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr,
                          NT: tl.constexpr, RCAP: tl.constexpr, SERIES_TERMS: tl.constexpr,
                          SERIES_MAX: tl.constexpr, LIBDEVICE: tl.constexpr, KS: tl.constexpr,
                          nuc_ptr=None, NB=0, NBP: tl.constexpr = 1, NUC: tl.constexpr = 0):
    """Program = one row of logits [M, V] -> out[row] (the race winner; 0 for greedy rows, which sample() replaces).
    NUC: the nucleus check first (_nuc_accept, the partials of the three launches before); a row it settles only
    stores that winner."""
    row = tl.program_id(0)
    rowl = row.to(tl.int64)
    xrow = x_ptr + rowl * stride_x
    g_row = g_ptr + rowl * stride_g
    gi_row = gi_ptr + rowl * stride_g
    r_row = r_ptr + rowl * stride_r
    nv = V
    if HAS_GREEDY:
        nv = tl.where(tl.load(greedy_ptr + row) != 0, 0, V)   # greedy rows: empty, every loop runs 0 times
    settled = False
    if NUC:
        if nv > 0:
            acc, w = _nuc_accept(nuc_ptr, rowl, NB, NBP, V, topk_ptr, topp_ptr, row, HAS_TOPK, HAS_TOPP)
            if acc:
                tl.store(out_ptr + row, w.to(tl.int64))
                settled = True
                nv = 0                                  # every loop below runs 0 times
    t = tl.load(t_ptr + row)
    ar = tl.arange(0, BLOCK)

    # 1. the row max (of the raw logits; t > 0 and IEEE division are monotone)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(0, nv, BLOCK):
        mx = tl.maximum(mx, tl.load(xrow + s + ar, mask=s + ar < nv, other=float("-inf")))
    m = tl.math.div_rn(tl.max(mx, axis=0), t)
    cut = tl.full([], float("-inf"), tl.float32)
    if HAS_MINP:
        cut = m + _log(tl.load(minp_ptr + row), LIBDEVICE)   # min_p = 0: -inf, nothing cut
    # lower bounds on the final threshold, so that G holds few candidates even without min-p (pre >= cut):
    #   top-p: the tokens below b = m + log((1 - top_p) / V) - 1 hold mass < (1 - top_p) S / e (S >= 1, the kept
    #   set's sum of exp(x - m)), so their better-mass is > top_p S: never kept (the factor e: rounding slack);
    #   top-k (k <= KS): the k-th largest of KS disjoint group maxima of the row is <= the k-th largest value.
    pre = cut
    kk = V
    if HAS_TOPK:
        kk = _row_topk(topk_ptr, row, V)
        if kk <= KS:
            gmax = tl.max(tl.reshape(mx, [KS, BLOCK // KS]), axis=1)                  # [KS] distinct elements
            srt = tl.sort(gmax, descending=True)
            vk = tl.sum(tl.where(tl.arange(0, KS) == kk - 1, srt, 0.0), axis=0)
            pre = tl.maximum(pre, tl.math.div_rn(vk, t))
    p = tl.full([], 1.0, tl.float32)
    if HAS_TOPP:
        p = tl.load(topp_ptr + row)
        if p < 1.0:
            pre = tl.maximum(pre, m + tl.log((1.0 - p) / V) - 1.0)

    # 2. compact the candidates {x >= pre, x > -inf} (token order) into G: their count, mass, smallest value; the
    # same for the min-p survivors {x >= cut} (the set top-k / top-p act on)
    zero_i = tl.full([], 0, tl.int32)
    zero_f = tl.full([], 0.0, tl.float32)
    n_g = zero_i
    n_all = zero_i
    s_g = tl.zeros([BLOCK], tl.float32)
    s_all = tl.zeros([BLOCK], tl.float32)
    xmin_g = tl.full([BLOCK], float("inf"), tl.float32)
    xmin_all = tl.full([BLOCK], float("inf"), tl.float32)
    for s in range(0, nv, BLOCK):
        offs = s + ar
        raw = tl.load(xrow + offs, mask=offs < nv, other=float("-inf"))
        if tl.math.div_rn(tl.max(raw, axis=0), t) >= cut:   # = max(x) of the tile: skip tiles without a survivor
            x = tl.math.div_rn(raw, t)
            ok = (x >= cut) & (x > float("-inf"))
            okg = ok & (x >= pre)
            pos = n_g + tl.cumsum(okg.to(tl.int32), axis=0) - 1
            st = okg & (pos < GCAP)
            tl.store(g_row + pos, x, mask=st)
            tl.store(gi_row + pos, offs, mask=st)
            n_g += tl.sum(okg.to(tl.int32), axis=0)
            n_all += tl.sum(ok.to(tl.int32), axis=0)
            e = tl.exp(x - m)
            s_g += tl.where(okg, e, 0.0)
            s_all += tl.where(ok, e, 0.0)
            xmin_g = tl.where(okg, tl.minimum(xmin_g, x), xmin_g)
            xmin_all = tl.where(ok, tl.minimum(xmin_all, x), xmin_all)
    tl.debug_barrier()   # G is read back by other threads of this program
    # G serves if it fits and holds the top-k set (k <= n_g, or top-k a no-op); else re-read the row ("full mode")
    topk_on = kk < n_all
    compact = (n_g <= GCAP) & ((kk <= n_g) | (kk >= n_all))
    n = tl.where(compact, n_g, nv)
    lo0 = _okey(tl.where(compact, tl.min(xmin_g, axis=0), tl.min(xmin_all, axis=0)))   # count(>= lo0) = all
    hi0 = _okey(m) + 1                                                                   # count(>= hi0) = 0
    base = lo0                                  # kept: key >= base
    c_base = tl.where(compact, n_g, n_all)      # candidates (of G or the row) with key >= base
    s_base = tl.sum(s_all, axis=0)              # S of the set top-p acts on (min-p, then top-k survivors)

    # 3. top-k, then top-p over the survivors (both no-ops when nothing would be dropped)
    if HAS_TOPK:
        if topk_on:
            if kk < c_base:
                base = _select(xrow, g_row, gi_row, r_row, n, t, cut, m, compact, lo0, hi0, c_base, zero_i,
                               zero_f, kk, False, SB, NT, RCAP)
                c_base, s_base = _mass_above(xrow, g_row, gi_row, n, t, cut, m, compact, base, BLOCK)
            else:   # compact with k = n_g: the top-k set is G
                s_base = tl.sum(s_g, axis=0)
    if HAS_TOPP:
        if (p < 1.0) & (c_base > 1):
            base = _select(xrow, g_row, gi_row, r_row, n, t, cut, m, compact, base, hi0, c_base, zero_i, zero_f,
                           p * s_base, True, SB, NT, RCAP)

    # 4. the race over {key >= base}: argmax exp(x - m) / E, E as sampler._race_kernel (first max wins)
    hk = _race_row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    rar = tl.arange(0, RB)
    best = tl.full([], -1.0, tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for s in range(0, n, RB):
        x, idx, ok = _src_tile(xrow, g_row, gi_row, s, n, t, cut, compact, RB)
        kept = ok & (_okey(x) >= base)
        if tl.max(kept.to(tl.int32), axis=0) > 0:   # tiles without a kept token skip the hash
            e = _race_exp1(hk, idx, SERIES_TERMS, SERIES_MAX)
            q = tl.where(kept, tl.math.div_rn(tl.exp(x - m), e), -1.0)
            qm = tl.max(q, axis=0)
            qi = tl.sum(tl.where(rar == tl.argmax(q, axis=0), idx, 0), axis=0)
            upd = qm > best
            best_id = tl.where(upd, qi, best_id)
            best = tl.where(upd, qm, best)
    if not settled:
        tl.store(out_ptr + row, best_id.to(tl.int64))


def filtered_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  greedy=None, min_p=None, top_k=None, top_p=None, gcap: int = GCAP, rcap: int = RCAP,
                  nt: int = NT, block: int = BLOCK, num_warps: int = 8, nucleus=None) -> torch.Tensor:
    """race_argmax(softmax(apply_filters(logits / temperature)), seeds, steps) in one launch (see the module doc).

    logits [M, V] fp32 (unit stride), temperature [M] f32 (> 0), seeds / steps [M] i64, greedy [M] bool or None
    (True rows are skipped: their output is 0), min_p [M] f32 / top_k [M] i64 (V or more = off) / top_p [M] f32 or
    None (the SamplingMetadata fields) -> [M] i64 token ids. gcap / rcap / nt (tests): smaller G, R, fan-out;
    block / num_warps: the row-pass tile and warps (bench/sampling.py --sweep). nucleus: the nucleus check first
    (None: NUCLEUS)."""
    assert gcap <= GCAP and rcap <= RCAP and block % KS == 0
    M, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    g, gi, r = _workspace(M, logits.device)
    out = torch.empty(M, dtype=torch.int64, device=logits.device)
    dummy = temperature
    nuc = NUCLEUS if nucleus is None else nucleus
    nb, nbp = nuc_blocks(V)
    parts = _nucleus_partials(logits, temperature, seeds, steps, greedy, min_p, nb, nbp, top_k) if nuc else dummy
    _filtered_race_kernel[(M,)](
        logits, logits.stride(0), V, temperature, greedy if greedy is not None else dummy,
        min_p if min_p is not None else dummy, top_k if top_k is not None else seeds,
        top_p if top_p is not None else dummy, seeds, steps, g, gi, r, out, g.stride(0), r.stride(0), gcap,
        HAS_GREEDY=greedy is not None, HAS_MINP=min_p is not None, HAS_TOPK=top_k is not None,
        HAS_TOPP=top_p is not None, BLOCK=block, SB=SB, RB=RB, NT=nt, RCAP=rcap, SERIES_TERMS=SERIES_TERMS,
        SERIES_MAX=SERIES_MAX, LIBDEVICE=_libdevice(), KS=KS, num_warps=num_warps,
        nuc_ptr=parts, NB=nb, NBP=nbp, NUC=int(bool(nuc)))
    return out


def nuc_blocks(V: int) -> tuple:
    """(NB, NBP) of the nucleus check for a row of V logits: blocks of NUC_BLOCK, the partial rows' width (a power of
    two >= 2: row NUC_X holds two values)."""
    nb = cdiv(V, NUC_BLOCK)
    return nb, max(2, next_pow2(nb))


def _libdevice() -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1"


def _nucleus_partials(logits, temperature, seeds, steps, greedy, min_p, nb: int, nbp: int, top_k=None) -> torch.Tensor:
    """The nucleus check's three (row, block) launches (_nuc_block_kernel's phases; top-k: _nuc_kth_kernel's row
    launch between phases 0 and 1) -> their partials
    [M, NUC_PARTS * nbp] (fp32 / int32 bits)."""
    M, V = logits.shape
    width = NUC_PARTS_N * nbp
    rows = next_pow2(max(M, 8))   # grown in powers of two, reused across calls (as _workspace)
    buf = workspace("sampling_nucleus", logits.device, lambda b: b.numel() >= M * width,
                    lambda _: torch.empty(rows * width, dtype=torch.float32, device=logits.device))
    parts = buf[:M * width].view(M, width)
    g = greedy if greedy is not None else temperature
    mp = min_p if min_p is not None else temperature
    for phase in range(3):
        if phase == 1 and top_k is not None:
            _nuc_kth_kernel[(M,)](parts, nb, nbp, V, g, top_k, HAS_GREEDY=greedy is not None, num_warps=4)
        _nuc_block_kernel[(M, nb)](
            logits, logits.stride(0), V, temperature, g, mp, seeds, steps, parts, nb, NBP=nbp, PHASE=phase,
            HAS_GREEDY=greedy is not None, HAS_MINP=min_p is not None, HAS_TOPK=top_k is not None, BLOCK=NUC_BLOCK,
            SERIES_TERMS=SERIES_TERMS, SERIES_MAX=SERIES_MAX, LIBDEVICE=_libdevice(), num_warps=4)
    return parts
