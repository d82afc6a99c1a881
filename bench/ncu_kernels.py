"""Hardware-counter profile of the open issues' kernels (Nsight Compute), ours beside the peer, one case per process.

Each case warms up (compiles) outside the profiled range, then runs ONE call between cudaProfilerStart / Stop, so
`ncu --profile-from-start off` sees exactly that call's kernels:
  kda16k       kernels.kda.chunk.chunk_kda_fwd, T = 16k, H = 32, K = V = 128 (issue 4: prep, akk, wu, hpass)
  kda16k-fla   fla-core chunk_kda on the same inputs
  mla64x8k     kernels.mla.decode.mla_decode_triton, B = 64, S = 8k (issue 5: stage 1 + merge)
  mla1x128k    the same at B = 1, S = 128k
  mla*-fi      FlashInfer's fa3 MLA decode on the same pages (needs flashinfer; bench/wheels.sh)
Usage (H200): bash bench/ncu.sh [cases]   (the wrapper: sections, stall reasons, one report per case under $OUT)
              python bench/ncu_kernels.py CASE   (alone: runs the case once, unprofiled)
"""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)


def _kda(fla: bool):
    import kda_prefill as kp

    x = kp._inputs([16384])
    fn = kp._fla(x)[0] if fla else kp._ours(x)[0]
    return fn


def _mla(B: int, S: int, fi: bool):
    import mla as bm
    from kernels.mla.decode import mla_decode_triton

    pool = bm.Pool(B * S + 1024)
    bt, sl = pool.tables(B, S)
    q = torch.randn(B, bm.H, bm.L, device="cuda").to(bm.DT)
    qp = torch.randn(B, bm.H, bm.R, device="cuda").to(bm.DT)
    if fi:
        f = bm.FlashInferMLA()
        f.plan(bt, sl, torch.ones(B, dtype=torch.int32, device="cuda"), causal=False)
        f.packed = None
        return lambda: f.run(q, qp, pool.cache)
    out = torch.empty(B, bm.H, bm.L, dtype=bm.DT, device="cuda")
    return lambda: mla_decode_triton(q, qp, pool.cache, bt, sl, bm.SCALE, out=out)


CASES = {
    "kda16k": lambda: _kda(False),
    "kda16k-fla": lambda: _kda(True),
    "mla64x8k": lambda: _mla(64, 8192, False),
    "mla64x8k-fi": lambda: _mla(64, 8192, True),
    "mla1x128k": lambda: _mla(1, 131072, False),
    "mla1x128k-fi": lambda: _mla(1, 131072, True),
}


def main():
    case = sys.argv[1]
    assert case in CASES, f"unknown case {case}; known: {list(CASES)}"
    fn = CASES[case]()
    for _ in range(3):                      # compile + autotune outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{case}: one call profiled")


if __name__ == "__main__":
    main()
