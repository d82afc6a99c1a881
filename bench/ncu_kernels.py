"""Hardware-counter profile of the open issues' kernels (Nsight Compute), ours beside the peer, one case per process.

Each case warms up (compiles) outside the profiled range, then runs ONE call between cudaProfilerStart / Stop, so
`ncu --profile-from-start off` sees exactly that call's kernels:
  kda16k       kernels.kda.chunk.chunk_kda_fwd, T = 16k, H = 32, K = V = 128 (issue 4: prep, akk, wu, hpass)
  kda16k-fla   fla-core chunk_kda on the same inputs
  kda16k+NAME  kda16k with bench/kda_prefill.py's QUICK_VARIANTS entry NAME applied (e.g. kda16k+prep-kg)
  mla64x8k     kernels.mla.decode.mla_decode_triton, B = 64, S = 8k (issue 5: stage 1 + merge)
  mla1x128k    the same at B = 1, S = 128k
  mla*-fi      FlashInfer's fa3 MLA decode on the same pages (needs flashinfer; bench/wheels.sh)
  decode-b1    one batch-1 decode step of the full-size model at context 1k (issue 6; H200 only: 91.5 GiB)
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


def _kda(fla: bool, variant: str = ""):
    import kda_prefill as kp
    import kernels.kda.chunk as ck

    if variant:
        cfg = ck.prep_variant(dict(kp.QUICK_VARIANTS)[variant])
        for n, val in cfg.items():
            setattr(ck, n, val)
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


def _decode_b1():
    """The full-size 27-layer model (random bf16 weights made on the device, as bench/e2e.py; needs an H200), one
    greedy sequence 1,024 tokens in: the profiled call is one pipelined decode engine step (its graph's kernels as
    nodes, plus the sampling and copies around the replay)."""
    import e2e
    from backend.config import ModelConfig
    from backend.engine.engine import EngineConfig, LLMEngine
    from backend.engine.request import SamplingParams
    from backend.engine.runner import ModelRunner
    from backend.model.random_weights import random_model

    dev = torch.device("cuda")
    cfg = ModelConfig.from_dict(e2e.config_dict(27))
    model = random_model(cfg, dev, torch.bfloat16)
    ecfg = EngineConfig(max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=2048, block_size=64, device="cuda",
                        dtype="bfloat16", max_prefill_tokens_with_decode=0, prefill_graph_tokens=0)
    engine = LLMEngine(ModelRunner("", ecfg, model=model), ecfg, start=False)
    e2e.start_decode(engine, 1, 1024, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=512))
    return engine.step


CASES = {
    "decode-b1": _decode_b1,
    "kda16k": lambda: _kda(False),
    "kda16k-fla": lambda: _kda(True),
    "mla64x8k": lambda: _mla(64, 8192, False),
    "mla64x8k-fi": lambda: _mla(64, 8192, True),
    "mla1x128k": lambda: _mla(1, 131072, False),
    "mla1x128k-fi": lambda: _mla(1, 131072, True),
}


def known_case(case: str) -> bool:
    """A CASES name, or kda16k+NAME with NAME a bench/kda_prefill.py QUICK_VARIANTS entry."""
    if case.startswith("kda16k+"):
        import kda_prefill as kp

        return case.split("+", 1)[1] in dict(kp.QUICK_VARIANTS)
    return case in CASES


def main():
    case = sys.argv[1]
    assert known_case(case), f"unknown case {case}; known: {list(CASES)} or kda16k+VARIANT"
    fn = _kda(False, case.split("+", 1)[1]) if case.startswith("kda16k+") else CASES[case]()
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
