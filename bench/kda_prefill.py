"""KDA chunked-prefill benchmark (H200): kernels/kda/chunk.py::chunk_kda_fwd vs fla-core chunk_kda.

Kimi-Linear shapes: H=32, K=V=128, bf16 inputs, fp32 state, unbounded gate (no safe_gate).
Cases: single sequence T = 4k, 16k, 64k, and varlen 16 x 1k. Timing: triton.testing.do_bench median.
Both sides do the whole core op: L2 norm of q/k, gate activation from the raw z (A_log, dt_bias), beta sigmoid,
the chunked delta rule, initial-state read and final-state write.
Run: python bench/kda_prefill.py   (prints one line per case and, when fla is importable, the ratio)
     python bench/kda_prefill.py --sweep   (launch-config sweep of kernels/kda/chunk.py at T=16k and 16x1k)
"""
from __future__ import annotations

import inspect
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

H, K, V = 32, 128, 128
DEVICE = "cuda"
CASES = [("T=4k", [4096]), ("T=16k", [16384]), ("T=64k", [65536]), ("varlen 16x1k", [1024] * 16)]


def _inputs(lens, device=None, dtype=torch.bfloat16):
    device = device or DEVICE
    T = sum(lens)
    g = torch.Generator(device=device).manual_seed(0)
    rn = lambda *s: torch.randn(*s, device=device, generator=g)
    q, k, v = rn(T, H, K).to(dtype), rn(T, H, K).to(dtype), rn(T, H, V).to(dtype)
    z = rn(T, H * K).to(dtype)
    b = rn(T, H).to(dtype)
    A_log = torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=g))
    dt_bias = rn(H * K) * 0.5
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return dict(q=q, k=k, v=v, z=z, b=b, A_log=A_log, dt_bias=dt_bias, cu=cu)


def _ours(x):
    from kernels.kda.chunk import chunk_kda_fwd

    P = len(x["cu"]) - 1
    pool = torch.zeros(P + 1, H, K, V, device=DEVICE, dtype=torch.float32)
    cu_t = torch.tensor(x["cu"], dtype=torch.int32, device=DEVICE)
    slots = torch.arange(1, P + 1, dtype=torch.int32, device=DEVICE)
    hi = torch.zeros(P, dtype=torch.bool, device=DEVICE)
    out = torch.empty_like(x["v"])

    def fn():
        return chunk_kda_fwd(x["q"], x["k"], x["v"], x["z"], x["A_log"], x["dt_bias"], x["b"], K ** -0.5, pool,
                             cu_t, slots, hi, out=out, cu_seqlens_cpu=x["cu"])
    return fn, lambda: (out, pool[1:])


def _fla(x):
    from fla.ops.kda import chunk_kda

    params = inspect.signature(chunk_kda).parameters
    T = x["cu"][-1]
    P = len(x["cu"]) - 1
    kw = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    beta = x["b"][None]
    if "use_beta_sigmoid_in_kernel" in params:
        kw["use_beta_sigmoid_in_kernel"] = True
    else:
        beta = torch.sigmoid(beta.float()).to(x["b"].dtype)
    g = x["z"].view(1, T, H, K)
    if "use_gate_in_kernel" in params or "A_log" in params:
        kw.update(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    else:                                            # gate outside the kernel (only for old fla versions)
        from kernels.kda.ref import kda_gate_ref
        g = kda_gate_ref(x["z"], x["A_log"], x["dt_bias"])[None]
    if P > 1:
        kw["cu_seqlens"] = torch.tensor(x["cu"], dtype=torch.long, device=DEVICE)
        if "cu_seqlens_cpu" in params:
            kw["cu_seqlens_cpu"] = torch.tensor(x["cu"], dtype=torch.long)
    h0 = torch.zeros(P, H, K, V, device=DEVICE, dtype=torch.float32)
    res = {}

    def fn():
        o, ht = chunk_kda(x["q"][None], x["k"][None], x["v"][None], g, beta, initial_state=h0, **kw)
        res["o"], res["ht"] = o, ht
        return o
    return fn, lambda: (res["o"][0], res["ht"])


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / (b.pow(2).mean().sqrt() + 1e-30)).item()


def bench_prefill(cases=CASES, warmup=25, rep=100):
    import triton.testing

    rows = []
    print(f"KDA chunked prefill, H={H} K={K} V={V} bf16, do_bench median (ms), tokens/s", flush=True)
    for name, lens in cases:
        x = _inputs(lens)
        T = sum(lens)
        fn, get = _ours(x)
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        line = f"{name:14s} ours {ms:8.3f} ms {T / ms * 1e3 / 1e6:8.2f} Mtok/s"
        row = dict(case=name, T=T, ours_ms=ms)
        try:
            ffn, fget = _fla(x)
            ffn()
            torch.cuda.synchronize()
            fms = triton.testing.do_bench(ffn, warmup=warmup, rep=rep, return_mode="median")
            fn()
            ffn()
            (o, st), (fo, fst) = get(), fget()
            eo, es = _rel(o, fo), _rel(st, fst)
            line += (f" | fla {fms:8.3f} ms {T / fms * 1e3 / 1e6:8.2f} Mtok/s | speedup {fms / ms:5.2f}x"
                     f" | rel-rms vs fla o {eo:.1e} state {es:.1e}")
            row.update(fla_ms=fms, speedup=fms / ms, rel_o=eo, rel_state=es)
        except Exception as e:                       # fla missing or API mismatch: report ours only
            line += f" | fla unavailable: {type(e).__name__}: {str(e)[:120]}"
        print(line, flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def sweep_prefill(lens_list=((16384,), (1024,) * 16), warmup=10, rep=50):
    """Launch-config sweep for kernels/kda/chunk.py (module constants), one line per config and case."""
    import itertools

    import triton.testing

    import kernels.kda.chunk as ck

    saved = {n: getattr(ck, n) for n in ("INTRA_BK", "INTRA_NUM_WARPS", "STATE_BV", "STATE_NUM_WARPS",
                                         "STATE_NUM_STAGES")}
    try:
        for lens in lens_list:
            x = _inputs(list(lens))
            T = sum(lens)
            for ibk, iw, sbv, sw, ss in itertools.product((32, 64), (4, 8), (32, 64), (4, 8), (2, 3)):
                ck.INTRA_BK, ck.INTRA_NUM_WARPS = ibk, iw
                ck.STATE_BV, ck.STATE_NUM_WARPS, ck.STATE_NUM_STAGES = sbv, sw, ss
                try:
                    fn, _ = _ours(x)
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
                    print(f"T={T} P={len(lens)} intra BK={ibk} w={iw} | state BV={sbv} w={sw} st={ss}: {ms:.3f} ms",
                          flush=True)
                except Exception as e:                   # e.g. out of shared memory for a config
                    print(f"T={T} intra BK={ibk} w={iw} | state BV={sbv} w={sw} st={ss}: failed "
                          f"{type(e).__name__}: {str(e)[:100]}", flush=True)
            del x
    finally:
        for n, v in saved.items():
            setattr(ck, n, v)


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep_prefill()
    else:
        bench_prefill()
