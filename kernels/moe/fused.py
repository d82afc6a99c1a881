"""Fused MoE (routed experts) in Triton: align/sort -> grouped GEMM w13 + SiLU*up -> grouped GEMM w2 -> fp32 combine.

Pipeline (no host sync anywhere; every size comes from tensor shapes, so it is CUDA-graph capturable):

1. **Align** (``moe_align``): the M = T*k (token, slot) assignments, flat index ``i = t*k + j``, are grouped by
   expert, each expert's group padded up to a multiple of BLOCK_M. Outputs
   ``sorted_ids [max_padded] i32`` (flat assignment index, padding = sentinel ``M``), ``expert_ids [max_blocks] i32``
   (the expert of each BLOCK_M block) and ``num_post [1] i32`` (padded total; blocks at or past it exit at once).
   ``max_padded = roundup(M + min(M, E) * (BLOCK_M - 1), BLOCK_M)`` bounds the padded total from shapes only.
   Small M: one Triton program (stable sort of the keys ``expert*BLOCK + i`` with ``tl.sort``, ``tl.histogram``).
   Large M on CUDA: three Triton launches over chunks of ids (``_moe_align_chunked``: histograms, plan, per-chunk
   sort + scatter); elsewhere (the interpreter) a handful of capturable torch ops (stable ``torch.sort``,
   scatter_add, cumsum, scatter), the same output bits.
   Within an expert, assignments keep their flat order (stable), so the result is deterministic.
   Decode (M <= ALIGN_IN_GEMM_MAX): no align launch; every GEMM program computes its own block's rows and expert
   from the M ids (``_block_rows_from_ids``: histogram, cumsum, rank within the expert), the same layout.
2. **GEMM 1** (``_moe_gemm1_kernel``): per (block, N tile): rows gathered from x, gate and up tiles of the block's
   expert ``w13[e]`` (read once per block of up to BLOCK_M tokens), two fp32 accumulators,
   ``silu(gate) * up`` in fp32, stored (x.dtype) into ``inter [M, I]`` at the flat assignment row.
3. **GEMM 2** (``_moe_gemm2_kernel``): ``y [M, D] = inter @ w2[e].T`` per block, stored in x.dtype (like HF, whose
   per-expert ``F.linear`` output is x.dtype). Optional split-K (``split2``): S programs per tile write fp32 partials
   ``[S, M, D]`` over K ranges instead.
4. **Combine** (``_moe_combine_kernel``): ``out[t] = sum_j w[t, j] * y[t*k + j]`` in fp32 (j ascending), cast to
   x.dtype; with split-K, ``y[i]`` is the partials' sum in split order rounded to x.dtype. No atomics:
   bit-deterministic. ``fused_moe_add_norm`` skips this launch: GEMM 1 + GEMM 2, then
   kernels.norm.combine_add_rmsnorm does the combine with the residual add and the next layer's RMSNorm. (Removed
   after the H200 A/B: that combine + add + norm in GEMM 2's tail, by the last program to arrive on a counter,
   ``TAIL_NORM``: 50 us per step slower at batch 1, neutral at batch 8.)

Decode N tiles (``get_config`` with top_k): the few selected experts' weights are cut into ``nt`` even ("ragged")
N tiles per row block, ``nt`` picked so that blocks * nt programs spread evenly over the SMs (``balanced_tiles``);
BN-wide tiles leave a tail (batch 1, 9 blocks: 288 GEMM1 programs, 24 SMs run a third tile). KIMI_MOE_TILES=wide
turns this off (A/B switch).

Expert ids must lie in [0, E).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels._jit import INTERPRET, cast_to
from kernels._pdl import gdc_launch_dependents, gdc_wait
from kernels._tensors import H200_SMEM, cdiv, max_shared_mem, next_pow2, num_sms
from kernels.moe.router import dot_acc, dot_mode

# Largest M = T*k aligned by the single-program Triton align kernel; above it the torch path is used.
# KIMI_MOE_ALIGN=torch forces the torch path for every M (fallback switch). Up to 8192 compiles without spills on
# sm_90 / sm_121 (16 warps from 4096 lanes); raising it (a 256-token next turn is M = 2304: ~40 torch launches per
# layer) is an A/B for the H200: bench/ablate.py --prefill 512 --set kernels.moe.fused.ALIGN_SMALL_MAX=8192.
ALIGN_SMALL_MAX = 0 if os.environ.get("KIMI_MOE_ALIGN", "") == "torch" else 2048
# Above it: the chunked Triton align (_moe_align_chunked) on CUDA tensors, the default since session 23 (None: CUDA
# only; the Triton interpreter runs it ~50,000x slower than torch's CPU ops, 172 s for 65,536 ids; True: every device,
# as the tests set it); KIMI_MOE_ALIGN=torch (or ALIGN_CHUNKED=False) keeps torch ops. H200 12-05 (bench/ablate.py
# --prefill 512,1024,8192, two cases each against interleaved controls in one process): the 8192-token first token
# 132.5 / 133.4 ms vs 135.0-137.0 for the torch path; 512 / 1024-token figures moved 28-77 ms between identical cases
# (not readable); decode unchanged (2.200 / 2.201 vs 2.203 / 2.206 ms eager). Equal to the torch path bit for bit on
# the H200 (tests/kernels/test_moe.py -k align).
ALIGN_CHUNKED = False if os.environ.get("KIMI_MOE_ALIGN", "") == "torch" else None
# Largest M for which each GEMM program derives its block's rows from the ids itself (no align launch; decode b1-b3).
# KIMI_MOE_ALIGN=kernel (or torch) turns it off: every M goes through moe_align (A/B switch).
ALIGN_IN_GEMM_MAX = 0 if os.environ.get("KIMI_MOE_ALIGN", "") in ("torch", "kernel") else 32
# Largest M whose decode configs get SM-balanced ragged N tile counts (get_config); KIMI_MOE_TILES=wide: none (A/B)
BALANCE_MAX_M = 0 if os.environ.get("KIMI_MOE_TILES", "") == "wide" else 128
# Decode (BLOCK_M 16) switches of get_config. One token (M == top_k) defaults to the chain measured fastest on the
# H200 (2026-12-03, bench/moe.py --sweep-decode --decode-m 9: 36.97 vs 44.66 us per layer): direct rows, GEMM1 3
# stages, GEMM2 + combine with PDL (no prefetch). KIMI_MOE_DIRECT=0 / KIMI_MOE_PDL=0 turn those off (A/B);
# KIMI_MOE_DIRECT=1 is the default; KIMI_MOE_PDL=1 -> PDL on every BLOCK_M-16 decode config, "=prefetch" adding the L2
# prefetch of GEMM2's rows, ",evict" evict_first loads, ",gemm1" GEMM1 launched with PDL too (MoEConfig.pdl1)
DECODE_DIRECT = os.environ.get("KIMI_MOE_DIRECT", "1") == "1"
_PDL_ENV = os.environ.get("KIMI_MOE_PDL", "")
_PDL = set(_PDL_ENV.split(",")) - {"0", ""}
DECODE_PDL, DECODE_PREFETCH, DECODE_EVICT = bool(_PDL), "prefetch" in _PDL, "evict" in _PDL
DECODE_PDL_T1 = _PDL_ENV != "0"          # PDL at one token unless switched off
DECODE_PDL1 = "gemm1" in _PDL
# With DECODE_PREFETCH: K elements of each GEMM2 weight row hinted into L2 before the wait (0: the whole row, as
# measured on the H200 12-03 with "prefetch": b1 +150 us per step; the whole 42 MB of w2 rows then competes with
# GEMM1's 85 MB stream for L2). A few MB, like the skinny GEMM's 4 MB PDL head (kernels.gemv.PDL_L2_MB), is untimed:
# bench/ablate.py --set "kernels.moe.fused.DECODE_PREFETCH=True;kernels.moe.fused.DECODE_PREFETCH_K=128"
# (128 elements: 256 B of each row, 9 x 2304 rows = 5.3 MB at b1). KIMI_MOE_PREFETCH_K=N
DECODE_PREFETCH_K = int(os.environ.get("KIMI_MOE_PREFETCH_K", "0"))
# One-token GEMM1: row blocks counted as L2-resident when its tiles are balanced over the SMs (get_config). 1 = the
# shared expert, appended last, whose w13 the decode router hints into L2 (backend.model.kimi_linear
# .ROUTER_L2_HINT_MB): the 8 routed blocks then take 33 tiles each (264 HBM programs, 2 per SM) and the shared
# block's 33 L2-hit programs ride on top, instead of 44 tiles per block (396 = 3 per SM, the hinted ones among them,
# so the SMs streaming three HBM tiles still set the time). 0: every block streams from HBM. H200 12-04 (bench/
# ablate.py --batch 1 --set kernels.moe.fused.DECODE_L2_BLOCKS=1, interleaved controls): b1 step 2.234 vs 2.232-2.233,
# and 2.213 vs 2.212-2.214 with the ragged gemv tiles: a tie, so 0 stays
DECODE_L2_BLOCKS = int(os.environ.get("KIMI_MOE_L2_BLOCKS", "0"))
# (Removed in session 25: decode GEMM1 / GEMM2 in-loop L2 hints of the weight rows' K slice n steps ahead,
# KIMI_MOE_L2_AHEAD; H200, session 19, BENCHMARKS.md: the b1 step 176-210 us slower. Last present in cb00f87.)
# (Removed in session 23: one-token N tile widths BN1 16 / BN2 32, 88 tiles per expert = 792 programs instead of 396,
# after a pure-read kernel over the 9 experts had read w13 at 3.89 vs 3.67 TB/s with 792 programs. In the model, H200
# bench/ablate.py --batch 1, two cases against interleaved controls: 2.509 / 2.508 ms per step vs 2.206 / 2.203.)


# ----------------------------------------------------------------------------------------------------------------
# 1. align
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_align_small_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, npost_ptr, scratch_ptr, M, E, max_padded,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, FILL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    valid = offs < M
    e = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)  # padding lanes -> expert E (sorted last)
    # sentinel everywhere (the real rows are scattered over it after the barrier)
    for start in range(0, max_padded, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + o, tl.zeros((FILL,), dtype=tl.int32) + M, mask=o < max_padded)
    # per-expert counts, padded counts, exclusive starts
    eo = tl.arange(0, BLOCK_E)
    counts = tl.histogram(e, BLOCK_E)
    counts = tl.where(eo < E, counts, 0)
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    uend = tl.cumsum(counts, axis=0)
    tl.store(scratch_ptr + eo, pend - padded)
    tl.store(scratch_ptr + BLOCK_E + eo, uend - counts)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    # stable sort by expert: keys are unique (expert, flat index)
    keys = tl.sort(e * BLOCK + offs)
    se = keys // BLOCK
    sidx = keys % BLOCK
    tl.debug_barrier()
    sv = se < E
    pstart = tl.load(scratch_ptr + se, mask=sv, other=0)
    ustart = tl.load(scratch_ptr + BLOCK_E + se, mask=sv, other=0)
    pos = pstart + (offs - ustart)
    tl.store(sorted_ptr + pos, sidx, mask=sv)
    # every block of an expert starts with a real row, so the first row of each block names its expert
    tl.store(expert_ids_ptr + pos // BM, se, mask=sv & (pos % BM == 0))


# Large M (prefill), ALIGN_CHUNKED: three launches instead of ~40 torch kernels (a radix sort among them; H200
# session 20: a 1k-token prefill step launched ~2,000 kernels, ~1,000 of them this alignment, and idled 47% of its
# wall time on the host).
# Chunks of ALIGN_CHUNK ids: (1) per-chunk expert histograms (and the sentinel fill), (2) one program turns them into
# each chunk's destination offsets per expert, the padded block -> expert table and the padded total, (3) each chunk
# sorts its (expert, index) keys and scatters its rows. Stable like the torch path (experts ascending, flat order
# within an expert); the same output bits.
ALIGN_CHUNK = 1024
ALIGN_MAX_CHUNKS = 256   # the plan program loops over the chunks (one program); above it the torch path


@triton.jit
def _moe_align_hist_kernel(ids_ptr, counts_ptr, sorted_ptr, M, E, max_padded, fill_per,
                           C: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr):
    c = tl.program_id(0)
    offs = c * C + tl.arange(0, C)
    e = tl.load(ids_ptr + offs, mask=offs < M, other=E).to(tl.int32)
    eo = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + c * BLOCK_E + eo, tl.where(eo < E, tl.histogram(e, BLOCK_E), 0))
    for start in range(c * fill_per, tl.minimum((c + 1) * fill_per, max_padded), FILL):  # sentinel M everywhere
        o = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + o, tl.zeros((FILL,), dtype=tl.int32) + M, mask=o < max_padded)


@triton.jit
def _moe_align_plan_kernel(counts_ptr, offset_ptr, expert_ids_ptr, npost_ptr, NC, E, max_blocks,
                           CB: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, TB: tl.constexpr):
    # counts [NC, BLOCK_E] in blocks of CB chunks (a [CB, BLOCK_E] tile at a time: any chunk count fits the registers
    # and shared memory of every target, GB10's 99 KB included)
    eo = tl.arange(0, BLOCK_E)
    tot = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, NC, CB):                    # pass 1: rows per expert
        rc = c0 + tl.arange(0, CB)
        tot += tl.sum(tl.load(counts_ptr + rc[:, None] * BLOCK_E + eo[None, :], mask=(rc < NC)[:, None], other=0),
                      axis=0)
    padded = (tot + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    carry = tl.zeros((BLOCK_E,), tl.int32)          # rows of expert e in the chunks before this block
    for c0 in range(0, NC, CB):                    # pass 2: each chunk's destination offsets per expert
        rc = c0 + tl.arange(0, CB)
        cmask = (rc < NC)[:, None]
        cnt = tl.load(counts_ptr + rc[:, None] * BLOCK_E + eo[None, :], mask=cmask, other=0)   # [CB, BLOCK_E]
        before = carry[None, :] + tl.cumsum(cnt, axis=0) - cnt
        local = tl.cumsum(cnt, axis=1) - cnt       # rows of the experts before e within chunk c
        # row j of expert e in chunk c (position p = local + j in the chunk's sorted order) goes to
        # pstart[e] + before[c, e] + j = offset[c, e] + p
        tl.store(offset_ptr + rc[:, None] * BLOCK_E + eo[None, :], pstart[None, :] + before - local, mask=cmask)
        carry += tl.sum(cnt, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(npost_ptr, total)
    for b0 in range(0, max_blocks, TB):            # block b -> its expert (0 past the padded total, as the torch path)
        b = b0 + tl.arange(0, TB)
        ex = tl.sum(((pend[None, :] <= (b * BM)[:, None]) & (eo < E)[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(b * BM < total, ex, 0), mask=b < max_blocks)


@triton.jit
def _moe_align_scatter_kernel(ids_ptr, offset_ptr, sorted_ptr, M, E, C: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, C)
    e = tl.load(ids_ptr + c * C + i, mask=c * C + i < M, other=E).to(tl.int32)
    keys = tl.sort(e * C + i)                      # the chunk's rows by (expert, index)
    se = keys // C
    sv = se < E
    off = tl.load(offset_ptr + c * BLOCK_E + se, mask=sv, other=0)
    tl.store(sorted_ptr + off + i, c * C + keys % C, mask=sv)


def _moe_align_chunked(flat: torch.Tensor, E: int, block_m: int, max_padded: int, max_blocks: int):
    dev, M, C = flat.device, flat.numel(), ALIGN_CHUNK
    NC = cdiv(M, C)
    BLOCK_E = max(16, next_pow2(E + 1))
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(NC, BLOCK_E, dtype=torch.int32, device=dev)
    offset = torch.empty(NC, BLOCK_E, dtype=torch.int32, device=dev)
    _moe_align_hist_kernel[(NC,)](flat, counts, sorted_ids, M, E, max_padded, cdiv(max_padded, NC),
                                  C=C, BLOCK_E=BLOCK_E, FILL=1024, num_warps=4)
    _moe_align_plan_kernel[(1,)](counts, offset, expert_ids, num_post, NC, E, max_blocks,
                                 CB=8, BLOCK_E=BLOCK_E, BM=block_m, TB=16, num_warps=8)
    _moe_align_scatter_kernel[(NC,)](flat, offset, sorted_ids, M, E, C=C, BLOCK_E=BLOCK_E, num_warps=4)
    return sorted_ids, expert_ids, num_post


def max_padded_size(M: int, E: int, block_m: int) -> int:
    n = M + min(M, E) * (block_m - 1)
    return cdiv(n, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """-> (sorted_ids [max_padded] i32, expert_ids [max_blocks] i32, num_post [1] i32). See module docstring."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    M = flat.numel()
    E = num_experts
    max_padded = max_padded_size(M, E, block_m)
    max_blocks = max_padded // block_m
    if M <= ALIGN_SMALL_MAX:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
        num_post = torch.empty(1, dtype=torch.int32, device=dev)
        BLOCK = max(16, next_pow2(M))
        BLOCK_E = max(16, next_pow2(E + 1))
        scratch = torch.empty(2 * BLOCK_E, dtype=torch.int32, device=dev)
        _moe_align_small_kernel[(1,)](
            flat.contiguous(), sorted_ids, expert_ids, num_post, scratch, M, E, max_padded,
            BLOCK=BLOCK, BLOCK_E=BLOCK_E, BM=block_m, FILL=1024,
            num_warps=16 if BLOCK >= 4096 else (8 if BLOCK >= 1024 else 4),   # 4096 / 8192 lanes: 58 / 110 regs
        )
        return sorted_ids, expert_ids, num_post
    chunked = flat.is_cuda if ALIGN_CHUNKED is None else ALIGN_CHUNKED
    if chunked and cdiv(M, ALIGN_CHUNK) <= ALIGN_MAX_CHUNKS:
        return _moe_align_chunked(flat.contiguous(), E, block_m, max_padded, max_blocks)
    # torch ops (capturable: no .item(), no boolean indexing)
    flat = flat.to(torch.int64)
    se, order = torch.sort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    ustart = torch.cumsum(counts, 0) - counts
    pos = torch.arange(M, device=dev) - ustart[se] + pstart[se]
    sorted_ids = torch.full((max_padded,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    expert_ids = torch.zeros(max_blocks + 1, dtype=torch.int32, device=dev)
    blk = torch.where(pos % block_m == 0, pos // block_m, torch.full_like(pos, max_blocks))
    expert_ids.scatter_(0, blk, se.to(torch.int32))
    num_post = pend[-1:].to(torch.int32)
    return sorted_ids, expert_ids[:max_blocks], num_post


@triton.jit
def _block_rows_from_ids(ids_ptr, pid_m, M, E, BM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """moe_align's layout for one block, computed from the M <= BLOCK ids alone -> (idx [BM] flat assignment indices,
    sentinel M for padding; the block's expert; the padded total). Same layout as moe_align: experts ascending, each
    padded to a multiple of BM, rows of an expert in flat order."""
    offs = tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < M, other=E).to(tl.int32)  # padding lanes -> expert E (no block)
    eo = tl.arange(0, BLOCK_E)
    counts = tl.where(eo < E, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    start = pid_m * BM
    ex = tl.sum((pend <= start).to(tl.int32), axis=0)            # pend is non-decreasing: the block's expert
    pstart = tl.sum(tl.where(eo == ex, pend - padded, 0), axis=0)
    want = start - pstart + tl.arange(0, BM)                       # ranks within expert ex of the block's rows
    match = e == ex
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    hit = match[None, :] & (rank[None, :] == want[:, None])        # [BM, BLOCK]
    idx = tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, tl.sum(tl.where(hit, offs[None, :], 0), axis=1), M)
    return idx, ex, tl.sum(padded, axis=0)


# ----------------------------------------------------------------------------------------------------------------
# 2./3. grouped GEMMs
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _block_rows(sorted_ptr, expert_ids_ptr, npost_ptr, ids_ptr, M, N, E, NT, BM: tl.constexpr, BN: tl.constexpr,
                RAGGED: tl.constexpr, IDS_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's row block, its N columns [n_lo, n_hi), the block's rows idx [BM] (>= M: padding), its expert and
    the padded row count: from moe_align's outputs, (IDS_BLOCK > 0) derived from the ids by _block_rows_from_ids, or
    (IDS_BLOCK < 0, "direct") one block per assignment: block b is row b alone, expert ids[b] (no sort, no histogram:
    one id load before the weight loads; an expert chosen by several assignments is streamed once per assignment).
    NT N tiles per row block: BN wide (RAGGED False), or (RAGGED) N split evenly into NT tiles of N // NT or
    N // NT + 1 <= BN columns, so that blocks * NT programs can be a multiple of the SM count (no wave tail)."""
    pid = tl.program_id(0)
    pid_m = pid // NT
    pid_n = pid % NT
    if RAGGED:
        n_lo = pid_n * N // NT
        n_hi = (pid_n + 1) * N // NT
    else:  # n_lo a multiple of BN: the compiler keeps the stores vectorised
        n_lo = pid_n * BN
        n_hi = N
    if IDS_BLOCK < 0:
        idx = tl.where(tl.arange(0, BM) == 0, pid_m, M)
        e = tl.load(ids_ptr + pid_m)
        npost = (pid_m + 1) * BM
    elif IDS_BLOCK > 0:
        idx, e, npost = _block_rows_from_ids(ids_ptr, pid_m, M, E, BM, IDS_BLOCK, BLOCK_E)
    else:
        npost = tl.load(npost_ptr)
        idx = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        e = tl.load(expert_ids_ptr + pid_m)
    return pid_m, n_lo, n_hi, idx, e, npost


@triton.jit
def _prefetch_rows_l2(ptrs, nbytes):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16, 16-byte aligned) from each pointer of ptrs: brings
    weight rows into L2 without registers or shared memory (sm_90)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptrs.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "E", "NT"])  # runtime sizes: one compile for every batch size / tile count
def _moe_gemm1_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    M, N, K, stride_xm, stride_we, stride_wn, stride_om, ids_ptr, E, NT,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    MODE: tl.constexpr, INTERP: tl.constexpr, IDS_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, RAGGED: tl.constexpr,
    GDC: tl.constexpr = False, W_EVICT: tl.constexpr = "", WAIT: tl.constexpr = False, SHARED_PF: tl.constexpr = False,
):
    """inter[idx, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, N + n]) for the rows idx of one block.
    GDC: signal at once that a PDL-launched GEMM2 may start its CTAs as this kernel's CTAs retire (its pre-wait part
    then overlaps this kernel's tail; with WAIT only once past the wait, so that the dependent never reads ids
    before the router is done). WAIT: launched with PDL after the router: nothing is read before griddepcontrol.wait
    but, with SHARED_PF (direct rows), the programs of each token's last column prefetch expert E - 1's gate and up
    rows into L2 (speculative: the model's shared expert, appended last by the router; useless, not wrong, else).
    W_EVICT: the weight loads' L2 eviction policy ("evict_first": streamed once,
    so they leave L2 to what is read again, e.g. GEMM2 weights prefetched by a PDL GEMM2).
    IDS_BLOCK > 0: the block's rows come from the ids (_block_rows_from_ids), not from moe_align's outputs; < 0: one
    block per assignment (direct, see _block_rows).
    Grid: (blocks * NT,); NT and RAGGED as in _block_rows."""
    if WAIT:
        if SHARED_PF:
            pf_m = tl.program_id(0) // NT
            if pf_m % TOP_K == TOP_K - 1:
                pf_n = tl.program_id(0) % NT
                if RAGGED:
                    lo, hi = pf_n * N // NT, (pf_n + 1) * N // NT
                else:
                    lo, hi = pf_n * BN, tl.minimum(pf_n * BN + BN, N)
                rows = tl.minimum(lo + tl.arange(0, BN), hi - 1).to(tl.int64)
                nbytes = (K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)) // 16 * 16 + tl.zeros_like(rows)
                shared = w_ptr + (E - 1).to(tl.int64) * stride_we + rows * stride_wn
                _prefetch_rows_l2(shared, nbytes.to(tl.int32))
                _prefetch_rows_l2(shared + N * stride_wn, nbytes.to(tl.int32))
        gdc_wait()
    if GDC:
        gdc_launch_dependents()
    pid_m, n_lo, n_hi, idx, e, npost = _block_rows(sorted_ptr, expert_ids_ptr, npost_ptr, ids_ptr, M, N, E, NT,
                                                   BM, BN, RAGGED, IDS_BLOCK, BLOCK_E)
    if pid_m * BM >= npost:
        return
    e = e.to(tl.int64)
    row_ok = idx < M
    tok = (idx // TOP_K).to(tl.int64)
    offs_n = n_lo + tl.arange(0, BN)
    n_ok = offs_n < n_hi
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:  # no K mask: keeps the contiguous K loads vectorised
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0, eviction_policy=W_EVICT)
            bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0, eviction_policy=W_EVICT)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bmask = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(g_ptrs, mask=bmask, other=0.0, eviction_policy=W_EVICT)
            bu = tl.load(u_ptrs, mask=bmask, other=0.0, eviction_policy=W_EVICT)
        acc_g = dot_acc(a, bg, acc_g, MODE)
        acc_u = dot_acc(a, bu, acc_u, MODE)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    o_ptrs = out_ptr + idx[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, cast_to(act, out_ptr.dtype.element_ty, INTERP), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "E", "NT", "k_steps"])
def _moe_gemm2_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npost_ptr,
    M, N, K, stride_am, stride_we, stride_wn, stride_os, stride_om, ids_ptr, E, NT, k_steps,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
    INTERP: tl.constexpr, IDS_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, RAGGED: tl.constexpr,
    GDC: tl.constexpr = False, PREFETCH: tl.constexpr = 0, W_EVICT: tl.constexpr = "",
):
    """out[s, idx, n] = inter[idx, Ks] . w2[e, n, Ks] for the rows idx of one block and the K range
    Ks = [s * k_steps * BK, (s + 1) * k_steps * BK) of split s = program_id(1) (one split: the whole K, out = y in
    x.dtype; several: fp32 partials [S, M, N], summed in split order by the combine kernel, no atomics).
    Grid: (blocks * NT, S); IDS_BLOCK, NT and RAGGED as in _moe_gemm1_kernel.
    GDC (launched with PDL after GEMM1): the rows, expert and weight addresses (and with PREFETCH > 0 an L2 prefetch
    of the first PREFETCH K elements of each of this tile's weight rows: no dependence on GEMM1) before waiting for
    GEMM1's inter; then signal the (PDL-launched) combine. W_EVICT as in _moe_gemm1_kernel."""
    pid_m, n_lo, n_hi, idx, e, npost = _block_rows(sorted_ptr, expert_ids_ptr, npost_ptr, ids_ptr, M, N, E, NT,
                                                   BM, BN, RAGGED, IDS_BLOCK, BLOCK_E)
    if pid_m * BM >= npost:
        return
    _gemm2_tile(a_ptr, w_ptr, out_ptr, M, K, stride_am, stride_we, stride_wn, stride_os, stride_om, k_steps,
                n_lo, n_hi, idx, e, BM, BN, BK, EVEN_K, MODE, INTERP, GDC, PREFETCH, W_EVICT)


@triton.jit
def _gemm2_tile(a_ptr, w_ptr, out_ptr, M, K, stride_am, stride_we, stride_wn, stride_os, stride_om, k_steps,
                n_lo, n_hi, idx, e, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                MODE: tl.constexpr, INTERP: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr,
                W_EVICT: tl.constexpr):
    # one live block's tile of _moe_gemm2_kernel (its docstring): PDL wait, K loop, store
    pid_s = tl.program_id(1)
    k_lo = pid_s * k_steps * BK                 # a multiple of BK: the K loads stay aligned
    k_hi = tl.minimum(k_lo + k_steps * BK, K)
    e = e.to(tl.int64)
    row_ok = idx < M
    row = idx.to(tl.int64)
    offs_n = n_lo + tl.arange(0, BN)
    n_ok = offs_n < n_hi
    offs_k = tl.arange(0, BK)
    if GDC:
        if PREFETCH > 0:  # rows past n_hi prefetch row n_hi - 1 again (no masked variant of the instruction)
            pf_rows = tl.minimum(offs_n, n_hi - 1).to(tl.int64)
            pf_bytes = tl.minimum(k_hi - k_lo, PREFETCH) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            _prefetch_rows_l2(w_ptr + e * stride_we + pf_rows * stride_wn + k_lo, pf_bytes + tl.zeros_like(offs_n))
        gdc_wait()
        gdc_launch_dependents()
    a_ptrs = a_ptr + row[:, None] * stride_am + k_lo + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + k_lo + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0, eviction_policy=W_EVICT)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy=W_EVICT)
        acc = dot_acc(a, b, acc, MODE)
        a_ptrs += BK
        b_ptrs += BK
    o_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + row[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, cast_to(acc, out_ptr.dtype.element_ty, INTERP), mask=row_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------------------------
# 4. combine
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, D, stride_ys, TOP_K: tl.constexpr, SPLIT: tl.constexpr,
                        BD: tl.constexpr, INTERP: tl.constexpr, GDC: tl.constexpr = False):
    """out[t] = sum_j w[t, j] * y[t*k + j] in fp32. SPLIT > 1: y holds gemm2's fp32 K partials [SPLIT, M, D]; each
    y row is their sum in split order rounded to out's dtype (as the one-split gemm2 stores it), then weighted.
    GDC: launched with PDL after GEMM2 (waits for it first)."""
    if GDC:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = offs < D
    acc = combine_row(y_ptr, w_ptr, t, offs, ok, D, stride_ys, TOP_K, SPLIT, out_ptr.dtype.element_ty, INTERP)
    tl.store(out_ptr + t * D + offs, cast_to(acc, out_ptr.dtype.element_ty, INTERP), mask=ok)


@triton.jit
def combine_row(y_ptr, w_ptr, t, offs, mask, D, stride_ys, TOP_K: tl.constexpr, SPLIT: tl.constexpr, DT: tl.constexpr,
                INTERP: tl.constexpr):
    """fp32 sum_j w[t, j] * y[t*k + j] over the columns offs (SPLIT > 1: each y row is the sum of its fp32 K
    partials in split order, rounded to DT first). Shared by _moe_combine_kernel and kernels.norm's fused
    combine + add + RMSNorm, so both round alike."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        y_ptrs = y_ptr + (t * TOP_K + j) * D + offs
        yj = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        if SPLIT > 1:
            for s in tl.static_range(1, SPLIT):
                yj += tl.load(y_ptrs + s * stride_ys, mask=mask, other=0.0)
            yj = cast_to(yj, DT, INTERP).to(tl.float32)
        acc += wj * yj
    return acc


# ----------------------------------------------------------------------------------------------------------------
# configs (from shapes only; no autotuning, so capture-safe)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    BM: int
    BN1: int  # GEMM1 N tile (per gate / up accumulator)
    BN2: int
    BK: int
    num_warps: int
    num_stages: int
    nt1: int = 0     # GEMM1 N tiles per row block: 0 -> cdiv(I, BN1) BN1-wide tiles; > 0 -> I split evenly (RAGGED)
    nt2: int = 0     # the same for GEMM2 over D
    split2: int = 1  # GEMM2 K splits (fp32 partials summed in the combine kernel)
    BK2: int = 0     # GEMM2 K tile, warps, stages; 0 -> as GEMM1
    warps2: int = 0
    stages2: int = 0
    direct: bool = False  # one row block per assignment (no sort/histogram; for T = 1, where ids are distinct)
    pdl: bool = False     # GEMM2 and the combine launched with PDL (their prologue overlaps the previous kernel's tail)
    prefetch2: int = 0    # with pdl: K elements of each GEMM2 weight row prefetched into L2 before the wait
    evict: bool = False   # weight loads of both GEMMs evict_first in L2 (streamed once)
    ids_rows: int = 0     # largest M whose GEMM programs derive their rows from the ids (0: ALIGN_IN_GEMM_MAX)
    pdl1: bool = False    # GEMM1 launched with PDL (gains only if the router signals early; direct: prefetches E - 1)

    def short(self) -> str:
        s = f"{self.BM},{self.BN1},{self.BN2},{self.BK},{self.num_warps},{self.num_stages}"
        extra = [f"{k}={v}" for k, v in (("nt1", self.nt1), ("nt2", self.nt2), ("split2", self.split2),
                                          ("BK2", self.BK2), ("warps2", self.warps2), ("stages2", self.stages2),
                                          ("direct", self.direct), ("pdl", self.pdl), ("prefetch2", self.prefetch2),
                                          ("evict", self.evict), ("ids_rows", self.ids_rows), ("pdl1", self.pdl1))
                 if v != MoEConfig.__dataclass_fields__[k].default]
        return s + ("," + ",".join(extra) if extra else "")


def expected_blocks(M: int, E: int, top_k: int) -> int:
    """Expected BLOCK_M-16 row blocks for T = M / top_k tokens with distinct uniform ids per token: the expected
    number of distinct experts, E * (1 - (1 - k/E)^T) (exact for T = 1; decode blocks hold <= 16 rows)."""
    T = max(M // max(top_k, 1), 1)
    return max(1, round(E * (1.0 - (1.0 - min(top_k, E) / E) ** T)))


def balanced_tiles(N: int, BN: int, blocks: int, sms: int) -> int:
    """N tiles per row block, in [cdiv(N, BN), 2 cdiv(N, BN)] (tiles at least about half full), that minimise the
    busiest SM's columns: ceil(blocks * nt / sms) tiles of N / nt columns each (smallest nt on ties).
    E.g. N 1024, BN 32, 9 blocks, 132 SMs: 44 tiles of 23-24 columns, 396 programs = 3 per SM (32 BN-wide tiles:
    288 programs, 24 SMs run a third tile of 32 columns while the rest idle)."""
    lo = cdiv(N, BN)
    best = min(range(lo, 2 * lo + 1), key=lambda nt: (cdiv(blocks * nt, sms) / nt, nt))
    return best if (best != lo or N % BN) else 0


_CONFIGS: dict = {}


def _switches() -> tuple:
    """The module switches get_config reads (they are read per call: tests and bench/ablate.py --set change them)."""
    return (BALANCE_MAX_M, DECODE_L2_BLOCKS, DECODE_PDL, DECODE_PDL_T1, DECODE_PREFETCH,
            DECODE_PREFETCH_K, DECODE_DIRECT, DECODE_EVICT, DECODE_PDL1)


def get_config(M: int, E: int, dtype: torch.dtype, top_k: int | None = None, sms: int = 132,
               N1: int = 1024, N2: int = 2304, smem: int = H200_SMEM) -> MoEConfig:
    """_config, memoised on its arguments and the switches: it costs ~10-35 us of dataclass replaces per call, paid
    by every eager MoE layer (prefill and mixed steps: ~26 x 10 us of host time per step on the critical path)."""
    key = (M, E, dtype, top_k, sms, N1, N2, smem, _switches())
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= 8192:      # one entry per step size seen (prefill chunks vary): bounded, ~4 MB at most
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = _config(M, E, dtype, top_k, sms, N1, N2, smem)
    return cfg


def _config(M: int, E: int, dtype: torch.dtype, top_k: int | None, sms: int, N1: int, N2: int,
            smem: int) -> MoEConfig:
    """Tiles for H200 by the number of assignments M = T*k. Decode: BLOCK_M 16 (tl.dot minimum), narrow N tiles so
    that the few selected experts' weights are streamed by many SMs; prefill: 128x128-class tensor-core tiles.
    With top_k (decode, M <= BALANCE_MAX_M): N tile counts balanced over `sms` SMs for the expected number of row
    blocks (balanced_tiles; N1 = I and N2 = D are GEMM1's and GEMM2's N), and the KIMI_MOE_DIRECT / KIMI_MOE_PDL
    switches (DECODE_DIRECT: direct rows when M == top_k, i.e. one token; DECODE_PDL / _PREFETCH / _EVICT).
    Pipeline stages are capped to `smem`, the shared memory a block may opt into (fit_stages)."""
    per_expert = M / max(E, 1)
    if M <= 64:  # T <= 8 at k=8
        cfg = MoEConfig(16, 32, 64, 128, 4, 4)
    elif per_expert <= 4:  # T <= ~128
        cfg = MoEConfig(16, 64, 64, 128, 4, 4)
    elif per_expert <= 24:
        cfg = MoEConfig(32, 64, 128, 64, 4, 4)
    elif per_expert <= 96:
        cfg = MoEConfig(64, 64, 128, 64, 4, 3)
    else:
        cfg = MoEConfig(128, 64, 128, 64, 8, 3)
    if top_k is not None and M <= BALANCE_MAX_M and cfg.BM == 16:
        blocks = expected_blocks(M, E, top_k)
        hbm1 = max(1, blocks - DECODE_L2_BLOCKS) if M == top_k else blocks  # GEMM1 blocks streamed from HBM
        cfg = replace(cfg, nt1=balanced_tiles(N1, cfg.BN1, hbm1, sms), nt2=balanced_tiles(N2, cfg.BN2, blocks, sms))
    if top_k is not None and cfg.BM == 16:
        one = M == top_k
        pdl = DECODE_PDL or (one and DECODE_PDL_T1)
        pf2 = min(DECODE_PREFETCH_K or N1, N1) if pdl and DECODE_PREFETCH else 0    # elements, a multiple of 16
        cfg = replace(cfg, direct=DECODE_DIRECT and one, pdl=pdl, prefetch2=pf2,
                      evict=DECODE_EVICT, pdl1=DECODE_PDL1)
        if one and DECODE_DIRECT:
            cfg = replace(cfg, num_stages=3, stages2=cfg.num_stages)        # GEMM1 3 stages, GEMM2 keeps 4
    if dtype == torch.float32:  # fp32 operands: halve the pipeline depth to fit shared memory
        cfg = replace(cfg, BN2=min(cfg.BN2, 64), BK=min(cfg.BK, 64), num_stages=2, BK2=min(cfg.BK2, 64),
                      stages2=min(cfg.stages2, 2))
    return fit_stages(cfg, smem, dtype.itemsize)


SMEM_RESERVE = 8192  # bytes kept beside the pipelined tiles (epilogue conversions, barriers)


def _stages_within(stages: int, per_stage: int, smem: int) -> int:
    # Triton's software pipeliner (cp.async, sm_80+ incl. sm_12x) keeps stages - 1 tiles in shared memory
    return max(1, min(stages, 1 + (smem - SMEM_RESERVE) // per_stage))


def fit_stages(cfg: MoEConfig, smem: int, es: int = 2) -> MoEConfig:
    """cfg with each GEMM's num_stages capped so that its pipelined tiles fit `smem` bytes per block. A GEMM1 stage
    holds the x tile and the gate + up W tiles, (BM + 2 BN1) BK elements; a GEMM2 stage (BM + BN2) BK2. E.g. T = 64
    (BM 16, BN1 64, BK 128, 4 stages): 3 x 36 KB = 108 KB on sm_120a, over a GB10's 99 KB -> 3 stages (72 KB);
    the H200's 227 KB keeps every config as it is."""
    s1 = _stages_within(cfg.num_stages, (cfg.BM + 2 * cfg.BN1) * cfg.BK * es, smem)
    s2 = _stages_within(cfg.stages2 or cfg.num_stages, (cfg.BM + cfg.BN2) * (cfg.BK2 or cfg.BK) * es, smem)
    # stages2 0 means "as GEMM1": made explicit where only GEMM1's count changed
    return replace(cfg, num_stages=s1, stages2=s2 if (cfg.stages2 or s2 != s1) else 0)


def _fit(b: int, n: int) -> int:
    return max(16, min(b, next_pow2(n)))


def _tiles(N: int, BN: int, nt: int) -> tuple[int, int, bool]:
    """-> (BN, NT, RAGGED) for N columns: nt == 0 -> cdiv(N, BN) BN-wide tiles; else nt even tiles (<= BN wide)."""
    if nt <= 0:
        return BN, cdiv(N, BN), False
    nt = min(nt, N)
    assert cdiv(N, nt) <= BN, (N, BN, nt)
    return BN, nt, not (N % nt == 0 and N // nt == BN)


# ----------------------------------------------------------------------------------------------------------------
# host side: rows, the two GEMMs and the combine (separately callable for bench/moe.py --sweep-decode)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class MoERows:
    """Where each GEMM program finds its rows: moe_align's outputs, (ids_block > 0) the ids themselves, or
    (ids_block < 0, direct) one block per assignment (max_blocks = M)."""
    ids: torch.Tensor
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post: torch.Tensor
    max_blocks: int
    ids_block: int
    block_e: int
    E: int
    BM: int


def moe_rows(topk_ids: torch.Tensor, E: int, BM: int, direct: bool = False, ids_rows: int = 0) -> MoERows:
    """Row layout of the GEMMs: direct, from the ids in the GEMM programs (M <= ids_rows, 0: ALIGN_IN_GEMM_MAX), or
    moe_align's outputs."""
    ids = topk_ids.to(torch.int32).contiguous()
    M = ids.numel()
    if direct:  # block b = assignment b (row b, expert ids[b]); bytes-optimal only while no expert repeats (T = 1)
        return MoERows(ids, ids, ids, ids, M, -1, 0, E, BM)
    if M <= (ids_rows or ALIGN_IN_GEMM_MAX):  # decode: the GEMM programs find their rows in the ids (no align launch)
        return MoERows(ids, ids, ids, ids, max_padded_size(M, E, BM) // BM, max(16, next_pow2(M)),
                       max(16, next_pow2(E + 1)), E, BM)
    sorted_ids, expert_ids, num_post = moe_align(ids, E, BM)
    return MoERows(ids, sorted_ids, expert_ids, num_post, expert_ids.numel(), 0, 0, E, BM)


def _gdc(pdl: bool, launch: bool = True, **consts) -> dict:
    """Launch arguments of a kernel on the PDL path: GDC (and its PDL-only constexprs) and launch_pdl (launch False:
    the kernel only signals its dependents, GEMM1). Off under the interpreter (no griddepcontrol there)."""
    if not pdl or INTERPRET:
        return {}
    return dict(GDC=True, **consts, **({"launch_pdl": True} if launch else {}))


def _bulk_ok(w: torch.Tensor, K: int) -> bool:
    """Rows of w [E, N, K] can take cp.async.bulk.prefetch.L2: 16-byte aligned starts and K in 16-byte units."""
    sz = w.element_size()
    return w.data_ptr() % 16 == 0 and all(st * sz % 16 == 0 for st in w.stride()[:2]) and K * sz % 16 == 0


def _gdc1(pdl1: bool, shared_pf: bool) -> dict:
    """GEMM1 launched with PDL (WAIT; SHARED_PF: the speculative L2 prefetch of expert E - 1, direct rows and
    16-byte aligned weight rows only)."""
    if not pdl1 or INTERPRET:
        return {}
    return dict(WAIT=True, SHARED_PF=shared_pf, launch_pdl=True)


def moe_gemm1(x: torch.Tensor, w13: torch.Tensor, rows: MoERows, cfg: MoEConfig,
              inter: torch.Tensor | None = None) -> torch.Tensor:
    """-> inter [M, I] (x.dtype) = silu(gate) * up per assignment row (flat index t*k + j)."""
    M = rows.ids.numel()
    top_k = rows.ids.shape[-1]
    inter_dim, D = w13.shape[1] // 2, w13.shape[2]
    if inter is None:
        inter = torch.empty(M, inter_dim, dtype=x.dtype, device=x.device)
    BN, NT, ragged = _tiles(inter_dim, _fit(cfg.BN1, inter_dim), cfg.nt1)
    BK = _fit(cfg.BK, D)
    _moe_gemm1_kernel[(rows.max_blocks * NT,)](
        x, w13, inter, rows.sorted_ids, rows.expert_ids, rows.num_post,
        M, inter_dim, D, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), rows.ids, rows.E, NT,
        TOP_K=top_k, BM=rows.BM, BN=BN, BK=BK, EVEN_K=D % BK == 0, MODE=dot_mode(x.dtype), INTERP=INTERPRET,
        IDS_BLOCK=rows.ids_block, BLOCK_E=rows.block_e, RAGGED=ragged, **_gdc(cfg.pdl, launch=False),
        **_gdc1(cfg.pdl1, rows.ids_block < 0 and _bulk_ok(w13, D)),
        W_EVICT="evict_first" if cfg.evict else "",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return inter


def moe_gemm2(inter: torch.Tensor, w2: torch.Tensor, rows: MoERows, cfg: MoEConfig) -> torch.Tensor:
    """-> y [M, D] (inter.dtype), or with cfg.split2 > 1 fp32 K partials [S, M, D] (S <= split2: no empty split)."""
    M, inter_dim = inter.shape
    D = w2.shape[1]
    assert cfg.prefetch2 % 16 == 0, cfg  # whole 16-byte units per row (K = inter_dim itself is checked by _bulk_ok)
    BN, NT, ragged = _tiles(D, _fit(cfg.BN2, D), cfg.nt2)
    BK = _fit(cfg.BK2 or cfg.BK, inter_dim)
    steps = cdiv(inter_dim, BK)
    k_steps = cdiv(steps, max(1, min(cfg.split2, steps)))
    S = cdiv(steps, k_steps)
    if S == 1:
        y = torch.empty(M, D, dtype=inter.dtype, device=inter.device)
    else:
        y = torch.empty(S, M, D, dtype=torch.float32, device=inter.device)
    _moe_gemm2_kernel[(rows.max_blocks * NT, S)](
        inter, w2, y, rows.sorted_ids, rows.expert_ids, rows.num_post,
        M, D, inter_dim, inter.stride(0), w2.stride(0), w2.stride(1), M * D, D, rows.ids, rows.E, NT, k_steps,
        BM=rows.BM, BN=BN, BK=BK, EVEN_K=inter_dim % BK == 0, MODE=dot_mode(inter.dtype), INTERP=INTERPRET,
        IDS_BLOCK=rows.ids_block, BLOCK_E=rows.block_e, RAGGED=ragged, **_gdc(cfg.pdl, PREFETCH=cfg.prefetch2 if _bulk_ok(w2, inter_dim) else 0),
        W_EVICT="evict_first" if cfg.evict else "",
        num_warps=cfg.warps2 or cfg.num_warps, num_stages=cfg.stages2 or cfg.num_stages,
    )
    return y


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """out [T, D] = sum_j w[t, j] * y[t*k + j] (fp32); y from moe_gemm2 (one split or fp32 partials). pdl: launched
    with programmatic dependent launch (waits for the previous kernel of the stream first)."""
    T, top_k = topk_weights.shape
    D = out.shape[1]
    assert out.is_contiguous() and y.is_contiguous() and y.shape[-2:] == (T * top_k, D)
    split = y.shape[0] if y.dim() == 3 else 1
    BD = min(1024, next_pow2(D))
    _moe_combine_kernel[(T, cdiv(D, BD))](
        y, topk_weights.contiguous(), out, D, T * top_k * D, TOP_K=top_k, SPLIT=split, BD=BD, INTERP=INTERPRET,
        **_gdc(pdl), num_warps=4,
    )
    return out


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, out=None, config: MoEConfig | None = None):
    """Same contract as ``fused_moe_ref``. ``out`` (optional, [T, D] x.dtype) is fully overwritten."""
    T, D = x.shape
    E, N2, Dw = w13.shape
    inter_dim = N2 // 2
    assert Dw == D and w2.shape == (E, D, inter_dim), (w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == T
    top_k = topk_ids.shape[1]
    M = T * top_k
    if out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    assert out.is_contiguous() and out.shape == (T, D)
    if T == 0:
        return out
    x = x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    if w13.dtype != x.dtype:
        w13 = w13.to(x.dtype)
    if w2.dtype != x.dtype:
        w2 = w2.to(x.dtype)
    cfg = config or get_config(M, E, x.dtype, top_k, num_sms(x.device), inter_dim, D, max_shared_mem(x.device))
    rows = moe_rows(topk_ids, E, cfg.BM, cfg.direct, cfg.ids_rows)
    inter = moe_gemm1(x, w13, rows, cfg)
    y = moe_gemm2(inter, w2, rows, cfg)
    return moe_combine(y, topk_weights, out, cfg.pdl)


def fused_moe_uncombined_triton(x, w13, w2, topk_weights, topk_ids, config: MoEConfig | None = None) -> torch.Tensor:
    """fused_moe_triton without the combine -> moe_gemm2's y: [T*k, D] in x.dtype (one split) or fp32 K partials
    [S, T*k, D]; kernels.norm.combine_add_rmsnorm applies the combine (folded into the next residual add + norm)."""
    T, D = x.shape
    E, N2, Dw = w13.shape
    assert Dw == D and w2.shape == (E, D, N2 // 2), (w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == T
    top_k = topk_ids.shape[1]
    if T == 0:
        return torch.empty(0, D, dtype=x.dtype, device=x.device)
    x, w13, w2 = x.contiguous(), w13.contiguous().to(x.dtype), w2.contiguous().to(x.dtype)
    cfg = config or get_config(T * top_k, E, x.dtype, top_k, num_sms(x.device), N2 // 2, D,
                               max_shared_mem(x.device))
    rows = moe_rows(topk_ids, E, cfg.BM, cfg.direct, cfg.ids_rows)
    return moe_gemm2(moe_gemm1(x, w13, rows, cfg), w2, rows, cfg)


def fused_moe_add_norm(x, w13, w2, topk_weights, topk_ids, residual, norm_w, eps, config: MoEConfig | None = None):
    """The MoE layer and the next norm: -> (x_next [T, D], h [T, D]) in residual.dtype with h = residual + moe(x)
    and x_next = rmsnorm(h) * norm_w: fused_moe_uncombined_triton (GEMM1 + GEMM2, no combine launch) followed by
    kernels.norm.combine_add_rmsnorm. CPU tensors (no forced Triton): fused_moe_ref + add_rmsnorm. w13 / w2 / ids as
    fused_moe; residual [T, D] (row stride allowed), norm_w [D]."""
    from kernels._dispatch import use_triton
    from kernels.norm import add_rmsnorm, combine_add_rmsnorm

    if not use_triton(x):
        from kernels.moe.ref import fused_moe_ref

        return add_rmsnorm(fused_moe_ref(x, w13, w2, topk_weights, topk_ids), residual, norm_w, eps)
    assert residual.shape == x.shape, (residual.shape, x.shape)     # the other shapes: fused_moe_uncombined_triton
    y = fused_moe_uncombined_triton(x, w13, w2, topk_weights, topk_ids, config=config)
    return combine_add_rmsnorm(y, topk_weights, residual, norm_w, eps)
