"""Paged absorbed-MLA decode (one query token per sequence), split-KV with a balanced schedule + LSE merge.

Stage 1: a program owns BLOCK_H heads and one work unit (a contiguous range of key tiles of one sequence). Each
BLOCK_N x (L + R) latent tile is loaded once and feeds both ``S = q_lat c^T + q_pe kpe^T`` ([BLOCK_H x BLOCK_N]
tl.dot, MQA: one K row for all heads) and ``acc += P c`` (c = first L columns of the same tile). Online softmax in
base 2 (scale * log2(e) folded in), fp32 accumulation.

* ``num_splits == 1``: grid (N, head_blocks), one program per sequence writes the final output (zeros if empty).
* ``num_splits = k > 1``: work budget G = N * k. Every program derives the same schedule from ``seq_lens`` on the
  device (_unit_plan): one split length for the whole batch, ``max(MIN_SPLIT_TOKENS, total keys / G)``, so a long
  sequence gets many units and short ones few, and all units cost about the same (FlashMLA-style balance, mixed
  lengths included). MIN_SPLIT_TOKENS is one 64-key tile, so a short context on a mostly idle GPU (B=1 S=1k) runs as
  one-tile units. At most G + N units: grid (G + N, head_blocks); programs without a unit exit at once. Units
  write a normalised fp32 (or bf16: part16) partial and its LSE; stage 2 (grid (N, H / BLOCK_H2, L / BLOCK_L2),
  merge_config) merges a sequence's non-empty units.
* w_uv (kernels/mla/absorb.py, the batch-1 decode chain): the output is the W_UV product [N, H, V]; stage 2 is
  replaced by absorb's _uv_kernel (the merge of each head's units over all L columns, then w_uv[h] @ latent), which
  reads stage 1's latent rows instead on the direct path. Stage 1 and that kernel are PDL launches there (stage 1
  reads nothing before griddepcontrol.wait).
* default_num_splits: 1 (no stage 2) once batch x head_blocks fills the program slots (programs_per_sm x SMs: B >= 231
  with the default two per SM on 132 SMs), else ~one wave.

Graph capture: grids depend only on N, H and ``num_splits`` (a host int fixed at capture; the default comes from
N and ``block_table.shape``); lengths are read on the device only. No host sync.
"""
import os

import torch
import triton
import triton.language as tl

from kernels._pdl import gdc_enter, pdl_launch, pdl_on, prefetch_l2
from kernels._tensors import H200_SMEM, cdiv, max_shared_mem, next_pow2, num_sms, unit_last_stride

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 64  # smallest work unit (keys): one 64-key tile (256 before 12-02; config min_split_tokens=256)
MIN_UNIT_TOKENS = 64  # default_num_splits: at most one unit per 64 keys of the longest sequence
MAX_SPLITS = 256
# PDL launches of stage 1 (the batch-1 w_uv chain): before griddepcontrol.wait, each of the first EARLY_UNITS work
# units hints the rows of its first EARLY_TILES key tiles into L2 (the cache pages are stable: only the newest row,
# written by the prep kernel still running, may be hinted before it lands, and L2 is the coherence point), so the
# unit's first tile arrives from L2 after the wait instead of from HBM. The schedule (seq_lens, block table: host
# copies before the step) is then computed before the wait too. H200 12-04 (bench/ablate.py --batch 1 --steps 80 --set
# kernels.mla.decode.EARLY_TILES=..., ten interleaved cases): 2 tiles 2.185-2.187 ms per step against 2.191-2.194 for
# 0 (graph 2.166-2.170 vs 2.174-2.176), 1 tile in between. 0: nothing before the wait. KIMI_MLA_EARLY_TILES=N
EARLY_TILES = int(os.environ.get("KIMI_MLA_EARLY_TILES", "2"))
_EARLY_WITHOUT_GDC = False  # tests: the hints' code (addresses, block-table reads) without PDL, e.g. the interpreter
EARLY_UNITS = 32          # at most this many units hint (x 74 KB per 64-key tile: <= 2.4 MB per layer)

# GPU tile configuration (L=512/R=64), per cache dtype: BLOCK_H heads share each K tile of BLOCK_N keys.
# * "16bit" = 'ls n64 w4' (since session 9): 64-key page tiles, 4 warps, the latent (q, the tile and acc) in two
#   column halves (_unit_lsplit: three independent MMA chains for S, fewer registers), 2 programs x 112 KB smem per SM
#   so one loads while the other computes (each program's tile is single-buffered). sm_90 (Triton 3.9): 255 regs +
#   32 B stack. H200 (BENCHMARKS.md tenth and thirteenth rounds, FlashInfer fa3 in the same run): B=64 S=8k 190-198 us
#   (FlashInfer 157-163), B=1 S=128k graph 67 us (FlashInfer 80).
# * "16bit-small-smem" = 'w4 n32' (32-key page tiles, 4 warps, 74 KB, 2 programs per SM): devices whose blocks may
#   not opt into DECODE_LARGE_SMEM (GB10 / sm_12x: 99 KB).
# * "fp32" (tests only; IEEE dots run on FMA units): BLOCK_N 32, 1 stage = 147 KB.
# `python bench/mla.py --sweep-decode` times DECODE_VARIANTS beside FlashInfer; `--ptxas` reports their builds offline.
#
# Tried on the H200 and removed after they lost to the default (code last present in cb00f87; figures in
# BENCHMARKS.md, fifth to twentieth rounds): keys as the MMA M dimension (wgmma with the tile from smem; 'keys_m*'),
# heads padded to 64 (FlashMLA's M=64, 'h64*'), TMA tile loads, register prefetch of the next tiles ('pf*'; two of
# them wrong on the H200 under Triton 3.6), the block-table entry carried one iteration so Triton rings the tile
# ('cp'), tl.range warp specialisation (a no-op without TMA loads), in-loop L2 hints of tile t + a ('a1'..'a3'), a
# one-launch split decode whose last unit merges ('fm*', an acq_rel arrival counter per sequence), a phase offset
# of the two programs an SM holds (one sleeps 0.5-4 us before its first tile, picked by pid or by arrival on its
# %smid; H100 12-06, session 29: B = 64 / 128 at 8k unchanged to 0.5%, B = 1 128k graph 79.5-80.4 us against 81.3:
# no gain worth a variant; code in bfde557), the tile's row pointers from one page base and int32 offsets ('fa',
# FASTADDR: loop 1,191 -> 1,112 SASS instructions; H100 12-06, session 30: B = 64 / 128 8k +1.7-1.9%, B = 1 128k
# -0.7 us; code in 85952cb), and ROWIMM's partial last tile in a second loop with masked rows ('ri1': 912
# instructions, 264 B of stack; no gain over lz8 on the H100; code in 85952cb). What bounds these kernels on the
# H200 is the shared-memory traffic of the dots (ldmatrix re-reads of q and the tile), not the load/MMA overlap.
#
# Keys of a config: block_h, block_n, num_warps, num_stages; optional page_tile (one scalar block-table load per
# tile, BS % BLOCK_N == 0), lsplit (_unit_lsplit), programs_per_sm (resident stage-1 programs per SM the split
# heuristic aims at), part16 (bf16 split partials: the stage-1 write and stage-2 read halve, the LSE merge stays
# fp32; lost at B >= 32, won at B=1 by 1-2 us), maxnreg (ptxas register cap), min_split_tokens (smallest unit),
# merge (explicit stage-2 tiles, tests), early_tiles / early_units (EARLY_TILES / EARLY_UNITS overrides), lazy
# (lsplit: the online softmax rescales only when a head's max grew by more than this many log2 units,
# _tile_update2), rowimm (lsplit + page_tile: unclamped tile rows from a constexpr row stride, _tile_row_ptrs).
DECODE_CFG = {
    # lazy 8: default since session 30 (H100 12-06, graph us, same process: B=64 8k 228.8 -> 225.2, B=128 8k 431.1 ->
    # 423.6, B=8 128k 432.5 -> 424.6, B=1 128k 80.4 -> 78.9; the variant 'ls n64 w4' is the config before it)
    "16bit": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True, programs_per_sm=2,
                  lazy=8),
    "16bit-small-smem": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2),
    "fp32": dict(block_h=32, block_n=32, num_warps=8, num_stages=1),
}
DECODE_LARGE_SMEM = 160 * 1024   # bytes a block must be able to opt into for DECODE_CFG["16bit"] (H100/H200: 227 KB)
DECODE_VARIANTS = {
    "base": dict(block_h=32, block_n=64, num_warps=8, num_stages=2),   # the first GPU tiles (1 program per SM)
    "w4 n32": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2),
    "w4 n32 ls": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                      lsplit=True),
    "w4 n32 mt32": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                        min_split_tokens=32),
    # the 16-bit default before 'ls n64 w4': 8 warps capped at 128 registers (2 programs per SM)
    "ls n64 r128": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, page_tile=True, lsplit=True, maxnreg=128,
                        programs_per_sm=2),
    "ls n64 w4": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                      programs_per_sm=2),
    "ls n64 w4 p16": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                          programs_per_sm=2, part16=True),
    # the lazy softmax rescale (lz8: LAZY 8, the default since session 30)
    "ls n64 w4 lz8": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                          programs_per_sm=2, lazy=8),
    # tile rows from the page base and a constexpr row stride, unclamped (ROWIMM, _tile_row_ptrs): one loop that
    # also reads the rows past seq_len of the last tile (offline sm_90: 887 SASS instructions per tile against lz8's
    # 1,155, 40 B of stack). H100 12-06 (session 31): a tie at B = 64 / 128 8k, -1.7 us at B = 1 128k; removed in
    # 348a98b, back (session 41) for the H200, where stage 1 is issue-bound (session 29's counters: time follows
    # warp instructions there) and neither it nor lz8 has run. It needs those rows finite: the engine
    # zero-initialises the cache, but a non-finite latent of a page's earlier owner would stay in its tail, so it is
    # for A/B only (the tests and bench/mla.py give it finite tails). Its two forms without that requirement spill
    # (offline sm_90, Triton 3.9, session 41; not run): the rows past seq_len masked out of the loads, 1,128
    # instructions and 46 LDL per tile; their offsets selected to the tile's first row, 1,077 and 45 LDL. ri2 saves
    # its instructions by the loads' loop-invariant offsets (immediates). To adopt it, the store paths (store_latent,
    # absorb's prep) would write only finite rows, so that no page tail can hold a non-finite earlier latent.
    "ls n64 w4 lz8 ri2": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                              programs_per_sm=2, lazy=8, rowimm=True),
}
GPU_BLOCK_H = 32  # heads per program cap (the default split heuristic assumes it)
# Every tl.dot operand dim (M, N, K) is padded to >= MIN_DOT: Triton's GPU lowering asserts K >= 16 (M, N >= 16 keeps
# the MMA layouts valid too). The interpreter does not check this, so the wrappers assert it (_check_dots). Padding is
# masked (loads give 0, stores skip it), so it contributes nothing: e.g. the tiny test model, L=32, R=8, H=4, runs
# with BLOCK_R=16 and 16-row head blocks. Kimi shapes (L=512, R=64, H=32) are unaffected.
MIN_DOT = 16
LSUM_N = tl.constexpr(MIN_DOT)  # columns of the lazy update's row-sum dot (a jit global must be a constexpr)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # The Triton interpreter (CPU CI) multiplies bf16 operands as raw uint16: upcast there (values already rounded).
    # IEEE: fp32 operands without TF32 (fp32 caches must match the fp32 reference).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _unit_plan(seqlen_ptr, N, G, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Balanced split schedule, computed identically by every program from seq_lens (no host sync).

    A split length (in key tiles) common to the batch, ``max(MIN_TILES, cdiv(total_tiles, G))``, cuts sequence b into
    ``nsp_b = cdiv(tiles_b, split)`` work units of ``slen_b = cdiv(tiles_b, nsp_b)`` tiles (the last may be short or,
    rarely, empty). Units are numbered sequence after sequence from ``first_b``; there are at most G + N of them."""
    offs_b = tl.arange(0, BLOCK_B)
    bm = offs_b < N
    lens = tl.load(seqlen_ptr + offs_b, mask=bm, other=0)
    lens = tl.maximum(lens, 0)
    tiles = (lens + BLOCK_N - 1) // BLOCK_N
    total = tl.sum(tiles, 0)
    split = tl.maximum((total + G - 1) // G, MIN_TILES)
    nsp = (tiles + split - 1) // split
    slen = (tiles + tl.maximum(nsp, 1) - 1) // tl.maximum(nsp, 1)
    last = tl.cumsum(nsp, 0)  # inclusive
    first = last - nsp
    return offs_b, bm, lens, tiles, nsp, slen, first, last


@triton.jit
def _seq_units(offs_b, n, tiles, nsp, slen, first):
    """_unit_plan's scalars of sequence n -> (first unit, unit count, split length in tiles, key tiles)."""
    sel = offs_b == n
    return (tl.sum(tl.where(sel, first, 0), 0), tl.sum(tl.where(sel, nsp, 0), 0),
            tl.sum(tl.where(sel, slen, 0), 0), tl.sum(tl.where(sel, tiles, 0), 0))


@triton.jit
def _tile_page(bt_row, t, seq_len, offs_n, BS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr):
    """Block-table entries of key tile t: one scalar (PAGE_TILE: BS % BLOCK_N == 0, the tile lies in one page) or
    [BLOCK_N] per-row entries (rows past seq_len take the tile's first row's page, see _load_rows)."""
    if PAGE_TILE:
        return tl.load(bt_row + (t * BLOCK_N) // BS)
    else:
        tok = t * BLOCK_N + offs_n
        return tl.load(bt_row + tl.where(tok < seq_len, tok, t * BLOCK_N) // BS)


@triton.jit
def _tile_rows(cache_ptr, page, t, seq_len, offs_n, s_cp, s_cr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] row pointers of key tile t from its pages (_tile_page). Rows past seq_len repeat the tile's first row
    (t * BLOCK_N < seq_len, same page): finite data whose p is 0, so the loads need no row mask (a page's stale tail
    may be NaN, and 0 * NaN would poison acc); the caller masks their logits."""
    tok = t * BLOCK_N + offs_n
    tok = tl.where(tok < seq_len, tok, t * BLOCK_N)
    return cache_ptr + page.to(tl.int64) * s_cp + (tok % BS).to(tl.int64) * s_cr


@triton.jit
def _tile_row_ptrs(cache_ptr, bt_row, t, offs_n, s_cp, S_CR: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] row pointers of key tile t inside its page (PAGE_TILE), unclamped (ROWIMM): with the row stride a
    constexpr the rows are the page base plus constants per thread, instead of _tile_rows' clamp of the rows past
    seq_len (about 290 integer instructions per tile, offline sm_90)."""
    page = _tile_page(bt_row, t, 0, offs_n, BS, BLOCK_N, True).to(tl.int64)
    return cache_ptr + page * s_cp + ((t * BLOCK_N) % BS) * S_CR + offs_n.to(tl.int64) * S_CR


@triton.jit
def _load_cols(row, offs, cmask, FULL: tl.constexpr):
    """[BLOCK_N, len(offs)] columns ``offs`` of rows ``row``. FULL: every column is real (no mask)."""
    if FULL:
        return tl.load(row[:, None] + offs[None, :])
    else:
        return tl.load(row[:, None] + offs[None, :], mask=cmask[None, :], other=0.0)


@triton.jit
def _load_rows(cache_ptr, page, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr,
               L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key tile t's rows (_tile_rows): c [BLOCK_N, BLOCK_L] (latent, also V), kpe [BLOCK_N, BLOCK_R]."""
    row = _tile_rows(cache_ptr, page, t, seq_len, offs_n, s_cp, s_cr, BS, BLOCK_N)
    c = _load_cols(row, offs_l, lmask, BLOCK_L == L)
    kpe = _load_cols(row + L, offs_r, rmask, BLOCK_R == R)
    return c, kpe


@triton.jit
def _load_rows2(cache_ptr, page, t, seq_len, offs_n, offs_l0, offs_l1, offs_r, lmask0, lmask1, rmask, s_cp, s_cr,
                L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """_load_rows with the latent in two column halves (LSPLIT): c0, c1 [BLOCK_N, BLOCK_L / 2], kpe."""
    row = _tile_rows(cache_ptr, page, t, seq_len, offs_n, s_cp, s_cr, BS, BLOCK_N)
    return _load_halves(row, offs_l0, offs_l1, offs_r, lmask0, lmask1, rmask, L, R, BLOCK_L, BLOCK_R)


@triton.jit
def _load_halves(row, offs_l0, offs_l1, offs_r, lmask0, lmask1, rmask, L: tl.constexpr, R: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows ``row`` [BLOCK_N] of the cache -> c0, c1 (the latent's column halves), kpe."""
    c0 = _load_cols(row, offs_l0, lmask0, BLOCK_L == L)
    c1 = _load_cols(row, offs_l1, lmask1, BLOCK_L == L)
    kpe = _load_cols(row + L, offs_r, rmask, BLOCK_R == R)
    return c0, c1, kpe


@triton.jit
def _load_tile(cache_ptr, bt_row, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr,
               L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr):
    """Key tile t of one sequence: c [BLOCK_N, BLOCK_L], kpe [BLOCK_N, BLOCK_R], row mask (_tile_page + _load_rows)."""
    page = _tile_page(bt_row, t, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
    c, kpe = _load_rows(cache_ptr, page, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr, L, R,
                        BLOCK_L, BLOCK_R, BS, BLOCK_N)
    return c, kpe, t * BLOCK_N + offs_n < seq_len


@triton.jit
def _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Online-softmax step over one key tile (base 2), heads as the MMA M dimension: q [BLOCK_H, BLOCK_L],
    S [BLOCK_H, BLOCK_N], acc [BLOCK_H, BLOCK_L]."""
    s = _dot(q, tl.trans(c), IEEE, UPCAST)
    s += _dot(qpe, tl.trans(kpe), IEEE, UPCAST)
    s = s * qk_scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, IEEE, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _tile_update2(q0, q1, qpe, c0, c1, kpe, tmask, m_i, l_i, acc0, acc1, qk_scale, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, LAZY: tl.constexpr = 0):
    """_tile_update (heads as M) with the latent columns in halves (LSPLIT): S = q0 c0^T + q1 c1^T + qpe kpe^T as three
    dots from zero, each scaled before the sum (a dot + add would be folded back into one accumulator chain), so each
    MMA tile has three independent chains of K/32, K/32 and R/16 steps instead of one of (L + R)/16; acc0 / acc1
    [BLOCK_H, BLOCK_L / 2] += P c0 / P c1."""
    s = (_dot(q0, tl.trans(c0), IEEE, UPCAST) * qk_scale + _dot(q1, tl.trans(c1), IEEE, UPCAST) * qk_scale
         + _dot(qpe, tl.trans(kpe), IEEE, UPCAST) * qk_scale)
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY > 0:
        # the reference max moves only when some head's max grew by more than LAZY (log2 units): until then
        # p = exp2(s - m_i) <= 2^LAZY and acc / l keep their scale, so the 2 x [BLOCK_H, BLOCK_L / 2] rescale is
        # skipped (o = acc / l is the same for any reference; the first tile always moves it from -inf).
        # l_i is [BLOCK_H, LSUM_N] here (every column the row sum): the sum of the rounded p that acc sums, as a dot
        # with ones (no shuffles). Summing the unrounded p would leave the largest p's rounding (no longer p = 1)
        # in acc but not in l: 1.23x the eager update's rms error; the rounded sums give 0.74x
        # (test_decode_lazy_bf16_error).
        if tl.max(m_new - m_i, 0) > LAZY:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha[:, None]
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None]).to(c0.dtype)
        l_i = l_i + _dot(p, tl.full([p.shape[1], LSUM_N], 1.0, p.dtype), IEEE, UPCAST)
        acc0 = acc0 + _dot(p, c0, IEEE, UPCAST)
        acc1 = acc1 + _dot(p, c1, IEEE, UPCAST)
    else:  # (not after an early return: Triton would still type the code below with the lazy l_i)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(c0.dtype)
        acc0 = acc0 * alpha[:, None] + _dot(p, c0, IEEE, UPCAST)
        acc1 = acc1 * alpha[:, None] + _dot(p, c1, IEEE, UPCAST)
        m_i = m_new
    return m_i, l_i, acc0, acc1


@triton.jit
def _unit_lsplit(q_ptr, qpe_ptr, cache_ptr, bt_row, out_ptr, opart_ptr, lse_ptr, n, u, hb, H, seq_len, t_begin, t_end,
                 qk_scale, s_qn, s_qh, s_pn, s_ph, s_cp, s_cr, s_on, s_oh, s_wu, s_wh, s_lu,
                 L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr, PAGE_TILE: tl.constexpr, LAZY: tl.constexpr = 0,
                 ROWIMM: tl.constexpr = False, S_CR: tl.constexpr = 0):
    """Stage 1 of one work unit with q, the latent tile and acc in two column halves (LSPLIT, heads as M): the same
    loads (Triton's pipeliner) and math as the main path, more independent MMA chains, fewer registers.
    LAZY: the online softmax rescales only when a head's max grew by more than LAZY (log2 units; _tile_update2).
    ROWIMM (PAGE_TILE only): unclamped tile rows from the constexpr row stride S_CR (_tile_row_ptrs); the rows past
    seq_len of the last tile are read and must be finite (their logits are masked)."""
    HALF: tl.constexpr = BLOCK_L // 2
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_l0 = tl.arange(0, HALF)
    offs_l1 = HALF + offs_l0
    offs_r = tl.arange(0, BLOCK_R)
    lmask0 = offs_l0 < L
    lmask1 = offs_l1 < L
    rmask = offs_r < R
    offs_n = tl.arange(0, BLOCK_N)
    qrow = q_ptr + n.to(tl.int64) * s_qn + heads[:, None] * s_qh
    dt = cache_ptr.dtype.element_ty
    q0 = tl.load(qrow + offs_l0[None, :], mask=hmask[:, None] & lmask0[None, :], other=0.0).to(dt)
    q1 = tl.load(qrow + offs_l1[None, :], mask=hmask[:, None] & lmask1[None, :], other=0.0).to(dt)
    qpe = tl.load(qpe_ptr + n.to(tl.int64) * s_pn + heads[:, None] * s_ph + offs_r[None, :],
                  mask=hmask[:, None] & rmask[None, :], other=0.0).to(dt)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if LAZY > 0:  # the row sums as a dot's [BLOCK_H, LSUM_N] accumulator (_tile_update2)
        l_i = tl.zeros([BLOCK_H, LSUM_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    for t in range(t_begin, t_end):
        if ROWIMM:  # rows from the page base and the constexpr row stride S_CR, the rows past seq_len read too
            row = _tile_row_ptrs(cache_ptr, bt_row, t, offs_n, s_cp, S_CR, BS, BLOCK_N)
            c0, c1, kpe = _load_halves(row, offs_l0, offs_l1, offs_r, lmask0, lmask1, rmask, L, R, BLOCK_L, BLOCK_R)
        else:
            page = _tile_page(bt_row, t, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
            c0, c1, kpe = _load_rows2(cache_ptr, page, t, seq_len, offs_n, offs_l0, offs_l1, offs_r, lmask0, lmask1,
                                      rmask, s_cp, s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N)
        tmask = t * BLOCK_N + offs_n < seq_len
        m_i, l_i, acc0, acc1 = _tile_update2(q0, q1, qpe, c0, c1, kpe, tmask, m_i, l_i, acc0, acc1, qk_scale,
                                             IEEE, UPCAST, LAZY)
    if LAZY > 0:
        l_i = tl.max(l_i, 1)
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    if DIRECT:
        orow = out_ptr + n.to(tl.int64) * s_on + heads[:, None] * s_oh
    else:
        orow = opart_ptr + u.to(tl.int64) * s_wu + heads[:, None] * s_wh
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + u.to(tl.int64) * s_lu + heads, lse, mask=hmask)
    odt = orow.dtype.element_ty
    tl.store(orow + offs_l0[None, :], (acc0 * inv[:, None]).to(odt), mask=hmask[:, None] & lmask0[None, :])
    tl.store(orow + offs_l1[None, :], (acc1 * inv[:, None]).to(odt), mask=hmask[:, None] & lmask1[None, :])


@triton.jit
def _prefetch_unit_tiles(cache_ptr, bt_row, u, t_begin, t_end, seq_len, s_cp, s_cr, BS: tl.constexpr,
                         BLOCK_N: tl.constexpr, D: tl.constexpr, EPL: tl.constexpr, LP: tl.constexpr,
                         EARLY_TILES: tl.constexpr, EARLY_UNITS: tl.constexpr):
    # L2 hints for the rows of tiles t_begin .. t_begin + EARLY_TILES - 1 of unit u (u < EARLY_UNITS, tiles inside
    # the unit and keys < seq_len): one hint per 128-byte line (EPL elements) of each row's D values, LP >= lines
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, LP) * EPL
    for i in tl.static_range(EARLY_TILES):
        key = (t_begin + i) * BLOCK_N + offs_n
        # (elementwise: under the interpreter the scalar compare u < EARLY_UNITS gave the load an int32 mask)
        ok = (key < seq_len) & (key < t_end * BLOCK_N) & (offs_n * 0 + u < EARLY_UNITS)
        page = tl.load(bt_row + key // BS, mask=ok, other=0).to(tl.int64)
        rows = cache_ptr + page * s_cp + (key % BS).to(tl.int64) * s_cr
        prefetch_l2(rows[:, None] + offs_c[None, :], ok[:, None] & (offs_c < D)[None, :])


@triton.jit
def _mla_decode_stage1(
    q_ptr,
    qpe_ptr,
    cache_ptr,
    bt_ptr,
    seqlen_ptr,
    out_ptr,
    opart_ptr,
    lse_ptr,
    N,
    H,
    G,
    qk_scale,  # scale * log2(e)
    s_qn,
    s_qh,
    s_pn,
    s_ph,
    s_cp,
    s_cr,
    s_btn,
    s_on,
    s_oh,
    s_wu,
    s_wh,
    s_lu,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MIN_TILES: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PAGE_TILE: tl.constexpr = False,  # one scalar block-table load per tile (needs BS % BLOCK_N == 0)
    LSPLIT: tl.constexpr = False,  # latent columns in two halves (_unit_lsplit)
    LAZY: tl.constexpr = 0,  # LSPLIT: rescale only when a head's max grew by more than LAZY (_tile_update2)
    ROWIMM: tl.constexpr = False,  # LSPLIT + PAGE_TILE: unclamped rows from the constexpr row stride S_CR
    S_CR: tl.constexpr = 0,
    GDC: tl.constexpr = False,  # PDL launch (w_uv path): nothing is read before the wait, except (EARLY_TILES)
    EARLY_TILES: tl.constexpr = 0,  # with GDC: the schedule and L2 hints of the unit's first tiles before the wait
    EARLY_UNITS: tl.constexpr = 0,
    EPL: tl.constexpr = 64,  # cache elements per 128-byte line
    LP: tl.constexpr = 16,  # next_pow2(lines per cache row)
):
    if EARLY_TILES == 0:  # (the host passes EARLY_TILES > 0 with GDC only)
        gdc_enter(GDC)
    u = tl.program_id(0)  # DIRECT: the sequence; else the work unit
    hb = tl.program_id(1)
    if DIRECT:
        n = u
        seq_len = tl.load(seqlen_ptr + n)
        t_begin = 0
        t_end = tl.cdiv(seq_len, BLOCK_N)
        active = n >= 0  # always: writes zeros for empty sequences
    else:
        offs_b, bm, lens, tiles, nsp, slen, first, last = _unit_plan(seqlen_ptr, N, G, BLOCK_B, BLOCK_N, MIN_TILES)
        n = tl.sum(tl.where(bm & (last <= u), 1, 0), 0)  # sequence holding unit u (N: none)
        sel = offs_b == n
        seq_len = tl.sum(tl.where(sel, lens, 0), 0)
        sl = tl.sum(tl.where(sel, slen, 0), 0)
        t_begin = (u - tl.sum(tl.where(sel, first, 0), 0)) * sl
        t_end = tl.minimum(t_begin + sl, tl.sum(tl.where(sel, tiles, 0), 0))
        active = (n < N) & (t_begin < t_end)  # empty units are skipped by the merge (never written)
    if EARLY_TILES > 0:  # seq_lens and the block table are written by host copies before the step, not by a kernel
        if active:
            _prefetch_unit_tiles(cache_ptr, bt_ptr + n.to(tl.int64) * s_btn, u, t_begin, t_end, seq_len, s_cp, s_cr,
                                 BS, BLOCK_N, L + R, EPL, LP, EARLY_TILES, EARLY_UNITS)
        gdc_enter(GDC)
    if LSPLIT:
        if active:
            _unit_lsplit(q_ptr, qpe_ptr, cache_ptr, bt_ptr + n.to(tl.int64) * s_btn, out_ptr, opart_ptr, lse_ptr, n, u,
                         hb, H, seq_len, t_begin, t_end, qk_scale, s_qn, s_qh, s_pn, s_ph, s_cp, s_cr, s_on, s_oh,
                         s_wu, s_wh, s_lu, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, BLOCK_H, DIRECT, IEEE, UPCAST,
                         PAGE_TILE, LAZY, ROWIMM, S_CR)
    elif active:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        lmask = offs_l < L
        rmask = offs_r < R
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(
            q_ptr + n.to(tl.int64) * s_qn + heads[:, None] * s_qh + offs_l[None, :],
            mask=hmask[:, None] & lmask[None, :],
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)
        qpe = tl.load(
            qpe_ptr + n.to(tl.int64) * s_pn + heads[:, None] * s_ph + offs_r[None, :],
            mask=hmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        bt_row = bt_ptr + n.to(tl.int64) * s_btn
        for t in tl.range(t_begin, t_end):
            c, kpe, tmask = _load_tile(cache_ptr, bt_row, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp,
                                       s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
            m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, IEEE, UPCAST)

        has = l_i > 0
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        omask = hmask[:, None] & lmask[None, :]
        if DIRECT:
            tl.store(
                out_ptr + n.to(tl.int64) * s_on + heads[:, None] * s_oh + offs_l[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:
            tl.store(opart_ptr + u.to(tl.int64) * s_wu + heads[:, None] * s_wh + offs_l[None, :],
                     o.to(opart_ptr.dtype.element_ty), mask=omask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + u.to(tl.int64) * s_lu + heads, lse, mask=hmask)


@triton.jit
def _mla_decode_stage2(
    seqlen_ptr,
    opart_ptr,
    lse_ptr,
    out_ptr,
    N,
    H,
    G,
    s_wu,
    s_wh,
    s_lu,
    s_on,
    s_oh,
    L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MIN_TILES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H2: tl.constexpr,
    BLOCK_L2: tl.constexpr,
    GDC: tl.constexpr = False,  # PDL launch after a GDC stage 1: the CTAs are placed early, nothing read before the wait
):
    """LSE merge of sequence n's non-empty units for BLOCK_H2 heads x BLOCK_L2 latent columns: [BLOCK_S, BLOCK_H2,
    BLOCK_L2] partial tiles, BLOCK_S units per step. Large batches take many heads per program (few, fat programs:
    the per-program plan and LSE pass are latency, not bytes), B=1 many column slices (parallelism)."""
    gdc_enter(GDC)
    n = tl.program_id(0)
    hb = tl.program_id(1)
    lb = tl.program_id(2)
    offs_b, bm, lens, tiles, nsp, slen, first, last = _unit_plan(seqlen_ptr, N, G, BLOCK_B, BLOCK_N, MIN_TILES)
    u0, cnt, sl, nt = _seq_units(offs_b, n, tiles, nsp, slen, first)

    offs_s = tl.arange(0, BLOCK_S)
    heads = hb * BLOCK_H2 + tl.arange(0, BLOCK_H2)
    hmask = heads < H
    offs_l = lb * BLOCK_L2 + tl.arange(0, BLOCK_L2)
    lmask = offs_l < L
    mx = tl.full([BLOCK_S, BLOCK_H2], float("-inf"), tl.float32)
    for k0 in range(0, cnt, BLOCK_S):
        k = k0 + offs_s
        ok = (k < cnt) & (k * sl < nt)  # non-empty units only
        m2 = ok[:, None] & hmask[None, :]
        mx = tl.maximum(mx, tl.load(lse_ptr + (u0 + k).to(tl.int64)[:, None] * s_lu + heads[None, :], mask=m2,
                                    other=float("-inf")))
    m = tl.max(mx, 0)  # [BLOCK_H2]
    m = tl.where(m > float("-inf"), m, 0.0)  # no unit (empty sequence): weights 0 below

    acc = tl.zeros([BLOCK_H2, BLOCK_L2], tl.float32)
    den = tl.zeros([BLOCK_S, BLOCK_H2], tl.float32)
    for k0 in range(0, cnt, BLOCK_S):
        k = k0 + offs_s
        ok = (k < cnt) & (k * sl < nt)
        m2 = ok[:, None] & hmask[None, :]
        uu = (u0 + k).to(tl.int64)
        lse = tl.load(lse_ptr + uu[:, None] * s_lu + heads[None, :], mask=m2, other=float("-inf"))
        w = tl.where(m2, tl.exp2(lse - m[None, :]), 0.0)  # [BLOCK_S, BLOCK_H2]
        o = tl.load(opart_ptr + uu[:, None, None] * s_wu + heads[None, :, None] * s_wh + offs_l[None, None, :],
                    mask=m2[:, :, None] & lmask[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * o, 0)
        den += w
    d = tl.sum(den, 0)
    res = tl.where(d[:, None] > 0, acc / tl.where(d > 0, d, 1.0)[:, None], 0.0)
    tl.store(out_ptr + n.to(tl.int64) * s_on + heads[:, None] * s_oh + offs_l[None, :],
             res.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])


# stage 2 reads up to this many units per step: a uniform batch's units in one step (H200 12-04, stage 2 kernel /
# graph us: B=1 S=128k, 256 units, 6.8 / 67.3 vs 15.8 / 76.3 for 8 steps of 32, each two dependent L2 round trips)
MERGE_MAX_S = 256


def merge_units(max_blocks: int, block_size: int, block_n: int, num_splits: int, min_tiles: int = 1) -> int:
    """Units of a sequence that fills the block table, from host ints: _unit_plan's split length for a batch of such
    sequences, cdiv(tiles, split). A uniform batch has exactly this many per sequence (B=8 S=8k: 33 splits -> 32
    units of 4 tiles); shorter or mixed lengths get other counts (stage 2 loops over steps when they exceed BLOCK_S)."""
    tiles = max(1, cdiv(max_blocks * block_size, block_n))
    split = max(min_tiles, cdiv(tiles, max(1, num_splits)))
    return cdiv(tiles, split)


def merge_config(N: int, H: int, BLOCK_L: int, num_splits: int, num_sms: int = 132, elems: int = 8192,
                 units: int = 0) -> dict:
    """Stage-2 tiles from host ints: BLOCK_S units x BLOCK_H2 heads x BLOCK_L2 columns per step, ~``elems`` fp32
    values (a 32 KB tile, 64 registers per thread at 4 warps). BLOCK_S covers `units` (merge_units; 0: num_splits)
    units, so a uniform batch merges in one step without idle lanes (B=8 S=8k, 32 units: S32 x L256 6.3 us, S64 x
    L128 11.6). Start from whole rows and all heads (fewest programs), then halve heads, then columns (down to 64)
    until the grid has >= 2 programs per SM."""
    bs = max(1, min(MERGE_MAX_S, next_pow2(max(1, units or num_splits))))
    budget = max(1, elems // bs)
    bl = max(1, min(BLOCK_L, next_pow2(budget)))
    bh = max(1, min(next_pow2(H), budget // bl))

    def programs(bh_, bl_):
        return N * cdiv(H, bh_) * cdiv(BLOCK_L, bl_)

    while programs(bh, bl) < 2 * num_sms and (bh > 1 or bl > 64):
        if bh > 1:
            bh //= 2
        else:
            bl //= 2
    return dict(BLOCK_S=bs, BLOCK_H2=bh, BLOCK_L2=bl)


def _upcast(dtype) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and dtype in (torch.bfloat16, torch.float16)


def _block_h(H: int, cap: int = GPU_BLOCK_H) -> int:
    return max(MIN_DOT, min(next_pow2(cap), next_pow2(H)))


def _dot_dim(x: int) -> int:
    """Power-of-two tile extent covering x, at least MIN_DOT (the excess is masked)."""
    return max(MIN_DOT, next_pow2(max(1, int(x))))


def _check_dots(kernel: str, dots) -> None:
    """dots: (M, N, K) of each tl.dot the kernel issues with these blocks; all must be >= MIN_DOT."""
    for m, n, k in dots:
        assert min(m, n, k) >= MIN_DOT, f"{kernel}: tl.dot of M={m} N={n} K={k} (each must be >= {MIN_DOT})"


def decode_config(H: int, L: int, R: int, dtype, on_gpu: bool, block_n=None, config=None,
                  smem: int = H200_SMEM) -> tuple[dict, dict]:
    """-> (launch cfg, stage-1 constexpr blocks) for mla_decode_triton; every tl.dot dim >= MIN_DOT (asserted).
    smem: shared memory a block may opt into (kernels._tensors.max_shared_mem) picks the 16-bit default."""
    cfg = _gpu_cfg(DECODE_CFG, dtype, smem, DECODE_LARGE_SMEM)
    if config:  # the tile shape of the default, every optional flag from `config` alone (none inherited)
        cfg = {k: cfg[k] for k in ("block_h", "block_n", "num_warps", "num_stages")}
        cfg.update(config)
    elif dtype != torch.float32:  # engine A/B switch, 16-bit caches (read per call; a graph keeps its capture's)
        name = os.environ.get("KIMI_MLA_DECODE_VARIANT", "")  # any DECODE_VARIANTS name, e.g. "ls n64 w4 p16"
        if name:
            if name not in DECODE_VARIANTS:
                raise ValueError(f"KIMI_MLA_DECODE_VARIANT={name!r}: not one of {sorted(DECODE_VARIANTS)}")
            cfg = dict(DECODE_VARIANTS[name])
    b = dict(
        BLOCK_H=_block_h(H, cfg["block_h"]),
        BLOCK_N=_dot_dim(block_n or (cfg["block_n"] if on_gpu else 16)),
        BLOCK_L=max(_dot_dim(L), 2 * MIN_DOT) if cfg.get("lsplit") else _dot_dim(L),  # lsplit: halves >= MIN_DOT
        BLOCK_R=_dot_dim(R),
    )
    # S = q c^T, S += qpe kpe^T, acc += P c
    _check_dots("mla_decode", [(b["BLOCK_H"], b["BLOCK_N"], b["BLOCK_L"]), (b["BLOCK_H"], b["BLOCK_N"], b["BLOCK_R"]),
                               (b["BLOCK_H"], b["BLOCK_L"], b["BLOCK_N"])])
    return cfg, b


def _gpu_cfg(table, dtype, smem: int = H200_SMEM, large_smem: int = 0):
    """A copy of table's entry for dtype: "fp32", else "16bit", or "16bit-small-smem" when a block may opt into less
    than `large_smem` bytes of shared memory (`smem`, kernels._tensors.max_shared_mem; GB10: 99 KB)."""
    if dtype == torch.float32:
        return dict(table["fp32"])
    return dict(table["16bit-small-smem" if smem < large_smem else "16bit"])


def default_num_splits(batch: int, max_blocks: int, block_size: int, num_heads: int = 32, num_sms: int = 132,
                       programs_per_sm: int = 1) -> int:
    """Host heuristic from shapes only (graph-capturable): the work-unit budget per sequence of the balanced schedule.
    * 1 (direct: no partials, no merge) when batch x head_blocks programs already fill >= 7/8 of the SM slots
      (``programs_per_sm`` resident stage-1 programs per SM: 1 for the 112-216 KB smem configs, 2 for the 16-bit
      default's 'ls n64 w4' tiles and the small-smem 'w4 n32') -- e.g. B=128 on 132 SMs at one per SM. Costs
      balance on mixed-length batches (one long sequence is one program).
    * else about one wave, G = batch x splits ~ slots / head_blocks, at least 2 so mixed-length batches stay balanced;
      capped by the key tiles of the longest possible sequence (units may be one BLOCK_N tile: few tiles per SM, e.g.
      B=1 S=1k, then run as up to 16 one-tile units instead of 4 four-tile ones) and MAX_SPLITS."""
    head_blocks = cdiv(num_heads, _block_h(num_heads))
    programs = max(1, batch * head_blocks)
    slots = num_sms * max(1, programs_per_sm)
    if programs * 8 >= slots * 7:
        return 1
    splits = max(2, slots // programs)
    max_useful = max(1, cdiv(max_blocks * block_size, MIN_UNIT_TOKENS))
    return int(max(1, min(splits, max_useful, MAX_SPLITS)))


def mla_decode_triton(
    q_lat,
    q_pe,
    cache,
    block_table,
    seq_lens,
    scale,
    num_splits=None,
    out=None,
    block_n=None,
    min_split_tokens=None,
    config=None,
    w_uv=None,
    pdl=None,
    uv_cfg=None,
):
    """See kernels/mla/__init__.py. ``out`` (optional [N, H, L], or [N, H, V] with w_uv; last dim contiguous) is
    written in full. ``config`` (dict like DECODE_CFG's entries) overrides the GPU tiles (bench sweeps).
    ``w_uv`` ([H, V, L], last dim contiguous): the output is the W_UV product of the attention latent, [N, H, V]
    (kernels/mla/absorb.py: the split merge -- or, for num_splits 1, a read of the latent row stage 1 wrote -- fused
    with the product; stage 2 is not launched). ``pdl`` (w_uv path only; None: KIMI_PDL):
    stage 1 and the W_UV kernel are PDL launches; the plain path keeps ordinary launches. ``uv_cfg``: absorb.uv_config
    overrides (bench)."""
    N, H, L = q_lat.shape
    R = q_pe.shape[2]
    NB, BS, D = cache.shape
    assert D == L + R and q_pe.shape[:2] == (N, H)
    assert block_table.shape[0] >= N and seq_lens.shape[0] >= N
    assert cache.stride(2) == 1
    q_lat = unit_last_stride(q_lat)
    q_pe = unit_last_stride(q_pe)
    block_table = unit_last_stride(block_table, torch.int32)
    seq_lens = unit_last_stride(seq_lens, torch.int32)
    if w_uv is not None:  # the caller's out is the [N, H, V] product; stage 1 writes the latent rows to lat_out
        assert w_uv.dim() == 3 and w_uv.shape[0] == H and w_uv.shape[2] == L and w_uv.stride(2) == 1, w_uv.shape
        uv_out = out if out is not None else torch.empty(N, H, w_uv.shape[1], dtype=q_lat.dtype, device=q_lat.device)
        assert uv_out.shape == (N, H, w_uv.shape[1]) and uv_out.stride(2) == 1
        out = None
    if out is None:
        out = torch.empty(N, H, L, dtype=q_lat.dtype, device=q_lat.device)
    assert out.shape == (N, H, L) and out.stride(2) == 1
    if N == 0:
        return out if w_uv is None else uv_out
    on_gpu = q_lat.is_cuda
    cfg, blocks = decode_config(H, L, R, cache.dtype, on_gpu, block_n, config, max_shared_mem(q_lat.device))
    BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R = blocks["BLOCK_H"], blocks["BLOCK_N"], blocks["BLOCK_L"], blocks["BLOCK_R"]
    if num_splits is None:
        num_splits = default_num_splits(N, block_table.shape[1], BS, H, num_sms(q_lat.device),
                                        cfg.get("programs_per_sm", 1))
    num_splits = max(1, int(num_splits))
    min_tiles = max(1, (min_split_tokens or cfg.get("min_split_tokens") or MIN_SPLIT_TOKENS) // BLOCK_N)
    BLOCK_B = max(128, next_pow2(N))  # one compile for every batch up to 128 (a 128-lane plan is cheap)
    direct = num_splits == 1
    G = N * num_splits  # work-unit budget of the balanced schedule
    n_units = N if direct else G + N
    if direct:
        opart = out  # unused
        lse = seq_lens  # unused
        wstr = (0, 0)
        lstr = 0
    else:
        # normalised partials; bf16 (config part16) halves the split overhead (~2 x 64 KB per unit, read + write)
        pdt = torch.bfloat16 if cfg.get("part16", False) and cache.dtype != torch.float32 else torch.float32
        opart = torch.empty(n_units, H, L, dtype=pdt, device=q_lat.device)
        lse = torch.empty(n_units, H, dtype=torch.float32, device=q_lat.device)
        wstr = opart.stride()[:2]
        lstr = lse.stride(0)
    kw = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) if on_gpu else {}
    if on_gpu and cfg.get("maxnreg"):  # ptxas register cap (.maxnreg): e.g. 128 x 256 threads -> 2 programs per SM
        kw["maxnreg"] = cfg["maxnreg"]
    gdc = pdl_launch(pdl_on(pdl) if w_uv is not None else bool(pdl))
    early, early_kw = int(cfg.get("early_tiles", EARLY_TILES)), {}
    if (gdc or _EARLY_WITHOUT_GDC) and early > 0:  # L2 hints of each unit's first tiles before the wait (EARLY_TILES)
        epl = 128 // cache.element_size()
        early_kw = dict(EARLY_TILES=early, EARLY_UNITS=int(cfg.get("early_units", EARLY_UNITS)), EPL=epl,
                        LP=next_pow2(cdiv(D, epl)))
    variant = dict(PAGE_TILE=bool(cfg.get("page_tile", False)) and BS % BLOCK_N == 0,
                   LSPLIT=bool(cfg.get("lsplit", False)))
    variant.update(LAZY=int(cfg.get("lazy", 0)) if variant["LSPLIT"] else 0)
    # ROWIMM (page_tile + lsplit): the row stride as a constexpr (one compile per cache layout); int32 row offsets
    if cfg.get("rowimm") and variant["PAGE_TILE"] and variant["LSPLIT"] and BS * cache.stride(1) < 2 ** 31:
        variant.update(ROWIMM=True, S_CR=cache.stride(1))
    _mla_decode_stage1[(n_units, cdiv(H, BLOCK_H))](
        q_lat,
        q_pe,
        cache,
        block_table,
        seq_lens,
        out,
        opart,
        lse,
        N,
        H,
        G,
        float(scale) * LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        *wstr,
        lstr,
        L=L,
        R=R,
        BLOCK_L=BLOCK_L,
        BLOCK_R=BLOCK_R,
        BS=BS,
        BLOCK_N=BLOCK_N,
        BLOCK_H=BLOCK_H,
        BLOCK_B=BLOCK_B,
        MIN_TILES=min_tiles,
        DIRECT=direct,
        IEEE=cache.dtype == torch.float32,
        UPCAST=_upcast(cache.dtype),
        **variant,
        **kw,
        **gdc,
        **early_kw,
    )
    # w_uv: the merge (split path) or the latent-row read fused with the W_UV product; uv_cfg "stage2" keeps stage 2
    # (the merge over N x H x L-slice programs) and runs the product on its rows (bench alternative for long merges)
    uv_merge = w_uv is not None and not direct and not (uv_cfg or {}).get("stage2")
    if not direct and not uv_merge:
        mc = merge_config(N, H, BLOCK_L, num_splits, num_sms(q_lat.device),
                          units=merge_units(block_table.shape[1], BS, BLOCK_N, num_splits, min_tiles))
        if cfg.get("merge"):  # tests / sweeps: explicit stage-2 tiles
            mc.update(cfg["merge"])
        _mla_decode_stage2[(N, cdiv(H, mc["BLOCK_H2"]), cdiv(L, mc["BLOCK_L2"]))](
            seq_lens,
            opart,
            lse,
            out,
            N,
            H,
            G,
            *wstr,
            lstr,
            out.stride(0),
            out.stride(1),
            L=L,
            BLOCK_N=BLOCK_N,
            BLOCK_B=BLOCK_B,
            MIN_TILES=min_tiles,
            **mc,
            num_warps=4,
            **gdc,
        )
    if w_uv is not None:
        from .absorb import launch_uv

        return launch_uv(seq_lens, opart, lse, out, w_uv, uv_out, N, H, G, L, BLOCK_L, BLOCK_N, BLOCK_B, min_tiles,
                         uv_merge, num_splits, pdl=bool(gdc), cfg=uv_cfg)
    return out
