"""H200 benchmark: the MoE router (kernels/moe/router.py) at Kimi shapes (E 256, top-8, D 2304, bf16 gate, fp32 bias,
shared expert appended), T = 1 / 8 / 64 tokens, against the torch reference; then the norms (kernels/norm.py).

    python bench/router.py [--t 1,8,64] [--sweep] [--no-norm] [--sections router,router_norm,norm] [--smoke]

Router rows: us per call inside a CUDA graph and gate-weight GB/s (E * D * 2 bytes / time). Each graph cycles through
COPIES gate weights (> the 50 MB L2) so every call reads its gate from HBM, as in a decode step. Rows:
  torch         moe_router_ref (fp32 matmul, stable sort)
  two-launch    _router_logits_(gemv_)kernel + _router_topk_kernel (KIMI_ROUTER_FUSED=0; T > 16 always)
  ... row top-k the same with _router_topk_row_kernel
  v3 split-K    T > 16 under v2 / v3: _router_logits_splitk_kernel + _router_topk_row_kernel (T <= TOPK_ROW_MAX_T)
  v1            _router_fused_gemv_kernel (the one-launch decode router, T <= 16)
  v2 BEb wN     _router_decode_kernel with the arrival counter, b experts per N-warp program
                (KIMI_ROUTER_DECODE=v2 KIMI_ROUTER_BE=b KIMI_ROUTER_WARPS=N)
  v3 BEb wN     the same with the flag-in-data handshake (KIMI_ROUTER_DECODE=v3)
                default config (+ v3 with maxnreg 0, i.e. no register cap) only; --sweep: v3 at BE 1/2/4 x warps 1/2/4
Every Triton row is checked against the reference first (ids equal, weights close).
Norm rows (D 2304, bf16): add_rmsnorm, rmsnorm, combine (kernels.moe.fused.moe_combine, k = 9) + add_rmsnorm vs the
fused combine_add_rmsnorm (KIMI_FUSE_COMBINE_NORM=1), per NORM_CONFIGS launch config (warps, early weight load),
at T = 1, 64, 8192; each graph cycles through enough inputs to leave L2.
Router + norm rows (--sections router_norm, T <= 16): moe_router_add_norm_triton (the post-attention add + RMSNorm
computed by the decode router itself, one launch) vs add_rmsnorm_triton + moe_router_triton, PDL on; --sweep times
the fused kernel at NORM_SWEEP (BE, warps) configs (default KIMI_ROUTER_NORM_BE 1 / _WARPS 2).
--smoke: CPU, Triton interpreter, tiny shapes: runs every code path (CI check of this file), timings meaningless.
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import kernels.moe.router as R  # noqa: E402
import kernels.norm as N  # noqa: E402
from kernels.moe import moe_router_ref  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import time_us  # noqa: E402

E, K, D, SCALE = 256, 8, 2304, 2.446
COPIES = 48                   # 48 x 1.18 MB gate weights = 57 MB > L2
V2_DEFAULT = [(R.DECODE_BE, R.DECODE_WARPS)]
V2_SWEEP = [(be, w) for be in (1, 2, 4) for w in (1, 2, 4)]


def router_variants(T, sweep):
    """name -> fn(x, g, b) -> (w, ids)."""
    def two(x, g, b):
        logits = R.router_logits_triton(x, g)
        return R.router_topk_triton(logits, b, K, SCALE, True, False, E)

    def two_rows(x, g, b):   # the two-launch path as v2 / v3 run it (top-k: _router_topk_row_kernel)
        saved, R.ROUTER_DECODE = R.ROUTER_DECODE, "v3"
        try:
            return two(x, g, b)
        finally:
            R.ROUTER_DECODE = saved

    def two_v1(x, g, b):
        saved, R.ROUTER_DECODE = R.ROUTER_DECODE, "v1"
        try:
            return two(x, g, b)
        finally:
            R.ROUTER_DECODE = saved

    out = {"torch": lambda x, g, b: moe_router_ref(x, g, b, K, SCALE, True, False, append_expert=E),
           "two-launch": two_v1}
    if T <= R.TOPK_ROW_MAX_T:
        out["two-launch row top-k"] = two_rows
    if R.GEMV_MAX_T < T <= R.TOPK_ROW_MAX_T:
        def splitk(x, g, b):   # what moe_router_triton runs for these T under v2 / v3
            saved, R.ROUTER_DECODE = R.ROUTER_DECODE, "v3"
            try:
                return R.moe_router_triton(x, g, b, K, SCALE, True, False, E)
            finally:
                R.ROUTER_DECODE = saved
        out["v3 split-K + row top-k"] = splitk
    if T <= R.GEMV_MAX_T:
        out["v1"] = lambda x, g, b: R._router_decode_v1(x, g, b, K, SCALE, True, False, E)
        for poll in (False, True):
            for be, w in (V2_SWEEP if sweep and poll else V2_DEFAULT):
                out[f"v{2 + poll} BE{be} w{w}"] = (lambda be, w, poll: lambda x, g, b: R._router_decode_v2(
                    x, g, b, K, SCALE, True, False, E, BE=be, num_warps=w, poll=poll))(be, w, poll)
        be, w = V2_DEFAULT[0]
        out[f"v3 BE{be} w{w} nocap"] = lambda x, g, b: R._router_decode_v2(
            x, g, b, K, SCALE, True, False, E, BE=be, num_warps=w, poll=True, maxnreg=0)
    return out


def bench_router(ts, sweep, smoke, dev):
    e, d, copies = (E, 40, 2) if smoke else (E, D, COPIES)
    print(f"== router: E {e}, top-{K}, D {d}, bf16 gate ({e * d * 2 / 1e6:.2f} MB) x {copies} copies, fp32 bias")
    gs = [torch.randn(e, d, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    b = torch.randn(e, device=dev) * 0.05
    for T in ts:
        x = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
        for name, fn in router_variants(T, sweep).items():
            w, ids = fn(x, gs[0], b)
            wr, ir = moe_router_ref(x, gs[0], b, K, SCALE, True, False, append_expert=E)
            ok = torch.equal(ids, ir) and torch.allclose(w, wr, rtol=1e-5, atol=1e-6)
            us = time_us([(lambda g: lambda: fn(x, g, b))(g) for g in gs], smoke)
            print(f"  T {T:3d}  {name:20s} {us:8.2f} us  {e * d * 2 / us / 1e3:7.1f} GB/s  "
                  f"{'ok' if ok else 'MISMATCH vs reference'}")


NORM_SWEEP = [(1, 2), (1, 1), (1, 4), (2, 2), (2, 4), (4, 4)]


def bench_router_norm(ts, sweep, smoke, dev):
    """moe_router_add_norm (the post-attention add + RMSNorm inside the decode router: one launch) against
    add_rmsnorm + moe_router (two), both with PDL (decode chain order: each launch waits for the previous one), in a
    CUDA graph; gate weights cycled through HBM, attn / residual L2-resident (just written, as in a decode step)."""
    e, d, copies = (E, 40, 2) if smoke else (E, D, COPIES)
    print(f"== router + add_rmsnorm: E {e}, top-{K}, D {d}, bf16, PDL on; router BE{R.DECODE_BE} w{R.DECODE_WARPS}, "
          f"fused BE{R.NORM_BE} w{R.NORM_WARPS} (--sweep: the fused kernel at BE x warps {NORM_SWEEP})")
    gs = [torch.randn(e, d, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    b = torch.randn(e, device=dev) * 0.05
    nw = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
    for T in ts:
        if T > R.GEMV_MAX_T:
            continue
        attn = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
        res = torch.randn(T, d, device=dev, dtype=torch.bfloat16) * 4

        def two(g):
            x, h = N.add_rmsnorm_triton(attn, res, nw, 1e-6, pdl=True)
            return (x, h) + R.moe_router_triton(x, g, b, K, SCALE, True, False, E, pdl=True)

        def fused(g):
            return R.moe_router_add_norm_triton(attn, res, nw, 1e-6, g, b, K, SCALE, True, False, E, pdl=True)

        ref = two(gs[0])
        us2 = time_us([(lambda g: lambda: two(g))(g) for g in gs], smoke)
        print(f"  T {T:3d}  add_rmsnorm + router (2 launches)   {us2:8.2f} us")
        saved = R.NORM_BE, R.NORM_WARPS
        try:
            for be, w in (NORM_SWEEP if sweep else [(R.NORM_BE, R.NORM_WARPS)]):
                R.NORM_BE, R.NORM_WARPS = be, w
                x, h, tw, ids = fused(gs[0])
                ulp = (x.view(torch.int16).int() - ref[0].view(torch.int16).int()).abs().max().item()
                ok = torch.equal(h, ref[1]) and ulp <= 1 and torch.equal(ids, ref[3]) and \
                    torch.allclose(tw, ref[2], rtol=0, atol=1e-6)
                us = time_us([(lambda g: lambda: fused(g))(g) for g in gs], smoke)
                print(f"  T {T:3d}  fused BE{be} w{w} (1 launch)            {us:8.2f} us  {us - us2:+7.2f} us  "
                      f"x max {ulp} ulp  {'ok' if ok else 'MISMATCH vs two launches'}")
        finally:
            R.NORM_BE, R.NORM_WARPS = saved


def bench_norm(smoke, dev):
    d = 40 if smoke else D
    print(f"== norms: D {d}, bf16; configs (warps, early weight load): {N.NORM_CONFIGS}")
    w = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
    for T in ((1, 5) if smoke else (1, 64, 8192)):
        n = 2 if smoke else max(2, min(64, (128 << 20) // (T * d * 2 * 12)))   # inputs cycled: > L2 in all
        xs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        rs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        ys = [torch.randn(T * 9, d, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        tw = torch.rand(T, 9, device=dev)
        ref = N.add_rmsnorm_ref(xs[0], rs[0], w, 1e-6)
        for cfg in N.NORM_CONFIGS:
            got = N.add_rmsnorm_triton(xs[0], rs[0], w, 1e-6, cfg=cfg)
            ok = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(got, ref))
            us = time_us([(lambda i: lambda: N.add_rmsnorm_triton(xs[i], rs[i], w, 1e-6, cfg=cfg))(i)
                          for i in range(n)], smoke)
            us_n = time_us([(lambda i: lambda: N.rmsnorm_triton(xs[i], w, 1e-6, cfg=cfg))(i) for i in range(n)],
                           smoke)
            us_f = time_us([(lambda i: lambda: N.combine_add_rmsnorm_triton(ys[i], tw, rs[i], w, 1e-6, cfg=cfg))(i)
                            for i in range(n)], smoke)
            print(f"  T {T:5d} cfg {str(cfg):8s} add_rmsnorm {us:7.2f} us ({'ok' if ok else 'MISMATCH'})  "
                  f"rmsnorm {us_n:7.2f} us  combine_add_rmsnorm {us_f:7.2f} us")
        from kernels.moe.fused import moe_combine
        out = torch.empty(T, d, device=dev, dtype=torch.bfloat16)
        us_c = time_us([(lambda i: lambda: moe_combine(ys[i], tw, out))(i) for i in range(n)], smoke)
        print(f"  T {T:5d} moe_combine alone {us_c:7.2f} us (the launch KIMI_FUSE_COMBINE_NORM=1 removes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="1,8,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-norm", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sections", default="router,router_norm,norm",
                    help="comma list of router (decode router variants), router_norm (fused add + norm + router "
                         "vs the two launches, T <= 16), norm (the norm kernels)")
    a = ap.parse_args()
    sections = a.sections.split(",")
    dev = "cpu" if a.smoke else "cuda"
    if not a.smoke:
        print(torch.cuda.get_device_name(), "| triton", __import__("triton").__version__)
    ts = [int(t) for t in a.t.split(",")]
    if "router" in sections:
        bench_router(ts, a.sweep, a.smoke, dev)
    if "router_norm" in sections:
        bench_router_norm(ts, a.sweep, a.smoke, dev)
    if "norm" in sections and not a.no_norm:
        bench_norm(a.smoke, dev)


if __name__ == "__main__":
    main()
