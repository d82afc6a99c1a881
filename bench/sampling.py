"""H200 benchmark: per-request sampling filters + race (kernels/sampling.py filtered_race) vs the sampler's torch path
(apply_filters: full sort of [M, V] + softmax / cumsum / scatter, then softmax + the Triton race_argmax).

    python bench/sampling.py [--m 1,8,64] [--sweep] [--smoke] [--greedy-only | --sampled-only] [--cases A,B]

V = 163840 (Kimi), temperature 0.6, top_p 0.95, min_p 0.01 (the e2e profile's settings), + top_k 50, + min_p off
(top_p alone: more candidates than the workspace holds, the row kernel's slow "full mode"), temperature alone, and
LocalAI's generic defaults for a model not named *kimi* (T 0.9, top_k 40, top_p 0.95, no min_p: top-k drops survivors
in every row, so top-p acts on the top-k set's mass, which the nucleus check takes from each block's 8 largest logits).
Logits N(0, s^2) with s = 1 (flat: ~6 % of the vocabulary survives min_p) and s = 4 (peaked). Columns per case and M:
  torch us / ours us   one call inside a CUDA graph (GPU time; median of replays); ours: the row kernel alone
  nucleus us           ours with the nucleus check first (kernels/sampling.py NUCLEUS, the default; its agreement
                       after ours)
  eager us             sample() as the engine calls it (eager, outside the graph; the kernel path only for the rows
                       backend/engine/sampler.py _fast_ok sends there): wall us per call over 50 calls,
                       i.e. launch-bound when the GPU side is short (torch path: ~40 launches, ours: ~3)
  agree                chosen tokens equal to the torch path's, over 8 seed batches (must be 100 %: only float
                       near-ties may differ, ~1e-6 per row)
--sweep: the first case also per row-pass config (BLOCK, num_warps) of SWEEP, graph us (for kernels/sampling.py).
Greedy rows (first table): torch.argmax vs kernels/argmax.py argmax_rows over the same [M, V] fp32 logits, us per
call from one CUDA graph of 20 back-to-back calls (GPU time, launch gaps included), and argmax_rows per (block,
num_warps) of GREEDY_SWEEP; `same` = equal to torch.argmax. --greedy-only: that table alone.
--smoke: CPU, Triton interpreter, V = 1000, M = 2, s = 4: runs every code path (CI check of this file), timings
meaningless.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["KIMI_KERNELS"] = "triton"   # sample() takes the Triton paths on the CPU too

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from types import SimpleNamespace  # noqa: E402

from backend.engine import sampler as S  # noqa: E402
from backend.engine.request import Request, SamplingParams  # noqa: E402
from kernels.argmax import argmax_rows  # noqa: E402
from kernels.sampling import filtered_race  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import time_us  # noqa: E402

CASES = {"T0.6 p0.95 minp0.01": dict(temperature=0.6, top_p=0.95, min_p=0.01),
         "  + top_k 50": dict(temperature=0.6, top_p=0.95, min_p=0.01, top_k=50),
         "T0.6 p0.95 (no min_p)": dict(temperature=0.6, top_p=0.95),
         "T1.0 (no filter)": dict(temperature=1.0),
         "T0.9 k40 p0.95 generic": dict(temperature=0.9, top_k=40, top_p=0.95)}


SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


GREEDY_SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)]


def bench_greedy(ms, V, smoke, dev):
    print(f"greedy argmax, V={V}: us per call (20 calls in one graph)")
    print(f"{'M':>3s} | {'torch':>7s} {'ours':>7s} {'x':>5s} | same | sweep (block/warps us)")
    for M in ms:
        logits = torch.randn(M, V, device=dev) * 4.0
        reps = 1 if smoke else 20
        t_ref = time_us([lambda: torch.argmax(logits, dim=-1)] * reps, smoke)
        t_ours = time_us([lambda: argmax_rows(logits)] * reps, smoke)
        same = torch.equal(argmax_rows(logits), torch.argmax(logits, dim=-1))
        cells = []
        for blk, w in ([] if smoke else GREEDY_SWEEP):
            f = (lambda b=blk, nw=w: argmax_rows(logits, block=b, num_warps=nw))
            ok = torch.equal(f(), torch.argmax(logits, dim=-1))
            cells.append(f"{blk}/w{w} {time_us([f] * reps, smoke):.1f}{'' if ok else ' DIFF'}")
        print(f"{M:3d} | {t_ref:7.2f} {t_ours:7.2f} {t_ref / t_ours:5.1f} | {'yes' if same else 'NO'} | "
              + ", ".join(cells))


def torch_path(logits, md):
    x = S.apply_filters(logits / md.temperature[:, None], md)
    return S.race_argmax(torch.softmax(x, dim=-1), md.seeds, md.steps)


def fast_path(logits, md, **cfg):
    return filtered_race(logits, md.temperature, md.seeds, md.steps, md.greedy, md.min_p, md.top_k, md.top_p, **cfg)


def eager_sample_us(logits, md, fast: bool, smoke: bool) -> float:
    """sample() as the engine runs it (eager): wall us per call, n calls then one sync."""
    saved, S._FAST_FILTERS = S._FAST_FILTERS, fast
    try:
        n = 1 if smoke else 50
        S.sample(logits.clone(), md)
        if not smoke:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            S.sample(logits, md)   # filters read logits only (no penalties here), so no clone in the loop
        if not smoke:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / n
    finally:
        S._FAST_FILTERS = saved


def bench(ms, V, smoke, dev, sweep=False, only=""):
    print(f"V={V}; us per call (graph = GPU time; eager = sample() wall time per call, 50 calls)")
    print(f"{'case':22s} {'s':>3s} {'M':>3s} | {'torch us':>9s} {'ours us':>8s} {'x':>6s} {'nucleus us':>10s} | "
          f"{'eager torch':>11s} {'eager ours':>10s} | agree (ours, nucleus)")
    for name, kw in CASES.items():
        if only and not any(w in name for w in only.split(",")):
            continue
        for scale in ((4.0,) if smoke else (1.0, 4.0)):
            for M in ms:
                reqs = [Request([1], SamplingParams(**kw), seed=1000 + i) for i in range(M)]
                md = S.SamplingMetadata.build(reqs, V, torch.device(dev))
                logits = torch.randn(M, V, device=dev) * scale
                t_ref = time_us([lambda: torch_path(logits, md)], smoke, replays=10)
                t_ours = time_us([lambda: fast_path(logits, md, nucleus=False)], smoke, replays=10)
                t_nuc = time_us([lambda: fast_path(logits, md, nucleus=True)], smoke, replays=10)
                e_ref = eager_sample_us(logits, md, False, smoke)
                e_ours = eager_sample_us(logits, md, True, smoke)
                same = same_n = total = 0
                for r in range(1 if smoke else 8):
                    md2 = SimpleNamespace(**{f: getattr(md, f) for f in ("temperature", "greedy", "min_p", "top_k",
                                                                         "top_p", "steps")})
                    md2.seeds = torch.randint(0, 2**62, (M,), device=dev)
                    want = torch_path(logits, md2)
                    same += int((want == fast_path(logits, md2, nucleus=False)).sum())
                    same_n += int((want == fast_path(logits, md2, nucleus=True)).sum())
                    total += M
                bad = '' if same == total and same_n == total else '  MISMATCH'
                print(f"{name:22s} {scale:3.0f} {M:3d} | {t_ref:9.1f} {t_ours:8.1f} {t_ref / t_ours:6.1f} "
                      f"{t_nuc:10.1f} | {e_ref:11.1f} {e_ours:10.1f} | {same}/{total}, {same_n}/{total}{bad}")
                if sweep and name == next(iter(CASES)):   # the e2e case only (each config compiles anew)
                    cells = []
                    for blk, w in SWEEP:
                        f = (lambda b=blk, nw=w: fast_path(logits, md, block=b, num_warps=nw, nucleus=False))
                        ok = torch.equal(f(), fast_path(logits, md, nucleus=False))
                        cells.append(f"{blk}/w{w} {time_us([f], smoke, replays=10):.1f}{'' if ok else ' DIFF'}")
                    print("    sweep (block/warps us): " + ", ".join(cells))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--greedy-only", action="store_true")
    ap.add_argument("--sampled-only", action="store_true", help="skip the greedy table")
    ap.add_argument("--cases", default="", help="comma-separated parts of case names: only those cases (e.g. "
                    "'no min_p,no filter')")
    a = ap.parse_args()
    if a.smoke:
        bench_greedy([2], 1000, True, "cpu")
        bench([2], 1000, True, "cpu", a.sweep)
        return
    print(torch.cuda.get_device_name(), "| triton", __import__("triton").__version__)
    ms = [int(m) for m in a.m.split(",")]
    if not a.sampled_only:
        bench_greedy(ms, 163840, False, "cuda")
    if not a.greedy_only:
        bench(ms, 163840, False, "cuda", a.sweep, a.cases)


if __name__ == "__main__":
    main()
