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
* fused_merge (opt-in: variants 'w4 n32 fm*', or KIMI_MLA_FUSED_MERGE=1 on the default config): no stage 2; the last
  unit of a sequence to arrive (per-(sequence, head block) acq_rel counter, reset by that program) merges the
  partials in unit order (_merge_units) and writes the output; program u writes zeros for an empty sequence u.
* w_uv (kernels/mla/absorb.py, the batch-1 decode chain): the output is the W_UV product [N, H, V]; stage 2 is
  replaced by absorb's _uv_kernel (the merge of each head's units over all L columns, then w_uv[h] @ latent), which
  reads stage 1's latent rows instead on the direct path and with fused_merge. Stage 1 and that kernel are PDL
  launches there (stage 1 reads nothing before griddepcontrol.wait).
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
from kernels._tensors import H200_SMEM, arrival_counters, cdiv, max_shared_mem, next_pow2, num_sms, unit_last_stride

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
EARLY_UNITS = 32          # at most this many units hint (x 74 KB per 64-key tile: <= 2.4 MB per layer)
# In-loop L2 hints of tile t + L2_AHEAD after tile t's dots (l2_ahead(); NOT TIMED YET, session 17) for configs without
# their own "l2_ahead" key, i.e. the defaults: 0 = none. KIMI_MLA_L2_AHEAD=N; bench/ablate.py --set
# kernels.mla.decode.L2_AHEAD=2 (the variants 'ls n64 w4 a1|a2|a3' carry the key)
L2_AHEAD = int(os.environ.get("KIMI_MLA_L2_AHEAD", "0"))

# GPU tile configuration (Hopper, L=512/R=64), per cache dtype: BLOCK_H heads share each K tile of BLOCK_N tokens.
# ptxas for sm_90 (Triton 3.9, 16-byte-divisible strides as the JIT specialises them; `python bench/mla.py --ptxas`):
# bf16 = variant 'w4 n32' (32, 32, 4 warps, 2 stages, page tiles): 74 KB smem, 254 regs x 128 threads -> two programs
# per SM, so one loads while the other computes (the tile of one program is single-buffered); H200 12-02 (Triton 3.6,
# L2 flushed, vs 'base' = (32, 64, 8 warps): 1 program per SM): B=64 S=8k 253 vs 332 us (2.38 vs 1.82 TB/s), B=128
# S=8k 476 vs 631 us, B=1 S=128k graph 85.6 vs 99.3 us. fp32 (tests only; IEEE dots run on FMA units, spill):
# BLOCK_N 32, 1 stage = 147 KB.
# bench/mla.py sweeps these on the GPU.
# Since 12-03 the 16-bit default is 'ls n64 r128' (below: 64-key tiles, latent split in column halves, 8 warps capped
# at 128 regs, 2 programs x ~112 KB smem per SM); H200 12-03 (Triton 3.6, L2 flushed, same run): B=64 S=8k 228.8 vs
# 252.3 us, B=128 S=8k 432.0 vs 477.5, B=1 S=128k graph 78.3 vs 84.1, B=1 S=8k graph 20.9 vs 21.1. A device whose
# blocks may not take that much shared memory (GB10 / sm_12x: 99 KB) keeps 'w4 n32' ("16bit-small-smem").
# Since 12-03 (session 9) the 16-bit default is 'ls n64 w4': the same tiles with 4 warps, 35% less ldmatrix traffic
# per tile (see the variant notes); H200 (Triton 3.6, L2 flushed, same run as FlashInfer fa3 0.7.2.post1) vs 'ls n64
# r128': B=64 S=8k 195.5 vs 230.4 us (3.09 vs 2.62 TB/s; FlashInfer 162.8), B=128 S=8k 366.4 vs 432.9 (FlashInfer
# 304.8), B=1 S=128k graph 72.3 vs 78.0 (FlashInfer 80.5), B=1 S=8k graph 20.3 vs 20.9 (FlashInfer 24.1).
DECODE_CFG = {
    "16bit": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True, programs_per_sm=2),
    "16bit-small-smem": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2),
    "fp32": dict(block_h=32, block_n=32, num_warps=8, num_stages=1),
}
DECODE_LARGE_SMEM = 160 * 1024   # bytes a block must be able to opt into for DECODE_CFG["16bit"] (H100/H200: 227 KB)
# Variants that gave wrong results or an illegal address on the H200 (12-03, Triton 3.6; correct under the
# interpreter): kept for the bisection notes above, refused on CUDA (mla_decode_triton) and left out of GPU tests
GPU_BROKEN = ("keys_m tma", "keys_m pf n64", "keys_m s1", "keys_m pf n64 nd", "keys_m pf n64 nd p16")
# Variants timed by `bench/mla.py --sweep-decode` (keys beyond DECODE_CFG's are optional, default False):
# keys_m: keys as the MMA M dimension (S^T = c q^T, acc^T += c^T P^T). On sm_90 all three dots become wgmma with the
#   latent tile straight from smem, and Triton double-buffers that tile (2 x 72 KB cp.async stages; 184 KB, 237 regs).
#   The heads-as-M form runs mma.sync, and Triton 3.9 keeps its c tile single-buffered whatever num_stages is (the
#   tile feeds two dots in two layouts), so loads and MMAs of a program never overlap.
# page_tile: one scalar block-table load per tile (BS % BLOCK_N == 0) instead of a per-row gather.
# warp_spec: tl.range(..., warp_specialize=True). It compiles for sm_90 on Triton 3.6 and 3.9 but changes nothing here
#   (identical smem/regs/PTX): the Hopper warp-specialization pass only splits loops whose loads are TMA descriptor loads.
# tma: full tiles by TMA (host TensorDescriptor boxes of BLOCK_N x L and BLOCK_N x R over the cache rows; Triton
#   double-buffers them behind an mbarrier), the partial last tile by masked pointer loads. Needs keys_m to keep the
#   tile in smem; sm_90 regs: 3.9 255 + 8 B stack, 3.6 255 + 224 B stack (the peeled tail duplicates the body).
# part16: bf16 split partials (stage-1 write + stage-2 read halve; the LSE merge stays fp32).
# pad_heads (h64 *): BLOCK_H=64 with the 32 real heads (rows 32..63 masked) so both dots run wgmma heads-as-M: q from
#   smem, the latent tile from smem (c^T as a transposed view for S, c for P c), P from registers; Triton double-buffers
#   the tile by cp.async. Twice the tensor work of the 32 real heads, FlashMLA's M=64 trade. sm_90 (Triton 3.9, with the
#   mask-free loads): n16 128 KB / 245 regs, n32 144 KB / 255 regs, no spill; n64 216 KB spills (255 regs + 128 B).
# programs_per_sm: resident stage-1 programs per SM the split heuristic aims at (w4 n32: 74 KB, 252 regs x 128 -> 2).
# prefetch (pf*): software pipelining by hand. Triton's pipeliner gives none of the variants above any load/compute
#   overlap: whatever num_stages (2..4, ring of 1 or 2 tile buffers; the block-table load takes a stage of its own), the
#   cp.async of tile t+1 is issued after tile t's dots and waited for (wait_group 0) at the top of iteration t+1, so
#   each SM alternates HBM latency and MMAs (B=64 S=8k: ~5.6 us per 72 KB tile, 1.7 TB/s). prefetch=k loads tiles
#   t+1..t+k into registers (plain predicated ld.global, issued before tile t's dots, consumed k iterations later by the
#   st.shared that feeds the dots) and each tile's block-table entry one iteration before its loads; num_stages=1
#   keeps Triton's pipeliner out. In flight per SM during the dots: k x BLOCK_N x 1152 B (pf n32: 36 KB, pf2: 72 KB).
#   mma.sync heads-as-M re-reads q (36 KB) from smem per warp and tile, so BLOCK_N 16 would be smem-bound; BLOCK_N 64
#   spills at prefetch=1. sm_90: pf n32 72 KB / 193 regs (Triton 3.6: 211), pf2 n32 72 KB / 234 (3.6: 246), no spill.
#   keys_m pf n64 (wgmma, c stored once and read by both dots from smem): 108 KB, 3.6: 239 regs no spill; 3.9 spills
#   (255 + 488 B stack). H200 12-03 (call 2, Triton 3.6): WRONG on the direct path (num_splits=1: rel err 2.8e+01;
#   the split path was never checked), plain keys_m* correct (cp.async ring). Offline 3.6 the direct compile is the one
#   that spills (255 regs + 120 B stack: 16-bit STL/LDL of the carried tile's halves, which Triton keeps one bf16 per
#   register), the split compile does not (239); TTGIR/PTX of both paths order stores, fence.proxy.async, bar.sync and
#   wgmma waits as keys_m page does (no missing barrier found). Bisection variants: 'keys_m pf n64 nd' (no_direct:
#   num_splits=1 runs the split kernel + merge, so the unspilled compile), 'keys_m s1' (register -> smem -> wgmma
#   without prefetch: 1 stage, 206 regs, 108 KB). Carrying the tile as int32 pairs (one register per two values)
#   spilled more on 3.6 (784 B), not kept. 'keys_m pf n64 nd p16': bf16 partials (B=1 S=128k: 132 units' fp32 partials
#   are ~6% of the cache bytes).
# keys_m n32 w4: 'w4 n32' tiles (32 keys, 4 warps, 2 programs per SM) in the keys-as-M form: S^T (M = 32 keys) stays
#   mma.sync, P V becomes wgmma (M = 512 latent rows, c^T from the cp.async tile in smem): about half of w4 n32's
#   mma.sync work moves to wgmma. Triton 3.6 sm_90: 243 regs, no spill, single tile buffer (as w4 n32).
# lsplit (ls*): q, the latent tile and acc in two column halves (_unit_lsplit): S as three dots from zero (q0 c0^T,
#   q1 c1^T, qpe kpe^T: three independent MMA accumulator chains instead of one of 36 k-steps) and two PV dots. It
#   also cuts registers: (32, 64, 8 warps) 170 -> 140 (3.9) / 128 (3.6, no spill), so with maxnreg=128 (ptxas cap) two
#   8-warp programs fit per SM (2 x 112 KB smem): 'ls n64 r128' = 'base' tiles, 2 programs per SM, 72 KB tiles
#   (half the q smem re-reads per byte of 'w4 n32'). sm_90 (3.6 / 3.9): ls n64 r128 128 regs, no spill / 32 B stack;
#   ls n32 w8 r128 74 KB, 128 / 128 + 32 B; w4 n32 ls 252 / 249 regs; ls n64 r128 p16 (3.6) 128, no spill.
# ls n64 w4 (the 16-bit default since session 9): the 64-key tiles of 'ls n64 r128' with 4 warps (2 programs x
#   112 KB per SM). Per 64 keys and 32 heads the ldmatrix traffic falls from 912 LDSM.x4 (8 warps: S split [2 heads x
#   4 keys] over warps, so q is re-read by 4 warps and the tile by 2; 467 KB) to 592 (4 warps [1 x 4]: q by 4, the
#   tile once; 303 KB), and the cross-warp softmax from 11 barriers per tile to 7; each warp issues twice the MMAs.
#   sm_90 (Triton 3.9): 255 regs + 32 B stack (5 STL / 7 LDL in the loop). Counts: the loop lines of
#   `python bench/mla.py --ptxas --only decode` (kernels/_offline.sass_loop_stats, per warp: x4 114 x 8 / 148 x 4).
#   H200 (BENCHMARKS.md, tenth round): 'ls n64 w4' 195-198 us at B=64 S=8k vs 230 for 'ls n64 r128' (FlashInfer
#   fa3 159-163); the same tiles without the latent halves ('w4 n64') 212; with the one-launch merge capped at 8
#   splits ('fm8', fused_merge_max) 297; bf16 partials (p16) within the run-to-run noise. Removed after that run:
#   'w4 n64', 'ls n64 w4 fm8' and fused_merge_max.
# carry_page (cp *, page_tile): the block-table entry of tile t + 1 is loaded in iteration t and carried (_unit_lsplit
#   and the main loop). With the entry loaded in the iteration that uses it, the tile's cp.async depends on a load of
#   the same iteration and Triton's pipeliner (3.9, also 3.6) keeps a ring of ONE tile buffer and waits for all copies
#   (wait_group 0) at the top of every iteration: no load/MMA overlap inside a program, whatever num_stages. Carried,
#   the tile gets a num_stages - 1 deep ring (TTGIR 2x32x256 buffers, async_wait num = 3: the next tile's copies stay
#   in flight during this tile's dots). sm_90 (3.9): ls n32 w4 cp s3 110 KB, 254 regs. keys_m n64 w4 cp: every dot is
#   wgmma (68 HGMMA.64x32x16 per tile: S^T 36, P V 32; no ldmatrix), ring 2, 184 KB (one program per SM), 254 regs;
#   keys_m n32 w4 cp s3 (M = 32 keys: S^T on mma.sync, P V on wgmma) ring 2, 110 KB (two per SM), 241 regs. H200: all
#   slower than 'ls n64 w4' (B=64 S=8k: ls n32 w4 cp s3 220 us, keys_m n32 w4 cp s3 247, keys_m n64 w4 cp 259; the
#   8-warp ones, removed, 251-388): the shared-memory traffic, not the load/MMA overlap, bounds these kernels.
#   h64 n32 cp s3 (NOT TIMED YET, end of session 9): the padded-heads wgmma form (FlashMLA's M = 64) with the carried
#   entry: tile ring 3 (180 KB, one 8-warp program per SM), loop = 74 HGMMA + 4 bar.sync + 8 SHFL per 32-key tile (the
#   softmax stays inside each warp's rows), no ldmatrix; 255 regs + 72 B stack (13 LDL in the loop). The same tiles
#   without the carried entry ('h64 n32', ring 1) took 434 us at B=64 S=8k (fifth round).
# H200 12-04 (session 13, FlashInfer in the same run; BENCHMARKS.md thirteenth round), beside 'ls n64 w4': the carried
#   entry at 2 stages ('ls n64 w4 cp': still one tile buffer, 136 B of stack, 32 LDL in the loop offline) B=1 S=128k
#   graph 70.1 vs 66.9 us, B=64 S=8k 190.7 vs 189.5; PDL launches of both stages on the plain path (pdl=True; stage 2
#   takes GDC since then) 68.1 vs 66.9 at B=1 and equal at B >= 8; bf16 partials 65.8 at B=1 S=128k (16.4 vs 18.5 at
#   S=8k) but 198.5 vs 189.5 at B=64 S=8k. Neither variant kept.
# part16 on w4 n32 (w4 n32 p16): B=1 S=128k runs 256 units, whose fp32 partials (~17 MB written + read) are ~22% of
#   the cache bytes.
# min_split_tokens: smallest work unit (256 = the schedule before 12-02: B=1 S=1k ran as 4 units of 4 tiles; 32 =
#   'w4 n32 mt32': one 32-key tile per unit, B=1 S=1k as 32 units: half the serial stage-1 chain, twice the partials).
# fused_merge (fm *, or KIMI_MLA_FUSED_MERGE=1 on the default config): one launch for split decode. Each unit writes
#   its partial + LSE, then arrives on an acq_rel counter per (sequence, head block) (kernels._tensors
#   .arrival_counters, the gemv split-K pattern); the last of the sequence's non-empty units merges them in unit order
#   (_merge_units: the same bits whichever unit arrives last), writes the output and puts the counter back to 0 for
#   the next launch / graph replay. Program u < N also writes zeros for sequence u if it is empty (no unit arrives).
#   Cost: that one program reads every partial of the sequence, ne x BLOCK_H x L x 4 B (B=1 S=1k default schedule:
#   16 x 64 KB = 1 MB) at one SM's L2 rate instead of stage 2's ~256 programs; fused_max_splits (u8 / u4) caps the
#   default split count so ne <= ~8 / 4 (longer units: a longer stage-1 chain, fewer partials; p16 halves them).
DECODE_VARIANTS = {
    "base": dict(block_h=32, block_n=64, num_warps=8, num_stages=2),
    "base mt256": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, min_split_tokens=256),
    "base p16": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, part16=True),
    "w4 n32": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2),
    "h64 n16": dict(block_h=64, block_n=16, num_warps=8, num_stages=2, pad_heads=True, page_tile=True),
    "h64 n32": dict(block_h=64, block_n=32, num_warps=8, num_stages=2, pad_heads=True, page_tile=True),
    "h64 n32 p16": dict(block_h=64, block_n=32, num_warps=8, num_stages=2, pad_heads=True, page_tile=True,
                        part16=True),
    "h64 n64": dict(block_h=64, block_n=64, num_warps=8, num_stages=2, pad_heads=True, page_tile=True),
    "base page": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, page_tile=True),
    "keys_m": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, keys_m=True),
    "keys_m page": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, keys_m=True, page_tile=True),
    "keys_m s3": dict(block_h=32, block_n=64, num_warps=8, num_stages=3, keys_m=True),
    "keys_m p16": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, keys_m=True, part16=True),
    "keys_m tma": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, keys_m=True, page_tile=True, tma=True),
    "pf n32": dict(block_h=32, block_n=32, num_warps=8, num_stages=1, page_tile=True, prefetch=1),
    "pf2 n32": dict(block_h=32, block_n=32, num_warps=8, num_stages=1, page_tile=True, prefetch=2),
    "keys_m pf n64": dict(block_h=32, block_n=64, num_warps=8, num_stages=1, keys_m=True, page_tile=True, prefetch=1),
    "keys_m s1": dict(block_h=32, block_n=64, num_warps=8, num_stages=1, keys_m=True, page_tile=True),
    "keys_m pf n64 nd p16": dict(block_h=32, block_n=64, num_warps=8, num_stages=1, keys_m=True, page_tile=True,
                                 prefetch=1, no_direct=True, part16=True),
    "keys_m n32 w4": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, keys_m=True, page_tile=True,
                          programs_per_sm=2),
    "keys_m pf n64 nd": dict(block_h=32, block_n=64, num_warps=8, num_stages=1, keys_m=True, page_tile=True,
                             prefetch=1, no_direct=True),
    "w4 n32 p16": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                       part16=True),
    "w4 n32 ls": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                      lsplit=True),
    "ls n64 r128": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, page_tile=True, lsplit=True, maxnreg=128,
                        programs_per_sm=2),
    "ls n64 r128 p16": dict(block_h=32, block_n=64, num_warps=8, num_stages=2, page_tile=True, lsplit=True,
                            maxnreg=128, programs_per_sm=2, part16=True),
    "ls n64 w4": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                      programs_per_sm=2),
    # l2_ahead (NOT TIMED YET, session 17): after tile t's dots, hints for tile t + a's rows into L2 (_unit_lsplit /
    # the plain loop); a1 = the hints' overhead alone (tile t + 1's cp.async follows at once), a2 / a3 one / two
    # iterations of lead (in flight at B >= 1 on 132 SMs: up to ~264 programs x (a - 1) x 72 KB of the 50 MB L2)
    "ls n64 w4 a1": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                         programs_per_sm=2, l2_ahead=1),
    "ls n64 w4 a2": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                         programs_per_sm=2, l2_ahead=2),
    "ls n64 w4 a3": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                         programs_per_sm=2, l2_ahead=3),
    # one program per SM at the look-ahead (half the units at B = 1: longer units, half the partials to merge)
    "ls n64 w4 a3 pp1": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                             programs_per_sm=1, l2_ahead=3),
    "ls n64 w4 a2 p16": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                             programs_per_sm=2, l2_ahead=2, part16=True),
    "w4 n32 a2": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                      l2_ahead=2),
    "ls n64 w4 p16": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, page_tile=True, lsplit=True,
                          programs_per_sm=2, part16=True),
    "h64 n32 cp s3": dict(block_h=64, block_n=32, num_warps=8, num_stages=3, pad_heads=True, page_tile=True,
                          carry_page=True),
    "keys_m n64 w4 cp": dict(block_h=32, block_n=64, num_warps=4, num_stages=2, keys_m=True, page_tile=True,
                             carry_page=True),
    "keys_m n32 w4 cp s3": dict(block_h=32, block_n=32, num_warps=4, num_stages=3, keys_m=True, page_tile=True,
                                carry_page=True, programs_per_sm=2),
    "ls n32 w4 cp s3": dict(block_h=32, block_n=32, num_warps=4, num_stages=3, page_tile=True, lsplit=True,
                            carry_page=True, programs_per_sm=2),
    "ls n32 w8 r128": dict(block_h=32, block_n=32, num_warps=8, num_stages=2, page_tile=True, lsplit=True,
                           maxnreg=128, programs_per_sm=2),
    "w4 n32 mt32": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                        min_split_tokens=32),
    "w4 n32 fm": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                      fused_merge=True),
    "w4 n32 fm u8": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                         fused_merge=True, fused_max_splits=8),
    "w4 n32 fm u4": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                         fused_merge=True, fused_max_splits=4),
    "w4 n32 fm u8 p16": dict(block_h=32, block_n=32, num_warps=4, num_stages=2, page_tile=True, programs_per_sm=2,
                             fused_merge=True, fused_max_splits=8, part16=True),
}
GPU_BLOCK_H = 32  # heads per program cap (the default split heuristic assumes it)
# Every tl.dot operand dim (M, N, K) is padded to >= MIN_DOT: Triton's GPU lowering asserts K >= 16 (M, N >= 16 keeps
# the MMA layouts valid too). The interpreter does not check this, so the wrappers assert it (_check_dots). Padding is
# masked (loads give 0, stores skip it), so it contributes nothing: e.g. the tiny test model, L=32, R=8, H=4, runs
# with BLOCK_R=16 and 16-row head blocks. Kimi shapes (L=512, R=64, H=32) are unaffected.
MIN_DOT = 16


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
def _load_cols(row, offs, cmask, ok, FULL: tl.constexpr, OK_MASK: tl.constexpr):
    """[BLOCK_N, len(offs)] columns ``offs`` of rows ``row``. FULL: every column is real (no mask). OK_MASK: the load
    is predicated on the scalar ``ok`` (a prefetch past the unit's last tile); where, not &: the interpreter turns
    bool & scalar bool into int."""
    if OK_MASK:
        return tl.load(row[:, None] + offs[None, :], mask=tl.where(ok, cmask[None, :], False), other=0.0)
    elif FULL:
        return tl.load(row[:, None] + offs[None, :])
    else:
        return tl.load(row[:, None] + offs[None, :], mask=cmask[None, :], other=0.0)


@triton.jit
def _load_rows(cache_ptr, page, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr, ok,
               L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, OK_MASK: tl.constexpr):
    """Key tile t's rows (_tile_rows): c [BLOCK_N, BLOCK_L] (latent, also V), kpe [BLOCK_N, BLOCK_R]."""
    row = _tile_rows(cache_ptr, page, t, seq_len, offs_n, s_cp, s_cr, BS, BLOCK_N)
    c = _load_cols(row, offs_l, lmask, ok, BLOCK_L == L, OK_MASK)
    kpe = _load_cols(row + L, offs_r, rmask, ok, BLOCK_R == R, OK_MASK)
    return c, kpe


@triton.jit
def _load_rows2(cache_ptr, page, t, seq_len, offs_n, offs_l0, offs_l1, offs_r, lmask0, lmask1, rmask, s_cp, s_cr, ok,
                L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
                BLOCK_N: tl.constexpr, OK_MASK: tl.constexpr):
    """_load_rows with the latent in two column halves (LSPLIT): c0, c1 [BLOCK_N, BLOCK_L / 2], kpe."""
    row = _tile_rows(cache_ptr, page, t, seq_len, offs_n, s_cp, s_cr, BS, BLOCK_N)
    c0 = _load_cols(row, offs_l0, lmask0, ok, BLOCK_L == L, OK_MASK)
    c1 = _load_cols(row, offs_l1, lmask1, ok, BLOCK_L == L, OK_MASK)
    kpe = _load_cols(row + L, offs_r, rmask, ok, BLOCK_R == R, OK_MASK)
    return c0, c1, kpe


@triton.jit
def _load_tile(cache_ptr, bt_row, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr,
               L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr):
    """Key tile t of one sequence: c [BLOCK_N, BLOCK_L], kpe [BLOCK_N, BLOCK_R], row mask (_tile_page + _load_rows)."""
    page = _tile_page(bt_row, t, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
    c, kpe = _load_rows(cache_ptr, page, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr, True, L, R,
                        BLOCK_L, BLOCK_R, BS, BLOCK_N, False)
    return c, kpe, t * BLOCK_N + offs_n < seq_len


@triton.jit
def _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Online-softmax step over one key tile (base 2).
    KEYS_M=False: q [BLOCK_H, BLOCK_L], S [BLOCK_H, BLOCK_N], acc [BLOCK_H, BLOCK_L] (heads = MMA M: 32 -> mma.sync).
    KEYS_M=True: q/qpe passed transposed [BLOCK_L|BLOCK_R, BLOCK_H], S^T = c q^T [BLOCK_N, BLOCK_H],
    acc^T [BLOCK_L, BLOCK_H] += c^T P^T: M = keys (64) / latent (512), so Hopper can use wgmma with c from smem."""
    if KEYS_M:
        s = _dot(c, q, IEEE, UPCAST)
        s += _dot(kpe, qpe, IEEE, UPCAST)
        s = s * qk_scale
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + _dot(tl.trans(c), p.to(c.dtype), IEEE, UPCAST)
    else:
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
                  UPCAST: tl.constexpr):
    """_tile_update (heads as M) with the latent columns in halves (LSPLIT): S = q0 c0^T + q1 c1^T + qpe kpe^T as three
    dots from zero, each scaled before the sum (a dot + add would be folded back into one accumulator chain), so each
    MMA tile has three independent chains of K/32, K/32 and R/16 steps instead of one of (L + R)/16; acc0 / acc1
    [BLOCK_H, BLOCK_L / 2] += P c0 / P c1."""
    s = (_dot(q0, tl.trans(c0), IEEE, UPCAST) * qk_scale + _dot(q1, tl.trans(c1), IEEE, UPCAST) * qk_scale
         + _dot(qpe, tl.trans(kpe), IEEE, UPCAST) * qk_scale)
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(c0.dtype)
    acc0 = acc0 * alpha[:, None] + _dot(p, c0, IEEE, UPCAST)
    acc1 = acc1 * alpha[:, None] + _dot(p, c1, IEEE, UPCAST)
    return m_new, l_i, acc0, acc1


@triton.jit
def _unit_lsplit(q_ptr, qpe_ptr, cache_ptr, bt_row, out_ptr, opart_ptr, lse_ptr, n, u, hb, H, seq_len, t_begin, t_end,
                 qk_scale, s_qn, s_qh, s_pn, s_ph, s_cp, s_cr, s_on, s_oh, s_wu, s_wh, s_lu,
                 L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr, PAGE_TILE: tl.constexpr, CARRY_PAGE: tl.constexpr = False,
                 L2_AHEAD: tl.constexpr = 0, EPL: tl.constexpr = 64, LANES: tl.constexpr = 128):
    """Stage 1 of one work unit with q, the latent tile and acc in two column halves (LSPLIT, heads as M): the same
    loads (Triton's pipeliner) and math as the main path, more independent MMA chains, fewer registers.
    CARRY_PAGE (PAGE_TILE only): the block-table entry of tile t + 1 is loaded by iteration t and carried, so no load
    in the loop depends on another load of the same iteration; Triton's pipeliner then rings the tile num_stages - 1
    deep (cp.async of later tiles in flight during this tile's dots). With the entry loaded in-iteration it keeps one
    buffer and waits for every copy at the top of each iteration.
    L2_AHEAD = a > 0 (PAGE_TILE; GPU only): after tile t's dots, iteration t hints tile t + a's rows into L2 (tiles
    t_begin + 1 .. t_begin + a - 1 before the loop), so while this program's single-buffered tile waits and computes,
    HBM keeps streaming its next tiles. Tile t + 1's own cp.async is issued right after those dots (Triton's
    pipeliner, ring of one buffer), so a = 1 hints nothing early (the overhead-only control); a = 2 gives each hint
    one iteration of lead. Offline sm_90 (Triton 3.9, 'ls n64 w4'): loop 1191 -> 1240-1247 instructions, spills
    5 STL / 7 LDL -> 1 / 12 per tile (hinting at the top of the iteration with the entry carried: 1305-1366, 7-12 /
    39-48)."""
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
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    if CARRY_PAGE:  # t_begin = 0 on an empty direct row: entry 0 exists
        page = _tile_page(bt_row, t_begin, seq_len, offs_n, BS, BLOCK_N, True)
    if L2_AHEAD > 0:
        for i in tl.static_range(1, L2_AHEAD):   # tiles t_begin + 1 .. (tile t_begin's own load is next)
            _hint_tile_l2(cache_ptr, _ahead_page(bt_row, t_begin + i, t_end, BS, BLOCK_N), t_begin + i, t_end,
                          seq_len, s_cp, BS, BLOCK_N, L + R, EPL, LANES)
    for t in range(t_begin, t_end):
        if not CARRY_PAGE:
            page = _tile_page(bt_row, t, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
        c0, c1, kpe = _load_rows2(cache_ptr, page, t, seq_len, offs_n, offs_l0, offs_l1, offs_r, lmask0, lmask1,
                                  rmask, s_cp, s_cr, True, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, False)
        if CARRY_PAGE:  # tile t + 1's entry (clamped to the unit's last tile: a real entry)
            page = _tile_page(bt_row, tl.minimum(t + 1, t_end - 1), seq_len, offs_n, BS, BLOCK_N, True)
        tmask = t * BLOCK_N + offs_n < seq_len
        m_i, l_i, acc0, acc1 = _tile_update2(q0, q1, qpe, c0, c1, kpe, tmask, m_i, l_i, acc0, acc1, qk_scale,
                                             IEEE, UPCAST)
        if L2_AHEAD > 0:
            _hint_tile_l2(cache_ptr, _ahead_page(bt_row, t + L2_AHEAD, t_end, BS, BLOCK_N), t + L2_AHEAD, t_end,
                          seq_len, s_cp, BS, BLOCK_N, L + R, EPL, LANES)
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
        ok = (key < seq_len) & ((t_begin + i) < t_end) & (u < EARLY_UNITS)
        page = tl.load(bt_row + key // BS, mask=ok, other=0).to(tl.int64)
        rows = cache_ptr + page * s_cp + (key % BS).to(tl.int64) * s_cr
        prefetch_l2(rows[:, None] + offs_c[None, :], ok[:, None] & (offs_c < D)[None, :])


@triton.jit
def _hint_tile_l2(cache_ptr, page, ta, t_end, seq_len, s_cp, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  D: tl.constexpr, EPL: tl.constexpr, LANES: tl.constexpr):
    # L2_AHEAD (PAGE_TILE, rows of D elements back to back, 128-byte aligned: the host checks): L2 hints for key tile
    # ta's rows, one contiguous span of its valid rows x D elements in page `page` (_ahead_page); nothing when ta is
    # past the unit. One hint per 128-byte line (EPL elements), LANES lines per step (one per thread).
    nrow = tl.where(ta < t_end, tl.minimum(seq_len - ta * BLOCK_N, BLOCK_N), 0)
    n_lines = (nrow * D + EPL - 1) // EPL
    base = cache_ptr + page.to(tl.int64) * s_cp + ((ta * BLOCK_N) % BS) * D
    for i in tl.static_range((BLOCK_N * D // EPL + LANES - 1) // LANES):
        j = i * LANES + tl.arange(0, LANES)
        prefetch_l2(base + j * EPL, j < n_lines)


@triton.jit
def _ahead_page(bt_row, ta, t_end, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """L2_AHEAD: block-table entry of tile ta (PAGE_TILE: one page per tile); 0 past the unit (never hinted)."""
    return tl.load(bt_row + (ta * BLOCK_N) // BS, mask=ta < t_end, other=0)


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
    KEYS_M: tl.constexpr = False,  # keys as the MMA M dimension (see _tile_update)
    PAGE_TILE: tl.constexpr = False,  # one scalar block-table load per tile (needs BS % BLOCK_N == 0)
    WARP_SPEC: tl.constexpr = False,  # tl.range(..., warp_specialize=True) on the main loop
    c_desc=None,  # TMA (host tensor descriptors over the [NB * BS, L + R] cache rows): c / kpe boxes of BLOCK_N rows
    k_desc=None,
    TMA: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,  # tiles t+1..t+PREFETCH loaded into registers before tile t's dots (DECODE_VARIANTS)
    LSPLIT: tl.constexpr = False,  # latent columns in two halves (_unit_lsplit; heads as M, no PREFETCH / TMA)
    CARRY_PAGE: tl.constexpr = False,  # PAGE_TILE: block-table entry carried one iteration (_unit_lsplit; main loop)
    cnt_ptr=None,  # FUSED: int32 arrival counters [N x head_blocks], zero on entry, left zero
    FUSED: tl.constexpr = False,  # split path only: the last unit of a sequence to arrive merges (no stage 2)
    MERGE_S: tl.constexpr = 16,  # FUSED merge tile: MERGE_S units x BLOCK_H heads x MERGE_L columns per step
    MERGE_L: tl.constexpr = 8,
    MERGE_STAGES: tl.constexpr = 2,  # software-pipeline depth of the merge's column loop
    GDC: tl.constexpr = False,  # PDL launch (w_uv path): nothing is read before the wait, except (EARLY_TILES)
    EARLY_TILES: tl.constexpr = 0,  # with GDC: the schedule and L2 hints of the unit's first tiles before the wait
    EARLY_UNITS: tl.constexpr = 0,
    EPL: tl.constexpr = 64,  # cache elements per 128-byte line
    LP: tl.constexpr = 16,  # next_pow2(lines per cache row)
    L2_AHEAD: tl.constexpr = 0,  # PAGE_TILE, LSPLIT or the plain loop: L2 hints of tile t + L2_AHEAD in iteration t
    LANES: tl.constexpr = 128,  # L2_AHEAD: 32 x num_warps (one hinted line per thread and step)
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
        if FUSED:  # scalars only past the main loop (the [BLOCK_B] plan vectors would hold registers through it)
            ne = (tl.sum(tl.where(sel, tiles, 0), 0) + sl - 1) // tl.maximum(sl, 1)  # non-empty units of n
            u0 = tl.sum(tl.where(sel, first, 0), 0)
            zero_u = tl.sum(tl.where(bm & (offs_b == u) & (tiles == 0), 1, 0), 0) > 0  # sequence u is empty
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
                         PAGE_TILE, CARRY_PAGE, L2_AHEAD, EPL, LANES)
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
        if KEYS_M:
            q = tl.trans(q)  # [BLOCK_L, BLOCK_H]: the B operand of S^T = c q^T
            qpe = tl.trans(qpe)
            acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)
        else:
            acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        bt_row = bt_ptr + n.to(tl.int64) * s_btn

        if TMA:
            # full tiles by TMA (a box cannot stop at seq_len, and the page tail may be NaN), then the partial last
            # tile, if this unit holds it, by masked pointer loads
            t_full = tl.minimum(t_end, seq_len // BLOCK_N)
            full = offs_n >= 0
            for t in tl.range(t_begin, t_full, warp_specialize=WARP_SPEC):
                r0 = tl.load(bt_row + (t * BLOCK_N) // BS) * BS + (t * BLOCK_N) % BS
                c = c_desc.load([r0, 0])
                kpe = k_desc.load([r0, L])
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, full, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
            if t_full < t_end:
                c, kpe, tmask = _load_tile(cache_ptr, bt_row, t_full, seq_len, offs_n, offs_l, offs_r, lmask, rmask,
                                           s_cp, s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
        elif PREFETCH == 1:
            # software pipeline by hand (Triton's own, any num_stages, waits for tile t+1's cp.async at the top of
            # iteration t+1 right after issuing it at the end of iteration t: no overlap). Tile t+1's HBM loads go to
            # registers before tile t's dots and are consumed (stored to smem for the dots) one iteration later; its
            # block-table entries were loaded one iteration before that, so no dependent latency either.
            c, kpe, tmask = _load_tile(cache_ptr, bt_row, t_begin, seq_len, offs_n, offs_l, offs_r, lmask, rmask,
                                       s_cp, s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
            # pages of tile t+1, clamped to the unit's tiles (always a real block-table entry; t_end - 1 is -1 for an
            # empty sequence on the direct path, which read bt_row[-1])
            t1 = tl.maximum(tl.minimum(t_begin + 1, t_end - 1), t_begin)
            page = _tile_page(bt_row, t1, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
            for t in range(t_begin, t_end):
                c_n, kpe_n = _load_rows(cache_ptr, page, t + 1, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp,
                                        s_cr, t + 1 < t_end, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, True)
                page = _tile_page(bt_row, tl.minimum(t + 2, t_end - 1), seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
                tmask = t * BLOCK_N + offs_n < seq_len
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
                c = c_n
                kpe = kpe_n
        elif PREFETCH == 2:
            # as PREFETCH == 1 with tiles t+1 and t+2 in flight (registers) during tile t's dots
            c, kpe, tmask = _load_tile(cache_ptr, bt_row, t_begin, seq_len, offs_n, offs_l, offs_r, lmask, rmask,
                                       s_cp, s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
            t1 = tl.maximum(tl.minimum(t_begin + 1, t_end - 1), t_begin)
            page = _tile_page(bt_row, t1, seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
            c1, kpe1 = _load_rows(cache_ptr, page, t1, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr,
                                  t_begin + 1 < t_end, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, True)
            page = _tile_page(bt_row, tl.maximum(tl.minimum(t_begin + 2, t_end - 1), t_begin), seq_len, offs_n, BS,
                              BLOCK_N, PAGE_TILE)
            for t in range(t_begin, t_end):
                c_n, kpe_n = _load_rows(cache_ptr, page, t + 2, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp,
                                        s_cr, t + 2 < t_end, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, True)
                page = _tile_page(bt_row, tl.minimum(t + 3, t_end - 1), seq_len, offs_n, BS, BLOCK_N, PAGE_TILE)
                tmask = t * BLOCK_N + offs_n < seq_len
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
                c = c1
                kpe = kpe1
                c1 = c_n
                kpe1 = kpe_n
        elif CARRY_PAGE:  # PAGE_TILE: tile t + 1's block-table entry loaded by iteration t (see _unit_lsplit)
            page = _tile_page(bt_row, t_begin, seq_len, offs_n, BS, BLOCK_N, True)
            for t in range(t_begin, t_end):
                c, kpe = _load_rows(cache_ptr, page, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp, s_cr,
                                    True, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, False)
                page = _tile_page(bt_row, tl.minimum(t + 1, t_end - 1), seq_len, offs_n, BS, BLOCK_N, True)
                tmask = t * BLOCK_N + offs_n < seq_len
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
        elif L2_AHEAD > 0:  # PAGE_TILE: the plain loop with tile t + L2_AHEAD's rows hinted into L2 (_unit_lsplit)
            for i in tl.static_range(1, L2_AHEAD):
                _hint_tile_l2(cache_ptr, _ahead_page(bt_row, t_begin + i, t_end, BS, BLOCK_N), t_begin + i, t_end,
                              seq_len, s_cp, BS, BLOCK_N, L + R, EPL, LANES)
            for t in range(t_begin, t_end):
                c, kpe, tmask = _load_tile(cache_ptr, bt_row, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp,
                                           s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)
                _hint_tile_l2(cache_ptr, _ahead_page(bt_row, t + L2_AHEAD, t_end, BS, BLOCK_N), t + L2_AHEAD, t_end,
                              seq_len, s_cp, BS, BLOCK_N, L + R, EPL, LANES)
        else:
            for t in tl.range(t_begin, t_end, warp_specialize=WARP_SPEC):
                c, kpe, tmask = _load_tile(cache_ptr, bt_row, t, seq_len, offs_n, offs_l, offs_r, lmask, rmask, s_cp,
                                           s_cr, L, R, BLOCK_L, BLOCK_R, BS, BLOCK_N, PAGE_TILE)
                m_i, l_i, acc = _tile_update(q, qpe, c, kpe, tmask, m_i, l_i, acc, qk_scale, KEYS_M, IEEE, UPCAST)

        if KEYS_M:
            acc = tl.trans(acc)  # [BLOCK_H, BLOCK_L]
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
    if FUSED:  # split path only (the host asserts not DIRECT); ne, u0, zero_u from the plan above
        heads_f = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask_f = heads_f < H
        if active:
            cnt = cnt_ptr + n * tl.num_programs(1) + hb
            tl.debug_barrier()  # every thread's partial / LSE stores precede the (release) arrival
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == ne - 1:
                _merge_units(opart_ptr, lse_ptr, out_ptr, n, u0, ne, heads_f, hmask_f, s_wu, s_wh, s_lu, s_on, s_oh,
                             L, BLOCK_L, BLOCK_H, MERGE_S, MERGE_L, MERGE_STAGES)
                tl.store(cnt, 0)  # ready for the next launch (stream order)
        # sequence u empty (padded lane, seq_len 0): no unit arrives for it, so program u writes its zeros
        if zero_u:
            offs_z = tl.arange(0, BLOCK_L)
            tl.store(out_ptr + u.to(tl.int64) * s_on + heads_f[:, None] * s_oh + offs_z[None, :],
                     tl.zeros([BLOCK_H, BLOCK_L], out_ptr.dtype.element_ty),
                     mask=hmask_f[:, None] & (offs_z < L)[None, :])


@triton.jit
def _merge_units(opart_ptr, lse_ptr, out_ptr, n, u0, ne, heads, hmask, s_wu, s_wh, s_lu, s_on, s_oh,
                 L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_S: tl.constexpr,
                 MERGE_L: tl.constexpr, MERGE_STAGES: tl.constexpr):
    """LSE merge of units u0 .. u0 + ne - 1 (all non-empty) for BLOCK_H heads into out[n] (FUSED stage 1): the
    stage-2 math, units in a fixed order, [MERGE_S, BLOCK_H, MERGE_L] partial tiles. Loads bypass L1 (.cg): the
    partials were written by other SMs (ordered by the acq_rel arrival)."""
    offs_s = tl.arange(0, MERGE_S)
    mx = tl.full([MERGE_S, BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([MERGE_S, BLOCK_H], tl.float32)
    for k0 in range(0, ne, MERGE_S):
        k = k0 + offs_s
        m2 = (k < ne)[:, None] & hmask[None, :]
        mx = tl.maximum(mx, tl.load(lse_ptr + (u0 + k).to(tl.int64)[:, None] * s_lu + heads[None, :], mask=m2,
                                    other=float("-inf"), cache_modifier=".cg"))
    m = tl.max(mx, 0)  # [BLOCK_H]
    m = tl.where(m > float("-inf"), m, 0.0)
    for k0 in range(0, ne, MERGE_S):
        k = k0 + offs_s
        m2 = (k < ne)[:, None] & hmask[None, :]
        lse = tl.load(lse_ptr + (u0 + k).to(tl.int64)[:, None] * s_lu + heads[None, :], mask=m2,
                      other=float("-inf"), cache_modifier=".cg")
        den += tl.where(m2, tl.exp2(lse - m[None, :]), 0.0)
    d = tl.sum(den, 0)
    dd = tl.where(d > 0, d, 1.0)
    if ne <= MERGE_S:  # one unit chunk (the usual case): the column loop is innermost, so Triton can pipeline it
        m2 = (offs_s < ne)[:, None] & hmask[None, :]
        uu = (u0 + offs_s).to(tl.int64)
        lse = tl.load(lse_ptr + uu[:, None] * s_lu + heads[None, :], mask=m2, other=float("-inf"),
                      cache_modifier=".cg")
        w = tl.where(m2, tl.exp2(lse - m[None, :]), 0.0)  # [MERGE_S, BLOCK_H]
        for l0 in tl.range(0, BLOCK_L, MERGE_L, num_stages=MERGE_STAGES):
            offs_l = l0 + tl.arange(0, MERGE_L)
            lmask = offs_l < L
            o = tl.load(opart_ptr + uu[:, None, None] * s_wu + heads[None, :, None] * s_wh + offs_l[None, None, :],
                        mask=m2[:, :, None] & lmask[None, None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            res = tl.where(d[:, None] > 0, tl.sum(w[:, :, None] * o, 0) / dd[:, None], 0.0)
            tl.store(out_ptr + n.to(tl.int64) * s_on + heads[:, None] * s_oh + offs_l[None, :],
                     res.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])
    else:
        for l0 in range(0, BLOCK_L, MERGE_L):
            offs_l = l0 + tl.arange(0, MERGE_L)
            lmask = offs_l < L
            acc = tl.zeros([BLOCK_H, MERGE_L], tl.float32)
            for k0 in range(0, ne, MERGE_S):
                k = k0 + offs_s
                m2 = (k < ne)[:, None] & hmask[None, :]
                uu = (u0 + k).to(tl.int64)
                lse = tl.load(lse_ptr + uu[:, None] * s_lu + heads[None, :], mask=m2, other=float("-inf"),
                              cache_modifier=".cg")
                w = tl.where(m2, tl.exp2(lse - m[None, :]), 0.0)  # [MERGE_S, BLOCK_H]
                o = tl.load(opart_ptr + uu[:, None, None] * s_wu + heads[None, :, None] * s_wh + offs_l[None, None, :],
                            mask=m2[:, :, None] & lmask[None, None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
                acc += tl.sum(w[:, :, None] * o, 0)
            res = tl.where(d[:, None] > 0, acc / dd[:, None], 0.0)
            tl.store(out_ptr + n.to(tl.int64) * s_on + heads[:, None] * s_oh + offs_l[None, :],
                     res.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])


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
    name = ""  # the DECODE_VARIANTS entry in use, if any (GPU_BROKEN ones are refused on CUDA)
    if config:  # the tile shape of the default, every optional flag from `config` alone (none inherited)
        cfg = {k: cfg[k] for k in ("block_h", "block_n", "num_warps", "num_stages")}
        cfg.update(config)
        name = next((n for n, v in DECODE_VARIANTS.items() if v == config), "")
    elif dtype != torch.float32:  # engine A/B switches, 16-bit caches (read per call; a graph keeps its capture's)
        name = os.environ.get("KIMI_MLA_DECODE_VARIANT", "")  # any DECODE_VARIANTS name, e.g. "w4 n32 fm u4"
        if os.environ.get("KIMI_MLA_FUSED_MERGE", "0") == "1":  # one-launch split decode ('w4 n32 fm')
            name = name or "w4 n32 fm"
        if name:
            cfg = dict(DECODE_VARIANTS[name])
            if os.environ.get("KIMI_MLA_FUSED_MERGE", "0") == "1":
                cfg["fused_merge"] = True
    assert not (on_gpu and name in GPU_BROKEN), f"MLA decode variant {name!r} is wrong on GPUs (GPU_BROKEN)"
    # pad_heads: BLOCK_H = block_h even above H (masked rows), e.g. 64 so Hopper runs wgmma (M = 64 per warpgroup)
    b = dict(
        BLOCK_H=_dot_dim(cfg["block_h"]) if cfg.get("pad_heads") else _block_h(H, cfg["block_h"]),
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


def carry_page(cfg: dict, page_tile: bool) -> bool:
    """Stage 1's CARRY_PAGE for launch config ``cfg`` (DECODE_VARIANTS "carry_page"): only with one block-table entry
    per tile (``page_tile``, the PAGE_TILE constexpr) and not with the register prefetch or TMA loops."""
    return bool(cfg.get("carry_page", False)) and page_tile and not cfg.get("prefetch", 0) and not cfg.get("tma", False)


def l2_ahead(cfg: dict, page_tile: bool, on_gpu: bool, cache=None) -> int:
    """Stage 1's L2_AHEAD for launch config ``cfg`` (key "l2_ahead", or the module's L2_AHEAD when cfg has none): the
    look-ahead in key tiles of the in-loop L2 hints, on the GPU (the interpreter has no prefetch instruction) with one
    block-table entry per tile, in the LSPLIT loop or the plain one (not with the register prefetch, TMA, keys-as-M
    or the carried entry); and, given the cache [NB, BS, D], only where a tile's rows are one 128-byte-aligned span
    (rows of D elements back to back, rows and pages whole lines, an aligned base: _hint_tile_l2's addressing)."""
    a = int(cfg.get("l2_ahead", L2_AHEAD))
    plain = not (cfg.get("prefetch", 0) or cfg.get("tma", False) or cfg.get("keys_m", False)
                 or (cfg.get("carry_page", False) and not cfg.get("lsplit", False)))
    if cache is not None:
        es, D = cache.element_size(), cache.shape[2]
        plain = plain and cache.stride(1) == D and (D * es) % 128 == 0 and (cache.stride(0) * es) % 128 == 0 \
            and cache.data_ptr() % 128 == 0
    return a if a > 0 and on_gpu and page_tile and plain else 0


def default_num_splits(batch: int, max_blocks: int, block_size: int, num_heads: int = 32, num_sms: int = 132,
                       programs_per_sm: int = 1) -> int:
    """Host heuristic from shapes only (graph-capturable): the work-unit budget per sequence of the balanced schedule.
    * 1 (direct: no partials, no merge) when batch x head_blocks programs already fill >= 7/8 of the SM slots
      (``programs_per_sm`` resident stage-1 programs per SM: 1 for the 112-216 KB smem configs, 2 for the default
      'ls n64 w4' and the small-smem 'w4 n32') -- e.g. B=128 on 132 SMs at one per SM. Costs balance on mixed-length
      batches (one long sequence is one program).
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
    (kernels/mla/absorb.py: the split merge -- or, for num_splits 1 / fused-merge configs, a read of the latent row
    stage 1 wrote -- fused with the product; stage 2 is not launched). ``pdl`` (w_uv path only; None: KIMI_PDL):
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
        if cfg.get("fused_merge") and cfg.get("fused_max_splits"):  # bound the partials one program merges
            num_splits = min(num_splits, int(cfg["fused_max_splits"]))
    num_splits = max(1, int(num_splits))
    min_tiles = max(1, (min_split_tokens or cfg.get("min_split_tokens") or MIN_SPLIT_TOKENS) // BLOCK_N)
    BLOCK_B = max(128, next_pow2(N))  # one compile for every batch up to 128 (a 128-lane plan is cheap)
    # no_direct: num_splits 1 runs the split kernel (one unit per sequence) + stage 2 instead of the direct path
    direct = num_splits == 1 and not cfg.get("no_direct", False)
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
    fused = bool(cfg.get("fused_merge", False)) and not direct
    gdc = pdl_launch(pdl_on(pdl) if w_uv is not None else bool(pdl))
    early, early_kw = int(cfg.get("early_tiles", EARLY_TILES)), {}
    epl = 128 // cache.element_size()
    if gdc and early > 0:   # L2 hints of each unit's first tiles before the wait (EARLY_TILES)
        early_kw = dict(EARLY_TILES=early, EARLY_UNITS=int(cfg.get("early_units", EARLY_UNITS)), EPL=epl,
                        LP=next_pow2(cdiv(D, epl)))
    variant = dict(
        FUSED=fused,
        KEYS_M=bool(cfg.get("keys_m", False)),
        PAGE_TILE=bool(cfg.get("page_tile", False)) and BS % BLOCK_N == 0,
        WARP_SPEC=bool(cfg.get("warp_spec", False)) and on_gpu,
        PREFETCH=int(cfg.get("prefetch", 0)),
        LSPLIT=bool(cfg.get("lsplit", False)),
    )
    variant["CARRY_PAGE"] = carry_page(cfg, variant["PAGE_TILE"])
    ahead = l2_ahead(cfg, variant["PAGE_TILE"], on_gpu, cache)
    if ahead:
        variant.update(L2_AHEAD=ahead, EPL=epl, LANES=32 * cfg["num_warps"])
    assert not variant["LSPLIT"] or not (variant["KEYS_M"] or variant["PREFETCH"] or cfg.get("tma")), cfg
    # TMA boxes: exact L / R columns, tiles inside one page, rows viewable as one [NB * BS, L + R] tensor
    if cfg.get("tma", False) and BLOCK_L == L and BLOCK_R == R and BS % BLOCK_N == 0 and cache.stride(0) == BS * D:
        from triton.tools.tensor_descriptor import TensorDescriptor

        rows = cache.view(NB * BS, D)
        variant.update(TMA=True, c_desc=TensorDescriptor.from_tensor(rows, [BLOCK_N, L]),
                       k_desc=TensorDescriptor.from_tensor(rows, [BLOCK_N, R]))
    if fused:  # one counter per (sequence, head block); every launch leaves them at 0
        variant["cnt_ptr"] = arrival_counters(q_lat.device, N * cdiv(H, BLOCK_H))
        # merge tile [16 units, BLOCK_H, 8 fp32 / 16 bf16 columns] = 16 KB, cp.async-pipelined 5 / 4 deep, so up
        # to 16 units take the pipelined one-chunk path (offline sm_90, Triton 3.6 / 3.9: w4 n32 fm 239 / 251 regs,
        # 74 KB, no spill; p16 254 / 255 + 16 B stack on 3.9; [8, 32, 32] fp32 spills 440 B on 3.6)
        p16 = opart.dtype == torch.bfloat16
        variant.update(MERGE_S=int(cfg.get("merge_s", 16)),
                       MERGE_L=min(BLOCK_L, int(cfg.get("merge_l", 16 if p16 else 8))),
                       MERGE_STAGES=int(cfg.get("merge_stages", 4 if p16 else 5)) if on_gpu else 1)
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
    uv_merge = w_uv is not None and not direct and not fused and not (uv_cfg or {}).get("stage2")
    if not direct and not fused and not uv_merge:
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
