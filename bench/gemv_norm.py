"""H200 benchmark: the MoE combine + residual add + RMSNorm in the next projection's gemv prologue
(kernels/gemv_norm.py gemv_combine_norm, one launch) vs the two-launch path (kernels.norm.combine_add_rmsnorm_triton
then kernels.gemv.gemv_triton) at T = 1, Kimi-Linear in_proj shapes (KDA 12576 x 2304, MLA 6720 x 2304).

    python bench/gemv_norm.py [--pdl auto|0|1] [--moe] [--smoke]

us per call inside a CUDA graph (bench/_timing.py: median of replays); the graph cycles through enough copies of W
(>= 256 MB, as bench/gemv.py) that every call reads W from HBM. Input: a GEMM2-like y [9, 2304] bf16 (8 routed + the
shared expert), fp32 top-k weights, a residual and the norm weight (L2-resident, as after GEMM2).
--moe: each call is preceded by the MoE GEMMs that produce y (fused_moe_uncombined_triton, 256 + 1 experts of
I = 1024 in bf16, T = 1; the expert weights also flush L2), so the time includes the GEMM2 -> consumer hand-off that
the fusion shortens (with PDL: the consumer's W prefetch overlaps GEMM2's tail).
Prints both, the ratio (fused / two-launch) and the saving; checks h bitwise and out within bf16 tolerance first.
--smoke: CPU, Triton interpreter, tiny shapes and a one-split config (CI check of this file), timings meaningless.
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["KIMI_KERNELS"] = "triton"

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernels.gemv import GemvConfig, gemv_triton  # noqa: E402
from kernels.gemv_norm import fused_config, gemv_combine_norm  # noqa: E402
from kernels.moe.fused import fused_moe_uncombined_triton  # noqa: E402
from kernels.norm import combine_add_rmsnorm_triton  # noqa: E402
from kernels.testing import assert_close, bf16_tol  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import time_us  # noqa: E402

# (name, N, D, layers per decode step)
SHAPES = [("KDA in_proj", 12576, 2304, 20), ("MLA q|kv_a", 6720, 2304, 7)]
SMOKE_SHAPES = [("smoke a", 70, 96, 1), ("smoke b", 40, 256, 1)]
SMOKE_CFG = GemvConfig(BN=32, BK=32, split=1, dot=True, num_stages=2)   # the tiny shapes' default would split K
L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 64
EPS = 1e-6


class Case:
    """T = 1 decode: y (GEMM2's output, or the MoE that writes it), tw, residual, norm weight, copies of W [N, D]."""

    def __init__(self, N, D, k, device, smoke, moe, E, I):
        bf = torch.bfloat16
        self.N, self.D, self.k = N, D, k
        self.wbytes = N * D * 2
        n = 1 if smoke else max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // self.wbytes)))
        w0 = (torch.randn(N, D, device=device) / D ** 0.5).to(bf)
        self.ws = [w0] + [w0.clone() for _ in range(n - 1)]
        self.tw = torch.cat([torch.rand(1, k - 1, device=device) + 0.1, torch.ones(1, 1, device=device)], 1)
        self.r = (torch.randn(1, D, device=device) * 3).to(bf)
        self.nw = (1 + 0.1 * torch.randn(D, device=device)).to(bf)
        self.moe = moe
        if moe:
            self.x = torch.randn(1, D, device=device).to(bf)
            self.w13 = (torch.randn(E + 1, 2 * I, D, device=device) / D ** 0.5).to(bf)
            self.w2 = (torch.randn(E + 1, D, I, device=device) / I ** 0.5).to(bf)
            self.ids = torch.cat([torch.randperm(E, device=device)[:k - 1], torch.tensor([E], device=device)])
            self.ids = self.ids[None].to(torch.int32)
        self.y_static = (torch.randn(k, D, device=device) * 2).to(bf)

    def y(self):
        return fused_moe_uncombined_triton(self.x, self.w13, self.w2, self.tw, self.ids) if self.moe else self.y_static

    def two_launch(self, w, pdl, cfg):
        x, h = combine_add_rmsnorm_triton(self.y(), self.tw, self.r, self.nw, EPS, pdl=pdl)
        return gemv_triton(x, w, cfg, pdl), h

    def fused(self, w, pdl, cfg):
        return gemv_combine_norm(self.y(), self.tw, self.r, self.nw, EPS, w, pdl=pdl, cfg=cfg)

    def fns(self, which, pdl, cfg):
        f = self.fused if which == "fused" else self.two_launch
        return [lambda w=w: f(w, pdl, cfg) for w in self.ws]

    def check(self, pdl, cfg):
        o1, h1 = self.two_launch(self.ws[0], pdl, cfg)
        o2, h2 = self.fused(self.ws[0], pdl, cfg)
        assert torch.equal(h1, h2), "h differs from the two-launch path"
        assert_close("out", o2, o1, bf16_tol())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdl", default="auto", choices=["auto", "0", "1"], help="PDL launches (auto: KIMI_PDL)")
    ap.add_argument("--moe", action="store_true", help="the MoE GEMMs that write y before each call")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes (testing this file)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    pdl = None if args.pdl == "auto" else args.pdl == "1"
    shapes, cfg = (SMOKE_SHAPES, SMOKE_CFG) if args.smoke else (SHAPES, None)
    E, I, k = (4, 32, 3) if args.smoke else (256, 1024, 9)
    torch.manual_seed(0)
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
              f"pdl={args.pdl}, moe={args.moe}")
    for moe in ([False, True] if args.smoke else [args.moe]):
        print(f"{'shape':12s} {'N x D':>11s} {'MB':>6s} | {'two-launch us':>13s} | {'fused us':>8s} | {'ratio':>5s} | "
              f"{'saves us':>8s} | per step | fused config" + ("  (with the MoE GEMMs)" if moe else ""))
        for name, N, D, layers in shapes:
            case = Case(N, D, k, device, args.smoke, moe, E, I)
            plan = fused_config(1, N, D, device, torch.bfloat16, cfg)
            assert plan is not None, f"{name}: not on the fused path"
            case.check(pdl, cfg)
            t2 = time_us(case.fns("two", pdl, cfg), args.smoke, args.replays)
            t1 = time_us(case.fns("fused", pdl, cfg), args.smoke, args.replays)
            c = plan[0]
            print(f"{name:12s} {f'{N}x{D}':>11s} {case.wbytes / 1e6:6.2f} | {t2:13.2f} | {t1:8.2f} | {t1 / t2:5.3f} | "
                  f"{t2 - t1:8.2f} | {layers} x {t2 - t1:.2f} = {layers * (t2 - t1):.1f} us | "
                  f"BN{c.BN} BK{c.BK} w{c.num_warps} s{c.num_stages}")
            del case


if __name__ == "__main__":
    main()
