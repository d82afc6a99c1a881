"""H200 benchmark: Kimi-Linear routed MoE (E=256, top-8, D=2304, I=1024, bf16).

    python bench/moe.py [--tokens 1,8,64,256,1024,8192] [--no-check] [--no-ref] [--sweep]

--sweep also times a grid of tile configs per T (CUDA-graph replay) and prints the best, for tuning get_config.

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
from kernels.moe.fused import MoEConfig, fused_moe_triton, get_config  # noqa: E402

D, I, E, K, SCALE = 2304, 1024, 256, 8, 2.446
HBM_BW = 4.8e12


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,8192")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the slow per-expert-loop reference timing")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs per T")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    dt = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
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
