"""KDA chunked prefill (kernels/kda/chunk.py::chunk_kda_fwd) against the fp64 token recurrence.

CPU: TRITON_INTERPRET=1 at small shapes (H=2, K=16, V=32: K != V so a transposed state cannot pass).
GPU (@gpu): Kimi shapes H=32, K=V=128, bf16.
The path under test: the intra launches prep -> akk -> wu, then the state pass storing h_c / vn -> the parallel
output kernel; module-constant A/B variants are compared with it (test_variants_match_default_fp32).
Run: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_kda_chunk.py -q
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():                    # before the kernels are defined (triton.jit reads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.kda.chunk import chunk_kda_fwd  # noqa: E402
from kernels.kda.ref import kda_core_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

FP32_TOL = 2e-5     # fp32 inputs, IEEE dots, vs fp64 recurrence (observed ~1e-6; strong gates lose a few ulps of G)
BF16_TOL = 5e-3     # fla's get_err_ratio threshold (GPU)
# The Triton interpreter rounds fp32 -> bf16 toward zero (a biased 1-ulp error instead of RNE's half ulp), and the
# kernel stores qg/kg/w/u/Aqk and the output in bf16, so the CPU bf16 check is looser; the GPU tests use BF16_TOL.
BF16_TOL_INTERP = 2e-2


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / (b.pow(2).mean().sqrt() + 1e-30)).item()


def make_inputs(T, H=2, K=16, V=32, dtype=torch.float32, device=DEV, strong_gate=False, qkv_packed=False):
    g = torch.Generator().manual_seed(1234 + T)
    if qkv_packed:                                   # views into one [T, (2K+V)H] tensor, as the mixer passes them
        x = torch.randn(T, H * (2 * K + V), generator=g)
        q = x[:, : H * K].view(T, H, K)
        k = x[:, H * K: 2 * H * K].view(T, H, K)
        v = x[:, 2 * H * K:].view(T, H, V)
    else:
        q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
        v = torch.randn(T, H, V, generator=g)
    z = torch.randn(T, H * K, generator=g) * 2.0
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(H * K, generator=g) * 0.5
    if strong_gate:                                  # per-step gates from ~0 down to -20 and below
        A_log = torch.full((H,), math.log(8.0)) + torch.randn(H, generator=g) * 0.2
        z = torch.randn(T, H * K, generator=g) * 2.0 + 1.0
    b = torch.randn(T, H, generator=g) * 2.0
    cast = lambda t: t.to(device=device, dtype=dtype)
    if qkv_packed:
        x = cast(x)
        q, k, v = x[:, : H * K].view(T, H, K), x[:, H * K: 2 * H * K].view(T, H, K), x[:, 2 * H * K:].view(T, H, V)
    else:
        q, k, v = cast(q), cast(k), cast(v)
    return dict(q=q, k=k, v=v, z=cast(z), A_log=A_log.to(device), dt_bias=dt_bias.to(device), b=cast(b))


def run_pair(inp, cu, slots, has_init, S=8, poison_other=1e30, pool=None, out=None):
    """Run the kernel and the fp64 recurrence on copies of one pool. Returns (o, o_ref, pool, pool_ref, pool0)."""
    H, K = inp["q"].shape[1:]
    V = inp["v"].shape[-1]
    dev = inp["q"].device
    if pool is None:
        pool = torch.full((S, H, K, V), poison_other, dtype=torch.float32, device=dev)
        g = torch.Generator().manual_seed(7)
        for s, h in zip(slots, has_init):
            pool[s] = torch.randn(H, K, V, generator=g).to(dev) if h else float("nan")
    pool0 = pool.clone()
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    sl_t = torch.tensor(slots, dtype=torch.int32, device=dev)
    hi_t = torch.tensor(has_init, dtype=torch.bool, device=dev)
    K_ = inp["q"].shape[-1]
    o = chunk_kda_fwd(inp["q"], inp["k"], inp["v"], inp["z"], inp["A_log"], inp["dt_bias"], inp["b"], K_ ** -0.5,
                      pool, cu_t, sl_t, hi_t, out=out)
    d = {n: t.double() for n, t in inp.items()}
    pool_ref = pool0.double().clone()
    o_ref = kda_core_ref(d["q"], d["k"], d["v"], d["z"], d["A_log"], d["dt_bias"], d["b"], K_ ** -0.5, pool_ref,
                         cu_t, sl_t, hi_t, mode="recurrent")
    return o, o_ref, pool, pool_ref, pool0


def check(o, o_ref, pool, pool_ref, pool0, slots, tol):
    assert torch.isfinite(o).all()
    assert rel_rms(o, o_ref) <= tol, rel_rms(o, o_ref)
    for s in set(slots):
        assert torch.isfinite(pool[s]).all()
        assert rel_rms(pool[s], pool_ref[s]) <= tol, (s, rel_rms(pool[s], pool_ref[s]))
    others = [s for s in range(pool.shape[0]) if s not in set(slots)]
    assert torch.equal(pool[others], pool0[others]), "slots outside the batch were modified"


# ------------------------------------------------------------------------------------------------ CPU (interpreter)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("has_init", [False, True])
def test_single_sequence_fp32(T, has_init):
    inp = make_inputs(T)
    res = run_pair(inp, [0, T], [3], [has_init])
    check(*res, [3], FP32_TOL)


@pytest.mark.parametrize("has_init", [False, True])
def test_strong_gates_fp32(has_init):
    T = 130
    inp = make_inputs(T, strong_gate=True)
    d = inp["z"].double() + inp["dt_bias"].double()
    gmin = (-torch.exp(inp["A_log"].double()).repeat_interleave(16) * torch.nn.functional.softplus(d)).min()
    assert gmin < -20.0
    res = run_pair(inp, [0, T], [1], [has_init])
    check(*res, [1], FP32_TOL)


def test_varlen_fp32_poison():
    lens = [1, 70, 0, 64, 5, 63, 0]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    slots = [5, 2, 7, 1, 4, 6, 8]
    has_init = [True, False, True, True, False, True, False]
    inp = make_inputs(T, qkv_packed=True)
    out = torch.full((T, 2, 32), float("nan"), dtype=torch.float32, device=DEV)
    res = run_pair(inp, cu, slots, has_init, S=10, out=out)
    assert res[0].data_ptr() == out.data_ptr()
    check(*res, slots, FP32_TOL)
    # zero-length sequence with an initial state keeps it; without one (slot 8, NaN-poisoned) it gets zeros
    assert torch.equal(res[2][7], res[4][7])
    assert torch.isnan(res[4][8]).all() and torch.equal(res[2][8], torch.zeros_like(res[2][8]))


def test_many_sequences_device_metadata():
    """P > 16 sequences (device-side chunk -> sequence search), empty ones included, with and without the host
    copy of cu_seqlens (exact vs upper-bound grid)."""
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 70, (21,), generator=g).tolist()
    lens[3], lens[10] = 0, 1
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    slots = list(range(1, 22))
    has_init = [bool(i % 3) for i in range(21)]
    inp = make_inputs(T, H=1, K=16, V=16)
    res = run_pair(inp, cu, slots, has_init, S=24)
    check(*res, slots, FP32_TOL)
    pool = res[4].clone()
    o2 = chunk_kda_fwd(inp["q"], inp["k"], inp["v"], inp["z"], inp["A_log"], inp["dt_bias"], inp["b"], 0.25, pool,
                       torch.tensor(cu, dtype=torch.int32, device=DEV), torch.tensor(slots, dtype=torch.int32,
                       device=DEV), torch.tensor(has_init, device=DEV), cu_seqlens_cpu=cu)
    assert torch.equal(o2, res[0]) and torch.equal(pool, res[2])


def test_tokens_outside_cu_are_zero():
    T = 40
    inp = make_inputs(T)
    out = torch.full((T, 2, 32), float("nan"), dtype=torch.float32, device=DEV)
    pool = torch.zeros(4, 2, 16, 32, device=DEV)
    cu = torch.tensor([3, 20, 33], dtype=torch.int32, device=DEV)
    o = chunk_kda_fwd(inp["q"], inp["k"], inp["v"], inp["z"], inp["A_log"], inp["dt_bias"], inp["b"], 0.25, pool, cu,
                      torch.tensor([1, 2], dtype=torch.int32, device=DEV), torch.tensor([False, False], device=DEV),
                      out=out)
    assert torch.isfinite(o).all()
    assert (o[:3] == 0).all() and (o[33:] == 0).all()


def test_split_prefill_equals_one_shot():
    T, cut = 130, 70
    inp = make_inputs(T)
    pool_a = torch.zeros(3, 2, 16, 32, device=DEV)
    pool_b = torch.zeros(3, 2, 16, 32, device=DEV)
    one = lambda t: torch.tensor(t, dtype=torch.int32, device=DEV)
    args = lambda sl: [inp[n][sl] for n in ("q", "k", "v", "z")] + [inp["A_log"], inp["dt_bias"], inp["b"][sl], 0.25]
    o_full = chunk_kda_fwd(*args(slice(0, T)), pool_a, one([0, T]), one([1]), torch.tensor([False], device=DEV))
    o1 = chunk_kda_fwd(*args(slice(0, cut)), pool_b, one([0, cut]), one([1]), torch.tensor([False], device=DEV))
    o2 = chunk_kda_fwd(*args(slice(cut, T)), pool_b, one([0, T - cut]), one([1]), torch.tensor([True], device=DEV))
    assert rel_rms(torch.cat([o1, o2]), o_full) <= FP32_TOL
    assert rel_rms(pool_b[1], pool_a[1]) <= FP32_TOL
    assert torch.equal(pool_b[2], pool_a[2]) and (pool_b[0] == 0).all()


@pytest.mark.parametrize("strong_gate", [False, True])
def test_bf16_small(strong_gate):
    T = 130
    inp = make_inputs(T, dtype=torch.bfloat16, strong_gate=strong_gate)
    res = run_pair(inp, [0, 7, T], [1, 2], [True, False])
    assert res[0].dtype == torch.bfloat16
    check(*res, [1, 2], BF16_TOL if torch.cuda.is_available() else BF16_TOL_INTERP)


# ------------------------------------------------------------------------------------------------ GPU (Kimi shapes)
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130, 1000])
@pytest.mark.parametrize("strong_gate", [False, True])
def test_gpu_single_bf16(T, strong_gate):
    inp = make_inputs(T, H=32, K=128, V=128, dtype=torch.bfloat16, strong_gate=strong_gate)
    res = run_pair(inp, [0, T], [3], [True])
    check(*res, [3], BF16_TOL)


@pytest.mark.gpu
def test_gpu_varlen_bf16_packed():
    lens = [1, 1000, 0, 64, 129, 5, 300]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    slots = [9, 2, 7, 1, 4, 6, 3]
    has_init = [True, False, True, True, False, True, True]
    inp = make_inputs(T, H=32, K=128, V=128, dtype=torch.bfloat16, qkv_packed=True)
    out = torch.full((T, 32, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    res = run_pair(inp, cu, slots, has_init, S=12, out=out)
    check(*res, slots, BF16_TOL)


@pytest.mark.gpu
def test_gpu_fp32_and_split():
    T, cut = 1000, 333
    inp = make_inputs(T, H=32, K=128, V=128, dtype=torch.float32, strong_gate=True)
    res = run_pair(inp, [0, T], [2], [True])
    check(*res, [2], 1e-4)
    pool_a = res[2].clone()
    pool_a[2] = res[4][2]
    pool_b = pool_a.clone()
    one = lambda t: torch.tensor(t, dtype=torch.int32, device=DEV)
    args = lambda sl: [inp[n][sl] for n in ("q", "k", "v", "z")] + [inp["A_log"], inp["dt_bias"], inp["b"][sl],
                                                                      128 ** -0.5]
    yes = torch.tensor([True], device=DEV)
    o_full = chunk_kda_fwd(*args(slice(0, T)), pool_a, one([0, T]), one([2]), yes)
    o1 = chunk_kda_fwd(*args(slice(0, cut)), pool_b, one([0, cut]), one([2]), yes)
    o2 = chunk_kda_fwd(*args(slice(cut, T)), pool_b, one([0, T - cut]), one([2]), yes)
    assert rel_rms(torch.cat([o1, o2]), o_full) <= 1e-4
    assert rel_rms(pool_b[2], pool_a[2]) <= 1e-4


@pytest.mark.parametrize("prefetch,vfast,hout,htr", [(1, 1, 0, 0), (0, 0, 0, 0), (1, 0, 1, 0), (1, 0, 1, 1)])
def test_tiling_fp32(monkeypatch, prefetch, vfast, hout, htr):
    """Several K tiles in the intra kernels and several V tiles in every kernel (as at K = V = 128 on the GPU),
    for the default intra launches (akk in two K passes); the state pass with and without HPASS_PREFETCH, both
    output grid orders, the output inside the state pass (HPASS_OUT), and that pass on the transposed state
    (HPASS_T)."""
    import kernels.kda.chunk as chunk_mod

    monkeypatch.setattr(chunk_mod, "HPASS_PREFETCH", prefetch)
    monkeypatch.setattr(chunk_mod, "HPASS_OUT", hout)
    monkeypatch.setattr(chunk_mod, "HPASS_T", htr)
    monkeypatch.setattr(chunk_mod, "AKK_LV_SPLITK", 1)                # (the variants test runs it unsplit)
    monkeypatch.setattr(chunk_mod, "OUT_VFAST", vfast)                # (2 V tiles of 32 in the output grid)
    for name in ("PREP_BK", "AKK_BK", "WU_BK", "WU_BV"):
        monkeypatch.setattr(chunk_mod, name, 16)
    monkeypatch.setattr(chunk_mod, "HPASS_BV", 16)
    monkeypatch.setattr(chunk_mod, "OUT_BV", 32)
    T = 100
    inp = make_inputs(T, H=1, K=32, V=64, strong_gate=True)
    res = run_pair(inp, [0, 37, T], [2, 1], [True, False])
    check(*res, [2, 1], FP32_TOL)


@pytest.mark.parametrize("setting,V,want_t", [(2, 64, True), (2, 32, False), (0, 64, False), (1, 32, True)])
def test_hpass_t_rule(monkeypatch, setting, V, want_t):
    """HPASS_T=2 (the default) takes the transposed state pass exactly where the pass's V tile is 64 (the
    interpreter's tile: min(V, 64)); 1 always, 0 never. Either way the result is the fp64 recurrence's."""
    import kernels.kda.chunk as chunk_mod

    launched = []
    real = chunk_mod._kda_hpass_t_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(chunk_mod, "_kda_hpass_t_kernel", Spy())
    monkeypatch.setattr(chunk_mod, "HPASS_T", setting)
    inp = make_inputs(70, H=1, K=16, V=V)
    r = run_pair(inp, [0, 70], [1], [True], S=3)
    assert bool(launched) == want_t
    check(*r, [1], FP32_TOL)


def test_hpass_bv_rule():
    """The state pass's V tile: 64 / 32 with >= 2 programs per SM, else 32 with ~one per SM, else 16 (132 SMs)."""
    from kernels.kda.chunk import hpass_bv

    assert hpass_bv(128, 16, 32, 132) == 64        # varlen 16 x 1k: 1024 programs
    assert hpass_bv(128, 3, 32, 132) == 32         # 384 programs at BV 32 (192 at 64)
    assert hpass_bv(128, 1, 32, 132) == 32         # T = 16k, one sequence: 128 programs (the H200 12-04 case)
    assert hpass_bv(128, 1, 16, 132) == 16         # 64 programs at BV 32: too few, BV 16 gives 128
    assert hpass_bv(128, 1, 32, 160) == 16         # 128 < 7/8 of 160 SMs


@pytest.mark.slow
def test_sm90_offline_compile_no_spills():
    """Every kernel compiles for sm_90 at Kimi shapes (bf16) without register spills and within H200 shared memory.
    Offline (Triton's bundled ptxas), in a subprocess without TRITON_INTERPRET."""
    from tests.kernels.conftest import run_offline

    code = ("import json, kernels.kda.chunk as c; "
            "print(json.dumps({'bv64': c.compile_report(hpass_bv=64, out_bv=128), "
            "'bv32': c.compile_report(hpass_bv=32, which=('hpass',)), "
            "'bv16': c.compile_report(hpass_bv=16, which=('hpass',)), "
            "'exact_softplus': (setattr(c, 'FAST_SOFTPLUS', 0), "
            "c.compile_report(which=('prep_rows', 'prep_tiles')))[1], "
            "'prep_tiles': (setattr(c, 'FAST_SOFTPLUS', 1), c.compile_report(which=('prep_tiles',)))[-1], "
            "'prep_norm_loop': (setattr(c, 'PREP_NORM1', 0), c.compile_report(which=('prep_tiles',)))[-1], "
            "'cumsum_scan': (setattr(c, 'PREP_NORM1', 1), setattr(c, 'CUMSUM_DOT', 0), setattr(c, 'PREP_BK', 32), "
            "c.compile_report(which=('prep_tiles',)))[-1], "
            "'kg_in_prep': (setattr(c, 'AKK_KG', 0), c.compile_report(which=('akk', 'prep_rows', 'prep_tiles')))[-1], "
            "'akk_threeblock': (setattr(c, 'AKK_KG', 1), setattr(c, 'AKK_JOUTER', 0), "
            "c.compile_report(which=('akk',)))[-1], "
            "'akk_branched': (setattr(c, 'AKK_UNCOND', 0), setattr(c, 'AKK_MAXNREG', None), "
            "c.compile_report(which=('akk',)))[-1], "
            "'akk_lv_1k': (setattr(c, 'AKK_UNCOND', 0), setattr(c, 'AKK_MAXNREG', None), "
            "setattr(c, 'AKK_LV_SPLITK', 0), c.compile_report(which=('akk',)))[-1], "
            "'wu_two_loops': (setattr(c, 'WU_LOOP', 0), setattr(c, 'WU_MAXNREG', None), "
            "c.compile_report(which=('wu',)))[-1], "
            "'hpass_out_bv32': (setattr(c, 'HPASS_OUT', 1), c.compile_report(hpass_bv=32, which=('hpass',)))[-1], "
            "'hpass_out_bv64': c.compile_report(hpass_bv=64, which=('hpass',)), "
            "'hpass_t': {**c.compile_report(hpass_bv=32, which=('hpass_t',)), "
            "'hpass_t64': c.compile_report(hpass_bv=64, which=('hpass_t',))['hpass_t']}}))")
    rep = run_offline(code, 400)
    for cfg, kernels in rep.items():
        for name, (regs, stack, smem) in kernels.items():
            # capped at 168 regs (akk: 12 one-warp CTAs / SM; wu: 3 four-warp CTAs / SM), the default akk (writing
            # kg and kb, AKK_KG / AKK_KB; its blocks' pass specialised per row block, AKK_JOUTER = 3) keeps 8 B of
            # stack on Triton 3.9 (none on 3.6); the three-block akk up to 24 B (0 with AKK_KG on Triton 3.9);
            # every other kernel and configuration spills nothing (wu with AKK_KB: 153 regs on 3.9; reading k and G
            # it kept 32 B on 3.6)
            allowed = {("akk_threeblock", "akk"): 24, ("bv64", "akk"): 8}.get((cfg, name), 0)
            assert stack <= allowed, (cfg, name, regs, stack)
            assert smem <= 227 * 1024, (cfg, name, smem)


@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [1000], [1, 70, 0, 64, 1, 63]])
@pytest.mark.parametrize("strong_gate", [False, True])
def test_intra_awkward_lengths_fp32(lens, strong_gate):
    """Awkward lengths and varlen with length-0/1 sequences, gates down to -20 per step (every exponent formed is
    <= 0: nothing overflows), poisoned unused slots, vs the fp64 recurrence."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    H, K, V = (1, 16, 16) if T >= 1000 else (2, 16, 32)
    inp = make_inputs(T, H=H, K=K, V=V, strong_gate=strong_gate)
    if strong_gate:
        d = inp["z"].double() + inp["dt_bias"].double()
        gate = -torch.exp(inp["A_log"].double()).repeat_interleave(K) * torch.nn.functional.softplus(d)
        assert gate.min() < -20.0
    P = len(lens)
    slots = list(range(1, P + 1))
    res = run_pair(inp, cu, slots, [bool(i % 2) for i in range(P)], S=P + 3)
    check(*res, slots, FP32_TOL)


# A/B variants of kernels/kda/chunk.py (module constants); each must match the default to fp32 rounding.
VARIANTS = {
    "hpass-no-prefetch": dict(HPASS_PREFETCH=0),
    # session 5: level-anchored tensor-core diagonal blocks in a 1-warp akk (one K pass; the default takes two)
    "akk-lv": dict(AKK_LV_SPLITK=0, AKK_MAXNREG=None),
    "cumsum-scan": dict(CUMSUM_DOT=0, PREP_BK=32),
    "out-v-slowest": dict(OUT_VFAST=0),
    # the row norms by a K loop of dependent round trips (the default loads each [BT, K] once)
    "prep-norm-loop": dict(PREP_NORM1=0),
    # akk's off-diagonal blocks with per-block branches (the default runs blocks j >= i on masked rows)
    "akk-branched": dict(AKK_JOUTER=0, AKK_UNCOND=0, AKK_MAXNREG=None),
    # akk's off-diagonal blocks in one K pass over all three (the default before AKK_JOUTER, session 30); the default
    # since session 37 (AKK_JOUTER = 3) runs one K pass over the blocks j < i only, specialised per i
    "akk-threeblock": dict(AKK_JOUTER=0),
    # wu reading k and the fp32 G itself (the default since session 37: akk's levels pass writes wu's w operand
    # kb = beta kn exp2(G), AKK_KB)
    "akk-no-kb": dict(AKK_KB=0),
    # prep as the tile kernel (the default before PREP_ROWS, session 32; the prep variants above imply it too), and
    # writing kg itself (the default before AKK_KG, session 32), and the row walk writing kg (two walks)
    "prep-tiles": dict(PREP_ROWS=0),
    "prep-tiles-kg": dict(PREP_ROWS=0, AKK_KG=0),
    "prep-kg": dict(AKK_KG=0),
    # the row walk 4 rows per step ([4, K] tiles, tl.cumsum over the step's rows), and writing kg (its first walk
    # per row)
    "prep-rb4": dict(PREP_ROWS_RB=4),
    "prep-rb4-kg": dict(PREP_ROWS_RB=4, AKK_KG=0),
    # the row walk unrolled by 2, not 8 (the 64 rows: loop tails none; the test's partial chunks: masked rows)
    "prep-rows-u2": dict(PREP_ROWS_UNROLL=2),
    # wu's w tiles in a K loop, then its u tiles in a V loop (the default: one loop, loads one tile ahead)
    "wu-two-loops": dict(WU_LOOP=0, WU_MAXNREG=None),
    # the split that the output in the state pass (HPASS_OUT, the default since 12-05 where it fits) replaced: the
    # state pass writes h_c / vn, then the output launch
    "hpass-split": dict(HPASS_OUT=0),
    # the state pass with the output on the transposed state (vn and h_c as the dots' left operands) always (the
    # default takes it only at a V tile of 64: V >= 64, many sequences on the GPU; never: GPU_VARIANTS' hpass-nt)
    "hpass-t": dict(HPASS_T=1),
}


def test_prep_variant_rule():
    """A variant setting a constant only the tile prep reads runs the tile prep (PREP_ROWS = 0) unless it names
    PREP_ROWS; other variants are left as they are."""
    from kernels.kda.chunk import TILE_PREP_CONSTANTS, prep_variant

    for name in TILE_PREP_CONSTANTS:
        assert prep_variant({name: 1}) == {name: 1, "PREP_ROWS": 0}
        assert prep_variant({name: 1, "PREP_ROWS": 1}) == {name: 1, "PREP_ROWS": 1}
    assert prep_variant({"AKK_KG": 0}) == {"AKK_KG": 0}
    assert prep_variant({}) == {}
    assert prep_variant(VARIANTS["cumsum-scan"])["PREP_ROWS"] == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("strong_gate", [False, True])
def test_variants_match_default_fp32(variant, strong_gate, monkeypatch):
    """Each variant gives the default's intermediates (qg, kg, w, u, Aqk, gl), output and final states to fp32
    rounding (one K pass instead of two, a scan instead of the tensor-core cumsum: a few ulps), with gates down to -20
    per step (every exponent formed is <= 0), partial chunks (masked partner rows) and varlen with length-0/1
    sequences and poisoned unused slots; then the variant end to end vs the fp64 recurrence."""
    import kernels.kda.chunk as chunk_mod
    from kernels.kda.chunk import chunk_kda_plan

    assert any(getattr(chunk_mod, c) != v for c, v in VARIANTS[variant].items()), "the variant is the default"
    lens = [1, 70, 0, 64, 1, 63]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    inp = make_inputs(T, strong_gate=strong_gate)
    P = len(lens)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    slots = list(range(1, P + 1))
    res = {}
    for name in ("default", variant):
        with monkeypatch.context() as m:
            for const, val in chunk_mod.prep_variant(VARIANTS.get(name, {})).items():
                m.setattr(chunk_mod, const, val)
            pool = torch.full((P + 2, 2, 16, 32), float("nan"), device=DEV)
            pool[1:P + 1] = 0.5
            bufs = {}
            o, launches = chunk_kda_plan(inp["q"], inp["k"], inp["v"], inp["z"], inp["A_log"], inp["dt_bias"],
                                         inp["b"], 16 ** -0.5, pool, cu_t,
                                         torch.tensor(slots, dtype=torch.int32, device=DEV), None,
                                         cu_seqlens_cpu=cu, buffers=bufs)
            for f in launches.values():
                f()
            res[name] = (o, pool, bufs)
    (o0, p0, b0), (o1, p1, b1) = res["default"], res[variant]
    for name, ref in b0.items():
        assert torch.isfinite(b1[name]).all(), name
        assert rel_rms(b1[name], ref) <= 1e-5, (name, rel_rms(b1[name], ref))
    assert rel_rms(o1, o0) <= 1e-5 and rel_rms(p1[1:P + 1], p0[1:P + 1]) <= 1e-5
    assert torch.isnan(p1[0]).all() and torch.isnan(p1[P + 1]).all()
    with monkeypatch.context() as m:
        for const, val in chunk_mod.prep_variant(VARIANTS[variant]).items():
            m.setattr(chunk_mod, const, val)
        r = run_pair(inp, cu, slots, [bool(i % 2) for i in range(P)], S=P + 3)
    check(*r, slots, FP32_TOL)


# variants whose difference exists only on the GPU (FAST_SOFTPLUS: inline PTX lg2.approx, the interpreter keeps logf)
GPU_VARIANTS = dict(VARIANTS, **{
    "exact-softplus": dict(FAST_SOFTPLUS=0),
    # the state pass never on the transposed state (at the interpreter tests' V = 32 the default does not take it)
    "hpass-nt": dict(HPASS_T=0),
    # pipeline depth / register caps only (no effect in the interpreter)
    "hpass-s2": dict(HPASS_NUM_STAGES=2),
    "prep-s4": dict(PREP_NORM1=1, PREP_STAGES=4),
    "akk-r128": dict(AKK_MAXNREG=128),
    "akk-uncapped": dict(AKK_MAXNREG=None),
    "wu-r128": dict(WU_LOOP=0, WU_MAXNREG=128),
    "wu-uncapped": dict(WU_MAXNREG=None),
    "prep-r96": dict(PREP_MAXNREG=96),
    # the row walk through Triton's cp.async ring (3 stages, unroll 2), and unrolled by 16
    "prep-rows-s3": dict(PREP_ROWS_STAGES=3, PREP_ROWS_UNROLL=2),
    "prep-rows-u16": dict(PREP_ROWS_UNROLL=16),
    "prep-rb2": dict(PREP_ROWS_RB=2),
    "prep-rb8": dict(PREP_ROWS_RB=8),
})


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
def test_gpu_variants_bf16(variant, monkeypatch):
    """Each variant at Kimi shapes (bf16, strong gates, varlen with a partial last chunk and an empty sequence) vs
    the fp64 recurrence: compiles and is correct on the device's Triton."""
    import kernels.kda.chunk as chunk_mod

    for const, val in chunk_mod.prep_variant(GPU_VARIANTS[variant]).items():
        monkeypatch.setattr(chunk_mod, const, val)
    lens = [1, 1000, 0, 65, 300]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    slots = [2, 3, 4, 5, 6]
    inp = make_inputs(cu[-1], H=32, K=128, V=128, dtype=torch.bfloat16, strong_gate=True)
    res = run_pair(inp, cu, slots, [True, False, True, True, False], S=8)
    check(*res, slots, BF16_TOL)


def test_hpass_stages_fit_small_smem(monkeypatch):
    """A device whose blocks may take < 160 KB of shared memory (GB10: 99 KB) runs the state pass with 2 stages; the
    H200 (and the interpreter, which reports the H200's) with HPASS_NUM_STAGES."""
    import kernels.kda.chunk as chunk_mod

    seen = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["num_stages"])

    lens = [70]
    inp = make_inputs(70)
    cu_t = torch.tensor([0, 70], dtype=torch.int32, device=DEV)
    pool = torch.zeros(2, 2, 16, 32, device=DEV)
    monkeypatch.setattr(chunk_mod, "_kda_hpass_kernel", Rec())
    monkeypatch.setattr(chunk_mod, "HPASS_NUM_STAGES", 3)
    for smem, want in ((232448, 3), (101376, 2)):
        monkeypatch.setattr(chunk_mod, "max_shared_mem", lambda dev, s=smem: s)
        _, launches = chunk_mod.chunk_kda_plan(inp["q"], inp["k"], inp["v"], inp["z"], inp["A_log"], inp["dt_bias"],
                                               inp["b"], 16 ** -0.5, pool, cu_t,
                                               torch.tensor([1], dtype=torch.int32, device=DEV), None,
                                               cu_seqlens_cpu=[0] + lens, buffers={})
        launches["hpass"]()
        assert seen[-1] == want, (smem, seen)
