"""H200 benchmark: skinny GEMM (kernels/gemv.py) vs cuBLAS (F.linear / torch.bmm) at Kimi decode projection shapes.

    python bench/gemv.py [--m 1,4,16] [--sweep] [--smoke]

Per shape (N x K weight, bf16) and M rows: us per call inside a CUDA graph, achieved TB/s = weight bytes / time, and
ours / torch speed, next to the device-to-device copy bandwidth of the same run (2 * bytes / t of a 1 GiB copy).
The 50 MB L2 would hold the smaller weights, so each graph cycles through enough copies of W (>= 256 MB in all,
<= 64 copies) that every call reads W from HBM, as in a decode step where the other layers' weights pass through.
Then the projections of one batch-M decode step (20 KDA + 7 MLA layers, 1 dense MLP, lm_head) summed for both.
--sweep: per shape and M, each config of SWEEP (tl.dot / FMA, BN, BK, warps, stages; K split by the default rule or
forced to 1): us and TB/s, the default marked, then the best per shape (what to put in kernels/gemv.py).
--ragged / --tma: sweep only the ragged-tile (GemvConfig.ragged) / TMA variants of the tl.dot bases.
--smoke: CPU, Triton interpreter, tiny shapes: runs every code path (CI check of this file), timings meaningless.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernels.gemv import DOT_CONFIG, GemvConfig, gemv_config, gemv_ref, gemv_triton  # noqa: E402
from kernels.testing import assert_close, bf16_tol  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import copy_bandwidth, time_us  # noqa: E402  (bench/ is sys.path[0] when run)

# (name, B, N, K, calls per decode step): Kimi-Linear-48B-A3B, D = 2304, 20 KDA + 7 MLA layers, layer 0 dense MLP
SHAPES = [
    ("KDA in_proj", 1, 12576, 2304, 20),
    ("KDA f_b|g_b (bmm)", 2, 4096, 128, 20),
    ("o_proj (KDA+MLA)", 1, 2304, 4096, 27),
    ("MLA q|kv_a", 1, 6720, 2304, 7),
    ("MLA w_uv (bmm)", 32, 128, 512, 7),        # absorbed out_lat [32, M, 512] x W_UV [32, 128, 512]^T
    ("MLP gate|up", 1, 18432, 2304, 1),
    ("MLP down", 1, 2304, 9216, 1),
    ("lm_head", 1, 163840, 2304, 1),
]
SMOKE_SHAPES = [("smoke a", 1, 70, 96, 2), ("smoke bmm", 2, 48, 32, 1), ("smoke split", 1, 20, 512, 1)]
SHAPE_NAMES = {s[0]: s for s in SHAPES}
# sweep bases (tl.dot / FMA, BN, BK, warps, stages); each runs at the splits of sweep_splits()
SWEEP = [GemvConfig(dot=True, BN=bn, BK=bk, num_warps=w, num_stages=s) for bn, bk, w, s in
         [(32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4),
          (128, 64, 4, 6), (256, 64, 8, 4)]]
# FMA: M = 1 tiles of BN x BK (BK / 8 16-byte loads per row), with / without the register prefetch of step k+1
SWEEP += [GemvConfig(dot=False, BN=bn, BK=bk, num_warps=w, num_stages=1, prefetch=pf) for bn, bk, w, pf in
          [(16, 512, 4, False), (16, 512, 4, True), (32, 512, 4, False), (8, 1024, 4, True), (32, 256, 4, True),
           (64, 256, 8, False), (16, 256, 2, False), (8, 512, 2, True)]]
# variants of the default at its picked split: two-launch reduce, no eviction hint, .cg loads
VARIANTS = [replace(DOT_CONFIG, fused=False), replace(DOT_CONFIG, evict=False), replace(DOT_CONFIG, cg=True)]
# --ragged: the dot bases with N in even tiles filling whole waves of SMs (GemvConfig.ragged), plus the default
RAGGED_SWEEP = [replace(c, ragged=True) for c in SWEEP if c.dot] + [replace(c, ragged=True) for c in (
    GemvConfig(dot=True, BN=128, BK=128, num_warps=4, num_stages=4), GemvConfig(dot=True, BN=128, BK=64, num_warps=4,
                                                                                num_stages=8))] + [DOT_CONFIG]
# --tma: the dot bases with W by TMA boxes (a separate run: a fault would poison the CUDA context for what follows)
TMA_SWEEP = [replace(c, tma=True) for c in SWEEP if c.dot]
PROGRAM_TARGETS = (132, 264, 396, 528)   # splits putting ~1..4 programs on each of 132 SMs
L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 64


class Case:
    """x [B?, M, K] and enough copies of W [B?, N, K] to stream from HBM."""

    def __init__(self, B, N, K, M, device, smoke):
        self.B, self.N, self.K, self.M = B, N, K, M
        lead = () if B == 1 else (B,)
        self.wbytes = B * N * K * 2
        n = 1 if smoke else max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // self.wbytes)))
        self.x = torch.randn(*lead, M, K, device=device).to(torch.bfloat16)
        w0 = (torch.randn(*lead, N, K, device=device) / K ** 0.5).to(torch.bfloat16)
        self.ws = [w0] + [w0.clone() for _ in range(n - 1)]

    def torch_fns(self):
        if self.B == 1:
            return [lambda w=w: F.linear(self.x, w) for w in self.ws]
        return [lambda w=w: torch.bmm(self.x, w.transpose(1, 2)) for w in self.ws]

    def ours_fns(self, cfg=None):
        return [lambda w=w: gemv_triton(self.x, w, cfg) for w in self.ws]

    def check(self, cfg=None):
        assert_close("gemv", gemv_triton(self.x, self.ws[0], cfg), gemv_ref(self.x, self.ws[0]), bf16_tol())


def tbs(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12


def describe(c: GemvConfig, k_split: int) -> str:
    flags = ("" if c.fused or c.split == 1 else " 2launch") + ("" if c.evict else " noevict") + (" cg" if c.cg else "")
    flags += (" pf" if c.prefetch and not c.dot else "") + (" tma" if c.tma and c.dot else "")
    flags += " ragged" if c.ragged else ""
    return (f"{'dot' if c.dot else 'fma'} BN{c.BN} BK{c.BK} w{c.num_warps} s{c.num_stages} split{c.split}"
            f"(k{k_split}){flags}")


def sweep_splits(base: GemvConfig, M, N, K, B, device) -> list:
    """base at the picked split, split 1, and the splits giving ~PROGRAM_TARGETS programs (distinct splits only)."""
    picked, _ = gemv_config(M, N, K, B, device, base)
    tiles = B * -(-N // base.BN)
    out, seen = [], set()
    for s in [None, 1] + [max(1, round(t / tiles)) for t in PROGRAM_TARGETS]:
        c, k_split = gemv_config(M, N, K, B, device, replace(base, split=s))
        if c.split not in seen:
            seen.add(c.split)
            out.append(replace(base, split=c.split))
    return out


def bench(shapes, ms, device, smoke, bw):
    rows, step = [], {}
    print(f"{'shape':20s} {'M':>3s} {'N x K':>14s} {'MB':>7s} | {'torch us':>9s} {'TB/s':>5s} | {'ours us':>8s} "
          f"{'TB/s':>5s} {'%copy':>5s} | {'speed':>5s} | config")
    for name, B, N, K, calls in shapes:
        for M in ms:
            case = Case(B, N, K, M, device, smoke)
            case.check()
            t_ref, t_ours = time_us(case.torch_fns(), smoke), time_us(case.ours_fns(), smoke)
            cfg, k_split = gemv_config(M, N, K, B, device)
            mb = case.wbytes / 1e6
            print(f"{name:20s} {M:3d} {f'{N}x{K}':>14s} {mb:7.2f} | {t_ref:9.2f} {tbs(case.wbytes, t_ref):5.2f} | "
                  f"{t_ours:8.2f} {tbs(case.wbytes, t_ours):5.2f} {100 * case.wbytes / (t_ours * 1e-6) / bw:5.1f} | "
                  f"{t_ref / t_ours:4.2f}x | {describe(cfg, k_split)}")
            rows.append(f"| {name} | {M} | {B}x{N}x{K} | {t_ref:.2f} ({tbs(case.wbytes, t_ref):.2f}) | "
                        f"{t_ours:.2f} ({tbs(case.wbytes, t_ours):.2f}) | {t_ref / t_ours:.2f}x |")
            tr, to = step.get(M, (0.0, 0.0))
            step[M] = (tr + calls * t_ref, to + calls * t_ours)
            del case
    print("\nprojections of one decode step (sum of calls x us):")
    for M, (tr, to) in step.items():
        print(f"  M={M:2d}: torch {tr:8.1f} us, ours {to:8.1f} us, saves {tr - to:7.1f} us ({tr / to:.2f}x)")
    print("\n| projection | M | B x N x K | cuBLAS us (TB/s) | ours us (TB/s) | speed |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


def sweep(shapes, ms, device, smoke, bw, tma=False, ragged=False):
    bases = SWEEP[:2] + SWEEP[8:10] + [replace(SWEEP[9], BK=32)] if smoke else SWEEP
    if tma:
        bases = [replace(c, tma=True) for c in SWEEP[:2]] if smoke else TMA_SWEEP
    if ragged:
        bases = [replace(c, ragged=True) for c in SWEEP[:2]] + [DOT_CONFIG] if smoke else RAGGED_SWEEP
    best = {}
    for name, B, N, K, _ in shapes:
        for M in ms:
            case = Case(B, N, K, M, device, smoke)
            default, dk = gemv_config(M, N, K, B, device)
            t_ref = time_us(case.torch_fns(), smoke, replays=10)
            configs = [c for base in bases for c in sweep_splits(base, M, N, K, B, device)]
            if ragged:
                configs.append(default)          # the shape's own config, for the side-by-side
            if not (tma or ragged):
                configs += [replace(v, split=gemv_config(M, N, K, B, device, v)[0].split) for v in VARIANTS]
            results, seen = [], set()
            for cfg in configs:
                c, k_split = gemv_config(M, N, K, B, device, cfg)
                if describe(c, k_split) in seen:
                    continue
                seen.add(describe(c, k_split))
                bm = max(16, M) if c.dot else 1 << (M - 1).bit_length()
                if not c.dot and bm * c.BN * c.BK > 128 * 32 * c.num_warps:   # FMA accumulator > 128 regs/thread
                    continue
                try:
                    case.check(cfg)
                    us = time_us(case.ours_fns(cfg), smoke, replays=10)
                except Exception as e:  # noqa: BLE001  (out of shared memory etc.: report, keep sweeping)
                    print(f"  {name} M={M} {describe(c, k_split)}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                results.append((us, describe(c, k_split), c))
            results.sort(key=lambda r: r[0])
            mark = describe(default, dk)
            print(f"{name} M={M} ({B}x{N}x{K}, {case.wbytes / 1e6:.1f} MB): torch {t_ref:.2f} us "
                  f"{tbs(case.wbytes, t_ref):.2f} TB/s")
            for us, d, _ in results[:12] + [r for r in results[12:] if r[1] == mark]:
                print(f"    {us:8.2f} us {tbs(case.wbytes, us):5.2f} TB/s {100 * case.wbytes / (us * 1e-6) / bw:5.1f}%"
                      f" {d}{'  <- default' if d == mark else ''}")
            print(f"    ({len(results)} configs ran; the 12 fastest shown)")
            best[(name, B, N, K, M)] = (t_ref, results[0] if results else None)
            del case
    print("\nbest per shape (SHAPE_CONFIGS entries for kernels/gemv.py where ours wins):")
    for (name, B, N, K, M), (t_ref, r) in best.items():
        if r is None:
            print(f"  {name:20s} M={M:2d}: none ran")
            continue
        c = r[2]
        print(f"  {name:20s} M={M:2d}: torch {t_ref:8.2f} us, ours {r[0]:8.2f} us ({t_ref / r[0]:.2f}x)  {r[1]}")
        if r[0] < t_ref:
            print(f"      ({B}, {N}, {K}, {M}): GemvConfig(BN={c.BN}, BK={c.BK}, split={c.split}, dot={c.dot}, "
                  f"num_warps={c.num_warps}, num_stages={c.num_stages}, fused={c.fused}, evict={c.evict}, cg={c.cg}, "
                  f"prefetch={c.prefetch}, tma={c.tma}, ragged={c.ragged}),")
    for M in ms:
        tr = sum(calls * best[(n, B, N, K, M)][0] for n, B, N, K, calls in shapes)
        to = sum(calls * min(best[(n, B, N, K, M)][0], best[(n, B, N, K, M)][1][0] if best[(n, B, N, K, M)][1]
                             else float("inf")) for n, B, N, K, calls in shapes)
        print(f"  M={M:2d} per step: torch {tr:8.1f} us, best of ours/torch per shape {to:8.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,16", help="rows (decode batch sizes), each <= 16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes (testing this file)")
    ap.add_argument("--tma", action="store_true", help="sweep the TMA variants only (run it separately: see TMA_SWEEP)")
    ap.add_argument("--ragged", action="store_true", help="sweep the ragged-tile variants (and the default) only")
    ap.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if any(s[0].startswith(p) for p in args.shapes.split(","))]
    ms = [int(m) for m in args.m.split(",")]
    torch.manual_seed(0)
    bw = copy_bandwidth(device, args.smoke)
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    print(f"# device copy bandwidth {bw / 1e12:.2f} TB/s (2 x bytes / t, same run)")
    if args.tma or args.ragged:
        sweep(shapes, ms, device, args.smoke, bw, tma=args.tma, ragged=args.ragged)
        return
    bench(shapes, ms, device, args.smoke, bw)
    if args.sweep:
        print()
        sweep(shapes, ms, device, args.smoke, bw)


if __name__ == "__main__":
    main()
