"""H200 benchmark: Kimi-Linear routed MoE (E=256, top-8, D=2304, I=1024, bf16).

    python bench/moe.py [--tokens 1,8,64,256,1024,8192] [--no-check] [--no-ref] [--sweep]
    python bench/moe.py --sweep-decode [--decode-m 9,72,576]

--sweep also times a grid of tile configs per T (CUDA-graph replay) and prints the best, for tuning get_config.
--sweep-decode (only that, < 45 s on the H200): GEMM1 and GEMM2 timed separately at M = 9, 72, 576 assignments
(batch 1, 8, 64 with the shared expert folded in as expert 256: E = 257, 9 ids per token) for a list of candidate
configs (N tiles, ragged balanced tile counts, BK, stages, GEMM2 split-K), L2-cold: one CUDA graph of R launches,
each on its own routing (consecutive launches share no expert at M = 9), us per launch, TB/s of the selected experts'
weight bytes, and the device copy bandwidth (read + write) measured in the same run.

For each T: our Triton fused_moe (eager and CUDA-graph replay), the router, a dense torch reference (per-expert loop,
fused_moe_ref) and torch._grouped_mm when this torch has it; plus the roofline bound:
  bytes = unique selected experts' weights (3*D*I*2 B each) + activations; mem bound = bytes / 4.8 TB/s
  flops = 2 * T * k * 3 * D * I;  compute bound = flops / (bf16 matmul peak measured in this run)
  bound = max(mem, compute). Prints a table and markdown rows.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.moe import fused_moe, fused_moe_ref, moe_router  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import time_us  # noqa: E402  (bench/ is sys.path[0] when run)
from dataclasses import replace  # noqa: E402

from kernels.moe.fused import (MoEConfig, balanced_tiles, expected_blocks, fused_moe_triton, get_config,  # noqa: E402
                               moe_combine, moe_gemm1, moe_gemm2, moe_rows)

D, I, E, K, SCALE = 2304, 1024, 256, 8, 2.446
HBM_BW = 4.8e12
DEV = "cuda"


def t_ms(fn, graph=False):
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def bf16_peak():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = t_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


def grouped_mm_moe(x, w13t, w2t, w, ids):
    """torch._grouped_mm reference (sort by expert, two grouped GEMMs, fp32 combine)."""
    T = x.shape[0]
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True)[1]
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13t, offs=offs)
    act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(act, w2t, offs=offs)
    out = torch.zeros(T, D, device=x.device, dtype=torch.float32)
    out.index_add_(0, order // k, y.float() * w.reshape(-1)[order, None])
    return out.to(x.dtype)


# (BM, BN1, BN2, BK, warps, stages); each variant compiles once: use a --tokens subset to stay within 10 minutes
SWEEP = [MoEConfig(*c) for c in [
    # decode / small M
    (16, 32, 64, 128, 4, 4), (16, 32, 64, 64, 4, 4), (16, 32, 32, 128, 4, 4), (16, 64, 64, 128, 4, 4),
    (16, 64, 64, 64, 4, 5), (16, 64, 128, 128, 4, 3), (16, 32, 64, 256, 4, 3), (16, 64, 64, 128, 8, 4),
    # mid
    (32, 64, 128, 64, 4, 4), (32, 64, 64, 128, 4, 3), (32, 32, 64, 128, 4, 4), (64, 64, 128, 64, 4, 3),
    (64, 64, 64, 64, 4, 4), (64, 128, 128, 64, 8, 3),
    # prefill
    (128, 64, 128, 64, 8, 3), (128, 64, 128, 64, 8, 4), (128, 128, 128, 64, 8, 3), (128, 64, 256, 64, 8, 3),
    (128, 64, 128, 32, 4, 4), (64, 64, 256, 64, 8, 3),
]]


def sweep(args, w13, w2, gate, bias):
    print("\nconfig sweep (CUDA-graph replay, us); config = BM,BN1,BN2,BK,warps,stages")
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w, ids = moe_router(x, gate, bias, K, SCALE, True)
        res = []
        for c in SWEEP:
            if c.BM > 16 and T * K < 8 * c.BM:
                continue
            try:
                ms = t_ms(lambda: fused_moe_triton(x, w13, w2, w, ids, config=c), graph=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                print(f"  T={T} {c}: {type(exc).__name__}")
                continue
            res.append((ms * 1e3, c))
        res.sort(key=lambda r: r[0])
        cur = get_config(T * K, E, torch.bfloat16)
        cur_t = next((t for t, c in res if c == cur), float("nan"))
        top = ", ".join(f"{t:.1f}us {c.BM},{c.BN1},{c.BN2},{c.BK},{c.num_warps},{c.num_stages}" for t, c in res[:5])
        print(f"T={T:>5}: default {cur_t:.1f}us; best: {top}")


# --sweep-decode candidates. GEMM1: (BN1, BK, warps, stages); GEMM2: (BN2, BK2, warps2, stages2, K splits). Each tile
# set runs with BN-wide tiles (nt 0) and with balanced ragged tile counts (balanced_tiles), GEMM2 also split-K.
DEC_G1 = {9: [(32, 128, 4, 4), (32, 128, 4, 3), (32, 128, 4, 6), (16, 128, 4, 6), (16, 256, 4, 4), (32, 256, 4, 3),
              (64, 128, 4, 4)],
          72: [(64, 128, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6), (16, 256, 4, 4), (64, 128, 4, 3)],
          576: [(64, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3)]}
DEC_G2 = {9: [(64, 128, 4, 4, (1, 2)), (32, 128, 4, 4, (1,)), (64, 256, 4, 3, (1, 2)), (128, 128, 4, 3, (1, 2, 4)),
              (64, 128, 4, 6, (1,))],
          72: [(64, 128, 4, 4, (1, 2)), (32, 128, 4, 4, (1,)), (128, 128, 4, 3, (1, 2)), (64, 256, 4, 3, (1,))],
          576: [(64, 128, 4, 4, (1,)), (128, 128, 4, 3, (1,)), (64, 128, 4, 3, (1,))]}
DEC_REPS = 16


def _decode_candidates(M, blocks, sms):
    """-> (GEMM1 configs, GEMM2 configs) for M assignments (the DEC_G1 / DEC_G2 rows of the nearest listed M). At
    M = K + 1 (batch 1: distinct ids) every candidate also runs with direct rows (one block per assignment)."""
    key = min(DEC_G1, key=lambda m: abs(m - M))
    directs = (False, True) if M == K + 1 else (False,)
    g1 = [MoEConfig(16, bn, 64, bk, nw, ns, nt1=nt, direct=dr) for bn, bk, nw, ns in DEC_G1[key]
          for nt in sorted({0, balanced_tiles(I, bn, blocks, sms)}) for dr in directs]
    g2 = [MoEConfig(16, 32, bn, 128, 4, 4, nt2=nt, split2=sp, BK2=bk, warps2=nw, stages2=ns, direct=dr)
          for bn, bk, nw, ns, splits in DEC_G2[key] for nt in sorted({0, balanced_tiles(D, bn, blocks, sms)})
          for sp in splits for dr in directs]
    # PDL after GEMM1 (prologue and optional L2 prefetch of the whole K range overlap the previous kernel's tail)
    base = [c for c in g2 if c.nt2 and c.split2 == 1 and c.direct == directs[-1]][:3]
    g2 += [replace(c, pdl=True, prefetch2=pf) for c in base for pf in (0, I)]
    # weight loads evict_first (streamed once; matters in the chain, where they would evict prefetched GEMM2 rows)
    g1 += [replace(c, evict=True) for c in g1[:4] if c.nt1]
    # GEMM1 with PDL after a kernel that signals at once (here the previous GEMM1; the router does not yet): optimistic
    g1 += [replace(c, pdl1=True, pdl=True) for c in g1[:4] if c.nt1 and c.direct == directs[-1]][:1]
    g2 += [replace(c, evict=True) for c in base[:1]]
    return g1, g2


def _merge(c1, c2, direct):
    """GEMM1 fields of c1, GEMM2 fields of c2 (one config for fused_moe_triton)."""
    return MoEConfig(16, c1.BN1, c2.BN2, c1.BK, c1.num_warps, c1.num_stages, c1.nt1, c2.nt2, c2.split2,
                     c2.BK2 or c2.BK, c2.warps2 or c2.num_warps, c2.stages2 or c2.num_stages, direct, c2.pdl,
                     c2.prefetch2, c1.evict or c2.evict)  # (pdl1 off: GEMM1 follows the router in the model)


def _label1(c):
    return (f"BN1={c.BN1} BK={c.BK} w={c.num_warps} s={c.num_stages} nt1={c.nt1 or -(-I // c.BN1)}"
            f"{'' if c.nt1 else ' (BN-wide)'}{' direct' if c.direct else ''}{' evict' if c.evict else ''}"
            f"{' pdl1 (after an early-signalling kernel)' if c.pdl1 else ''}")


def _label2(c):
    return (f"BN2={c.BN2} BK2={c.BK2 or c.BK} w={c.warps2 or c.num_warps} s={c.stages2 or c.num_stages} "
            f"nt2={c.nt2 or -(-D // c.BN2)}{'' if c.nt2 else ' (BN-wide)'} split2={c.split2}"
            f"{' direct' if c.direct else ''}{f' pdl prefetch2={c.prefetch2}' if c.pdl else ''}"
            f"{' evict' if c.evict else ''}")


class _DecodeCase:
    """Inputs of one decode size: DEC_REPS routings of T = M / 9 tokens (8 distinct routed experts per token + one
    common expert, the folded shared one, drawn per routing; T = 1: consecutive routings share no expert, so the
    weights are L2-cold), their x, inter, combine weights and row layouts."""

    def __init__(self, M, w13, w2, sms, seed=0):
        gen = torch.Generator().manual_seed(seed)
        dev, E1, k = w13.device, w13.shape[0], K + 1
        self.M, self.T, self.w13, self.w2 = M, M // k, w13, w2
        self.blocks = expected_blocks(M, E1, k)
        perm = torch.randperm(E1, generator=gen)
        routs = []
        for r in range(DEC_REPS):
            if self.T == 1:
                routs.append(perm.roll(-k * r)[:k][None])
                continue
            p = torch.randperm(E1, generator=gen)
            routed = torch.stack([p[1:][torch.randperm(E1 - 1, generator=gen)[:K]] for _ in range(self.T)])
            routs.append(torch.cat([routed, p[:1].expand(self.T, 1)], dim=1))
        self.routs = [r.to(dev, torch.int32) for r in routs]
        self.uniq = sum(int(torch.unique(r).numel()) for r in routs) / DEC_REPS
        self.xs = [torch.randn(self.T, D, device=dev, dtype=w13.dtype) for _ in routs]
        self.inters = [torch.randn(M, I, device=dev, dtype=w13.dtype) for _ in routs]
        self.ws = [torch.rand(self.T, k, device=dev) for _ in routs]
        self.rows = [moe_rows(r, E1, 16) for r in self.routs]
        self.rows_direct = [moe_rows(r, E1, 16, direct=True) for r in self.routs]
        self.g1, self.g2 = _decode_candidates(M, self.blocks, sms)

    def gemm1(self, c):
        rows = self.rows_direct if c.direct else self.rows
        return [lambda i=i: moe_gemm1(self.xs[i], self.w13, rows[i], c, inter=self.inters[i])
                for i in range(DEC_REPS)]

    def chain(self, c):
        outs = [torch.empty(self.T, D, device=DEV, dtype=torch.bfloat16) for _ in range(DEC_REPS)]
        return [lambda i=i: fused_moe_triton(self.xs[i], self.w13, self.w2, self.ws[i], self.routs[i], out=outs[i],
                                             config=c) for i in range(DEC_REPS)]

    def gemm2(self, c):
        rows = self.rows_direct if c.direct else self.rows
        return [lambda i=i: moe_gemm2(self.inters[i], self.w2, rows[i], c) for i in range(DEC_REPS)]


def _decode_weights(init=True):
    E1, dev = E + 1, DEV
    if not init:  # shapes and strides only (compile jobs)
        return (torch.empty(E1, 2 * I, D, device=dev, dtype=torch.bfloat16),
                torch.empty(E1, D, I, device=dev, dtype=torch.bfloat16))
    return ((torch.randn(E1, 2 * I, D, device=dev, dtype=torch.bfloat16) * D**-0.5),
            (torch.randn(E1, D, I, device=dev, dtype=torch.bfloat16) * I**-0.5))


_WORKER: dict = {}  # per worker process: the weights (allocated once) and one _DecodeCase per M


def _compile_job(job):
    """Worker process: compile (launch once) one GEMM config of one decode size; the kernel lands in Triton's on-disk
    cache, so the timing process only loads it (compiles run in parallel, not one after another)."""
    M, which, c, sms = job
    if "w" not in _WORKER:
        _WORKER["w"] = [w.zero_() for w in _decode_weights(init=False)]
    if M not in _WORKER:
        _WORKER[M] = _DecodeCase(M, *_WORKER["w"], sms)
    case = _WORKER[M]
    if which == 1:
        case.gemm1(c)[0]()
    elif which == 2:
        case.gemm2(c)[0]()
    else:  # the combine for c split-K partials
        y = torch.zeros(c, M, D, device=DEV) if c > 1 else torch.zeros(M, D, device=DEV, dtype=torch.bfloat16)
        moe_combine(y, case.ws[0], torch.empty(case.T, D, device=DEV, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    return 1


def _precompile(Ms, sms, workers):
    import multiprocessing as mp

    jobs = []
    for M in Ms:
        g1, g2 = _decode_candidates(M, expected_blocks(M, E + 1, K + 1), sms)
        cur = get_config(M, E + 1, torch.bfloat16, K + 1, sms, I, D)
        jobs += [(M, 1, c, sms) for c in g1 + [cur]] + [(M, 2, c, sms) for c in g2 + [cur]]
        jobs += [(M, 3, sp, sms) for sp in (1, 2, 4)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return sum(pool.map(_compile_job, jobs, chunksize=1))


def _graph_us(fns, replays=10):
    """Median us per launch: one CUDA graph of the launches fns (one per routing), replayed (--smoke on the CPU:
    one eager pass, wall time)."""
    return time_us(fns, DEV != "cuda", replays)


def _try_us(fns, label):
    """_graph_us, or nan with the error printed (a candidate that fails to compile or launch, e.g. PDL in a graph on
    an older driver, must not end the sweep)."""
    try:
        return _graph_us(fns)
    except Exception as exc:  # noqa: BLE001
        print(f"  FAILED {label}: {type(exc).__name__}: {str(exc)[:200]}")
        return float("nan")


def _print_sweep(name, res, nbytes, copy_bw, cur_label):
    res.sort(key=lambda r: (r[0] != r[0], r[0]))  # failed (nan) last
    for us, label, _ in res:
        tbs = nbytes / (us * 1e-6) / 1e12
        mark = "  <- get_config" if label == cur_label else ""
        print(f"  {name} {us:7.2f} us {tbs:5.2f} TB/s ({100 * tbs / copy_bw:3.0f}% of copy)  {label}{mark}")


def sweep_decode(args):
    """GEMM1 / GEMM2 candidate configs at decode sizes (see the module docstring)."""
    import time

    t0 = time.time()
    Ms = [int(m) for m in args.decode_m.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132
    workers = 1 if args.smoke else min(8, os.cpu_count() or 1)  # smoke: the workers would see the full shapes
    n = _precompile(Ms, sms, workers) if workers > 1 else 0
    print(f"compiled {n} kernel configs in {workers} processes: {time.time() - t0:.0f} s")
    src = torch.empty(1 << 30 if DEV == "cuda" else 1 << 20, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_us = _graph_us([lambda: dst.copy_(src)])
    copy_bw = 2 * src.numel() / (copy_us * 1e-6) / 1e12
    w13, w2 = _decode_weights()
    print(f"sweep-decode: {sms} SMs, copy bandwidth (read + write, 1 GiB) {copy_bw:.2f} TB/s; {DEC_REPS} routings "
          f"per CUDA graph; TB/s = selected experts' weight bytes / time")
    for M in Ms:
        case = _DecodeCase(M, w13, w2, sms)
        cur = get_config(M, E + 1, torch.bfloat16, K + 1, sms, I, D)
        print(f"M={M} (T={case.T}): {case.uniq:.1f} unique experts per routing (get_config assumes {case.blocks} "
              f"blocks); get_config: {cur.short()}")
        res1 = [(_try_us(case.gemm1(c), _label1(c)), _label1(c), c) for c in case.g1]
        if _label1(cur) not in [r[1] for r in res1]:
            res1.append((_graph_us(case.gemm1(cur)), _label1(cur), cur))
        _print_sweep("gemm1", res1, case.uniq * 2 * I * D * 2, copy_bw, _label1(cur))
        res2 = [(_try_us(case.gemm2(c), _label2(c)), _label2(c), c) for c in case.g2]
        if _label2(cur) not in [r[1] for r in res2]:
            res2.append((_graph_us(case.gemm2(cur)), _label2(cur), cur))
        _print_sweep("gemm2", res2, case.uniq * D * I * 2, copy_bw, _label2(cur))
        # the whole layer (rows + GEMM1 + GEMM2 + combine per routing, back to back as in the model): get_config vs the
        # fastest GEMM1 with the fastest GEMM2 (one rows layout for both: each fastest one's direct flag in turn)
        b1, b2 = res1[0][2], res2[0][2]
        b2n = next(c for _, _, c in res2 if not c.pdl)  # the fastest without PDL, with PDL on in the chain
        chains = [("get_config", cur)] + [(f"best gemm1 + best gemm2, direct={dr}", _merge(b1, b2, dr))
                                          for dr in sorted({b1.direct, b2.direct})]
        chains += [(f"{name} + pdl prefetch2={pf}{' evict' if ev else ''}",
                    replace(c, pdl=True, prefetch2=pf, evict=ev))
                   for name, c in [("get_config", cur), ("best gemm1 + best non-PDL gemm2", _merge(b1, b2n, b1.direct))]
                   for pf, ev in ((0, False), (I, False), (I, True))]
        if M == K + 1:  # GEMM1 with PDL after the previous routing's combine (no early signal: realistic)
            chains += [("best + pdl1 + pdl prefetch2 evict", replace(_merge(b1, b2n, b1.direct), pdl1=True, pdl=True,
                                                                    prefetch2=I, evict=True))]
        if M > 32 and M <= 256:  # rows from the ids in every GEMM program instead of the align launch
            chains += [(f"get_config + ids_rows=256{' + pdl prefetch2=' + str(I) if p else ''}",
                        replace(cur, ids_rows=256, pdl=p, prefetch2=I if p else 0)) for p in (False, True)]
        for name, c in chains:
            print(f"  chain {_try_us(case.chain(c), name):7.2f} us  {name}: {c.short()}")
        outs = [torch.empty(case.T, D, device=DEV, dtype=torch.bfloat16) for _ in range(DEC_REPS)]
        for sp in (1, 2, 4):  # the combine with split-K partials reads S fp32 partials instead of one bf16 y
            ys = [torch.randn(sp, M, D, device=DEV) if sp > 1 else
                  torch.randn(M, D, device=DEV, dtype=torch.bfloat16) for _ in range(DEC_REPS)]
            us = _graph_us([lambda i=i: moe_combine(ys[i], case.ws[i], outs[i]) for i in range(DEC_REPS)])
            print(f"  combine split2={sp}: {us:.2f} us")
        print(f"  [{time.time() - t0:.0f} s]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,8192")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the slow per-expert-loop reference timing")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs per T")
    ap.add_argument("--sweep-decode", action="store_true", help="only: GEMM1/GEMM2 candidates at decode sizes")
    ap.add_argument("--decode-m", default="9,72,576", help="assignment counts M for --sweep-decode (multiples of 9)")
    ap.add_argument("--smoke", action="store_true", help="--sweep-decode code paths at tiny shapes, 2 routings (CPU "
                    "without CUDA: TRITON_INTERPRET=1, eager timing)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        global D, I, E, DEC_REPS, DEV
        D, I, E, DEC_REPS = 64, 32, 24, 2
        DEV = "cuda" if torch.cuda.is_available() else "cpu"
        for table in (DEC_G1, DEC_G2):  # one tile set per size
            for m in table:
                table[m] = table[m][:1]
        args.decode_m = "9,36"
        return sweep_decode(args)
    dev = "cuda"
    dt = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.sweep_decode:
        return sweep_decode(args)
    peak = bf16_peak()
    print(f"measured bf16 matmul peak (8192^3 torch.mm): {peak / 1e12:.0f} TFLOP/s; "
          f"HBM bound uses {HBM_BW / 1e12} TB/s")
    w13 = (torch.randn(E, 2 * I, D, device=dev) / D**0.5).to(dt)
    w2 = (torch.randn(E, D, I, device=dev) / I**0.5).to(dt)
    gate = (torch.randn(E, D, device=dev) / D**0.5).to(dt)
    bias = torch.randn(E, device=dev) * 0.05
    has_gmm = hasattr(torch, "_grouped_mm")
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

    rows = []
    hdr = (f"{'T':>5} {'uniqE':>5} {'cfg(BM,BN1,BN2,BK,w,s)':>24} {'ours us':>9} {'graph us':>9} {'router us':>9} "
           f"{'loop-ref us':>11} {'gmm us':>8} {'bound us':>8} {'%bound':>7} {'TB/s':>6} {'TFLOP/s':>7}")
    print(hdr)
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, D, device=dev, dtype=dt)
        w, ids = moe_router(x, gate, bias, K, SCALE, True)
        M = T * K
        uniq = int(torch.unique(ids).numel())
        wbytes = uniq * 3 * D * I * 2
        abytes = T * D * 2 * 2 + M * (I + D) * 2 * 2  # x in/out + inter and y written and read
        flops = 2 * M * 3 * D * I
        bound = max((wbytes + abytes) / HBM_BW, flops / peak)
        if not args.no_check:
            out = fused_moe(x, w13, w2, w, ids)
            ref = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids) if T <= 1024 else \
                fused_moe_ref(x, w13, w2, w, ids)
            err = ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
            assert err < 1e-2, (T, err)
        ours = t_ms(lambda: fused_moe(x, w13, w2, w, ids)) * 1e3
        ours_g = t_ms(lambda: fused_moe(x, w13, w2, w, ids), graph=True) * 1e3
        rt = t_ms(lambda: moe_router(x, gate, bias, K, SCALE, True), graph=True) * 1e3
        ref_t = float("nan") if args.no_ref else t_ms(lambda: fused_moe_ref(x, w13, w2, w, ids)) * 1e3
        gmm_t = float("nan")
        if has_gmm:
            try:
                grouped_mm_moe(x, w13t, w2t, w, ids)
                gmm_t = t_ms(lambda: grouped_mm_moe(x, w13t, w2t, w, ids)) * 1e3
            except Exception as exc:  # noqa: BLE001 - layout/arch limits of the private op
                print(f"  (torch._grouped_mm unavailable here: {type(exc).__name__}: {str(exc)[:80]})")
                has_gmm = False
        c = get_config(M, E, dt)
        cfg = f"{c.BM},{c.BN1},{c.BN2},{c.BK},{c.num_warps},{c.num_stages}"
        best = min(ours, ours_g)
        pct = 100 * bound * 1e6 / best
        tbs = (wbytes + abytes) / (best * 1e-6) / 1e12
        tfl = flops / (best * 1e-6) / 1e12
        print(f"{T:>5} {uniq:>5} {cfg:>24} {ours:>9.1f} {ours_g:>9.1f} {rt:>9.1f} {ref_t:>11.1f} {gmm_t:>8.1f} "
              f"{bound * 1e6:>8.1f} {pct:>6.1f}% {tbs:>6.2f} {tfl:>7.1f}")
        rows.append(f"| {T} | {uniq} | {cfg} | {ours:.1f} | {ours_g:.1f} | {rt:.1f} | {ref_t:.1f} | {gmm_t:.1f} | "
                    f"{bound * 1e6:.1f} | {pct:.0f}% | {tbs:.2f} | {tfl:.0f} |")
    if args.sweep:
        sweep(args, w13, w2, gate, bias)
    print()
    print("| T | unique experts | config | fused_moe us | graph us | router us | per-expert loop us | "
          "torch grouped_mm us | bound us | % of bound | TB/s | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
