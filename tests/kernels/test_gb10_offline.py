"""Every Triton kernel the model runs on CUDA compiles for a GB10 (DGX Spark: sm_12x, 99 KB shared memory per block,
48 SMs) at Kimi-Linear shapes, with the launch config our pickers choose there, within its shared memory.

No GPU: the model-facing wrappers run on CPU tensors (every tensor reports is_cuda, so the CUDA configs are picked;
kernels._tensors.max_shared_mem / num_sms report the GB10's 101376 B / 48 SMs; KIMI_PDL=1 as on sm_90+) with
JITFunction.run replaced by a recorder: it binds the launch exactly as the JIT would (Triton's own binder and
argument specialization for a GPUTarget("cuda", ARCH)) and launches nothing. Each recorded launch is then compiled
offline with Triton's bundled ptxas (CUDA 13.4 in Triton 3.9; target sm_121a, the GB10's: Triton emits sm_<cap>a
for cap >= 90; sm_120a gives the same shared memory / registers for every kernel here) and cuobjdump reports its
registers. Triton 3.9 lowers tl.dot to mma.sync on sm_12x (its cap >= 100 pipeline, no wgmma / tcgen05 there).
Run as a script for the report: `python tests/kernels/test_gb10_offline.py [arch]` (no TRITON_INTERPRET); with `--h200`
instead, one PTX fingerprint per launch at the H200's configs (fingerprints(): a refactor's "no kernel changed" check)."""
import importlib
import json
import os
import sys

import pytest

ARCH = 121
GB10_SMEM = 101376          # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_120 / sm_121
GB10_SMS = 48
GB10_REGS_PER_SM = 65536

# kernels each scenario must launch (the recorder fails the test when one is missing: a wrapper that stopped
# launching a kernel, or raised before it, would otherwise leave it unchecked)
EXPECTED = {
    "kda decode N=1": {"_kda_decode_kernel"},
    "kda decode N=64": {"_kda_decode_kernel"},            # the wide config (BV 64, maxnreg 128)
    "kda decode BV32 post": {"_kda_decode_kernel", "_kda_decode_post_kernel"},
    "kda prefill T=4096": {"_conv_prefill_stream_kernel", "_kda_prep_rows_kernel", "_kda_akk_lv_kernel",
                           "_kda_wu_kernel", "_kda_hpass_kernel", "_kda_out_kernel", "_gated_rmsnorm_kernel"},
    "kda gate": {"_kda_gate_kernel"},
    "mla decode N=1 S=128k": {"_mla_decode_stage1", "_mla_decode_stage2"},
    "mla decode N=64 S=8k": {"_mla_decode_stage1", "_mla_decode_stage2"},
    "mla decode w_uv N=1 S=8k": {"_mla_decode_stage1", "_uv_kernel"},   # the b1 chain: PDL, early L2 hints
    "mla extend": {"_mla_extend_kernel"},
    "mla prefill": {"_gather_latent_kernel", "_mla_prefill_kernel"},
    "mla cache": {"_store_latent_kernel"},
    "norms": {"_rmsnorm_kernel", "_add_rmsnorm_kernel", "_combine_add_rmsnorm_kernel", "_rmsnorm_head_kernel"},
    "router T=1": {"_router_decode_kernel"},
    "router T=16": {"_router_decode_kernel"},
    "router T=64": {"_router_logits_splitk_kernel", "_router_topk_row_kernel"},
    "router T=2048": {"_router_logits_kernel", "_router_topk_kernel"},
    "moe T=1": {"_moe_gemm1_kernel", "_moe_gemm2_kernel"},
    "moe T=8": {"_moe_gemm1_kernel", "_moe_gemm2_kernel"},
    "moe T=64": {"_moe_align_small_kernel", "_moe_gemm1_kernel", "_moe_gemm2_kernel"},
    "moe align chunked T=4096": {"_moe_align_hist_kernel", "_moe_align_plan_kernel", "_moe_align_scatter_kernel"},
    "moe T=512": {"_moe_gemm1_kernel", "_moe_gemm2_kernel"},
    "moe T=4096": {"_moe_gemm1_kernel", "_moe_gemm2_kernel"},
    "moe combine": {"_moe_combine_kernel"},
    "gemv M=1": {"_gemv_kernel"},
    "gemv M=16": {"_gemv_kernel"},
    "sampler": {"_race_kernel", "_argmax_kernel"},
}


# --------------------------------------------------------------------------------------------------- recorder
def _scenarios(torch):
    """name -> zero-arg callable running the model-facing wrapper at Kimi-Linear shapes on CPU tensors."""
    from kernels import norm
    from kernels.gemv import skinny_bmm_nt, skinny_linear
    from kernels.kda import kda_decode_triton, kda_prefill_triton
    from kernels.kda.gate import kda_gate_triton
    from kernels.kda.recurrent import TAIL_POST
    from kernels.mla import mla_decode, mla_extend, mla_prefill, store_latent
    from kernels.moe.fused import fused_moe_uncombined_triton, moe_combine
    from kernels.moe.router import moe_router_triton
    from kernels.testing import make_kda_layer, make_kda_tokens

    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    H, K, V, D = 32, 128, 128, 2304                        # KDA heads / dims, hidden
    MH, L, R, NOPE, BS = 32, 512, 64, 128, 64              # MLA heads, latent, rope, nope (= v), page
    E, TOPK, INTER, VOCAB = 256, 8, 1024, 163840
    lay = make_kda_layer(H, K, V, 4, conv_dtype=bf)
    lay["rec_state"] = lay["rec_state"].contiguous()

    def kda_dec(N, **kw):
        tok = make_kda_tokens(N, H, K, V, dtype=bf)
        slots = torch.arange(N, dtype=i32) % 3 + 1
        return lambda: kda_decode_triton(tok["qkv"], lay["conv_w"], tok["z"], tok["b"], lay["A_log"], lay["dt_bias"],
                                         tok["r"], lay["o_norm_w"], 1e-5, lay["conv_state"], lay["rec_state"],
                                         slots, **kw)

    def kda_pre(T):
        tok = make_kda_tokens(T, H, K, V, dtype=bf)
        cu = torch.tensor([0, T // 2, T], dtype=i32)
        return lambda: kda_prefill_triton(tok["qkv"], lay["conv_w"], tok["z"], tok["b"], lay["A_log"],
                                          lay["dt_bias"], tok["r"], lay["o_norm_w"], 1e-5, lay["conv_state"],
                                          lay["rec_state"], cu, torch.tensor([1, 2], dtype=i32),
                                          torch.tensor([True, False]))

    pages = 64
    cache = torch.zeros(pages, BS, L + R, dtype=bf)

    def mla_dec(N, S):
        nb = S // BS
        bt = (torch.arange(N * nb, dtype=i32) % pages).view(N, nb)
        sl = torch.full((N,), S, dtype=i32)
        q, qpe = torch.zeros(N, MH, L, dtype=bf), torch.zeros(N, MH, R, dtype=bf)
        return lambda: mla_decode(q, qpe, cache, bt, sl, 0.1)

    def mla_dec_uv(N, S):
        from kernels.mla.decode import mla_decode_triton

        nb = S // BS
        bt = (torch.arange(N * nb, dtype=i32) % pages).view(N, nb)
        sl = torch.full((N,), S, dtype=i32)
        q, qpe = torch.zeros(N, MH, L, dtype=bf), torch.zeros(N, MH, R, dtype=bf)
        w_uv = torch.zeros(MH, NOPE, L, dtype=bf)
        return lambda: mla_decode_triton(q, qpe, cache, bt, sl, 0.1, w_uv=w_uv, pdl=True)

    def mla_ext():
        T, nb = 512, 32                                    # two sequences of 256 new tokens, 2k context
        bt = (torch.arange(2 * nb, dtype=i32) % pages).view(2, nb)
        cu, sl = torch.tensor([0, 256, 512], dtype=i32), torch.tensor([2048, 2048], dtype=i32)
        q, qpe = torch.zeros(T, MH, L, dtype=bf), torch.zeros(T, MH, R, dtype=bf)
        return lambda: mla_extend(q, qpe, cache, bt, cu, sl, 0.1, 256)

    def mla_pre():
        T, nb = 512, 8
        bt = (torch.arange(2 * nb, dtype=i32) % pages).view(2, nb)
        cu, sl = torch.tensor([0, 256, 512], dtype=i32), torch.tensor([256, 256], dtype=i32)
        qn, qpe = torch.zeros(T, MH, NOPE, dtype=bf), torch.zeros(T, MH, R, dtype=bf)
        kvb = torch.zeros(MH * 2 * NOPE, L, dtype=bf)
        return lambda: mla_prefill(qn, qpe, cache, bt, cu, sl, kvb, 0.1, 256)

    def mla_cache():
        lat, slots = torch.zeros(64, L + R, dtype=bf), torch.arange(64, dtype=torch.int64)
        return lambda: store_latent(lat, cache, slots)

    def norms():
        T = 64
        x, res, w = torch.zeros(T, D, dtype=bf), torch.zeros(T, D, dtype=bf), torch.ones(D, dtype=bf)
        y, tw = torch.zeros(T * (TOPK + 1), D, dtype=bf), torch.zeros(T, TOPK + 1, dtype=f32)
        head = torch.zeros(T, MH * 192 + L + R, dtype=bf)[:, MH * 192:]
        return lambda: (norm.rmsnorm_triton(x, w, 1e-5), norm.add_rmsnorm_triton(x, res, w, 1e-5),
                        norm.combine_add_rmsnorm_triton(y, tw, res, w, 1e-5),
                        norm.rmsnorm_head_triton(head, torch.ones(L, dtype=bf), 1e-5))

    gate_w, bias = torch.zeros(E, D, dtype=bf), torch.zeros(E, dtype=f32)

    def router(T):
        x = torch.zeros(T, D, dtype=bf)
        return lambda: moe_router_triton(x, gate_w, bias, TOPK, 2.446, True, False, E)

    # routed + the folded shared expert (id E); torch.empty: 3.6 GB of pages never touched
    w13, w2 = torch.empty(E + 1, 2 * INTER, D, dtype=bf), torch.empty(E + 1, D, INTER, dtype=bf)

    def moe(T):
        x = torch.zeros(T, D, dtype=bf)
        ids = torch.cat([torch.randint(0, E, (T, TOPK), dtype=i32), torch.full((T, 1), E, dtype=i32)], 1)
        return lambda: fused_moe_uncombined_triton(x, w13, w2, torch.full((T, TOPK + 1), 0.1), ids)

    def align_chunked(T):
        import kernels.moe.fused as fused

        ids = torch.randint(0, E + 1, (T, TOPK + 1), dtype=i32)

        def run():
            old, fused.ALIGN_CHUNKED = fused.ALIGN_CHUNKED, True   # (the CUDA default: None)
            try:
                fused.moe_align(ids, E + 1, 64)
            finally:
                fused.ALIGN_CHUNKED = old
        return run

    def combine():
        T = 8
        return lambda: moe_combine(torch.zeros(T * (TOPK + 1), D, dtype=bf), torch.zeros(T, TOPK + 1),
                                   torch.empty(T, D, dtype=bf))

    def gemv(M):
        # the model's skinny linears: KDA in / o_proj, MLA in / o_proj, kv_b, lm_head; KDA f/g up-projections
        shapes = [(12576, D), (D, H * V), (MH * 192 + L + R, D), (D, MH * NOPE), (MH * 2 * NOPE, L), (VOCAB, D)]
        ws = [torch.empty(n, k, dtype=bf) for n, k in shapes]
        fg = torch.empty(2, H * K, K, dtype=bf)
        # and the batch-1 decode graph's lm_head (fp32 logits stored by the gemv, KIMI_LOGITS_INTO) and the dense
        # MLP's gate|up with silu * up in its epilogue (glu, KIMI_MLP_GLU)
        from kernels.gemv import gemv_triton
        glu = torch.empty(2 * 9216, D, dtype=bf)
        b1 = (lambda: (skinny_linear(torch.zeros(1, D, dtype=bf), ws[-1], out=torch.empty(1, VOCAB)),
                       gemv_triton(torch.zeros(1, D, dtype=bf), glu, glu=True))) if M == 1 else (lambda: None)
        return lambda: ([skinny_linear(torch.zeros(M, w.shape[1], dtype=bf), w) for w in ws],
                        skinny_bmm_nt(torch.zeros(2, M, K, dtype=bf), fg), b1())

    def sampler():
        from backend.engine.sampler import race_argmax

        M = 8
        p = torch.full((M, VOCAB), 1.0 / VOCAB)
        seeds, steps = torch.zeros(M, dtype=torch.int64), torch.zeros(M, dtype=torch.int64)
        from kernels.argmax import argmax_rows

        fns = [lambda: race_argmax(p, seeds, steps), lambda: argmax_rows(p)]
        try:                                               # the filtered race (kernels/sampling.py), where present
            from kernels.sampling import NUCLEUS, filtered_race

            t = torch.ones(M)
            fns.append(lambda: filtered_race(p, t, seeds, steps, torch.zeros(M, dtype=torch.bool), torch.zeros(M),
                                             torch.full((M,), 40, dtype=torch.int64), torch.full((M,), 0.9)))
            EXPECTED["sampler"] = EXPECTED["sampler"] | {"_filtered_race_kernel"} | (
                {"_nuc_block_kernel"} if NUCLEUS else set())   # the nucleus check's (row, block) launches
        except ImportError:
            pass
        return lambda: [f() for f in fns]

    return {
        "kda decode N=1": kda_dec(1), "kda decode N=64": kda_dec(64),
        "kda decode BV32 post": kda_dec(4, BV=32, tail=TAIL_POST),
        "kda prefill T=4096": kda_pre(4096),
        "kda gate": (lambda z: lambda: kda_gate_triton(z, lay["A_log"], lay["dt_bias"]))(torch.zeros(16, H * K)),
        "mla decode N=1 S=128k": mla_dec(1, 131072), "mla decode N=64 S=8k": mla_dec(64, 8192),
        "mla decode w_uv N=1 S=8k": mla_dec_uv(1, 8192),
        "mla extend": mla_ext(), "mla prefill": mla_pre(), "mla cache": mla_cache(), "norms": norms(),
        "router T=1": router(1), "router T=16": router(16), "router T=64": router(64), "router T=2048": router(2048),
        "moe T=1": moe(1), "moe T=8": moe(8), "moe T=64": moe(64), "moe T=512": moe(512), "moe T=4096": moe(4096),
        "moe align chunked T=4096": align_chunked(4096), "moe combine": combine(),
        "gemv M=1": gemv(1), "gemv M=16": gemv(16), "sampler": sampler(),
    }


def record(arch: int = ARCH, smem: int = GB10_SMEM, sms: int = GB10_SMS, scenarios=None):
    """Run every scenario (scenarios(torch) -> {name: callable}, default _scenarios) with launches recorded, not
    run -> ({key: launch}, {scenario: error or None}).
    A launch: ([scenarios], JITFunction, signature, constexprs, attrs, options) as JITFunction.run would compile it
    (one per distinct specialization and options)."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "records the CUDA launch configs: no TRITON_INTERPRET"
    os.environ["KIMI_PDL"] = "1"                           # sm_90+ default (kernels/_pdl.py)
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import kernels._tensors as kt

    fake = {"max_shared_mem": lambda device, cpu=0: smem, "num_sms": lambda device, cpu=0: sms}
    real = {n: getattr(kt, n) for n in fake}
    for name in ("kernels.gemv", "kernels.kda.chunk", "kernels.kda.recurrent", "kernels.mla.decode",
                 "kernels.moe.fused"):   # loaded before the patch below, so that it reaches them
        importlib.import_module(name)
    for mod in [m for n, m in sys.modules.items() if n.startswith(("kernels", "backend"))]:
        for n, f in fake.items():
            if getattr(mod, n, None) is real[n]:
                setattr(mod, n, f)
    torch.Tensor.is_cuda = property(lambda self: True)     # the wrappers' on_gpu configs / use_triton

    backend = make_backend(GPUTarget("cuda", arch, 32))
    launches, current = {}, [None]

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        if "_gb10_binder" not in self.__dict__:
            self._gb10_binder = create_function_from_signature(self.signature, self.params, backend)
        bound, spec, opts = self._gb10_binder(*args, **kwargs)
        opts, sig, consts, attrs = self._pack_args(backend, kwargs, bound, spec, opts)
        key = (self.fn.__name__, repr(spec), repr(opts))
        launches.setdefault(key, ([], self, sig, consts, attrs, opts))[0].append(current[0])
        return None

    JITFunction.run = run
    errors = {}
    for name, fn in (scenarios or _scenarios)(torch).items():
        current[0] = name
        try:
            fn()
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (host code after a skipped launch may read its garbage output)
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return launches, errors


_ITEMS: list = []  # (arch, launch) of report(), read by the forked compile workers by index


def _compile_one(i):
    import re

    from kernels._offline import compile_offline

    arch, (_, fn, sig, consts, attrs, opts) = _ITEMS[i]
    try:
        k = compile_offline(fn, sig, consts, arch=arch, attrs=attrs, extra_options=opts.__dict__)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {str(e)[-400:]}")
    ptx = k.ptx
    return dict(regs=k.regs, stack=k.stack, smem=k.smem, warps=opts.num_warps, stages=opts.num_stages,
                pdl=bool(opts.launch_pdl), gdc="griddepcontrol.wait" in ptx, mma=k.mma if k.mma != "fma" else "-",
                target=re.search(r"\.target (\S+)", ptx).group(1), ptx=k.fingerprint)


def report(arch: int = ARCH, scenarios=None, smem: int = GB10_SMEM, sms: int = GB10_SMS) -> dict:
    """-> {"launches": [{kernel, scenario, regs, stack, smem, ..., ptx (kernels._offline.ptx_fingerprint)} or
    {..., error}], "errors": {scenario: ...}, "kernels": {scenario: [kernel names]}}. Compiles in a fork pool (one
    process per core). smem / sms: what kernels._tensors reports for the device (GB10 by default)."""
    import multiprocessing as mp

    launches, errors = record(arch, smem, sms, scenarios=scenarios)
    _ITEMS[:] = [(arch, v) for v in launches.values()]
    with mp.get_context("fork").Pool(max(1, min(8, os.cpu_count() or 1))) as pool:
        res = pool.map(_compile_one, range(len(_ITEMS)), chunksize=1)
    out, seen = [], {}
    for (scens, fn, *_), r in zip(launches.values(), res):
        out.append(dict(kernel=fn.fn.__name__, scenario=" + ".join(dict.fromkeys(scens)), **r))
        for scen in scens:
            seen.setdefault(scen, set()).add(fn.fn.__name__)
    return dict(launches=out, errors=errors, kernels={k: sorted(v) for k, v in seen.items()},
                expected={k: sorted(v) for k, v in EXPECTED.items()})


@pytest.mark.slow
def test_gb10_offline_compile():
    """Every recorded launch compiles for sm_121a with shared memory <= 99 KB and registers x threads within the 64K
    register file, mma.sync dots only, griddepcontrol in every PDL launch; every scenario launched its kernels."""
    from tests.kernels.conftest import run_offline   # here: this file also runs as the script (no tests package)

    rep = run_offline(script=os.path.abspath(__file__), args=(str(ARCH),), timeout=600)
    print("\n".join(f"{x['scenario'][:24]:<24} {x['kernel']:<30} smem {x.get('smem')} regs {x.get('regs')} "
                    f"stack {x.get('stack')} warps {x.get('warps')} stages {x.get('stages')}"
                    for x in rep["launches"]))
    bad = [x for x in rep["launches"] if "error" in x]
    assert not bad, bad
    for x in rep["launches"]:
        assert x["smem"] <= GB10_SMEM, x
        assert x["regs"] * x["warps"] * 32 <= GB10_REGS_PER_SM, x
        assert x["target"].startswith(f"sm_{ARCH}"), x
        assert x["mma"] in ("mma.sync", "-"), x                    # no wgmma / tcgen05 on sm_12x
        assert x["gdc"] or not x["pdl"], x                         # a PDL launch waits on the previous grid
    assert any(x["pdl"] for x in rep["launches"])                  # KIMI_PDL=1: launch_pdl + griddepcontrol compile
    for scen in EXPECTED:
        missing = set(rep["expected"][scen]) - set(rep["kernels"].get(scen, []))
        assert not missing, (scen, missing, rep["errors"].get(scen))


# --------------------------------------------------------------------------------------------------- picks
def test_mla_extend_prefill_small_smem_pick():
    """bf16 MLA extend / prefill tiles by shared memory per block: the H200 keeps the defaults, a GB10 (99 KB) gets
    the '16bit-small-smem' tiles (74 / 88 KB on sm_120a; the defaults need 112 / 128 KB there); fp32 unchanged."""
    import torch

    from kernels.mla.extend import EXTEND_CFG, extend_config
    from kernels.mla.prefill import PREFILL_CFG, prefill_config

    bf = torch.bfloat16
    assert extend_config(32, 512, 64, bf, True, smem=232448)[0] == EXTEND_CFG["16bit"]
    cfg, b = extend_config(32, 512, 64, bf, True, smem=GB10_SMEM)
    assert cfg == EXTEND_CFG["16bit-small-smem"] and b["BLOCK_T"] * b["BLOCK_H"] == 32 and b["BLOCK_N"] == 32
    assert extend_config(32, 512, 64, torch.float32, True, smem=GB10_SMEM)[0] == EXTEND_CFG["fp32"]
    assert extend_config(32, 512, 64, bf, True, config={"rows": 64}, smem=GB10_SMEM)[1]["BLOCK_T"] == 2  # override
    assert prefill_config(128, 64, 128, bf, True, smem=232448)[0] == PREFILL_CFG["16bit"]
    cfg, b = prefill_config(128, 64, 128, bf, True, smem=GB10_SMEM)
    assert cfg == PREFILL_CFG["16bit-small-smem"] and (b["BLOCK_M"], b["BLOCK_N"]) == (128, 32)
    assert prefill_config(128, 64, 128, torch.float32, True, smem=GB10_SMEM)[0] == PREFILL_CFG["fp32"]


def test_moe_stages_small_smem_pick():
    """MoE GEMM stages capped to shared memory per block: at T = 8 / 64 (BM 16, BN1 64, BK 128) GEMM1's 4 stages
    hold 3 x 36 KB = 108 KB (sm_120a) -> 3 on a GB10, GEMM2 keeps 4 (3 x 20 KB); the H200 keeps every config."""
    import torch

    from kernels.moe.fused import fit_stages, get_config

    bf = torch.bfloat16
    for T in (1, 8, 64, 256, 512, 4096):
        M = 9 * T
        big = get_config(M, 257, bf, 9, 132, 1024, 2304)
        assert fit_stages(big, 232448) == big and get_config(M, 257, bf, 9, 132, 1024, 2304, smem=232448) == big
        small = get_config(M, 257, bf, 9, 48, 1024, 2304, smem=GB10_SMEM)
        s2 = small.stages2 or small.num_stages
        # Triton keeps stages - 1 tiles per GEMM in shared memory (sm_80+ cp.async pipeline)
        assert (small.num_stages - 1) * (small.BM + 2 * small.BN1) * small.BK * 2 <= GB10_SMEM - 8192, (T, small)
        assert (s2 - 1) * (small.BM + small.BN2) * (small.BK2 or small.BK) * 2 <= GB10_SMEM - 8192, (T, small)
    for T in (8, 64):
        big, small = get_config(9 * T, 257, bf, 9, 48, 1024, 2304), get_config(9 * T, 257, bf, 9, 48, 1024, 2304,
                                                                              smem=GB10_SMEM)
        assert (big.num_stages, big.stages2, small.num_stages, small.stages2) == (4, 0, 3, 4), (T, big, small)
    tiny = fit_stages(get_config(576, 257, bf, 9, 48), 40 * 1024)         # a stage of each fits, never 0 stages
    assert (tiny.num_stages, tiny.stages2) == (1, 2)


@pytest.mark.gpu
def test_gpu_small_smem_configs_match(monkeypatch):
    """The GB10 picks (MLA extend / prefill '16bit-small-smem' tiles, MoE stages capped to 99 KB) give the right
    results on the H200 (same tiles; wgmma there): the Kimi-shape GPU tests of tests/kernels/test_mla.py and
    test_moe.py with max_shared_mem reporting a GB10's 101376 B."""
    import kernels.mla.extend as ext
    import kernels.mla.prefill as pre
    import kernels.moe.fused as fused
    import tests.kernels.test_mla as tm
    import tests.kernels.test_moe as tmo

    picks = []
    for mod in (ext, pre, fused):
        monkeypatch.setattr(mod, "max_shared_mem", lambda device, cpu=0: GB10_SMEM)
    for mod, name in ((ext, "extend_config"), (pre, "prefill_config"), (fused, "get_config")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: picks.append(_real(*a, **k)) or picks[-1])
    tm.test_gpu_extend_kimi()
    tm.test_gpu_extend_full_prefill_4097()
    tm.test_gpu_prefill_expanded_kimi()
    for T in (1, 8, 64, 1000):
        tmo.test_kimi_fused_moe_shared_expert_gpu(T)
    assert ext.EXTEND_CFG["16bit-small-smem"] in [p[0] for p in picks if isinstance(p, tuple)]
    assert pre.PREFILL_CFG["16bit-small-smem"] in [p[0] for p in picks if isinstance(p, tuple)]
    assert any(isinstance(p, fused.MoEConfig) and p.BN1 == 64 and p.num_stages == 3 and p.stages2 == 4 for p in picks)


def fingerprints(arch: int = 90) -> list:
    """The scenarios as an H200 runs them (sm_<arch>, 227 KB shared memory, 132 SMs): one line per recorded launch,
    "scenario | kernel | ptx fingerprint regs stack smem", sorted. Two trees' lists are equal when a refactor left
    every compiled kernel as it was."""
    from kernels._tensors import H200_SMEM

    rep = report(arch, smem=H200_SMEM, sms=132)
    return sorted(f"{x['scenario']} | {x['kernel']} | " + (x["error"] if "error" in x else
                  f"ptx {x['ptx']} regs {x['regs']} stack {x['stack']} smem {x['smem']}") for x in rep["launches"])


if __name__ == "__main__":
    # python tests/kernels/test_gb10_offline.py [arch]   -> the GB10 report (JSON)
    # python tests/kernels/test_gb10_offline.py --h200   -> fingerprints() lines (refactor check)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if sys.argv[1:2] == ["--h200"]:
        print("\n".join(fingerprints()))
        sys.exit(0)
    print(json.dumps(report(int(sys.argv[1]) if len(sys.argv) > 1 else ARCH)))
