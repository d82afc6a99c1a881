"""KDA chunked-prefill benchmark (H200): kernels/kda/chunk.py::chunk_kda_fwd vs fla-core chunk_kda.

Kimi-Linear shapes: H=32, K=V=128, bf16 inputs, fp32 state, unbounded gate (no safe_gate).
Cases: single sequence T = 4k, 16k, 64k, and varlen 16 x 1k. Timing: triton.testing.do_bench median.
Both sides do the whole core op: L2 norm of q/k, gate activation from the raw z (A_log, dt_bias), beta sigmoid,
the chunked delta rule, initial-state read and final-state write.
Run: python bench/kda_prefill.py   (prints one line per case and, when fla is importable, the ratio)
     python bench/kda_prefill.py --sweep   (ours vs fla-core at T = 4k, 16k, 64k with per-stage times,
                                            then a launch-config sweep of the intra kernels at 16k; about a minute)
     python bench/kda_prefill.py --quick [--variants default,akk-lv,...]   (T=16k: the default vs every
                                            (named) QUICK_VARIANTS entry (module constants) vs fla-core, per-stage
                                            ms and a check against the default; then varlen 16 x 1k. ~80 s per
                                            variant that recompiles akk on the H200)
         [--cases T=16k,varlen]             (--quick's parts: T=16k, varlen 16 x 1k, or both, the default)
     python bench/kda_prefill.py --sweep-state   (the per-stage sweep of the state pass / output configs)
Each case prints kernels/kda/chunk.py (intra -> state pass only -> parallel output), fla when importable, and our
per-stage times.

Time budget (B=1, T=16k, H=32, K=V=128, C=64: NT=256 chunks, NT*H=8192 chunk-heads; H200: ~4.5 TB/s,
~400 TFLOP/s tf32 / ~800 bf16 dense in practice, 132 SMs). Per chunk-head:

  stage            FLOPs (dense)                     HBM/L2 bytes                          programs @16k  serial?
  intra            Dkk,Dqk 2.1 M (6.3 M as computed   in q,k,z,v 64 KB (+k,z re-read 32 KB   8192 (C x H),   no
                   with masked 64x64 per row block)   from L2); out qg,kg,w,u 64 KB, Aqk     1 CTA/SM
                   + inverse 1.6 M + w,u 2.1 M        8 KB, gl 0.5 KB -> ~140 KB             (244 regs x 8 w)
                   ~10 MFLOP tf32                                                            -> 62 waves
  state            w.h 2.1 M + kg^T.vn 2.1 M          w,kg 32 KB (shared by the V tiles     V/BV*P*H = 256   YES: 256
                   = 4.2 MFLOP, 2 dots/step           via L2), u 16 KB, out h_c 32 KB, vn   at BV=16         steps per
                                                      16 KB (bf16)                                           program
  output           qg.h 2.1 M + Aqk.vn 1 M            qg 16 + Aqk 8 + h_c 32 + vn 16 in,    NT*H*V/BV        no
                   = 3.1 MFLOP                        o 16 KB out -> 88 KB                  = 16384 @BV=64
Totals at 16k: intra ~82 GFLOP / ~1.1 GB (~0.25 ms at bandwidth, if not latency bound: 62 waves -> must be
<= ~16 us per program for a 1 ms intra); state ~34 GFLOP, serial 256 steps (~1 us/step -> ~0.26 ms);
output ~25 GFLOP / ~0.7 GB (~0.16 ms). h_c scratch: T*H*K*V*2/C = T*H*512 B (268 MB at 16k, bf16 = the MMA
operand the state is rounded to for the dots anyway). (The removed fused state+output kernel did 4 dots per
serial step, 7.3 MFLOP per chunk-head, in 128 programs at BV=32.)
(The intra row above describes the removed one-kernel intra; the current prep -> akk -> wu launches do the same
math.) Measured 2026-12-02 on the H200 at 16k: prep 0.56, akk 1.59, wu 0.44, hpass 0.51, out 0.24 ms (3.35 ms end
to end vs fla-core 2.08). SASS instruction count (offline, Triton 3.6) is the proxy that matched: akk ~112k warp-
instructions per chunk-head (4 programs x 4 warps) -> 1.59 ms = ~55% of the H200's issue rate; prep ~34k, wu ~11k.
The one-program intra with level-anchored dots (INTRA_FUSED, estimated ~96k) measured 3.772 vs 3.340 ms end to
end on 2026-12-03 and was removed (BENCHMARKS.md seventh round).
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


def _ours(x, stages=False):
    """(run, get (o, final states)); stages: also return {stage: launch} of one planned call (per-stage timing)."""
    from kernels.kda.chunk import chunk_kda_fwd, chunk_kda_plan

    P = len(x["cu"]) - 1
    pool = torch.zeros(P + 1, H, K, V, device=DEVICE, dtype=torch.float32)
    cu_t = torch.tensor(x["cu"], dtype=torch.int32, device=DEVICE)
    slots = torch.arange(1, P + 1, dtype=torch.int32, device=DEVICE)
    hi = torch.zeros(P, dtype=torch.bool, device=DEVICE)
    out = torch.empty_like(x["v"])

    args = (x["q"], x["k"], x["v"], x["z"], x["A_log"], x["dt_bias"], x["b"], K ** -0.5, pool, cu_t, slots, hi)

    def fn():
        return chunk_kda_fwd(*args, out=out, cu_seqlens_cpu=x["cu"])
    if stages:
        _, launches = chunk_kda_plan(*args, out=out, cu_seqlens_cpu=x["cu"])
        return fn, lambda: (out, pool[1:]), launches
    return fn, lambda: (out, pool[1:])


def _time_ours(x, warmup, rep, stage_warmup, stage_rep):
    """Ours on the case x: (median ms end to end, _stage_times of one planned call, (o, final states) of a fresh run
    after the timing)."""
    import triton.testing

    fn, get, launches = _ours(x, stages=True)
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    st = _stage_times(launches, stage_warmup, stage_rep)
    fn()
    torch.cuda.synchronize()
    return ms, st, tuple(t.clone() for t in get())


def _time_fla(x, warmup, rep):
    """fla-core chunk_kda on the case x: (median ms, output, final state) of a fresh run after the timing."""
    import triton.testing

    ffn, fget = _fla(x)
    ffn()
    torch.cuda.synchronize()
    fms = triton.testing.do_bench(ffn, warmup=warmup, rep=rep, return_mode="median")
    ffn()
    torch.cuda.synchronize()
    fo, fst = fget()
    return fms, fo, fst


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


def _stage_times(launches, warmup, rep):
    import triton.testing

    res = {}
    for name, f in launches.items():                 # once in order: compiled, and every scratch buffer valid
        kern = f()
        try:                                         # what this toolchain's compiler made of it (None if unknown)
            res[name + "_res"] = (kern.n_regs, kern.n_spills, kern.metadata.shared)
        except Exception:
            res[name + "_res"] = None
    torch.cuda.synchronize()
    for name, f in launches.items():
        res[name] = triton.testing.do_bench(f, warmup=warmup, rep=rep, return_mode="median")
    return res


def _fmt_stages(st):
    out = []
    for n, t in st.items():
        if n.endswith("_res"):
            continue
        r = st.get(n + "_res")
        out.append(f"{n} {t:.3f} ms" + (f" (regs {r[0]} spills {r[1]} smem {r[2] // 1024} KB)" if r else ""))
    return ", ".join(out)


def bench_prefill(cases=CASES, warmup=25, rep=100):
    rows = []
    print(f"KDA chunked prefill, H={H} K={K} V={V} bf16, do_bench median (ms), tokens/s", flush=True)
    for name, lens in cases:
        x = _inputs(lens)
        T = sum(lens)
        row = dict(case=name, T=T)
        outs = None
        line = f"{name:14s}"
        try:
            ms, st, outs = _time_ours(x, warmup, rep, 5, 30)
            line += f" | ours {ms:7.3f} ms {T / ms * 1e3 / 1e6:6.2f} Mtok/s"
            row["ours_ms"] = ms
            row["ours_stages"] = st
        except Exception as e:                       # still time fla
            line += f" | ours FAILED {type(e).__name__}: {str(e)[:200]}"
        try:
            fms, fo, fst = _time_fla(x, warmup, rep)
            line += f" | fla {fms:7.3f} ms {T / fms * 1e3 / 1e6:6.2f} Mtok/s"
            row["fla_ms"] = fms
            if outs is not None:
                eo, es = _rel(outs[0], fo), _rel(outs[1], fst)
                line += f" | {fms / row['ours_ms']:4.2f}x fla, rel-rms vs fla o {eo:.1e} state {es:.1e}"
                row["ours_speedup"] = fms / row["ours_ms"]
        except Exception as e:                       # fla missing or API mismatch: report ours only
            line += f" | fla unavailable: {type(e).__name__}: {str(e)[:120]}"
        print(line, flush=True)
        if "ours_stages" in row:
            print(f"{'':14s}   stages: " + _fmt_stages(row["ours_stages"]), flush=True)
        rows.append(row)
        del x, outs
        torch.cuda.empty_cache()
    return rows


def sweep_prefill(lens_list=((16384,), (1024,) * 16), warmup=5, rep=25):
    """Per-stage launch-config sweep for kernels/kda/chunk.py (module constants), one line per stage config and
    case (each stage timed alone, so the configs add instead of multiplying; ~1 minute)."""
    import kernels.kda.chunk as ck

    names = ("HPASS_BV", "HPASS_NUM_WARPS", "HPASS_NUM_STAGES", "OUT_BV", "OUT_NUM_WARPS", "OUT_NUM_STAGES")
    saved = {n: getattr(ck, n) for n in names}
    grid = [  # (stage, {constant: value})
        *[("hpass", dict(HPASS_BV=bv, HPASS_NUM_WARPS=w, HPASS_NUM_STAGES=st))
          for bv, w, st in ((16, 4, 2), (16, 8, 2), (16, 4, 3), (32, 4, 2), (32, 8, 2), (32, 4, 3), (64, 4, 2),
                            (64, 8, 2))],
        *[("out", dict(OUT_BV=bv, OUT_NUM_WARPS=w, OUT_NUM_STAGES=st))
          for bv, w, st in ((64, 4, 2), (64, 8, 2), (64, 4, 1), (128, 4, 2), (128, 8, 2))],
    ]
    try:
        for lens in lens_list:
            x = _inputs(list(lens))
            T = sum(lens)
            for stage, cfg in grid:
                for n, val in saved.items():
                    setattr(ck, n, val)
                for n, val in cfg.items():
                    setattr(ck, n, val)
                desc = " ".join(f"{n}={val}" for n, val in cfg.items())
                try:
                    _, _, launches = _ours(x, stages=True)
                    for f in launches.values():  # valid scratch for the timed stage
                        f()
                    st = _stage_times({stage: launches[stage]}, warmup, rep)
                    print(f"T={T} P={len(lens)} {stage:9s} {desc}: " + _fmt_stages(st), flush=True)
                except Exception as e:                   # e.g. out of shared memory for a config
                    print(f"T={T} P={len(lens)} {stage:9s} {desc}: failed {type(e).__name__}: {str(e)[:100]}",
                          flush=True)
            del x
            torch.cuda.empty_cache()
    finally:
        for n, val in saved.items():
            setattr(ck, n, val)


INTRA_STAGES = ("prep", "akk", "wu")


def intra_compare(Ts=(4096, 16384, 65536), warmup=10, rep=50):
    """Ours next to fla-core: per T one line of totals and the ratio, then the per-stage times."""
    print(f"ours vs fla-core, H={H} K={K} V={V} bf16, do_bench median (ms)", flush=True)
    for T in Ts:
        x = _inputs([T])
        line = f"T={T:6d}"
        try:
            ms, st, (o, s) = _time_ours(x, warmup, rep, 3, 20)
            line += f" | ours {ms:7.3f} ms (intra {sum(st.get(n, 0.0) for n in INTRA_STAGES):6.3f})"
        except Exception as e:
            print(line + f" | FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        try:
            fms, fo, fst = _time_fla(x, warmup, rep)
            line += f" | fla {fms:7.3f} ms | {fms / ms:4.2f}x fla (o {_rel(o, fo):.1e} state {_rel(s, fst):.1e})"
        except Exception as e:
            line += f" | fla unavailable: {type(e).__name__}: {str(e)[:120]}"
        print(line, flush=True)
        print(f"{'':8s} stages: " + _fmt_stages(st), flush=True)
        del x
        torch.cuda.empty_cache()


def sweep_intra(T=16384, warmup=5, rep=25):
    """Launch-config sweep of the intra kernels at one T (each stage timed alone)."""
    import kernels.kda.chunk as ck

    names = ("PREP_ROWS", "PREP_BK", "PREP_NUM_WARPS", "AKK_BK", "AKK_NUM_WARPS", "AKK_LV_SPLITK", "WU_BK", "WU_BV",
             "WU_NUM_WARPS")
    saved = {n: getattr(ck, n) for n in names}
    grid = [
        *[("prep", dict(PREP_BK=bk, PREP_NUM_WARPS=w)) for bk, w in ((32, 4), (64, 8))],
        *[("akk", dict(AKK_BK=bk, AKK_NUM_WARPS=w, AKK_LV_SPLITK=sk))
          for bk, w, sk in ((16, 1, 1), (16, 1, 0), (32, 1, 1), (16, 2, 1))],
        *[("wu", dict(WU_BK=bk, WU_BV=bk, WU_NUM_WARPS=w)) for bk, w in ((64, 4), (64, 8), (32, 4))],
    ]
    x = _inputs([T])
    try:
        for stage, cfg in grid:
            for n, val in saved.items():
                setattr(ck, n, val)
            for n, val in ck.prep_variant(cfg).items():     # the tile prep's constants imply PREP_ROWS = 0
                setattr(ck, n, val)
            desc = " ".join(f"{n}={val}" for n, val in cfg.items())
            try:
                _, _, launches = _ours(x, stages=True)
                for f in launches.values():
                    f()
                st = _stage_times({stage: launches[stage]}, warmup, rep)
                print(f"T={T} {stage:4s} {desc}: " + _fmt_stages(st), flush=True)
            except Exception as e:
                print(f"T={T} {stage:4s} {desc}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
    finally:
        for n, val in saved.items():
            setattr(ck, n, val)
        del x
        torch.cuda.empty_cache()


# --quick: (name, {module constant: value}) timed against the default and fla-core in one run
QUICK_VARIANTS = [
    ("default", {}),
    # since 12-03 the default is lv2k + cumsum-dot + out-vfast + hpass-s3-prefetch (so fast-softplus, hpass-prefetch,
    # cumsum-dot, out-vfast, hpass-s3 and hpass-s3-prefetch below now run the default); the per-pair akk variants
    # (AKK_DIAG 0 / 1 / 2), wu-kb, intra-fused and the old fused state+output path were removed after that round,
    # prep-fused (PREP_FUSED: 3.993 vs 2.222 ms at T=16k on the H200) after the next
    # FAST_SOFTPLUS: lg2.approx softplus (offline sm_90: prep K-loop body 2134 -> 1446 instructions)
    ("fast-softplus", dict(FAST_SOFTPLUS=1)),
    ("hpass-prefetch", dict(HPASS_PREFETCH=1)),
    # BV=16 (auto at B=1): 256 programs, but each re-reads the head's w / kg (32 KB per chunk) from L2: ~8 MB per
    # serial step, ~4 TB/s at the measured ~2 us/step; BV=32 / 64 halve / quarter that with 128 / 64 programs
    ("hpass-prefetch-bv32", dict(HPASS_PREFETCH=1, HPASS_BV=32)),
    ("hpass-prefetch-bv64", dict(HPASS_PREFETCH=1, HPASS_BV=64)),
    # session 5 (offline sm_90 SASS, Triton 3.6; per chunk-head warp-instructions, the proxy that matched):
    # akk-lv: _kda_akk_lv_kernel, 1 warp per 16-row sub-chunk, diagonal blocks by level-anchored tensor-core dots,
    # off-diagonal per earlier 16-column block only, in one K pass; 245 regs / 12.8 KB smem, no spills; ~23k vs the
    # removed per-pair akk's ~112k (this kernel's [16, x] tiles are replicated in every warp at 2 or 4 warps: the
    # same per-thread SASS count at 1, 2 and 4 warps). The default (akk-lv-2k) does it in two K passes
    # (off-diagonal blocks, then levels): 164 regs (12 warps/SM instead of 8), ~13% more instructions
    ("akk-lv", dict(AKK_LV_SPLITK=0, AKK_MAXNREG=None)),
    ("akk-lv-w2", dict(AKK_LV_SPLITK=0, AKK_NUM_WARPS=2, AKK_MAXNREG=None)),   # 255 regs, no spills
    # cumsum-dot: prep's gate cumsum as 2 tf32 dots with the triangular ones matrix (hi/lo split, fp32-accurate)
    # instead of tl.cumsum's scan (~40% of prep's instructions); prep BK=16: 123 regs (4 CTAs/SM), ~18k vs ~27k
    # (FAST_SOFTPLUS alone) / ~36k (default)
    ("cumsum-dot", dict(FAST_SOFTPLUS=1, CUMSUM_DOT=1, PREP_BK=16)),
    # out-vfast: V tile fastest in the output grid (2nd V tile's qg 16 KB + Aqk 8 KB from L2, not HBM)
    ("out-vfast", dict(OUT_VFAST=1)),
    # hpass-s3: 3 pipeline stages in the state pass. Offline sm_90 (3.6): at 2 stages the loop head waits for every
    # cp.async group (DEPBAR.LE SB0, 0x0: the next chunk's w / kg are fetched with no overlap, one L2 round trip
    # on every serial step); at 3 it waits with 3 groups in flight (one chunk ahead). 80 regs, 106 KB smem (2/SM)
    ("hpass-s3", dict(HPASS_NUM_STAGES=3)),
    ("hpass-s3-prefetch", dict(HPASS_NUM_STAGES=3, HPASS_PREFETCH=1)),
    # session 10 (offline sm_90, Triton 3.9; untimed): the intra launches are latency-bound (prep ~0.15 ms of issue
    # and ~0.22 ms of bytes in 0.52 ms; akk ~45% of the issue rate at 12 one-warp CTAs / SM; wu 3 CTAs / SM).
    # prep-norm1: the q / k norms from one [64, 128] load each instead of 8 unpipelined round trips (127 regs)
    ("prep-norm1", dict(PREP_NORM1=1)),
    ("prep-norm1-s4", dict(PREP_NORM1=1, PREP_STAGES=4)),
    # register caps for occupancy: akk 162 -> 128 regs (12 -> 16 CTAs / SM, 144 B stack, +5% instructions);
    # wu 150 -> 128 (3 -> 4 CTAs / SM, 16 B stack)
    ("akk-r128", dict(AKK_JOUTER=0, AKK_UNCOND=0, AKK_MAXNREG=128)),
    ("wu-r128", dict(WU_LOOP=0, WU_MAXNREG=128)),
    ("intra-r128-norm1", dict(PREP_NORM1=1, AKK_JOUTER=0, AKK_UNCOND=0, AKK_MAXNREG=128, WU_LOOP=0, WU_MAXNREG=128)),
    # akk-unc: the off-diagonal K pass without its per-block branches, which kept its loads out of the pipeliner
    # (plain LDG waited for per K tile -> a cp.async ring; loop body 549 -> 429 instructions; 230 regs, 8 CTAs / SM;
    # r168: 24 B stack, 12 / SM as now; r128: 144 B stack, 16 / SM)
    # (akk-unc-r168 and prep-norm1 became the defaults in session 12; the old paths are the two after it)
    ("akk-unc", dict(AKK_JOUTER=0, AKK_UNCOND=1, AKK_MAXNREG=None)),
    ("akk-unc-r168", dict(AKK_JOUTER=0, AKK_UNCOND=1, AKK_MAXNREG=168)),
    ("akk-unc-r128", dict(AKK_JOUTER=0, AKK_UNCOND=1, AKK_MAXNREG=128)),
    ("prep-norm-loop", dict(PREP_NORM1=0)),
    ("akk-branched", dict(AKK_JOUTER=0, AKK_UNCOND=0, AKK_MAXNREG=None)),
    # session 12 (offline sm_90, Triton 3.9): wu runs x load -> 4-dot inverse chain -> K loop -> V loop, each loop's
    # first cp.async waited for after the chain / the previous loop (three exposed load latencies per program, 20
    # waves of 3 CTAs / SM). wu-loop: one loop, loads one tile ahead in registers, tile 0's before the chain (197
    # regs: 2 CTAs / SM; r168: 8 B stack); wu-loop-lp: bf16 dot operands (fla's precision), 168 regs, 3 / SM.
    # H200 12-04: wu 0.436 (two loops) -> 0.408 (wu-loop) -> 0.391 ms (wu-loop-r168, the default since); wu-loop-lp
    # 0.325 ms but WRONG (o rel err 1.2: M converted to bf16 once before the loop; converted per tile: an illegal
    # address), both removed
    ("wu-two-loops", dict(WU_LOOP=0, WU_MAXNREG=None)),
    ("wu-loop", dict(WU_LOOP=1, WU_MAXNREG=None)),
    ("wu-loop-r168", dict(WU_LOOP=1, WU_MAXNREG=168)),
    # prep with NORM1 (its K loop only writes G / qg / kg now): wider tiles / more warps (offline sm_90, Triton 3.9:
    # BK 32 168 regs, 3 CTAs / SM; BK 32 at 8 warps 120 regs; BK 16 at 8 warps 96 regs; the default 127, 4 / SM)
    ("prep-bk32", dict(PREP_BK=32)),
    ("prep-bk32-w8", dict(PREP_BK=32, PREP_NUM_WARPS=8)),
    # the state pass at BV 32: half the programs (128 at T=16k, H=32), half the L2 re-reads of w / kg per step.
    # H200 12-04 (T=16k: BV 16 0.377, bv32 0.364, bv32-w8 0.370 ms; varlen 16x1k, where the rule picks BV 64:
    # 0.293 / 0.308 / 0.401): the rule now takes 32 over 16 while it gives ~one program per SM
    ("hpass-bv16", dict(HPASS_BV=16)),
    ("hpass-bv32", dict(HPASS_BV=32)),
    ("hpass-bv32-w8", dict(HPASS_BV=32, HPASS_NUM_WARPS=8)),
    # session 17 (no device; offline sm_90, Triton 3.9, K = V = 128, 3 stages): the output inside the state pass
    # (HPASS_OUT: no h_c / vn written and read back, no output launch; ~0.8 of ~4.1 GB at T=16k). Loop per chunk:
    # 28 HGMMA / 28 LDGSTS against 16 / 16, the same 7-11 barriers; BV 32 164 regs / 180 KB (split: 136 / 108 KB),
    # BV 16 103 / 174 KB (one program per SM: at T=16k 256 programs would take two waves, so bv16 is expected to
    # lose), BV 64 242 / 192 KB; 2 stages: 124 / 118 / 136 KB. Timed as the hpass stage alone (no out stage).
    # H200 12-05: T=16k 2.062 -> 1.868 ms, the default since; "hpass-split" is the split it replaced
    ("hpass-out", dict(HPASS_OUT=1)),
    ("hpass-split", dict(HPASS_OUT=0)),
    ("hpass-out-s2", dict(HPASS_OUT=1, HPASS_NUM_STAGES=2)),
    ("hpass-out-bv16", dict(HPASS_OUT=1, HPASS_BV=16)),
    ("hpass-out-bv64", dict(HPASS_OUT=1, HPASS_BV=64)),
    # (session 17's akk as two launches, AKK_PARTS, and prep writing wu's gated k, WU_KBG: slower in sessions 19 and
    # 22, removed in session 25)
    # prep's register cap (offline sm_90, Triton 3.9: 127 regs uncapped = 4 CTAs / SM; 112 no spill, still 4;
    # 96: 64 B stack, 5 / SM; 80: 256 B, 6 / SM)
    ("prep-r96", dict(PREP_MAXNREG=96)),
    ("prep-r80", dict(PREP_MAXNREG=80)),
    # (session 22, HPASS_VN: the state pass formed vn = M (beta v - kb h_c) from wu's inverse M, wu writing only M;
    # H100 12-05 at T=16k: 2.255 vs 2.147 ms, wu 0.422 -> 0.157 but hpass 0.405 -> 0.613 (the M dot on the chain)
    # and prep 0.549 -> 0.711 (writing kb); removed, BENCHMARKS.md twenty-second round)
    # session 22 (offline sm_90, Triton 3.9): the state pass on the transposed state h^T (HPASS_T), vn and h_c the
    # dots' left operands (registers) instead of smem round trips on the chain; BV 32: mma.sync, 212 regs, 120 KB;
    # BV 64: wgmma, 254 regs, 170 KB. H200 12-05: varlen 16 x 1k (BV 64) hpass 0.286 vs 0.366 ms; T = 16k (BV 32)
    # 0.384 vs 0.359 -> the default (HPASS_T=2) takes it at BV 64 only; hpass-nt: the other pass everywhere
    ("hpass-nt", dict(HPASS_T=0)),
    ("hpass-t", dict(HPASS_T=1)),
    ("hpass-t-bv64", dict(HPASS_T=1, HPASS_BV=64)),
    ("hpass-t-bv16", dict(HPASS_T=1, HPASS_BV=16)),
    # session 24 (Nsight Compute, H100, T=16k: prep 547 us, 600 MB read for 403 MB of q, k, z at 25% occupancy; akk
    # 746 us, 37% issue, 12 one-warp CTAs / SM by registers), H200 --quick: the late norms (prep summing the norms in
    # its output loop, qg / kg unnormalised, folded back in by wu / akk / the state pass) 1.995 ms against 1.880
    # (prep 0.507 vs 0.470, hpass 0.433 vs 0.361), at prep 96 regs 2.027; the branched akk capped at 128 regs
    # ('akk-b-r128', still below) 2.044 (akk 0.821 vs 0.653, 32 B of spills). The late norms were removed.
    ("akk-b-r128", dict(AKK_JOUTER=0, AKK_UNCOND=0, AKK_MAXNREG=128)),
    # session 29: akk's off-diagonal blocks j < i in a loop, one K pass each (AKK_JOUTER): offline sm_90 no spill (the
    # three-block pass: 24 B) and ~6% fewer instructions per chunk (the row side is recomputed per block); capped at
    # 168 (12 one-warp CTAs / SM), and at 128 (16 / SM, 160 B of spills). H100 12-06 (session 30) at T=16k: akk
    # 0.718 ms against 0.755 (three-block), 0.846 at 128 regs -> the default since; akk-threeblock: the pass before
    ("akk-threeblock", dict(AKK_JOUTER=0)),
    ("akk-jouter-r128", dict(AKK_MAXNREG=128)),     # (the block passes at 128 regs: 16 one-warp CTAs / SM)
    # session 34: the block passes as one loop over (block, K tile), one cp.async ring through the block boundaries
    # instead of a ramp per block (AKK_JOUTER = 2; offline sm_90, Triton 3.6: 168 regs, no stack against 48 B), and
    # akk's levels pass writing wu's w operand kb = beta kn exp2(G) (AKK_KB), so wu reads kb instead of k and the
    # fp32 G (512 B fewer per row read, 256 B more written). H100 12-07 (session 37), T=16k: 1.873 ms (the nested
    # loop, wu reading k and G) -> 1.852 (jflat), 1.817 (kb), 1.802 (both; 1.35x fla-core) -> both the default for a
    # few hours; the nested loop (AKK_JOUTER = 1) was removed (code in 689a5dd); akk-no-kb: wu reading k and G
    ("akk-no-kb", dict(AKK_KB=0)),
    # session 37: AKK_JOUTER = 3, one K pass per program over its i blocks with the row side once per K tile
    # (specialised per i outside the loop): offline sm_90 7,680 SASS per chunk in the off-diagonal loops against
    # 16,224 for the flat loop. H100 12-07, T=16k: akk 0.740 -> 0.684 ms, 1.797 -> 1.737 ms end to end (1.40x
    # fla-core) -> the default since; the flat loop (AKK_JOUTER = 2) was removed (code in a58ddc5)
    # (session 31: L2 hints, 'prep-evict1' / '-evict2', 'prep-prefz', 'prep-prefz-evict1', 'akk-pref', 'wu-pref',
    # 'pref-all': H100 12-06 at T=16k prep 0.549 -> 0.569 ms (prefz), 0.598 (pref-all), akk / wu unchanged. Removed.)
    # (session 31-32: PREP_COLS, prep as a norms launch + one-warp programs per (chunk, head, 16 columns), 'prep-cols'
    # / '-dot' / '-w2', and the tile kernel at 8 warps, 'prep-w8': H100 12-06, T=16k prep 1.124 / 0.718 ms against
    # 0.547. Removed.)
    # session 32: prep as one warp per (chunk, head) walking the rows (PREP_ROWS: a running gate sum per lane,
    # warp-shuffle norms, no shared memory or barrier; z read twice, softplus twice; offline sm_90 64 regs). H100
    # 12-06, T=16k: prep 0.547 -> 0.393 ms (rows ahead in registers 0.408, two warps 0.431: removed) -> the default
    # since; prep-tiles: the tile kernel (with AKK_KG, not writing kg). -s3: Triton's cp.async ring, 3 stages,
    # unroll 2 (0.397 on the H100); -u4 / -u16: the walks unrolled by 4 / 16 (the default 8; even on the H100)
    ("prep-tiles", dict(PREP_ROWS=0)),
    ("prep-rows-s3", dict(PREP_ROWS_STAGES=3, PREP_ROWS_UNROLL=2)),
    ("prep-rows-u4", dict(PREP_ROWS_UNROLL=4)),
    ("prep-rows-u16", dict(PREP_ROWS_UNROLL=16)),
    # (session 32: WU_KG, wu writing kg so that prep walks its rows once, 'wu-kg' / '-r200' / '-two-loops': H100
    # 12-06, T=16k prep 0.398 -> 0.302 ms, wu 0.425 -> 0.666 / 0.541 / 0.517, total 1.948 against 1.957 at best.
    # Removed.) session 32: akk's levels pass writes kg (AKK_KG; it loads kn and G of its rows on every K tile
    # anyway), prep walks its rows once. H100 12-06, T=16k: prep 0.392 -> 0.297 ms, akk 0.717 -> 0.740 (168 regs;
    # uncapped, 218 regs: 0.760), total 1.941 -> 1.865 (1.31x fla-core) -> the default since; prep-kg: the row walk
    # writing kg (two walks), prep-tiles-kg: the tile prep writing kg (the defaults before)
    ("prep-kg", dict(AKK_KG=0)),
    ("prep-tiles-kg", dict(PREP_ROWS=0, AKK_KG=0)),
    # session 32 (untimed): the row walk RB rows per step as [RB, K] tiles (PREP_ROWS_RB), their loads issued
    # together. Offline sm_90 (Triton 3.9), SASS per row ~160 at RB 1 / 2 / 4, 153 at 8; regs 64 / 64 / 96 / 167
    # (32 / 32 / 21 / 12 one-warp CTAs / SM)
    ("prep-rb2", dict(PREP_ROWS_RB=2)),
    ("prep-rb4", dict(PREP_ROWS_RB=4)),
    ("prep-rb8", dict(PREP_ROWS_RB=8)),
    # (session 33: akk's diagonal inverse by tf32x3 products, 'akk-inv-pow', and its levels accumulated onto the
    # block, 'akk-lvsel' / '-s2' / '-s2-r144' / 'akk-lvsel-pow-s2-r144': H100 12-06, T=16k akk 0.742 / 0.751 / 0.771
    # / 0.780 ms against 0.740. Removed; code in abd9f75.)
    # (session 34: akk as one 4-warp program per (chunk, head) with batched dots, 'akk-cta' / '-w8' / '-slots' (AKK_CTA
    # 1 / 2): H100 12-06, T=16k akk 0.923 / 1.325 / 0.806 ms against 0.744. Removed; code in 735d3a9.)
    # (session 30: AKK_PAIR, two row blocks per program: 'akk-pair' / '-r192' / '-nocap'; H100 12-06, session 31,
    # T=16k: akk 0.943 / 0.841 / 0.846 ms against 0.718 for the default. Removed.)
]


def quick(warmup=5, rep=20, only=None, cases=("T=16k", "varlen")):
    """One short H200 run: at T=16k every QUICK_VARIANTS entry (or those named in ``only``, in that order; total
    and per-stage ms, ratio to fla-core, rel-rms of o and the final state vs the default and vs fla), then varlen
    16 x 1k for the same variants (none named: the default only) and fla. A FAILED line
    (e.g. a compile error on this Triton) leaves the other lines intact. Compiles dominate: on 2026-12-02 fla + 3
    variants took ~320 s (each akk variant recompiles), so name the variants wanted (--variants a,b,...). On a fresh
    H100 the T=16k part (fla + the default) takes ~190 s and the varlen part's compiles (fla's varlen autotune, our
    BV-64 state pass) did not finish in 190 more (12-07): --cases varlen runs that part alone."""
    import kernels.kda.chunk as ck

    names = sorted({n for _, cfg in QUICK_VARIANTS for n in cfg} | {"PREP_ROWS"})
    saved = {n: getattr(ck, n) for n in names}
    print(f"--quick: H={H} K={K} V={V} bf16, do_bench median (ms)", flush=True)
    try:
        for case, lens, which in (("T=16k", [16384], only), ("varlen 16x1k", [1024] * 16,
                                                                  only or ("default",))):
            if case.split()[0] not in cases:
                continue
            x = _inputs(lens)
            try:
                fms, fo, fst = _time_fla(x, warmup, rep)
            except Exception as e:                   # fla missing or API mismatch: ours only
                fms = None
                print(f"{case}: fla unavailable: {type(e).__name__}: {str(e)[:120]}", flush=True)
            if fms:
                print(f"{case}: fla-core {fms:.3f} ms", flush=True)
            ref = None
            table = dict(QUICK_VARIANTS)
            for name in which or table:          # in the order named (the first one is the reference)
                if name not in table:
                    print(f"{case} {name:20s} unknown variant (QUICK_VARIANTS)", flush=True)
                    continue
                cfg = ck.prep_variant(table[name])    # the tile prep's constants imply PREP_ROWS = 0
                for n, val in saved.items():
                    setattr(ck, n, cfg.get(n, val))
                try:
                    ms, st, (o, s) = _time_ours(x, warmup, rep, 2, 10)
                    if ref is None:
                        ref = (o, s)
                    line = f"{case} {name:20s} {ms:6.3f} ms" + (f" {fms / ms:4.2f}x fla" if fms else "")
                    line += f" | o {_rel(o, ref[0]):.1e} state {_rel(s, ref[1]):.1e} vs default"
                    if fms:
                        line += f", o {_rel(o, fo):.1e} state {_rel(s, fst):.1e} vs fla"
                    line += " | " + _fmt_stages(st)
                except Exception as e:
                    line = f"{case} {name:20s} FAILED {type(e).__name__}: {str(e)[:200]}"
                print(line, flush=True)
            del x, ref
            torch.cuda.empty_cache()
    finally:
        for n, val in saved.items():
            setattr(ck, n, val)


if __name__ == "__main__":
    if "--help" in sys.argv or "-h" in sys.argv:    # the modes are in the module docstring
        print(__doc__)
    elif "--quick" in sys.argv:            # T=16k: default vs each QUICK_VARIANTS entry vs fla; varlen 16x1k
        only = None
        if "--variants" in sys.argv:     # e.g. --variants default,akk-lv (the first one is the reference)
            only = tuple(sys.argv[sys.argv.index("--variants") + 1].split(","))
            unknown = set(only) - {n for n, _ in QUICK_VARIANTS}
            assert not unknown, f"unknown variants {sorted(unknown)}"
        cases = ("T=16k", "varlen")
        if "--cases" in sys.argv:        # e.g. --cases varlen (T=16k, varlen)
            cases = tuple(sys.argv[sys.argv.index("--cases") + 1].split(","))
            assert set(cases) <= {"T=16k", "varlen"}, cases
        quick(only=only, cases=cases)
    elif "--sweep" in sys.argv:            # ours vs fla at 4k/16k/64k, then the intra launch-config sweep
        intra_compare()
        sweep_intra()
    elif "--sweep-state" in sys.argv:    # the hpass / output launch-config sweep
        sweep_prefill()
    else:
        bench_prefill()
