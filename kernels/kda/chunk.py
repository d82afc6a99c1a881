"""KDA chunked prefill (Triton): gate + L2 norm + beta + chunked delta rule, varlen, slot-pool state.

Entry point: ``chunk_kda_fwd`` (called by kernels/kda/__init__.py ``kda_prefill`` on the Triton path).

Launches:

1. Intra-chunk work, three fully parallel launches with few live tiles each (every exponent <= 0):
   1a. ``_kda_prep_rows_kernel`` (PREP_ROWS; the tile kernel ``_kda_prep_kernel`` otherwise), grid (chunk, head),
       one warp walking the chunk's rows: L2 norms, beta = sigmoid(b), the gate
       g = -exp(A_log) softplus(z + dt_bias) and its chunk-local cumsum G2 = G / ln 2 (log2 units, so every
       exponential is exp2); writes qg, kg, gl and the scratch G2 [rows, K] fp32, rs [rows, 4] fp32 =
       (scale/|q|, 1/|k|, beta).
   1b. ``_kda_akk_lv_kernel``, grid (chunk x 16-row sub-chunk i, head), one warp: Aqk and Dkk for rows
       [16i, 16i+16), every pair on the tensor cores: each earlier 16-column block by one dot per K tile, anchor =
       first row n of the sub-chunk ((x_r exp2(G_r - G_n)) . (k_s exp2(G_n - G_s)), both factors <= 1); the 16x16
       diagonal block by level anchors (pair (r, s) -> the highest bit b in which r and s differ; anchor = the
       first row of r's half of the aligned 2b-block, s < n <= r; one exp2 tile per level and K tile;
       AKK_LV_SPLITK=1: the off-diagonal blocks and the levels in two passes over K); then the diagonal block of
       (I + diag(beta) StrictTril(Dkk)) is inverted (fp32: forward substitution on the two 8x8 halves, then a block
       merge). Writes Aqk (the contract) and the scratch X [rows, 64] fp32 (block inverses Di on the diagonal
       blocks, beta-scaled Dkk below them).
   1c. ``_kda_wu_kernel``, grid (chunk, head): M = (I - N + N^2 - N^3) Di with N = Di L_off (N is strictly
       block-lower, N^4 = 0), then w and u as [64, 64] x [64, BK|BV] dots.
   Per chunk the intra launches produce
       qg  = scale * qn * exp2(G)                [BT, K]     (inter-chunk read of the state)
       kg  = kn * exp2(G_last - G)               [BT, K]     (state update)
       w   = M @ (beta * kn * exp2(G))           [BT, K]
       u   = M @ (beta * v)                      [BT, V]
       Aqk = tril(Dqk)                           [BT, BT]    (scale folded in)
       gl  = G_last                              [K]  fp32, log2 units
   with M = (I + diag(beta) StrictTril(Dkk))^-1.
   (Removed after H200 runs: the one-kernel intra "v1", 1.67x slower, 5.83 vs 3.50 ms end to end at T=16k; the
   one-launch level-anchored intra ``INTRA_FUSED``, 3.772 vs 3.340 ms at T=16k, BENCHMARKS.md seventh round; the
   first akk ``_kda_akk_kernel`` with the diagonal block per pair on CUDA cores, AKK_DIAG 0 / 1 / 2, 1.59-1.85 ms
   for akk vs 0.69 ms for the level-anchored one at T=16k; ``PREP_FUSED`` (no prep launch and no fp32 G scratch:
   akk and wu recomputing the gate cumsum from z per K tile, the diagonal block on CUDA cores), 3.993 ms at T=16k
   (akk 2.535, wu 0.885) vs 2.222 ms for the default.)
2. State and output, two launches (one with HPASS_OUT):
   2a. ``_kda_hpass_kernel`` -- one program per (V tile, sequence, head), BV = 16 at B=1 (auto: the largest of
       64/32/16 giving >= 2 programs per SM): the sequential pass with the fp32 state in registers and only
       two dots per chunk (HPASS_PREFETCH=1 loads the next chunk's u / gl one iteration ahead):
           store h_c = h (bf16 for bf16 inputs: the state's rounding as an MMA operand; fp32 for fp32 inputs)
           into hs [NT, H, K, V];  vn = u - w @ h_c, stored (same dtype);  h = exp2(gl) * h + kg^T @ vn
       then the final state to the slot and zeros for tokens outside [cu[0], cu[-1]).
       The initial state is read from rec_state[state_slots[p]] when has_initial_state[p] (zeros otherwise) and
       the final state is written back there (fla layout [S, H, K, V], fp32). No other slot is touched.
   2b. ``_kda_out_kernel`` -- one program per (chunk, head, V tile), fully parallel (no sequential dependency):
           o = qg @ h_c + Aqk @ vn
   HPASS_OUT=1 (the default with bf16 / fp16 operands where a block may take >= 160 KB of shared memory, e.g. the
   H200): 2a computes 2b's o in its loop (four dots per chunk, two of them off the serial chain); h_c and vn are
   not stored and 2b is not launched. Where the V tile is 64 (many sequences) and a block may take 176 KB, that pass
   runs on the transposed state h^T (``_kda_hpass_t_kernel``, HPASS_T).
   (Removed: the older fused state+output kernel ``_kda_state_kernel``, one sequential program per (V tile,
   sequence, head) doing all four dots per chunk; the split above replaced it as the default on the H200.)

Varlen metadata (chunk offsets) is built on the device: no host sync, and the intra grid is the static upper
bound cdiv(T, 64) + P (surplus programs exit), so the call is CUDA-graph friendly for fixed (T, P).

Precision: all accumulation in fp32. For bf16 inputs the intermediates (qg, kg, w, u, Aqk) are stored in bf16
and the state is cast to bf16 as an MMA operand (as fla does); the intra-chunk matrices use tf32. For fp32 inputs
everything is stored in fp32 and the dots use IEEE fp32 (slow, for tests/oracles).

Tuning: the module constants below (PREP_*, AKK_*, WU_*, HPASS_*, OUT_*);
``python bench/kda_prefill.py --sweep`` times the intra stages vs fla-core per stage and sweeps their constants
(``--sweep-state``: the hpass / output launch-config sweep); ``compile_report()`` compiles the kernels offline for
sm_90 and reports registers / spills / smem. Time budget per stage: see the docstring of bench/kda_prefill.py.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels._tensors import cdiv, max_shared_mem, next_pow2, num_sms

BT = 64          # chunk size
BC = 16          # sub-chunk (diagonal block) size
RCP_LN2 = 1.4426950408889634

# launch configuration (tunable)
# (checked offline with triton 3.9 for sm_90, K = V = 128, bf16: no register spills; hpass 80 regs / 72 KB at BV=16
#  (4 warps), 136 / 80 KB at BV=32 (4), 204 / 104 KB at BV=64 (8); out 72 regs / 48 KB at BV=64 (4 warps), 95 / 72 KB
#  at BV=128)
# intra -> state pass only (stores h_c, vn) -> fully parallel output
HPASS_BV = None          # None: hpass_bv's rule (64 under the interpreter)
HPASS_NUM_WARPS = None   # None: 4 for BV <= 32, 8 for BV = 64
HPASS_NUM_STAGES = 3       # H200 12-03: hpass 0.508 -> 0.376 ms at T=16k (with HPASS_PREFETCH), one chunk in flight
HPASS_PREFETCH = 1       # 1: load u / gl of the next chunk one iteration ahead (off the serial chain; offline
                         # sm_90, Triton 3.6: 82 regs at BV=16, 136 at BV=32, no spills)
# HPASS_OUT = 1 (default since H200 12-05, session 19: T=16k 2.062 -> 1.868 ms, 1.11x fla-core; varlen 16x1k 1.989 ->
# 1.872 ms; the same output and state bits): the state pass also computes the output (o = qg h_c + Aqk vn in its loop,
# see _kda_hpass_kernel), so h_c [NT, H, K, V] and vn are neither written nor read back and the output launch (0.191
# ms) goes away; the state pass stays 0.36 ms (164 regs, 180 KB smem at BV 32). Costs it two more dots per chunk (off
# its serial chain) and qg / Aqk loads (L2 re-reads per V tile). Only with bf16 / fp16 operands where a block may take
# >= 160 KB of shared memory (3 stages carry qg / Aqk too): fp32 operands and a GB10 keep the split. 0: the split.
HPASS_OUT = 1
# HPASS_T: the state pass on the transposed state h^T [BV, K] (_kda_hpass_t_kernel; with HPASS_OUT), so vn and h_c
# are left operands of their dots and stay in registers instead of being stored to shared memory, fenced and re-read
# on every serial step. BV is then the MMA's M. Offline sm_90 (Triton 3.9, 3 stages; loop per chunk): BV 32 / 4 warps
# mma.sync (HMMA 112, LDSM 54, STSM 8, 8 barriers), 212 regs, 120 KB, no spill; BV 64 / 4 warps wgmma (HGMMA 24, 19
# barriers), 254 regs, 170 KB; the current pass at BV 32: HGMMA 28, STSM 6, 9 barriers, 164 regs, 180 KB.
# H200 12-05 (session 23, `bench/kda_prefill.py --quick`, same process): varlen 16 x 1k (the rule's BV 64) hpass
# 0.286 ms vs 0.366 (total 1.800 vs 1.880 ms); T = 16k, one sequence (BV 32) 0.384 vs 0.359, at BV 64 0.405, at BV
# 16 0.610. So 2 (the default): the transposed pass where the state pass's V tile is 64 and a block may take
# HPASS_T_SMEM; 1: always; 0: never. HPASS_T_WARPS (None: 4).
HPASS_T = 2
HPASS_T_SMEM = 176 * 1024   # BV 64 at 3 stages: 170 KB on sm_90 (sm_80: 128 KB but a 136 B spill; A100s keep the other)
HPASS_T_WARPS = None
OUT_BV = 64
OUT_NUM_WARPS = 4
OUT_NUM_STAGES = 2
OUT_VFAST = 1            # V tile fastest in the output grid (the 2nd V tile's qg / Aqk reads hit L2); default since
                         # H200 12-03: out 0.246 -> 0.191 ms at T=16k
# intra launches (prep -> akk -> wu). Defaults since 12-03 = the best variant per stage of `bench/kda_prefill.py
# --quick` on the H200 (akk-lv-2k, cumsum-dot, out-vfast, hpass-s3-prefetch; BENCHMARKS.md seventh round). Before:
# the winners of `bench/kda_prefill.py --sweep` on the H200
# (Triton 3.6, T=16k, H=32, K=V=128, bf16; 2026-12-02): prep BK=32 / 4 warps 0.564 ms (BK=64 / 8 warps 0.933);
# wu BK=BV=32 / 4 warps 0.437 ms (64/64/4 0.529). Offline sm_90 / triton 3.9: prep 128 regs, wu 168 regs / 64 KB
# smem, no spills.
PREP_BK = 16             # with CUMSUM_DOT (H200 12-03: prep 0.559 -> 0.522 ms at T=16k)
PREP_NUM_WARPS = 4
# ptxas register cap for prep (A/B): 127 regs uncapped = 4 four-warp CTAs / SM; 96 -> 5, 80 -> 6 (offline sm_90
# spills: see bench/kda_prefill.py QUICK_VARIANTS). 96 lost on the H200 (session 19: T=16k 2.098 vs 2.062 ms) and the
# H100 (session 22). None: uncapped.
PREP_MAXNREG = None
# PREP_NORM1 = 1 (default since H200 12-04, session 11: prep 0.521 -> 0.454 ms, T=16k 2.227 -> 2.162 ms): the q / k
# row norms from one [BT, K] load each instead of K / PREP_BK dependent load round trips (offline sm_90, Triton 3.9:
# that loop is not pipelined, LDG -> reduce -> next; prep is latency-bound, 0.52 ms at T=16k against ~0.22 ms for its
# ~0.92 GB at 4.3 TB/s and ~0.15 ms of issue). 127 regs, 4 CTAs / SM. 0: the K loop (variant prep-norm-loop).
PREP_NORM1 = 1
# (Session 24, late norms: prep summing the norms in its output loop so q / k are read once, qg / kg stored
# unnormalised and the norms folded back in by wu (M's rows times rk), akk (Aqk's columns times |k|) and the state
# pass (the qg product times rq). Nsight Compute on an H100 had shown prep reading 600 MB from DRAM for its 403 MB of
# q, k, z -- the loop's re-read of q / k mostly misses L2 -- at 25% occupancy, 2.07 TB/s. H200, bench/kda_prefill.py
# --quick: prep 0.507 ms against 0.470 (capped at 128 regs; 0.538 at 96), the state pass 0.433 against 0.361 (its
# per-chunk rq load sits in the loop), T=16k 1.995 against 1.880 ms. Not kept; BENCHMARKS.md twenty-fourth round.)
# (PREP_PREFZ / AKK_PREF / WU_PREF: an L2 prefetch of whole 128-byte lines of the rows the K loops read in 32 / 64-byte
# pieces (prep's z; akk's q, k, G; wu's k, v) before the loops; PREP_EVICT 1: prep's norm-pass q / k loads evict_last,
# its loop's loads evict_first (2: the stores too). H100 12-06, session 31, T=16k: prep 0.549 -> 0.569 ms with z's
# prefetch, 0.598 with it and PREP_EVICT 1 (alone untimed), akk and wu unchanged by theirs. Removed; code in 2a92ace.)
# (PREP_COLS, prep as a norms launch + one-warp programs per (chunk, head, 16 columns) so that a column's cumsum
# stays in a warp, and prep-w8 (the tile kernel at 8 warps): H100 12-06, session 32, T=16k prep 1.124 / 0.718 ms
# against 0.547. Removed; code in 9e31fa5.)
# PREP_ROWS = 1 (default since H100 12-06, session 32: prep 0.547 -> 0.393 ms, T=16k 2.090 -> 1.937 ms, varlen 16 x 1k
# 2.014 -> 1.860): prep as _kda_prep_rows_kernel, one one-warp program per (chunk, head) walking the 64 rows one [K]
# row at a time: the cumsum is a running sum in each lane's registers, the row norms are warp shuffles, nothing goes
# through shared memory (the tile kernel, PREP_ROWS=0 / variant prep-tiles, has 10-12 BAR.SYNC per 16-column tile:
# a column's rows span its four warps). Costs: z read twice (a first walk for G of the last row, which kg needs) and
# softplus twice. 64 regs: 32 one-warp CTAs / SM (the per-SM CTA limit). PREP_ROWS_UNROLL / PREP_ROWS_STAGES: the
# walks' unroll factor and pipeline depth (None: Triton's choice; 3 stages at unroll 2, a 3 KB cp.async ring: 0.397
# ms). (Removed, code in 9e31fa5: row r + 1's loads ahead of row r's stores in registers, 72 regs, 28 CTAs / SM: 0.408
# ms; two warps per walk, the norms crossing warps: 0.431 ms.)
PREP_ROWS = 1
PREP_ROWS_UNROLL = 8
PREP_ROWS_STAGES = None
# PREP_ROWS_RB (A/B, untimed): rows per step of the walk (1: one [K] row; 4 / 8: [RB, K] tiles whose loads go out
# together, the step's cumsum by tl.cumsum inside the warp; fewer interpreted steps too)
PREP_ROWS_RB = 1
# the constants only the tile kernel reads: an A/B setting any of them means PREP_ROWS = 0 (bench and tests)
TILE_PREP_CONSTANTS = ("PREP_BK", "PREP_NUM_WARPS", "PREP_MAXNREG", "PREP_NORM1", "PREP_STAGES", "CUMSUM_DOT")


def prep_variant(cfg: dict) -> dict:
    """An A/B variant's constants with PREP_ROWS = 0 added where they set the tile kernel's (unless they say)."""
    if "PREP_ROWS" not in cfg and any(n in cfg for n in TILE_PREP_CONSTANTS):
        return dict(cfg, PREP_ROWS=0)
    return cfg
PREP_STAGES = None       # pipeline depth of prep's output K loop (None: the launch's num_stages, Triton's default 3)
# akk = _kda_akk_lv_kernel (level-anchored tensor-core dots for the diagonal blocks; its [16, x] tiles are
# replicated in every warp at 2 or 4 warps, so 1 warp). H200 12-03: akk 1.583 -> 0.691 ms at T=16k vs the removed
# per-pair akk (AKK_DIAG 0: exact exp2 per pair and channel, 1.587 ms at 4 warps / BK 32; 1: running products of
# per-token factors, 1.600 / 1.845 ms unrolled / rolled, issue-bound, not MUFU-bound; 2: products in 8x8 halves +
# one anchored 8x8 dot, never timed to the end; before them the exact 8x8-split "HALF" diagonal, 4.63 ms).
AKK_BK = 16              # 1 warp, BK 16 with AKK_LV_SPLITK
AKK_NUM_WARPS = 1
# ptxas register cap for akk. 168 (default since H200 12-04, with AKK_UNCOND): the unconditional K pass takes 230 regs
# uncapped (8 one-warp CTAs / SM); at 168, 12 / SM with 24 B of stack. The branched pass (AKK_UNCOND=0) takes 162
# uncapped; 128 -> 16 CTAs / SM, 144 B stack spill, +5% instructions (akk is ~45% of the H200's issue rate:
# latency-bound). None: uncapped. The AKK_JOUTER passes fit 168 without a spill (the nested loop of sessions 30-36
# kept 2 B on Triton 3.6; at 128 it spilled 46 B and lost, H100 12-06: akk 0.846 vs 0.718 ms).
AKK_MAXNREG = 168
AKK_LV_SPLITK = 1        # 1 = two passes over K (off-diagonal blocks, then the levels; fewer registers)
# AKK_UNCOND = 1 (default since H200 12-04, session 11, with AKK_MAXNREG=168: akk 0.695 -> 0.673 ms at T=16k): the
# off-diagonal K pass without the per-block branches (blocks j >= i load nothing: rows masked, zero products).
# Offline sm_90 (Triton 3.9): the branches kept that loop's loads out of Triton's pipeliner (plain LDG, waited for each
# K tile); unconditional they become a cp.async ring (LDGSTS), and the loop body shrinks 549 -> 429 instructions.
# 0: the branched pass (variant akk-branched, 162 regs uncapped).
AKK_UNCOND = 1
# AKK_JOUTER (with AKK_LV_SPLITK): the off-diagonal pass over the earlier column blocks j < i only, instead of one K
# pass updating all three blocks (AKK_JOUTER=0 with UNCOND: those with j >= i on masked rows, half of its 12 block
# passes per chunk zero work). Per chunk, in K tiles: 24 row-side (q, k, G of R and their anchor factors) + 48 block
# updates, against 32 + 96 for the three-block pass and 48 + 48 for the per-block passes of sessions 30-37 (1, 2).
# No branch inside the K loop. The s = r terms of Aqk move to the levels' pass. AKK_UNCOND applies to the three-block
# pass only.
# AKK_JOUTER = 3 (default since H100 12-07, session 37: akk 0.740 -> 0.684 ms at T=16k, end to end 1.797 -> 1.737 ms,
# 1.36x -> 1.40x fla-core; varlen not timed): one K pass per program over its i blocks with the row side once per K
# tile, specialised per i by a warp-uniform branch outside the loop (_akk_off_pass): offline sm_90 (Triton 3.6) per
# chunk 8 x (235 + 319 + 406) = 7,680 SASS in the off-diagonal loops against 6 x 8 x 338 = 16,224 for the flat loop
# (AKK_JOUTER = 2; the kernel's code 3,344 instructions against 1,904: three loop bodies); 168 regs, no stack (8 B on
# Triton 3.9).
# 0: the three-block pass (variant akk-threeblock).
# (AKK_JOUTER = 2, the block passes as one loop over (j, K tile), so that Triton's cp.async ring ran through the block
# boundaries: the default for the first hours of session 37 (H100 12-07, with AKK_KB: T=16k 1.873 -> 1.802 ms against
# the nested loop; alone akk 0.740 -> 0.726). Removed in session 37; code in a58ddc5.)
# (AKK_JOUTER = 1, the same passes as a nested loop, one K pass per block: the default from session 30 (H100 12-06:
# akk 0.755 -> 0.718 ms against the three-block pass) to session 36. Removed in session 37; code in 689a5dd.)
AKK_JOUTER = 3
# (AKK_PAIR, two programs per chunk-head with row blocks (3, 0) and (2, 1), block 3's row side once per K tile:
# offline ~6.7k instructions per chunk-head in the off-diagonal pass against the loop's ~12k, but 88 B of stack at
# 168 regs; H100 12-06, session 31: akk 0.943 ms (168 regs), 0.841 (192), 0.846 (uncapped, 238) against 0.718 for
# the loop. Removed; code in e327ff8.)
# (AKK_PARTS = 2, akk as two one-warp launches, the off-diagonal pass and the levels + inverse, each with half the
# accumulators: slower on the H200 in session 19, T=16k 2.107 vs 2.062 ms, and on the H100 in session 22, akk 0.808 vs
# 0.754 ms; removed in session 25, last present in cb00f87.)
# (AKK_CHUNK, akk as one program per (chunk, head) with [64, 64] level dots, measured 3.4x slower on its stage on the
# H200 in session 20, 2.212 vs 0.652 ms at T=16k, and was removed.)
WU_BK = 32
WU_BV = 32
WU_NUM_WARPS = 4
# WU_LOOP = 1 (default since H200 12-04, session 12, with WU_MAXNREG=168: wu 0.436 -> 0.391 ms at T=16k, the same
# bits): wu's w and u tiles in one loop whose loads run one tile ahead, tile 0's issued before the inverse chain
# (LOOP 0, the variant wu-two-loops: a K loop, then a V loop, each starting with a load waited for after the chain
# / the previous loop). Uncapped 189 regs (2 CTAs / SM on the H200: 0.408 ms); capped at 168: 3 / SM, 8 B stack.
WU_LOOP = 1
# AKK_KG = 1 (default since H100 12-06, session 32: T=16k 1.941 -> 1.865 ms, 1.31x fla-core; varlen 16 x 1k 1.862 ->
# 1.786; needs AKK_LV_SPLITK): akk's levels pass, which loads kn and G of its 16 rows on every K tile anyway, also
# writes kg = kn exp2(G_last - G), so prep walks its rows once (no first walk over z for G of the last row, softplus
# once, no kg store): prep 0.392 -> 0.297 ms, akk 0.717 -> 0.740 (168 regs; Triton 3.6 spills 12 B there, 3.9 keeps
# 24 B of stack; uncapped, 218 regs on 3.6: 0.760). 0 (or AKK_LV_SPLITK 0): prep writes kg (two walks).
AKK_KG = 1
# AKK_KB = 1 (default since H100 12-07, session 37, timed beside AKK_JOUTER 1 / 2; with 1, T=16k 1.873 -> 1.817
# ms: wu 0.421 -> 0.353, akk 0.740 -> 0.761; needs AKK_LV_SPLITK and WU_LOOP 1): akk's levels pass also writes wu's
# w operand kb = beta kn exp2(G) (the operand dtype, a scratch [rows, K] of its own), so wu reads kb instead of k and
# the fp32 G: 512 fewer bytes per row read, 256 more written. (The same kb written by prep, WU_KBG below, cost prep
# more than wu saved; akk has kn, G and beta in registers on that pass: one exp2 and one store per element more.)
# 0: wu reads k and G.
AKK_KB = 1
# (WU_KG, wu writing kg from the k and G tiles it loads anyway so that prep walks its rows once: H100 12-06,
# session 32, T=16k prep 0.398 -> 0.302 ms but wu 0.425 -> 0.666 (one loop, 168 regs, 54 B spilled), 0.541 (200
# regs), 0.517 (two loops, no spill): 1.948 ms against 1.957 at best. Removed; code in f04496e. AKK_KG above.)
# (WU_KBG = 1, prep also writing wu's operand kb = beta kn exp2(G) so that wu reads neither k nor the fp32 G: prep's
# extra write cost more than wu saved, H200 session 19 T=16k 2.179 vs 2.062 ms, H100 session 22 2.239 vs 2.147;
# removed in session 25, last present in cb00f87.)
# (session 33: AKK_INV_POW, akk's diagonal 8-row halves inverted as (I - L)(I + L^2)(I + L^4) by tf32x3 dots instead
# of the 7-step forward substitution (offline ~690 fewer SASS per program), and AKK_LV_SEL, the four levels accumulated
# onto the diagonal block with a select after each dot instead of eight per-level accumulators (Triton 3.6: 144 regs,
# no stack at 2 stages; 14 one-warp CTAs / SM against 12). H100 12-06 at T=16k: akk 0.742 (inv-pow), 0.771 (lvsel,
# 144 regs), 0.751 (lvsel uncapped, 168, no stack), 0.780 (both) against 0.740 ms: neither fewer instructions on the
# inverse chain nor more resident warps shortens akk. Removed; code in abd9f75.)
# (session 34: AKK_CTA, akk as one 4-warp program per (chunk, head), the four row blocks' work as batched 3-D dots
# (the six off-diagonal pairs as a batch of 8, or as 4 slots of one row block against two column blocks; the four
# diagonal blocks' levels as a batch of 4), so that a chunk's q, k and G would be read from L2 once per CTA. H100
# 12-06 at T=16k: akk 0.923 (8 pairs), 0.806 (4 slots), 1.325 (8 warps) against 0.744 ms. Nsight Compute: L2
# bytes 3.58 -> 2.85 GB, but the re-reads miss L1 (hit rate 3.7%: the pipelined loads are cp.async into shared
# memory, which bypasses L1), and barrier / MIO stalls appear. Removed; code in 735d3a9.)
WU_MAXNREG = 168         # register cap for wu (LOOP 0: 150 regs uncapped, 3 CTAs / SM; 128: 4, 16 B spill offline)
# FAST_SOFTPLUS = 1 (A/B): the gate's softplus with ex2 / lg2.approx in prep (fla's choice) instead of libdevice's
# accurate logf polynomial (~25 instructions per element; offline sm_90 prep loop body 2134 -> see --quick). No
# effect under the interpreter.
FAST_SOFTPLUS = 1
# CUMSUM_DOT = 1: the chunk-local gate cumsum of prep as two tf32 tensor-core dots with the lower-triangular ones
# matrix on a hi / lo split of g (fp32-accurate; see _cumsum0) instead of tl.cumsum, whose scan over rows spread
# across lanes and warps was ~40% of prep's instructions (offline sm_90, Triton 3.6, FAST_SOFTPLUS: prep K-loop body
# 1446 -> 761 SASS instructions per 16 elements / thread; with PREP_BK=16: 123 regs, 4 CTAs / SM).
CUMSUM_DOT = 1


@triton.jit
def _mm(a, b, PREC: tl.constexpr, MODE: tl.constexpr):
    """a @ b with fp32 accumulation. MODE 0: fp32 operands at PREC; 1: low-precision (bf16) operands on the tensor
    cores; 2: upcast to fp32 first (the Triton interpreter mis-handles bf16 dots)."""
    if MODE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif MODE == 1:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _softplus(x, FAST: tl.constexpr = 0):
    """log(1 + e^x), linear above 20. FAST=1: ex2 / lg2.approx (MUFU, as fla's softplus; ~2^-22 relative) instead
    of libdevice's accurate logf (a ~25-instruction polynomial per element); not available in the interpreter."""
    if FAST:
        one_p = 1.0 + tl.exp2(tl.minimum(x, 20.0) * 1.4426950408889634)
        lg = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [one_p], dtype=tl.float32, is_pure=True,
                                       pack=1)
        return tl.where(x > 20.0, x, lg * 0.6931471805599453)
    else:
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _cumsum0(g, BT: tl.constexpr, CS: tl.constexpr = 0):
    """Inclusive cumsum over the rows of g [BT, BK] fp32.
    CS=0: tl.cumsum, a scan over rows spread across lanes and warps (offline sm_90, Triton 3.6: ~38 SASS
    instructions per element in prep: shuffles, shared-memory passes, barriers).
    CS=1: two tensor-core dots with the lower-triangular ones matrix Tri [BT, BT]: Tri @ hi + Tri @ (g - hi), hi = g
    with the low 13 mantissa bits cleared (exact in tf32), so every product is exact; the only error beyond fp32
    accumulation is the tf32 rounding of lo = g - hi (<= 2^-11 |lo| <= 2^-21 |g| per term)."""
    if CS:
        r = tl.arange(0, BT)
        tri = tl.where(r[:, None] >= r[None, :], 1.0, 0.0)
        hi = (g.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(tri, g - hi, tl.dot(tri, hi, input_precision="tf32"), input_precision="tf32")
    else:
        return tl.cumsum(g, 0)


@triton.jit
def _gate(zr, dtb, neg_a, m, FAST: tl.constexpr = 0):
    """The gate g = neg_a softplus(z + dt_bias) (log2 units, <= 0) of raw z values zr, 0 where m is off."""
    return tl.where(m, neg_a * _softplus(zr.to(tl.float32) + dtb, FAST), 0.0)


@triton.jit
def _load_gate_cumsum(z, dt_bias, tok, stride_z, i_h, c, cm, m2, neg_a, K: tl.constexpr, FAST: tl.constexpr = 0,
                      CS: tl.constexpr = 0):
    """Chunk-local inclusive cumsum (log2 units) of g = -exp(A_log) softplus(z + dt_bias); padded rows -> 0.
    CS: see _cumsum0 (CS=1 needs >= 16 rows: the tensor-core path)."""
    zz = tl.load(z + tok[:, None] * stride_z + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
    g = _gate(zz, tl.load(dt_bias + i_h * K + c, mask=cm, other=0.0).to(tl.float32)[None, :], neg_a, m2, FAST)
    return _cumsum0(g, tok.shape[0], CS)


# ---------------------------------------------------------------------------------------------- intra (3 kernels)
@triton.jit
def _chunk_rows(i_c, chunk_offsets, cu_seqlens, n_seq, PB: tl.constexpr, BT: tl.constexpr):
    """Global chunk index -> (first token t0, sequence end eos), both int64 (device-side search of chunk_offsets)."""
    pidx = tl.arange(0, PB)
    offs = tl.load(chunk_offsets + 1 + pidx, mask=pidx < n_seq, other=2147483647)
    i_n = tl.sum((offs <= i_c).to(tl.int32), 0).to(tl.int64)                    # coff[n] <= i_c < coff[n+1]
    i_t = (i_c - tl.load(chunk_offsets + i_n)).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos + i_t * BT, eos


@triton.jit
def _kda_prep_kernel(
    q, k, z, A_log, dt_bias, b, chunk_offsets, cu_seqlens, n_seq,
    qg_out, kg_out, gl_out, g_out, rs_out,
    stride_q, stride_k, stride_z, stride_b, scale,
    PB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr = 0,
    CS: tl.constexpr = 0, NORM1: tl.constexpr = 0, KP: tl.constexpr = 0, STAGES: tl.constexpr = None,
    KG: tl.constexpr = 1,
):
    """Intra launch 1, grid (chunk, head): L2 norms, beta, gate + chunk-local cumsum (log2 units). Writes the
    contract outputs qg, kg, gl and the scratch G [rows, K] fp32 and rs [rows, 4] fp32 = (rq, rk, beta, -)
    (rq = scale / |q|, rk = 1 / |k|; padded rows: G = G of the last valid row, beta = 0).
    NORM1 (PREP_NORM1): the row norms from one [BT, KP] load of q and of k (KP = K rounded up to a power of two)
    instead of a loop of K / BK dependent round trips; STAGES (PREP_STAGES): software-pipeline depth of the K loop
    that writes G / qg / kg (its q / k / z tiles of later iterations in flight)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets + n_seq):
        return
    t0, eos = _chunk_rows(i_c, chunk_offsets, cu_seqlens, n_seq, PB, BT)
    rows = tl.arange(0, BT)
    rmask = rows < (eos - t0)
    tok = t0 + rows
    cblk = (i_c.to(tl.int64) * H + i_h) * BT
    if NORM1:
        cf = tl.arange(0, KP)
        mf = rmask[:, None] & (cf < K)[None, :]
        qf = tl.load(q + tok[:, None] * stride_q + i_h * K + cf[None, :], mask=mf, other=0.0).to(tl.float32)
        kf = tl.load(k + tok[:, None] * stride_k + i_h * K + cf[None, :], mask=mf, other=0.0).to(tl.float32)
        sq = tl.sum(qf * qf, 1)
        sk = tl.sum(kf * kf, 1)
    else:
        sq = tl.zeros([BT], dtype=tl.float32)
        sk = tl.zeros([BT], dtype=tl.float32)
        for kb in range(0, K, BK):
            c = kb + tl.arange(0, BK)
            m2 = rmask[:, None] & (c < K)[None, :]
            bq = tl.load(q + tok[:, None] * stride_q + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
            bk = tl.load(k + tok[:, None] * stride_k + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
            sq += tl.sum(bq * bq, 1)
            sk += tl.sum(bk * bk, 1)
    rq = scale / tl.sqrt(sq + 1e-6)
    rk = 1.0 / tl.sqrt(sk + 1e-6)
    bb = tl.load(b + tok * stride_b + i_h, mask=rmask, other=0.0).to(tl.float32)
    beta = tl.where(rmask, tl.sigmoid(bb), 0.0)
    tl.store(rs_out + (cblk + rows) * 4, rq)
    tl.store(rs_out + (cblk + rows) * 4 + 1, rk)
    tl.store(rs_out + (cblk + rows) * 4 + 2, beta)
    neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * 1.4426950408889634
    for kb in tl.range(0, K, BK, num_stages=STAGES):
        c = kb + tl.arange(0, BK)
        cm = c < K
        m2 = rmask[:, None] & cm[None, :]
        bq = tl.load(q + tok[:, None] * stride_q + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
        bk = tl.load(k + tok[:, None] * stride_k + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
        G = _load_gate_cumsum(z, dt_bias, tok, stride_z, i_h, c, cm, m2, neg_a, K, FAST, CS)  # [BT, BK], <= 0
        gl = tl.sum(tl.where((rows == BT - 1)[:, None], G, 0.0), 0)                    # G of the last row
        tl.store(gl_out + (i_c.to(tl.int64) * H + i_h) * K + c, gl, mask=cm)
        o_k = (cblk + rows)[:, None] * K + c[None, :]
        tl.store(g_out + o_k, G, mask=cm[None, :])
        tl.store(qg_out + o_k, (bq * rq[:, None] * tl.exp2(G)).to(qg_out.dtype.element_ty), mask=cm[None, :])
        if KG:  # (KG=0, AKK_KG: akk writes kg)
            tl.store(kg_out + o_k, (bk * rk[:, None] * tl.exp2(tl.minimum(gl[None, :] - G, 0.0)))
                     .to(kg_out.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _kda_prep_rows_kernel(
    q, k, z, A_log, dt_bias, b, chunk_offsets, cu_seqlens, n_seq,
    qg_out, kg_out, gl_out, g_out, rs_out,
    stride_q, stride_k, stride_z, stride_b, scale,
    PB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    FAST: tl.constexpr = 0, UNROLL: tl.constexpr = None, STAGES: tl.constexpr = None, KG: tl.constexpr = 1,
    RB: tl.constexpr = 1,
):
    """PREP_ROWS: prep's outputs (as _kda_prep_kernel's) from a walk down the chunk's rows, one [KP] row of q, k,
    z per step, grid (chunk, head), meant for one warp: the running gate sum stays in each lane's registers and the
    row norms are warp reductions, so no step crosses a warp (no shared memory, no barrier). kg needs G of the last
    row first, so a first walk sums the gate only (z read twice; softplus twice). KG=0 (AKK_KG: akk writes kg): one
    walk, no kg. RB > 1 (PREP_ROWS_RB): the (second) walk takes RB rows per step as [RB, KP] tiles (their loads
    issued together; the cumsum over the RB rows and the norms stay inside the warp)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets + n_seq):
        return
    t0, eos = _chunk_rows(i_c, chunk_offsets, cu_seqlens, n_seq, PB, BT)
    nv = tl.minimum(eos - t0, BT).to(tl.int32)                                # valid rows of this chunk
    rows = tl.arange(0, BT)
    cblk = (i_c.to(tl.int64) * H + i_h) * BT
    c = tl.arange(0, KP)
    cm = c < K
    dtb = tl.load(dt_bias + i_h * K + c, mask=cm, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * 1.4426950408889634
    pz = z + t0 * stride_z + i_h * K + c                                      # [KP] pointers of row 0
    gl = tl.zeros([KP], dtype=tl.float32)
    G = tl.zeros([KP], dtype=tl.float32)
    if RB > 1:
        pq = q + t0 * stride_q + i_h * K + c
        pk = k + t0 * stride_k + i_h * K + c
        if KG:  # G of the last row by the blocked walk's own sums (kg's exponents <= 0 and exact at it)
            for r0 in tl.range(0, BT, RB, num_stages=STAGES):
                _, gl = _gate_rows_step(pz, r0, nv, cm, dtb, neg_a, gl, stride_z, RB, FAST)
        G = _prep_rows_blocks(pz, pq, pk, dtb, neg_a, nv, cblk, c, cm, G, gl, stride_z, stride_q, stride_k, scale,
                              qg_out, kg_out, g_out, rs_out, K, BT, RB, FAST, STAGES, KG)
    else:
        if KG:
            for r in tl.range(0, nv, loop_unroll_factor=UNROLL):            # G of the last row (padded rows: g = 0)
                gl += _gate(tl.load(pz + r * stride_z, mask=cm, other=0.0), dtb, neg_a, cm, FAST)
        rqv = tl.zeros([BT], dtype=tl.float32)
        rkv = tl.zeros([BT], dtype=tl.float32)
        pq = q + t0 * stride_q + i_h * K + c
        pk = k + t0 * stride_k + i_h * K + c
        for r in tl.range(0, BT, loop_unroll_factor=UNROLL, num_stages=STAGES):
            m = cm & (tl.zeros([KP], dtype=tl.int32) + r < nv)              # (vector form: the interpreter)
            zr = tl.load(pz + r * stride_z, mask=m, other=0.0)
            qr = tl.load(pq + r * stride_q, mask=m, other=0.0)
            kr = tl.load(pk + r * stride_k, mask=m, other=0.0)
            G += _gate(zr, dtb, neg_a, m, FAST)                              # [KP], <= 0
            bq = qr.to(tl.float32)
            bk = kr.to(tl.float32)
            rq = scale / tl.sqrt(tl.sum(bq * bq, 0) + 1e-6)
            rk = 1.0 / tl.sqrt(tl.sum(bk * bk, 0) + 1e-6)
            rqv = tl.where(rows == r, rq, rqv)
            rkv = tl.where(rows == r, rk, rkv)
            o_k = (cblk + r) * K + c
            tl.store(g_out + o_k, G, mask=cm)
            tl.store(qg_out + o_k, (bq * rq * tl.exp2(G)).to(qg_out.dtype.element_ty), mask=cm)
            if KG:
                tl.store(kg_out + o_k, (bk * rk * tl.exp2(tl.minimum(gl - G, 0.0))).to(kg_out.dtype.element_ty),
                         mask=cm)
    if KG == 0:
        gl = G
    tl.store(gl_out + (i_c.to(tl.int64) * H + i_h) * K + c, gl, mask=cm)
    rmask = rows < nv
    bb = tl.load(b + (t0 + rows) * stride_b + i_h, mask=rmask, other=0.0).to(tl.float32)
    if RB == 1:
        tl.store(rs_out + (cblk + rows) * 4, rqv)
        tl.store(rs_out + (cblk + rows) * 4 + 1, rkv)
    tl.store(rs_out + (cblk + rows) * 4 + 2, tl.where(rmask, tl.sigmoid(bb), 0.0))


@triton.jit
def _gate_rows_step(pz, r0, nv, cm, dtb, neg_a, G, stride_z, RB: tl.constexpr, FAST: tl.constexpr):
    """PREP_ROWS_RB: one step of RB rows from row r0 -> (Gb [RB, KP]: G of each row, the running sum G [KP] after
    the step's last row, taken exactly from Gb); pz: the [KP] row-0 pointers of z."""
    rr = r0 + tl.arange(0, RB)
    m = (rr < nv)[:, None] & cm[None, :]
    g = _gate(tl.load(pz[None, :] + (rr * stride_z)[:, None], mask=m, other=0.0), dtb[None, :], neg_a, m, FAST)
    Gb = G[None, :] + tl.cumsum(g, 0)                                        # [RB, KP], <= 0
    return Gb, tl.sum(tl.where((tl.arange(0, RB) == RB - 1)[:, None], Gb, 0.0), 0)


@triton.jit
def _prep_rows_blocks(pz, pq, pk, dtb, neg_a, nv, cblk, c, cm, G, gl, stride_z, stride_q, stride_k, scale,
                      qg_out, kg_out, g_out, rs_out, K: tl.constexpr, BT: tl.constexpr, RB: tl.constexpr,
                      FAST: tl.constexpr, STAGES: tl.constexpr, KG: tl.constexpr):
    """PREP_ROWS_RB: the row walk RB rows per step ([RB, KP] tiles; pz / pq / pk: the [KP] row-0 pointers, G: the
    running gate sum [KP]); stores G, qg, kg (KG) and rs's rq / rk of every row; returns G after the last row."""
    for r0 in tl.range(0, BT, RB, num_stages=STAGES):
        Gb, G = _gate_rows_step(pz, r0, nv, cm, dtb, neg_a, G, stride_z, RB, FAST)
        rr = r0 + tl.arange(0, RB)
        m = (rr < nv)[:, None] & cm[None, :]
        bq = tl.load(pq[None, :] + (rr * stride_q)[:, None], mask=m, other=0.0).to(tl.float32)
        bk = tl.load(pk[None, :] + (rr * stride_k)[:, None], mask=m, other=0.0).to(tl.float32)
        rq = scale / tl.sqrt(tl.sum(bq * bq, 1) + 1e-6)
        rk = 1.0 / tl.sqrt(tl.sum(bk * bk, 1) + 1e-6)
        tl.store(rs_out + (cblk + rr) * 4, rq)
        tl.store(rs_out + (cblk + rr) * 4 + 1, rk)
        o_k = (cblk + rr)[:, None] * K + c[None, :]
        tl.store(g_out + o_k, Gb, mask=cm[None, :])
        tl.store(qg_out + o_k, (bq * rq[:, None] * tl.exp2(Gb)).to(qg_out.dtype.element_ty), mask=cm[None, :])
        if KG:
            tl.store(kg_out + o_k, (bk * rk[:, None] * tl.exp2(tl.minimum(gl[None, :] - Gb, 0.0)))
                     .to(kg_out.dtype.element_ty), mask=cm[None, :])
    return G


@triton.jit
def _akk_off_block(pk, pg, prs, nv, j, c, cm, Gn, qe, ke, ok, oq, stride_k, K: tl.constexpr, BC: tl.constexpr,
                   PREC: tl.constexpr):
    """akk, off-diagonal column block j (chunk rows [j BC, (j+1) BC), all before the anchor n) on one K tile:
    ok / oq += (x_r exp2(G_r - G_n)) . (kn_s exp2(G_n - G_s)) (the row sides qe / ke come in scaled).
    pk / pg / prs: the chunk's row-0 bases of k, G and rs (scalar 64-bit; in-tile offsets stay 32-bit)."""
    cols = j * BC + tl.arange(0, BC)
    mc = (cols < nv)[:, None] & cm[None, :]
    kc = tl.load(pk + cols[:, None] * stride_k + c[None, :], mask=mc, other=0.0).to(tl.float32)
    rkc = tl.load(prs + cols * 4 + 1)
    Gc = tl.load(pg + cols[:, None] * K + c[None, :], mask=cm[None, :], other=0.0)
    kct = tl.trans(kc * rkc[:, None] * tl.exp2(tl.minimum(Gn[None, :] - Gc, 0.0)))             # [BK, BC]
    ok = tl.dot(ke, kct, ok, input_precision=PREC)
    oq = tl.dot(qe, kct, oq, input_precision=PREC)
    return ok, oq


@triton.jit
def _akk_level(pg, i_b, c, cm, qr, kr, Gr, lk, lq, hb: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
               PREC: tl.constexpr):
    """akk, level hb of the diagonal block on one K tile: the rows r of R with bit hb set pair with the rows s of
    the lower half of their aligned 2 hb-block through the anchor n = the first row of the upper half (s < n <= r):
        (x_r exp2(G_r - G_n)) . (kn_s exp2(G_n - G_s)),  both factors <= 1.
    One exp2 tile e = exp2(-|G - G_n(row)|) serves both sides; the operands are unmasked (every factor <= 1, so the
    unused cross products are finite) and the level's pairs are picked from lk / lq [BC, BC] after the K loop."""
    r16 = tl.arange(0, BC)
    a = i_b * BC + ((r16 & ~(2 * hb - 1)) | hb)                                        # anchor row of each row
    Ga = tl.load(pg + a[:, None] * K + c[None, :], mask=cm[None, :], other=0.0)
    d = Gr - Ga
    e = tl.exp2(-tl.abs(d))
    ke = kr * e
    ct = tl.trans(ke)                                                                  # [BK, BC]
    lk = tl.dot(ke, ct, lk, input_precision=PREC)
    lq = tl.dot(qr * e, ct, lq, input_precision=PREC)
    return lk, lq


@triton.jit
def _akk_level_sel(lk, lq, d_kk, d_qk, hb: tl.constexpr, BC: tl.constexpr):
    """akk: add level hb's pairs (r with bit hb set, s without, same aligned 2 hb-block) to the diagonal block."""
    r16 = tl.arange(0, BC)
    up = (r16 & hb) != 0
    sel = (((r16[:, None] ^ r16[None, :]) < 2 * hb) & up[:, None]) & (~up)[None, :]
    return d_kk + tl.where(sel, lk, 0.0), d_qk + tl.where(sel, lq, 0.0)


@triton.jit
def _akk_store_off(pa, px, rr, i_b, j, ok, oq, beta, BT: tl.constexpr, BC: tl.constexpr):
    """akk: column block j != i of the rows R: Aqk (oq for j < i, zeros for j > i) and X = beta Dkk for j < i
    (the diagonal block i of both is stored separately). pa / px: the chunk's row-0 bases of Aqk and X; j a
    literal (the block passes) or a loop index (the zero blocks above the diagonal)."""
    r16 = tl.arange(0, BC)
    jj = tl.zeros([BC, BC], dtype=tl.int32) + j
    o = rr[:, None] * BT + (j * BC + r16)[None, :]
    tl.store(pa + o, tl.where(jj < i_b, oq, 0.0).to(pa.dtype.element_ty), mask=jj != i_b)
    tl.store(px + o, ok * beta[:, None], mask=jj < i_b)


@triton.jit
def _akk_rows(pq, pk, pg, rr, rmask, rq, rk, c, cm, stride_q, stride_k, K: tl.constexpr):
    """akk: the rows R on one K tile: qn (scale folded in), kn, G (log2 units)."""
    m2 = rmask[:, None] & cm[None, :]
    qr = tl.load(pq + rr[:, None] * stride_q + c[None, :], mask=m2, other=0.0).to(tl.float32)
    kr = tl.load(pk + rr[:, None] * stride_k + c[None, :], mask=m2, other=0.0).to(tl.float32)
    Gr = tl.load(pg + rr[:, None] * K + c[None, :], mask=cm[None, :], other=0.0)
    return qr * rq[:, None], kr * rk[:, None], Gr


@triton.jit
def _akk_row_side(pq, pk, pg, rr, rmask, rq, rk, i_b, kb, stride_q, stride_k, K: tl.constexpr, BC: tl.constexpr,
                  BK: tl.constexpr):
    """akk: K tile kb of the rows R (_akk_rows) and their off-diagonal factors against the anchor n = i BC ->
    (c, cm, qr, kr, Gr, Gn, qe, ke) with qe / ke = qr / kr * exp2(min(G_r - G_n, 0))."""
    c = kb + tl.arange(0, BK)
    cm = c < K
    qr, kr, Gr = _akk_rows(pq, pk, pg, rr, rmask, rq, rk, c, cm, stride_q, stride_k, K)
    Gn = tl.load(pg + i_b * BC * K + c, mask=cm, other=0.0)
    ef = tl.exp2(tl.minimum(Gr - Gn[None, :], 0.0))
    return c, cm, qr, kr, Gr, Gn, qr * ef, kr * ef


@triton.jit
def _akk_off_accs(BC: tl.constexpr):
    """akk: zeroed accumulators of three off-diagonal column blocks (k and q for each)."""
    z = tl.zeros([BC, BC], dtype=tl.float32)
    return z, z, z, z, z, z


@triton.jit
def _akk_level_accs(BC: tl.constexpr):
    """akk: zeroed accumulators of the four diagonal-block levels hb = 8, 4, 2, 1 (k and q for each)."""
    z = tl.zeros([BC, BC], dtype=tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def _akk_four_levels(pg, i_b, c, cm, qr, kr, Gr, l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q, K: tl.constexpr,
                     BC: tl.constexpr, PREC: tl.constexpr):
    """akk: the four levels' dots on one K tile (_akk_level for hb = BC/2 .. 1)."""
    l8k, l8q = _akk_level(pg, i_b, c, cm, qr, kr, Gr, l8k, l8q, BC // 2, K, BC, PREC)
    l4k, l4q = _akk_level(pg, i_b, c, cm, qr, kr, Gr, l4k, l4q, BC // 4, K, BC, PREC)
    l2k, l2q = _akk_level(pg, i_b, c, cm, qr, kr, Gr, l2k, l2q, BC // 8, K, BC, PREC)
    l1k, l1q = _akk_level(pg, i_b, c, cm, qr, kr, Gr, l1k, l1q, BC // 16, K, BC, PREC)
    return l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q


@triton.jit
def _kda_akk_lv_kernel(
    q, k, g_in, rs_in, chunk_offsets, cu_seqlens, n_seq, a_out, x_out,
    stride_q, stride_k,
    PB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, SPLITK: tl.constexpr = 0, UNCOND: tl.constexpr = 0, JOUTER: tl.constexpr = 0,
    KG: tl.constexpr = 0, kg_out=None, KB: tl.constexpr = 0, kb_out=None,
):
    """Intra launch 2, grid (chunk x row sub-chunk i (fastest), head), meant for num_warps=1: the rows
    R = [i BC, (i+1) BC) of
         Aqk[r, s] = sum_d qn[r,d] kn[s,d] exp2(G[r,d] - G[s,d])  (s <= r)    -> a_out (the contract, zeros above)
         Dkk[r, s] = same with kn[r]                              (s < r)
    with every pair on the tensor cores and every exponent <= 0:
      off-diagonal: one [BC, BK] x [BK, BC] dot pair per earlier column block j < i (a warp-uniform branch, so
        sub-chunk 0 does none), anchor n = i BC: (x_r exp2(G_r - G_n)) . (kn_s exp2(G_n - G_s)), both factors <= 1;
      diagonal block: level anchors hb = BC/2, ..., 1 (_akk_level), 4 exp2 tiles per K tile for BC = 16 instead of
        BC x BC x K exp2 and 2 BC cross-lane K reductions per block; s = r of Aqk: sum qn kn.
    SPLITK=1: the off-diagonal blocks and the levels in two passes over K (fewer live accumulators).
    UNCOND=1 (AKK_UNCOND): every program runs all three off-diagonal block updates, those with j >= i on masked
    (zero) rows, so the off-diagonal pass has no branches and its loads can be pipelined.
    JOUTER=3 (AKK_JOUTER, needs SPLITK): one K pass per program updating its i blocks, the row side once per K tile
    (a warp-uniform branch on i outside the loop picks the pass specialised for i = 1, 2 or 3: _akk_off_pass; no
    masked blocks, no branch in the K loop).
    Then the diagonal block of (I + diag(beta) StrictTril(Dkk)) is inverted (fp32). x_out [rows, BT] fp32: columns
    < i BC hold beta_r Dkk[r, s], columns [i BC, (i+1) BC) the block inverse Di (columns above are not written).
    (Offline sm_90, Triton 3.6: at 2 or 4 warps these [16, x] tiles are replicated in every warp (the dot-operand
    layouts), so 1 warp does the same work with a quarter of the issue slots.)
    KG=1 (AKK_KG, needs SPLITK): the levels' pass also writes kg = kn exp2(G_last - G) of the rows R (prep then
    walks its rows once). KB=1 (AKK_KB, needs SPLITK): and wu's w operand kb = beta kn exp2(G)."""
    tl.static_assert((BT == 64) & (BC == 16))           # 3 off-diagonal column blocks, 4 levels
    tl.static_assert(((KG == 0) & (KB == 0)) | (SPLITK == 1))
    i_b = tl.program_id(0) % (BT // BC)
    i_c = tl.program_id(0) // (BT // BC)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets + n_seq):
        return
    t0, eos = _chunk_rows(i_c, chunk_offsets, cu_seqlens, n_seq, PB, BT)
    nv = eos - t0                                        # valid rows of this chunk (may exceed BT)
    cblk = (i_c.to(tl.int64) * H + i_h) * BT
    r16 = tl.arange(0, BC)
    rr = i_b * BC + r16                                  # rows of R within the chunk
    rmask = rr < nv
    # scalar 64-bit row-0 bases of this chunk-head + 32-bit in-tile offsets (small address tensors)
    pq = q + t0 * stride_q + i_h * K
    pk = k + t0 * stride_k + i_h * K
    pg = g_in + cblk * K
    prs = rs_in + cblk * 4
    pa = a_out + cblk * BT
    px = x_out + cblk * BT
    pkg = kg_out + cblk * K if KG else kg_out            # (KG: akk's levels pass writes kg)
    pkb = kb_out + cblk * K if KB else kb_out            # (KB: and wu's operand kb)
    rq = tl.load(prs + rr * 4)
    rk = tl.load(prs + rr * 4 + 1)
    beta = tl.load(prs + rr * 4 + 2)
    tl.static_assert((JOUTER == 0) | (JOUTER == 3), "AKK_JOUTER: 0 or 3 (1 and 2 were removed in session 37)")
    if JOUTER == 3:                                      # one K pass per program, its i_b blocks specialised
        tl.static_assert(SPLITK == 1)
        for nb in tl.static_range(1, BT // BC):         # the pass compiled for each i_b = nb > 0
            if i_b == nb:
                _akk_off_pass(pq, pk, pg, prs, pa, px, rr, rmask, rq, rk, beta, nv, i_b, stride_q, stride_k, nb, K,
                              BT, BC, BK, PREC)
        zero = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(i_b + 1, BT // BC):               # Aqk is zero above the diagonal block
            _akk_store_off(pa, px, rr, i_b, j, zero, zero, beta, BT, BC)
        _akk_levels_inverse(pq, pk, pg, pa, px, rr, rmask, rq, rk, beta, i_b, stride_q, stride_k,
                            tl.zeros([BC], dtype=tl.float32), K, BT, BC, BK, PREC, DQ0=1, KG=KG, pkg=pkg, KB=KB,
                            pkb=pkb)
        return
    o0k, o0q, o1k, o1q, o2k, o2q = _akk_off_accs(BC)   # off-diagonal column blocks 0..2
    l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q = _akk_level_accs(BC)    # diagonal-block levels hb = 8, 4, 2, 1
    dq0 = tl.zeros([BC], dtype=tl.float32)               # diagonal s = r of Aqk
    # SPLITK=1: two passes over K (off-diagonal blocks, then the levels): fewer live accumulators (registers)
    for kb in range(0, K, BK):
        c, cm, qr, kr, Gr, Gn, qe, ke = _akk_row_side(pq, pk, pg, rr, rmask, rq, rk, i_b, kb, stride_q, stride_k, K,
                                                      BC, BK)
        if UNCOND:  # no branches: blocks j >= i_b load nothing (rows masked by nv_j = 0) and add zero products
            o0k, o0q = _akk_off_block(pk, pg, prs, tl.where(i_b > 0, nv, 0), 0, c, cm, Gn, qe, ke, o0k, o0q,
                                      stride_k, K, BC, PREC)
            o1k, o1q = _akk_off_block(pk, pg, prs, tl.where(i_b > 1, nv, 0), 1, c, cm, Gn, qe, ke, o1k, o1q,
                                      stride_k, K, BC, PREC)
            o2k, o2q = _akk_off_block(pk, pg, prs, tl.where(i_b > 2, nv, 0), 2, c, cm, Gn, qe, ke, o2k, o2q,
                                      stride_k, K, BC, PREC)
        else:
            if i_b > 0:
                o0k, o0q = _akk_off_block(pk, pg, prs, nv, 0, c, cm, Gn, qe, ke, o0k, o0q, stride_k, K, BC,
                                          PREC)
            if i_b > 1:
                o1k, o1q = _akk_off_block(pk, pg, prs, nv, 1, c, cm, Gn, qe, ke, o1k, o1q, stride_k, K, BC,
                                          PREC)
            if i_b > 2:
                o2k, o2q = _akk_off_block(pk, pg, prs, nv, 2, c, cm, Gn, qe, ke, o2k, o2q, stride_k, K, BC,
                                          PREC)
        dq0 += tl.sum(qr * kr, 1)
        if not SPLITK:
            l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q = _akk_four_levels(pg, i_b, c, cm, qr, kr, Gr, l8k, l8q, l4k, l4q,
                                                                      l2k, l2q, l1k, l1q, K, BC, PREC)
    _akk_store_off(pa, px, rr, i_b, 0, o0k, o0q, beta, BT, BC)
    _akk_store_off(pa, px, rr, i_b, 1, o1k, o1q, beta, BT, BC)
    _akk_store_off(pa, px, rr, i_b, 2, o2k, o2q, beta, BT, BC)
    _akk_store_off(pa, px, rr, i_b, 3, o2k, o2q, beta, BT, BC)     # (block 3 is never < i: zeros)
    if SPLITK:
        _akk_levels_inverse(pq, pk, pg, pa, px, rr, rmask, rq, rk, beta, i_b, stride_q, stride_k, dq0, K, BT, BC,
                            BK, PREC, KG=KG, pkg=pkg, KB=KB, pkb=pkb)
    else:
        _akk_diag_inverse(pa, px, rr, beta, i_b, dq0, l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q, BT, BC, PREC)


@triton.jit
def _akk_off_pass(pq, pk, pg, prs, pa, px, rr, rmask, rq, rk, beta, nv, i_b, stride_q, stride_k, NB: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """akk, JOUTER=3: the off-diagonal blocks j < NB (= i_b, a literal in each of the kernel's warp-uniform branches)
    in one pass over K, the row side (_akk_row_side) once per K tile for all NB blocks; then their stores."""
    o0k, o0q, o1k, o1q, o2k, o2q = _akk_off_accs(BC)
    for kb in range(0, K, BK):
        c, cm, qr, kr, Gr, Gn, qe, ke = _akk_row_side(pq, pk, pg, rr, rmask, rq, rk, i_b, kb, stride_q, stride_k, K,
                                                      BC, BK)
        o0k, o0q = _akk_off_block(pk, pg, prs, nv, 0, c, cm, Gn, qe, ke, o0k, o0q, stride_k, K, BC, PREC)
        if NB > 1:
            o1k, o1q = _akk_off_block(pk, pg, prs, nv, 1, c, cm, Gn, qe, ke, o1k, o1q, stride_k, K, BC, PREC)
        if NB > 2:
            o2k, o2q = _akk_off_block(pk, pg, prs, nv, 2, c, cm, Gn, qe, ke, o2k, o2q, stride_k, K, BC, PREC)
    _akk_store_off(pa, px, rr, i_b, 0, o0k, o0q, beta, BT, BC)
    if NB > 1:
        _akk_store_off(pa, px, rr, i_b, 1, o1k, o1q, beta, BT, BC)
    if NB > 2:
        _akk_store_off(pa, px, rr, i_b, 2, o2k, o2q, beta, BT, BC)


@triton.jit
def _akk_levels_inverse(pq, pk, pg, pa, px, rr, rmask, rq, rk, beta, i_b, stride_q, stride_k, dq0, K: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        DQ0: tl.constexpr = 0, KG: tl.constexpr = 0, pkg=None, KB: tl.constexpr = 0, pkb=None):
    """akk (SPLITK): the levels' own pass over K, then the diagonal blocks and the inverse (_akk_diag_inverse).
    dq0: the s = r terms of Aqk from the off-diagonal pass (DQ0=1: summed here instead, onto the given dq0).
    KG=1: also kg [R, K] = kn exp2(G_last - G) to pkg (this chunk-head's row 0; G_last: G's row BT - 1, which for
    a partial chunk holds the last valid row's G). KB=1: also kb [R, K] = beta kn exp2(G) to pkb (wu's w operand)."""
    l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q = _akk_level_accs(BC)
    for kb in range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        qr, kr, Gr = _akk_rows(pq, pk, pg, rr, rmask, rq, rk, c, cm, stride_q, stride_k, K)
        if KG:
            gl = tl.load(pg + (BT - 1) * K + c, mask=cm, other=0.0)
            tl.store(pkg + rr[:, None] * K + c[None, :],
                     (kr * tl.exp2(tl.minimum(gl[None, :] - Gr, 0.0))).to(pkg.dtype.element_ty), mask=cm[None, :])
        if KB:
            tl.store(pkb + rr[:, None] * K + c[None, :],
                     (kr * beta[:, None] * tl.exp2(tl.minimum(Gr, 0.0))).to(pkb.dtype.element_ty), mask=cm[None, :])
        if DQ0:
            dq0 += tl.sum(qr * kr, 1)
        l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q = _akk_four_levels(pg, i_b, c, cm, qr, kr, Gr, l8k, l8q, l4k, l4q, l2k,
                                                                  l2q, l1k, l1q, K, BC, PREC)
    _akk_diag_inverse(pa, px, rr, beta, i_b, dq0, l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q, BT, BC, PREC)


@triton.jit
def _akk_diag_inverse(pa, px, rr, beta, i_b, dq0, l8k, l8q, l4k, l4q, l2k, l2q, l1k, l1q, BT: tl.constexpr,
                      BC: tl.constexpr, PREC: tl.constexpr):
    """akk: the diagonal blocks of Aqk / Dkk from the levels (+ dq0, the s = r terms of Aqk), Aqk's stored, then the
    inverse of (I + diag(beta) StrictTril(Dkk)) on the block stored to X."""
    r16 = tl.arange(0, BC)
    d_kk = tl.zeros([BC, BC], dtype=tl.float32)
    d_qk = tl.where(r16[:, None] == r16[None, :], dq0[:, None], 0.0)
    d_kk, d_qk = _akk_level_sel(l8k, l8q, d_kk, d_qk, BC // 2, BC)
    d_kk, d_qk = _akk_level_sel(l4k, l4q, d_kk, d_qk, BC // 4, BC)
    d_kk, d_qk = _akk_level_sel(l2k, l2q, d_kk, d_qk, BC // 8, BC)
    d_kk, d_qk = _akk_level_sel(l1k, l1q, d_kk, d_qk, BC // 16, BC)
    tl.store(pa + rr[:, None] * BT + (i_b * BC + r16)[None, :], d_qk.to(pa.dtype.element_ty))
    lmat = tl.where(r16[:, None] > r16[None, :], d_kk * beta[:, None], 0.0)        # L_ii = diag(beta) StrictTril(Dkk)
    tl.store(px + rr[:, None] * BT + (i_b * BC + r16)[None, :], _block_diag_inverse(lmat, r16, BC, PREC))


@triton.jit
def _block_diag_inverse(lmat, r, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 on every BC-row diagonal block of lmat ([N, N] fp32, strictly lower in each block; r = arange(N);
    entries outside the blocks are ignored; zeros outside the blocks). Each block's two BC/2-row halves by forward
    substitution, all halves side by side (row j of every half per step: BC/2 - 1 steps instead of BC - 1), then each
    block's lower-left quarter by the merge X = D - D L_21 D (D = the two half inverses; (D L_21)^2 = 0)."""
    HB: tl.constexpr = BC // 2
    hr = (r // HB)[:, None] == (r // HB)[None, :]                                     # same half
    lt = tl.trans(tl.where(hr, lmat, 0.0))                                             # lt[c, r] = L[r, c]
    di = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for j in range(1, HB):
        sel = (r % HB) == j
        a_r = tl.sum(tl.where(sel[None, :], lt, 0.0), 1)    # [N] over c: L[the selected row of c's half, c]
        nr = tl.sum(a_r[:, None] * di, 0)                   # [N]: each selected row's update in its half
        di = tl.where(sel[:, None] & hr, di - nr[None, :], di)
    blk = (r // BC)[:, None] == (r // BC)[None, :]
    l21 = tl.where(blk & ((r % BC) >= HB)[:, None] & ((r % BC) < HB)[None, :], lmat, 0.0)
    return di - tl.dot(di, tl.dot(l21, di, input_precision=PREC), input_precision=PREC)


@triton.jit
def _wu_tile(k, g_in, v, tok, cblk, rows, rmask, i, stride_k, stride_v, i_h, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr):
    """Tile i of wu's one loop: k [BT, BK] (columns i*BK..), its gate G [BT, BK] fp32 and v [BT, BV] (columns
    i*BV..); zeros past K / V (a tile index past both loads nothing)."""
    ck = i * BK + tl.arange(0, BK)
    bk = tl.load(k + tok[:, None] * stride_k + i_h * K + ck[None, :], mask=rmask[:, None] & (ck < K)[None, :],
                 other=0.0)
    G = tl.load(g_in + (cblk + rows)[:, None] * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
    return bk, G, _wu_v_tile(v, tok, rmask, i, stride_v, i_h, V, BV)


@triton.jit
def _wu_v_tile(v, tok, rmask, i, stride_v, i_h, V: tl.constexpr, BV: tl.constexpr):
    """v [BT, BV] of wu's tile i (columns i*BV..; zeros past V)."""
    cv = i * BV + tl.arange(0, BV)
    return tl.load(v + tok[:, None] * stride_v + i_h * V + cv[None, :], mask=rmask[:, None] & (cv < V)[None, :],
                   other=0.0)


@triton.jit
def _wu_tile_kb(kb_in, v, tok, cblk, rows, rmask, i, stride_v, i_h, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """AKK_KB: tile i of wu's one loop from akk's kb [BT, BK] (beta kn exp2(G), columns i*BK..) and v [BT, BV]."""
    ck = i * BK + tl.arange(0, BK)
    bk = tl.load(kb_in + (cblk + rows)[:, None] * K + ck[None, :], mask=(ck < K)[None, :], other=0.0)
    return bk, _wu_v_tile(v, tok, rmask, i, stride_v, i_h, V, BV)


@triton.jit
def _kda_wu_kernel(
    k, v, g_in, rs_in, x_in, chunk_offsets, cu_seqlens, n_seq, w_out, u_out,
    stride_k, stride_v,
    PB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LOOP: tl.constexpr = 0, KB: tl.constexpr = 0,
    kb_in=None,
):
    """Intra launch 3, grid (chunk, head): M = (I + L)^-1 = sum_j (-N)^j Di with N = Di L_off (strictly block-lower,
    N^(BT/BC) = 0), from x_in (Di on the diagonal blocks, L_off below); then w = M (beta kn exp2(G)), u = M (beta v)
    as [BT, BT] x [BT, BK|BV] dots.
    LOOP 0: a K loop for w, then a V loop for u (each pipelined by Triton after the inverse: two exposed load
    latencies after it). LOOP 1: one loop over max(K / BK, V / BV) tiles, each one k, G and v tile, the next tile's
    loads issued (into registers) before this tile's dots and tile 0's before the inverse, so no load waits on the
    inverse chain or on a loop boundary. (bf16 dot operands there, fla's precision, were faster on the H200 -- wu
    0.325 ms -- but wrong with M converted once before the loop and an illegal address with M converted per tile,
    Triton 3.6, 12-04: removed.)
    KB=1 (AKK_KB, LOOP 1): w's operand comes ready from kb_in (akk's beta kn exp2(G)); k and g_in are not read."""
    tl.static_assert((KB == 0) | (LOOP == 1))
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets + n_seq):
        return
    t0, eos = _chunk_rows(i_c, chunk_offsets, cu_seqlens, n_seq, PB, BT)
    rows = tl.arange(0, BT)
    rmask = rows < (eos - t0)
    tok = t0 + rows
    cblk = (i_c.to(tl.int64) * H + i_h) * BT
    rb = rows // BC
    if LOOP == 1:
        if KB:
            nk, nv = _wu_tile_kb(kb_in, v, tok, cblk, rows, rmask, 0, stride_v, i_h, K, V, BK, BV)
        else:
            nk, ng, nv = _wu_tile(k, g_in, v, tok, cblk, rows, rmask, 0, stride_k, stride_v, i_h, K, V, BK, BV)
    x = tl.load(x_in + (cblk + rows)[:, None] * BT + rows[None, :])
    di = tl.where(rb[:, None] == rb[None, :], x, 0.0)          # block-diagonal inverse (the 'where' drops the
    lo = tl.where(rb[:, None] > rb[None, :], x, 0.0)           # never-written entries above the diagonal blocks)
    nmat = tl.dot(di, lo, input_precision=PREC)
    m = di
    for _ in tl.static_range(BT // BC - 1):
        m = di - tl.dot(nmat, m, input_precision=PREC)
    rk = tl.load(rs_in + (cblk + rows) * 4 + 1)
    beta = tl.load(rs_in + (cblk + rows) * 4 + 2)
    if LOOP == 1:
        NI: tl.constexpr = max((K + BK - 1) // BK, (V + BV - 1) // BV)
        for i in range(NI):
            if KB:
                bk, bv = nk, nv
                nk, nv = _wu_tile_kb(kb_in, v, tok, cblk, rows, rmask, i + 1, stride_v, i_h, K, V, BK, BV)
                wop = bk.to(tl.float32)
            else:
                bk, G, bv = nk, ng, nv
                nk, ng, nv = _wu_tile(k, g_in, v, tok, cblk, rows, rmask, i + 1, stride_k, stride_v, i_h, K, V, BK,
                                      BV)
                wop = bk.to(tl.float32) * (rk * beta)[:, None] * tl.exp2(G)
            ck = i * BK + tl.arange(0, BK)
            cv = i * BV + tl.arange(0, BV)
            wv = tl.dot(m, wop, input_precision=PREC)
            uv = tl.dot(m, bv.to(tl.float32) * beta[:, None], input_precision=PREC)
            tl.store(w_out + (cblk + rows)[:, None] * K + ck[None, :], wv.to(w_out.dtype.element_ty),
                     mask=(ck < K)[None, :])
            tl.store(u_out + (cblk + rows)[:, None] * V + cv[None, :], uv.to(u_out.dtype.element_ty),
                     mask=(cv < V)[None, :])
    else:
        for kb in range(0, K, BK):
            c = kb + tl.arange(0, BK)
            cm = c < K
            m2 = rmask[:, None] & cm[None, :]
            bk = tl.load(k + tok[:, None] * stride_k + i_h * K + c[None, :], mask=m2, other=0.0).to(tl.float32)
            G = tl.load(g_in + (cblk + rows)[:, None] * K + c[None, :], mask=cm[None, :], other=0.0)
            wv = tl.dot(m, bk * (rk * beta)[:, None] * tl.exp2(G), input_precision=PREC)
            tl.store(w_out + (cblk + rows)[:, None] * K + c[None, :], wv.to(w_out.dtype.element_ty),
                     mask=cm[None, :])
        for vb in range(0, V, BV):
            c = vb + tl.arange(0, BV)
            cm = c < V
            m2 = rmask[:, None] & cm[None, :]
            bv = tl.load(v + tok[:, None] * stride_v + i_h * V + c[None, :], mask=m2, other=0.0).to(tl.float32)
            uv = tl.dot(m, bv * beta[:, None], input_precision=PREC)
            tl.store(u_out + (cblk + rows)[:, None] * V + c[None, :], uv.to(u_out.dtype.element_ty),
                     mask=cm[None, :])


@triton.jit
def _zero_outside(o, bos, eos, i_n, n_seq, n_tok, stride_o, i_h, vv, BT: tl.constexpr, BV: tl.constexpr,
                  V: tl.constexpr):
    """Tokens outside [cu[0], cu[-1]) get zeros (done by the first / last sequence's programs)."""
    rows = tl.arange(0, BT)
    zero = tl.zeros([BT, BV], dtype=o.dtype.element_ty)
    if i_n == 0:
        for t0z in range(0, bos.to(tl.int32), BT):
            tz = t0z + rows
            tl.store(o + tz.to(tl.int64)[:, None] * stride_o + i_h * V + vv[None, :], zero,
                     mask=(tz < bos)[:, None])
    if i_n == n_seq - 1:
        for t0z in range(eos.to(tl.int32), n_tok, BT):
            tz = t0z + rows
            tl.store(o + tz.to(tl.int64)[:, None] * stride_o + i_h * V + vv[None, :], zero,
                     mask=(tz < n_tok)[:, None])


@triton.jit
def _hpass_sequence(cu_seqlens, chunk_offsets, state_slots, has_initial_state, i_n, BT: tl.constexpr):
    """Sequence i_n of a state pass: (bos, eos, its first chunk, its state slot, initial-state flag, chunk count)."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(state_slots + i_n).to(tl.int64)
    h0i = tl.load(has_initial_state + i_n).to(tl.int32)
    return bos, eos, c0, slot, h0i, ((eos - bos + BT - 1) // BT).to(tl.int32)


@triton.jit
def _kda_hpass_kernel(
    kg_in, w_in, u_in, gl_in, h_out, vn_out, o, rec_state,
    cu_seqlens, chunk_offsets, state_slots, has_initial_state, n_seq, n_tok,
    stride_o, stride_s,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, MM: tl.constexpr, PREFETCH: tl.constexpr = 0,
    qg_in=None, a_in=None, OUT: tl.constexpr = 0,
):
    """Split path, launch 2: the sequential state pass only. Per chunk: store h_c (the state at the chunk start,
    in the MMA operand dtype) and vn = u - w h_c, then h = exp2(gl) h + kg^T vn. Two dots per chunk.
    PREFETCH=1: u and gl (which feed no dot, so Triton's pipeliner leaves their loads in the loop body, on the
    serial chain) are loaded one chunk ahead by hand.
    OUT=1 (HPASS_OUT): the output kernel's work in the same loop, o = qg h_c + Aqk vn (the same operands and
    expression as _kda_out_kernel), written to o; h_c and vn are not stored (h_out / vn_out unused) and there is no
    output launch. Two more dots per chunk, off the recurrence's chain (qg h_c needs only h_c, Aqk vn only vn)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
    bos, eos, c0, slot, h0i, nt = _hpass_sequence(cu_seqlens, chunk_offsets, state_slots, has_initial_state, i_n, BT)

    kk = tl.arange(0, K)
    vv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    o_kv = kk[:, None] * V + vv[None, :]
    o_bk = rows[:, None] * K + kk[None, :]
    o_kbt = kk[:, None] + rows[None, :] * K
    o_bv = rows[:, None] * V + vv[None, :]
    p_h = rec_state + slot * stride_s + i_h * K * V
    h = tl.load(p_h + o_kv).to(tl.float32)
    h = tl.where(h0i != 0, h, 0.0)
    dt = w_in.dtype.element_ty
    if PREFETCH:
        ch = c0 * H + i_h
        nx_u = tl.load(u_in + ch * BT * V + o_bv, mask=tl.zeros([BT, BV], dtype=tl.int32) < nt, other=0.0)
        nx_gl = tl.load(gl_in + ch * K + kk, mask=tl.zeros([K], dtype=tl.int32) < nt, other=0.0)

    for it in range(nt):
        cg = c0 + it
        ch = cg * H + i_h
        r0 = ch * BT
        b_w = tl.load(w_in + r0 * K + o_bk)
        b_kgt = tl.load(kg_in + r0 * K + o_kbt)                       # [K, BT]
        if OUT:
            b_qg = tl.load(qg_in + r0 * K + o_bk)                     # [BT, K]
            b_a = tl.load(a_in + r0 * BT + rows[:, None] * BT + rows[None, :])   # [BT, BT], zeros above the diagonal
        if PREFETCH:
            b_u = nx_u.to(tl.float32)
            b_gl = nx_gl
            # chunk it + 1 of this sequence, if any
            nx_u = tl.load(u_in + (r0 + H * BT) * V + o_bv,
                           mask=(tl.zeros([BT, BV], dtype=tl.int32) + it + 1) < nt, other=0.0)
            nx_gl = tl.load(gl_in + (ch + H) * K + kk, mask=(tl.zeros([K], dtype=tl.int32) + it + 1) < nt,
                            other=0.0)
        else:
            b_u = tl.load(u_in + r0 * V + o_bv).to(tl.float32)
            b_gl = tl.load(gl_in + ch * K + kk)
        hb = h.to(dt)
        if not OUT:
            tl.store(h_out + ch * K * V + o_kv, hb.to(h_out.dtype.element_ty))
        vn = b_u - _mm(b_w, hb, PREC, MM)
        vnb = vn.to(dt)
        if OUT:
            b_o = _mm(b_qg, hb, PREC, MM) + _mm(b_a, vnb, PREC, MM)
            t0 = bos + it * BT
            tl.store(o + t0 * stride_o + i_h * V + (rows[:, None] * stride_o + vv[None, :]),
                     b_o.to(o.dtype.element_ty), mask=(rows < eos - t0)[:, None])
        else:
            tl.store(vn_out + r0 * V + o_bv, vnb.to(vn_out.dtype.element_ty))
        h = h * tl.exp2(b_gl)[:, None] + _mm(b_kgt, vnb, PREC, MM)

    tl.store(p_h + o_kv, h.to(rec_state.dtype.element_ty))
    _zero_outside(o, bos, eos, i_n, n_seq, n_tok, stride_o, i_h, vv, BT, BV, V)


@triton.jit
def _kda_hpass_t_kernel(
    kg_in, w_in, u_in, gl_in, qg_in, a_in, o, rec_state,
    cu_seqlens, chunk_offsets, state_slots, has_initial_state, n_seq, n_tok,
    stride_o, stride_s,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, MM: tl.constexpr,
):
    """HPASS_T: the state pass with the output (HPASS_OUT's work) on the transposed state h^T [BV, K], so that the
    two operands the recurrence produces are the LEFT operands of its dots and can stay in registers (the MMA
    accumulator -> A-operand conversion FlashAttention uses for P V), never stored to shared memory on the serial
    chain: vn^T = u^T - h_c^T w^T, h^T = exp2(gl) h^T + vn^T kg, o^T = h_c^T qg^T + vn^T Aqk^T. The right operands
    (w^T, kg, qg^T, Aqk^T) are loads, pipelined. The same roundings as _kda_hpass_kernel (h_c and vn in the operand
    dtype), so the same values up to accumulation order. u and gl are loaded one chunk ahead (as PREFETCH=1).
    BV is the MMA's M (4 warps: at BV 32 Triton runs mma.sync, at 64 wgmma)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
    bos, eos, c0, slot, h0i, nt = _hpass_sequence(cu_seqlens, chunk_offsets, state_slots, has_initial_state, i_n, BT)

    kk = tl.arange(0, K)
    vv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    o_vk = vv[:, None] + kk[None, :] * V                  # h^T [BV, K] in the pool's [K, V]
    o_kbt = kk[:, None] + rows[None, :] * K               # [K, BT] view of a [BT, K] row block
    o_vbt = vv[:, None] + rows[None, :] * V               # [BV, BT] view of a [BT, V] row block
    p_h = rec_state + slot * stride_s + i_h * K * V
    ht = tl.load(p_h + o_vk).to(tl.float32)
    ht = tl.where(h0i != 0, ht, 0.0)
    dt = w_in.dtype.element_ty
    ch = c0 * H + i_h
    nx_u = tl.load(u_in + ch * BT * V + o_vbt, mask=tl.zeros([BV, BT], dtype=tl.int32) < nt, other=0.0)
    nx_gl = tl.load(gl_in + ch * K + kk, mask=tl.zeros([K], dtype=tl.int32) < nt, other=0.0)
    for it in range(nt):
        ch = (c0 + it) * H + i_h
        r0 = ch * BT
        b_wt = tl.load(w_in + r0 * K + o_kbt)                                     # w^T [K, BT]
        b_kg = tl.load(kg_in + r0 * K + rows[:, None] * K + kk[None, :])           # kg [BT, K]
        b_qgt = tl.load(qg_in + r0 * K + o_kbt)                                   # qg^T [K, BT]
        b_at = tl.load(a_in + r0 * BT + rows[None, :] * BT + rows[:, None])       # Aqk^T [BT, BT]
        b_ut = nx_u.to(tl.float32)
        b_gl = nx_gl
        nx_u = tl.load(u_in + (r0 + H * BT) * V + o_vbt,
                       mask=(tl.zeros([BV, BT], dtype=tl.int32) + it + 1) < nt, other=0.0)
        nx_gl = tl.load(gl_in + (ch + H) * K + kk, mask=(tl.zeros([K], dtype=tl.int32) + it + 1) < nt, other=0.0)
        hb = ht.to(dt)
        vnb = (b_ut - _mm(hb, b_wt, PREC, MM)).to(dt)                            # vn^T [BV, BT]
        b_ot = _mm(hb, b_qgt, PREC, MM) + _mm(vnb, b_at, PREC, MM)               # o^T [BV, BT]
        t0 = bos + it * BT
        tl.store(o + t0 * stride_o + i_h * V + (rows[None, :] * stride_o + vv[:, None]),
                 b_ot.to(o.dtype.element_ty), mask=(rows < eos - t0)[None, :])
        ht = ht * tl.exp2(b_gl)[None, :] + _mm(vnb, b_kg, PREC, MM)

    tl.store(p_h + o_vk, ht.to(rec_state.dtype.element_ty))
    _zero_outside(o, bos, eos, i_n, n_seq, n_tok, stride_o, i_h, vv, BT, BV, V)


@triton.jit
def _kda_out_kernel(
    qg_in, a_in, h_in, vn_in, o, chunk_offsets, cu_seqlens, n_seq, stride_o,
    PB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, MM: tl.constexpr, VFAST: tl.constexpr = 0,
):
    """Split path, launch 3: fully parallel over (chunk, head, V tile): o = qg h_c + tril(Aqk) vn.
    VFAST=1: grid (V tile (fastest) x chunk, head), so the V tiles of a chunk-head run together and the second
    one's qg / Aqk reads hit L2 (grid (chunk, head, V tile) runs all V tile 0 programs first)."""
    if VFAST:
        NV: tl.constexpr = (V + BV - 1) // BV
        i_v = tl.program_id(0) % NV
        i_c = tl.program_id(0) // NV
        i_h = tl.program_id(1)
    else:
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        i_v = tl.program_id(2)
    if i_c >= tl.load(chunk_offsets + n_seq):
        return
    pidx = tl.arange(0, PB)
    offs = tl.load(chunk_offsets + 1 + pidx, mask=pidx < n_seq, other=2147483647)
    i_n = tl.sum((offs <= i_c).to(tl.int32), 0).to(tl.int64)
    i_t = (i_c - tl.load(chunk_offsets + i_n)).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    kk = tl.arange(0, K)
    vv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    ch = i_c.to(tl.int64) * H + i_h
    r0 = ch * BT
    b_qg = tl.load(qg_in + r0 * K + rows[:, None] * K + kk[None, :])
    b_h = tl.load(h_in + ch * K * V + kk[:, None] * V + vv[None, :])
    b_a = tl.load(a_in + r0 * BT + rows[:, None] * BT + rows[None, :])
    b_vn = tl.load(vn_in + r0 * V + rows[:, None] * V + vv[None, :])
    b_o = _mm(b_qg, b_h, PREC, MM) + _mm(b_a, b_vn, PREC, MM)
    tl.store(o + t0 * stride_o + i_h * V + (rows[:, None] * stride_o + vv[None, :]),
             b_o.to(o.dtype.element_ty), mask=(rows < eos - t0)[:, None])


def compile_report(arch: int = 90, H: int = 32, K: int = 128, V: int = 128, bf16: bool = True,
                   hpass_bv: Optional[int] = None, out_bv: Optional[int] = None,
                   which: Sequence[str] = ("hpass", "out", "prep", "akk", "wu")) -> dict:
    """Compile the kernels offline for sm_<arch> (kernels/_offline.py; no GPU needed, Triton's bundled ptxas) at
    Kimi shapes and return {name: (registers, spill stack bytes, shared bytes)}. Run without TRITON_INTERPRET.
    hpass / out = the state pass and output kernels at (hpass_bv or 16, HPASS_NUM_WARPS) / (out_bv or OUT_BV,
    OUT_NUM_WARPS); prep / akk / wu = the intra kernels at the module constants (prep: the row walk when PREP_ROWS,
    else the tile kernel; prep_rows / prep_tiles: either)."""
    from kernels._offline import compile_offline

    lp, sd = ("*bf16", "*bf16") if bf16 else ("*fp32", "*fp32")
    prec = "tf32" if bf16 else "ieee"
    mm = 1 if bf16 else 0
    specs = {
        "hpass": (_kda_hpass_kernel,
                  dict(kg_in=sd, w_in=sd, u_in=sd, gl_in="*fp32", h_out=sd, vn_out=sd, o=lp, rec_state="*fp32",
                       cu_seqlens="*i32", chunk_offsets="*i32", state_slots="*i32", has_initial_state="*i8",
                       n_seq="i32", n_tok="i32", stride_o="i32", stride_s="i32", qg_in=sd, a_in=sd),
                  dict(H=H, K=K, V=V, BT=BT, BV=min(V, hpass_bv or 16), PREC=prec, MM=mm,
                       PREFETCH=int(HPASS_PREFETCH), OUT=int(HPASS_OUT)),
                  dict(num_warps=HPASS_NUM_WARPS or (8 if (hpass_bv or 16) >= 64 else 4),
                       num_stages=HPASS_NUM_STAGES)),
        "hpass_t": (_kda_hpass_t_kernel,
                    dict(kg_in=sd, w_in=sd, u_in=sd, gl_in="*fp32", qg_in=sd, a_in=sd, o=lp, rec_state="*fp32",
                         cu_seqlens="*i32", chunk_offsets="*i32", state_slots="*i32", has_initial_state="*i8",
                         n_seq="i32", n_tok="i32", stride_o="i32", stride_s="i32"),
                    dict(H=H, K=K, V=V, BT=BT, BV=min(V, hpass_bv or 16), PREC=prec, MM=mm),
                    dict(num_warps=HPASS_T_WARPS or 4, num_stages=HPASS_NUM_STAGES)),
        "out": (_kda_out_kernel,
                dict(qg_in=sd, a_in=sd, h_in=sd, vn_in=sd, o=lp, chunk_offsets="*i32", cu_seqlens="*i32",
                     n_seq="i32", stride_o="i32"),
                dict(PB=16, H=H, K=K, V=V, BT=BT, BV=min(V, out_bv or OUT_BV), PREC=prec, MM=mm,
                     VFAST=int(OUT_VFAST)),
                dict(num_warps=OUT_NUM_WARPS, num_stages=OUT_NUM_STAGES)),
    }
    intra_common = dict(chunk_offsets="*i32", cu_seqlens="*i32", n_seq="i32", g_in="*fp32", rs_in="*fp32")
    specs.update({
        "prep_tiles": (_kda_prep_kernel,
                 dict(q=lp, k=lp, z=lp, A_log="*fp32", dt_bias="*fp32", b=lp, chunk_offsets="*i32",
                      cu_seqlens="*i32", n_seq="i32", qg_out=sd, kg_out=sd, gl_out="*fp32", g_out="*fp32",
                      rs_out="*fp32", stride_q="i32", stride_k="i32", stride_z="i32", stride_b="i32", scale="fp32"),
                 dict(PB=16, H=H, K=K, BT=BT, BK=min(K, PREP_BK), FAST=int(FAST_SOFTPLUS), CS=int(CUMSUM_DOT),
                      NORM1=int(PREP_NORM1), KP=next_pow2(K), STAGES=PREP_STAGES, KG=int(not _akk_kg())),
                 dict(num_warps=PREP_NUM_WARPS, **_maxnreg(PREP_MAXNREG))),
        "prep_rows": (_kda_prep_rows_kernel,
                      dict(q=lp, k=lp, z=lp, A_log="*fp32", dt_bias="*fp32", b=lp, chunk_offsets="*i32",
                           cu_seqlens="*i32", n_seq="i32", qg_out=sd, kg_out=sd, gl_out="*fp32", g_out="*fp32",
                           rs_out="*fp32", stride_q="i32", stride_k="i32", stride_z="i32", stride_b="i32",
                           scale="fp32"),
                      dict(PB=16, H=H, K=K, KP=next_pow2(K), BT=BT, FAST=int(FAST_SOFTPLUS), UNROLL=PREP_ROWS_UNROLL,
                           STAGES=PREP_ROWS_STAGES, KG=int(not _akk_kg()), RB=PREP_ROWS_RB),
                      dict(num_warps=1)),
        "akk": (_kda_akk_lv_kernel, dict(intra_common, q=lp, k=lp, a_out=sd, x_out="*fp32", stride_q="i32",
                                         stride_k="i32", **(dict(kg_out=sd) if _akk_kg() else {}),
                                         **(dict(kb_out=sd) if _akk_kb() else {})),
                dict(PB=16, H=H, K=K, BT=BT, BC=BC, BK=min(K, AKK_BK), PREC=prec, SPLITK=int(AKK_LV_SPLITK),
                     UNCOND=int(AKK_UNCOND), JOUTER=int(AKK_JOUTER if AKK_LV_SPLITK else 0),
                     **(dict(KG=1) if _akk_kg() else {}), **(dict(KB=1) if _akk_kb() else {})),
                dict(num_warps=AKK_NUM_WARPS, **_maxnreg(AKK_MAXNREG))),
        "wu": (_kda_wu_kernel,
               dict(intra_common, k=lp, v=lp, x_in="*fp32", w_out=sd, u_out=sd, stride_k="i32", stride_v="i32",
                    **(dict(kb_in=sd) if _akk_kb() else {})),
               dict(PB=16, H=H, K=K, V=V, BT=BT, BC=BC, BK=min(K, WU_BK), BV=min(V, WU_BV), PREC=prec,
                    LOOP=int(WU_LOOP), KB=int(_akk_kb())),
               dict(num_warps=WU_NUM_WARPS, **_maxnreg(WU_MAXNREG))),
    })
    specs["prep"] = specs["prep_rows" if PREP_ROWS else "prep_tiles"]
    specs = {n: specs[n] for n in which}
    out = {}
    for name, (fn, types, consts, opts) in specs.items():
        div = [n for n in fn.arg_names if n in types and (types[n].startswith("*") or n.startswith("stride"))]
        b = compile_offline(fn, types, consts, arch=arch, divisible=div, extra_options=opts)
        out[name] = (b.regs, b.stack, b.smem)
    return out


def hpass_bv(V: int, P: int, H: int, nsm: int) -> int:
    """The state pass's V tile when HPASS_BV is None: the largest of 64 / 32 giving >= 2 programs ((V / BV) x P x H)
    per SM; else 32 while that still gives ~one per SM (H200 12-04, T=16k, P=1, H=32: BV 32 = 128 programs 0.364 ms
    vs BV 16 = 256 programs 0.377); else 16."""
    for cand in (64, 32):
        if cdiv(V, cand) * P * H >= 2 * nsm:
            return cand
    return 32 if cdiv(V, 32) * P * H >= nsm * 7 // 8 else 16


def _fast_softplus() -> int:
    return int(bool(FAST_SOFTPLUS) and not _interpreting())


def _akk_kg() -> bool:
    """Whether akk writes kg (AKK_KG, on the two-pass akk only); prep writes it otherwise."""
    return bool(AKK_KG and AKK_LV_SPLITK)


def _akk_kb() -> bool:
    """Whether akk writes wu's operand kb (AKK_KB, on the two-pass akk, with wu's one loop)."""
    return bool(AKK_KB and AKK_LV_SPLITK and WU_LOOP == 1)


def _maxnreg(n) -> dict:
    """Launch / compile option capping the registers per thread (not passed under the interpreter)."""
    return {} if (n is None or _interpreting()) else {"maxnreg": int(n)}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _is_pow2(x: int) -> bool:
    return x >= 16 and (x & (x - 1)) == 0


def chunk_offsets_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [P+1] i32 (device) -> chunk_offsets [P+1] i32: the BT-token chunks before each sequence, built on
    the device (no host sync; 5 launches, so a step computes it once for all its KDA layers)."""
    offsets = torch.zeros(cu_seqlens.shape[0], dtype=torch.int32, device=cu_seqlens.device)
    torch.cumsum(torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + (BT - 1), BT, rounding_mode="floor"), 0,
                 out=offsets[1:])
    return offsets


def _plan(q, k, v, z, A_log, dt_bias, b, scale, rec_state, cu_dev, slots, hi, o, P, T, H, K, V, cu_seqlens_cpu,
          buffers=None, chunk_offsets=None):
    """Allocate the scratch and return the launches in order as {stage name: zero-argument callable} (the bench
    times the stages one by one). ``buffers`` (a dict) receives the intra outputs qg, kg, w, u, a, gl (tests)."""
    dev = q.device
    # varlen metadata on device (no host sync): chunk_offsets[n] = chunks before sequence n; the chunk-parallel
    # grids use the upper bound cdiv(T, BT) + P (exact when cu_seqlens_cpu is given); surplus programs exit at once
    if chunk_offsets is None:
        chunk_offsets = chunk_offsets_of(cu_dev)
    if cu_seqlens_cpu is not None:
        cu = [int(x) for x in cu_seqlens_cpu]
        NT = sum((cu[i + 1] - cu[i] + BT - 1) // BT for i in range(P))
    else:
        NT = cdiv(T, BT) + P
    fp32 = q.dtype == torch.float32 and v.dtype == torch.float32
    sdt = torch.float32 if fp32 else torch.bfloat16
    prec = "ieee" if fp32 else "tf32"
    mm = 0 if fp32 else (2 if _interpreting() else 1)
    n_rows = max(NT, 1) * H * BT
    qg = torch.empty(n_rows, K, dtype=sdt, device=dev)
    kg = torch.empty(n_rows, K, dtype=sdt, device=dev)
    w = torch.empty(n_rows, K, dtype=sdt, device=dev)
    u = torch.empty(n_rows, V, dtype=sdt, device=dev)
    a = torch.empty(n_rows, BT, dtype=sdt, device=dev)
    gl = torch.empty(max(NT, 1) * H, K, dtype=torch.float32, device=dev)
    if buffers is not None:
        buffers.update(qg=qg, kg=kg, w=w, u=u, a=a, gl=gl)
    PB = max(16, next_pow2(P))
    nsm = num_sms(dev, cpu=1)
    launches = {}
    if NT > 0:
        # intra scratch: G [rows, K] fp32 (log2 units), rs [rows, 4] fp32 (rq, rk, beta), x [rows, BT] fp32
        # (block inverses + beta-scaled off-diagonal Dkk)
        g2 = torch.empty(n_rows, K, dtype=torch.float32, device=dev)
        rs = torch.empty(n_rows, 4, dtype=torch.float32, device=dev)
        xs = torch.empty(n_rows, BT, dtype=torch.float32, device=dev)
        kbs = torch.empty(n_rows, K, dtype=sdt, device=dev) if _akk_kb() else None   # AKK_KB: wu's w operand

        def prep():
            args = (q, k, z, A_log, dt_bias, b, chunk_offsets, cu_dev, P, qg, kg, gl, g2, rs,
                    q.stride(0), k.stride(0), z.stride(0), b.stride(0), float(scale))
            kw = dict(PB=PB, H=H, K=K, KP=next_pow2(K), BT=BT, FAST=_fast_softplus(), KG=int(not _akk_kg()))
            if PREP_ROWS:  # one warp per (chunk, head) walking the rows
                return _kda_prep_rows_kernel[(NT, H)](*args, **kw, UNROLL=PREP_ROWS_UNROLL, STAGES=PREP_ROWS_STAGES,
                                                      RB=PREP_ROWS_RB, num_warps=1)
            return _kda_prep_kernel[(NT, H)](*args, **kw, BK=min(K, PREP_BK), CS=int(CUMSUM_DOT),
                                             NORM1=int(PREP_NORM1), STAGES=PREP_STAGES, num_warps=PREP_NUM_WARPS,
                                             **_maxnreg(PREP_MAXNREG))

        def akk():
            return _kda_akk_lv_kernel[(BT // BC * NT, H)](
                q, k, g2, rs, chunk_offsets, cu_dev, P, a, xs, q.stride(0), k.stride(0),
                PB=PB, H=H, K=K, BT=BT, BC=BC, BK=min(K, AKK_BK), PREC=prec, SPLITK=int(AKK_LV_SPLITK),
                UNCOND=int(AKK_UNCOND), JOUTER=int(AKK_JOUTER if AKK_LV_SPLITK else 0),
                **(dict(KG=1, kg_out=kg) if _akk_kg() else {}), **(dict(KB=1, kb_out=kbs) if _akk_kb() else {}),
                num_warps=AKK_NUM_WARPS, **_maxnreg(AKK_MAXNREG),
            )

        def wu():
            return _kda_wu_kernel[(NT, H)](
                k, v, g2, rs, xs, chunk_offsets, cu_dev, P, w, u, k.stride(0), v.stride(0),
                PB=PB, H=H, K=K, V=V, BT=BT, BC=BC, BK=min(K, WU_BK), BV=min(V, WU_BV), PREC=prec,
                LOOP=int(WU_LOOP), **(dict(KB=1, kb_in=kbs) if _akk_kb() else {}),
                num_warps=WU_NUM_WARPS, **_maxnreg(WU_MAXNREG),
            )

        launches["prep"] = prep
        launches["akk"] = akk
        launches["wu"] = wu

    big_smem = max_shared_mem(dev) >= 160 * 1024
    # fp32 operands (fp32 inputs) double the state pass's tiles: past a CUDA block's shared memory with the output in
    # it (the interpreter has no such limit: its fp32 tests cover the fused path)
    fuse_out = bool(HPASS_OUT) and big_smem and (sdt.itemsize == 2 or dev.type != "cuda")
    # per-chunk start states h_c [NT, H, K, V] and vn [NT*H*BT, V], both in the MMA operand dtype (not with fuse_out:
    # the state pass writes o itself; its h_out / vn_out arguments are then unused)
    hs = w if fuse_out else torch.empty(max(NT, 1) * H * K, V, dtype=sdt, device=dev)
    vn = u if fuse_out else torch.empty(n_rows, V, dtype=sdt, device=dev)
    hbv = min(V, HPASS_BV or (64 if _interpreting() else hpass_bv(V, P, H, nsm)))
    obv = min(V, OUT_BV)
    # 3 stages need up to 128 KB of smem per block (BV 64; 102 / 108 KB at BV 16 / 32): a GB10 (sm_121, 99 KB per
    # block) takes 2 (70 / 76 / 96 KB)
    h_stages = HPASS_NUM_STAGES if big_smem else min(HPASS_NUM_STAGES, 2)

    def hpass_t():
        return _kda_hpass_t_kernel[(cdiv(V, hbv), P, H)](
            kg, w, u, gl, qg, a, o, rec_state,
            cu_dev, chunk_offsets, slots, hi, P, T,
            o.stride(0), rec_state.stride(0),
            H=H, K=K, V=V, BT=BT, BV=hbv, PREC=prec, MM=mm,
            num_warps=HPASS_T_WARPS or 4, num_stages=h_stages,
        )

    use_t = fuse_out and (HPASS_T == 1 or (HPASS_T == 2 and hbv == 64 and max_shared_mem(dev) >= HPASS_T_SMEM))

    def hpass():
        if use_t:
            return hpass_t()
        return _kda_hpass_kernel[(cdiv(V, hbv), P, H)](
            kg, w, u, gl, hs, vn, o, rec_state,
            cu_dev, chunk_offsets, slots, hi, P, T,
            o.stride(0), rec_state.stride(0),
            H=H, K=K, V=V, BT=BT, BV=hbv, PREC=prec, MM=mm, PREFETCH=int(HPASS_PREFETCH),
            qg_in=qg, a_in=a, OUT=int(fuse_out),
            num_warps=HPASS_NUM_WARPS or (8 if hbv >= 64 else 4), num_stages=h_stages,
        )

    def out():
        grid = (cdiv(V, obv) * NT, H) if OUT_VFAST else (NT, H, cdiv(V, obv))
        return _kda_out_kernel[grid](
            qg, a, hs, vn, o, chunk_offsets, cu_dev, P, o.stride(0),
            PB=PB, H=H, K=K, V=V, BT=BT, BV=obv, PREC=prec, MM=mm, VFAST=int(OUT_VFAST),
            num_warps=OUT_NUM_WARPS, num_stages=OUT_NUM_STAGES,
        )
    launches["hpass"] = hpass
    if NT > 0 and not fuse_out:
        launches["out"] = out
    return launches


def chunk_kda_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    rec_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[Sequence[int]] = None,
    buffers: Optional[dict] = None,
    chunk_offsets: Optional[torch.Tensor] = None,
):
    """Validate and allocate for ``chunk_kda_fwd``; returns (o, {stage: launch}) without launching anything
    (running the launches in order is the op; the bench times them one by one).

    q, k [T, H, K], v [T, H, V] (post-conv+SiLU, pre-L2-norm; token stride may be padded, last dims contiguous);
    z [T, H*K] raw gate input; A_log [H] fp32; dt_bias [H*K] fp32; b [T, H] beta logits; scale (K**-0.5);
    rec_state [S, H, K, V] fp32 pool; cu_seqlens [P+1] int32; state_slots [P] int32;
    has_initial_state [P] bool (None = all True). Returns o [T, H, V] in v.dtype (tokens outside
    [cu[0], cu[-1]) are zero). ``out`` may be given to write in place. No host sync: varlen metadata is built
    on the device; the optional host copy ``cu_seqlens_cpu`` only sizes the chunk grid exactly. ``chunk_offsets``
    (optional, ``chunk_offsets_of(cu_seqlens)``): the same metadata computed once for several calls.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    assert k.shape == (T, H, K) and v.shape[:2] == (T, H), (q.shape, k.shape, v.shape)
    assert _is_pow2(K) and _is_pow2(V), "K and V must be powers of two >= 16"
    assert z.shape[0] == T and z.shape[-1] == H * K and b.shape[0] == T and b.shape[-1] == H
    assert rec_state.shape[1:] == (H, K, V) and rec_state.is_contiguous()
    dev = q.device
    if z.dim() == 3:
        z = z.reshape(T, H * K)
    for t in (q, k, v):
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "head and channel dims must be contiguous"
    if z.stride(-1) != 1:
        z = z.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    A_log = A_log.reshape(-1).float().contiguous()
    dt_bias = dt_bias.reshape(-1).float().contiguous()
    P = cu_seqlens.numel() - 1
    cu_dev = cu_seqlens.to(device=dev, dtype=torch.int32)
    slots = state_slots.to(device=dev, dtype=torch.int32)
    if has_initial_state is None:
        hi = torch.ones(P, dtype=torch.int8, device=dev)
    else:
        hi = has_initial_state.to(device=dev, dtype=torch.int8)
    if out is None:
        o = torch.empty(T, H, V, dtype=v.dtype, device=dev)
    else:
        o = out
        assert o.shape == (T, H, V) and o.stride(-1) == 1 and o.stride(-2) == V
    if P <= 0:
        return o.zero_(), {}
    return o, _plan(q, k, v, z, A_log, dt_bias, b, scale, rec_state, cu_dev, slots, hi, o, P, T, H, K, V,
                    cu_seqlens_cpu, buffers, chunk_offsets)


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    rec_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[Sequence[int]] = None,
    chunk_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """KDA prefill over packed varlen sequences, state read from / written to the slot pool in place; returns o.
    Arguments: see ``chunk_kda_plan``."""
    o, launches = chunk_kda_plan(q, k, v, z, A_log, dt_bias, b, scale, rec_state, cu_seqlens, state_slots,
                                 has_initial_state, out=out, cu_seqlens_cpu=cu_seqlens_cpu,
                                 chunk_offsets=chunk_offsets)
    for fn in launches.values():
        fn()
    return o
