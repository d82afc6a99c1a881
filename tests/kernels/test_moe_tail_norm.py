"""fused_moe_add_norm: the MoE layer with the combine + residual add + next RMSNorm in GEMM2's tail (the last program
to arrive on an arrival counter) vs fused_moe_uncombined_triton + kernels.norm.combine_add_rmsnorm, bit for bit.

CPU: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_moe_tail_norm.py -q   (small shapes)
GPU: python -m pytest tests/kernels/test_moe_tail_norm.py -q -m gpu                 (Kimi shapes, CUDA graphs, PDL)
Script (no TRITON_INTERPRET): python tests/kernels/test_moe_tail_norm.py -> the sm_90 layouts of both reductions.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if HAS_CUDA else "cpu"
EPS = 1e-6


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch):
    """CPU tensors take the Triton path (the interpreter) in these tests, as KIMI_KERNELS=triton would."""
    import kernels._dispatch as d
    import kernels.moe.fused as f

    monkeypatch.setattr(d, "_FORCE", "triton")
    monkeypatch.setattr(f, "TAIL_NORM", True)   # opt-in (KIMI_MOE_TAIL_NORM=1): these tests are about the tail


def make_layer(T, D, I, E, k, dtype, device=DEV, strided=False):
    """E routed experts + the shared one stacked as expert E (w13 / w2 [E + 1, ..]); ids [T, k + 1]: k distinct routed
    ids and E last with weight 1.0, as the model's router appends it; residual [T, D] (row-strided if strided)."""
    x = torch.randn(T, D, device=device).to(dtype)
    w13 = (torch.randn(E + 1, 2 * I, D, device=device) / D**0.5).to(dtype)
    w2 = (torch.randn(E + 1, D, I, device=device) / I**0.5).to(dtype)
    routed = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    ids = torch.cat([routed, torch.full((T, 1), E, device=device)], 1).to(torch.int32)
    tw = torch.cat([torch.rand(T, k, device=device) + 0.1, torch.ones(T, 1, device=device)], 1)
    r = (torch.randn(T, 2 * D if strided else D, device=device) * 3).to(dtype)[:, -D:]
    nw = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
    return x, w13, w2, tw, ids, r, nw


def unfused(x, w13, w2, tw, ids, r, nw, cfg=None):
    from kernels.moe.fused import fused_moe_uncombined_triton
    from kernels.norm import combine_add_rmsnorm

    return combine_add_rmsnorm(fused_moe_uncombined_triton(x, w13, w2, tw, ids, config=cfg), tw, r, nw, EPS)


def counter(t):
    """The arrival counter the kernels use on t's device (keyed by the tensor's device, e.g. cuda:0)."""
    from kernels._tensors import arrival_counters

    return arrival_counters(t.device, 1)


def fused_tail_only(monkeypatch, *args, **kw):
    """fused_moe_add_norm with the unfused norm launch forbidden (proves that the tail path ran)."""
    import kernels.norm as norm
    from kernels.moe.fused import fused_moe_add_norm

    def no_launch(*a, **k):
        raise AssertionError("combine_add_rmsnorm launched on the tail path")

    with monkeypatch.context() as m:
        m.setattr(norm, "combine_add_rmsnorm", no_launch)
        return fused_moe_add_norm(*args, **kw)


@needs_triton
@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tail_equals_unfused(T, dtype, monkeypatch):
    """T <= TAIL_NORM_MAX_T with the default config (T = 1 direct rows, T = 2 / 3 rows from the ids): no norm
    launch, the same bits as the two calls, the counter back at 0; close to the torch reference."""
    from kernels.moe.ref import fused_moe_ref
    from kernels.norm import add_rmsnorm_ref

    args = make_layer(T, 48, 32, 10, 4, dtype, strided=True)
    xn, h = fused_tail_only(monkeypatch, *args, EPS)
    xn2, h2 = unfused(*args)
    assert xn.dtype == h.dtype == dtype and xn.shape == h.shape == (T, 48)
    assert torch.equal(h, h2) and torch.equal(xn, xn2)
    assert counter(h)[0].item() == 0
    x, w13, w2, tw, ids, r, nw = args
    xr, hr = add_rmsnorm_ref(fused_moe_ref(x.float(), w13.float(), w2.float(), tw, ids).to(dtype), r, nw, EPS)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (h.float() - hr.float()).abs().max() <= tol * hr.float().abs().max()
    assert (xn.float() - xr.float()).abs().max() <= tol * xr.float().abs().max()


@needs_triton
@pytest.mark.parametrize("case", ["align", "split2", "ids_rows", "d_pow2"])
def test_tail_other_row_layouts(case, monkeypatch):
    """align: moe_align's rows (blocks past the padded total exit early but still arrive; under the interpreter the
    last program in grid order, one of those, runs the tail); split2: fp32 K partials summed in the tail; ids_rows
    at T = 4 (the cap); d_pow2: D a power of two (no masked columns)."""
    from dataclasses import replace

    import kernels.moe.fused as f

    T, D = {"align": (3, 40), "split2": (2, 48), "ids_rows": (4, 48), "d_pow2": (2, 64)}[case]
    args = make_layer(T, D, 32, 10, 4, torch.bfloat16)
    cfg = f.get_config(T * 5, 11, torch.bfloat16, 5, 132, 32, D)
    if case == "align":
        monkeypatch.setattr(f, "ALIGN_IN_GEMM_MAX", 0)
    if case == "split2":
        cfg = replace(cfg, split2=2, BK2=16)
    if case == "ids_rows":
        cfg = replace(cfg, ids_rows=64)
    xn, h = fused_tail_only(monkeypatch, *args, EPS, config=cfg)
    xn2, h2 = unfused(*args, cfg=cfg)
    assert torch.equal(h, h2) and torch.equal(xn, xn2)
    assert counter(h)[0].item() == 0


@needs_triton
def test_tail_replay_safe_and_poison(monkeypatch):
    """Outputs fully written (NaN-poisoned buffers), and calls in a row (as CUDA-graph replays run the same launch on
    the same counter) give the same bits: the last program left the counter at 0 each time."""
    args = make_layer(2, 48, 32, 10, 4, torch.bfloat16)
    want = unfused(*args)
    for _ in range(3):
        out = tuple(torch.full((2, 48), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2))
        xn, h = fused_tail_only(monkeypatch, *args, EPS, out=out)
        assert xn is out[0] and h is out[1]
        assert torch.equal(xn, want[0]) and torch.equal(h, want[1])
        assert counter(h)[0].item() == 0


@needs_triton
def test_fallbacks(monkeypatch):
    """T above the cap, KIMI_MOE_TAIL_NORM=0 (TAIL_NORM False) and a mixed dtype take the two calls (same bits);
    CPU tensors without forced Triton take the torch references."""
    import kernels._dispatch as d
    import kernels.moe.fused as f
    import kernels.norm as norm
    from kernels.moe import fused_moe_add_norm
    from kernels.moe.ref import fused_moe_ref

    calls = []
    real = norm.combine_add_rmsnorm
    monkeypatch.setattr(norm, "combine_add_rmsnorm", lambda *a: calls.append(1) or real(*a))
    big = make_layer(f.TAIL_NORM_MAX_T + 1, 48, 32, 10, 4, torch.bfloat16)
    res, want = fused_moe_add_norm(*big, EPS), unfused(*big)
    assert calls and torch.equal(res[0], want[0]) and torch.equal(res[1], want[1])
    small = make_layer(1, 48, 32, 10, 4, torch.bfloat16)
    monkeypatch.setattr(f, "TAIL_NORM", False)
    calls.clear()
    res = fused_moe_add_norm(*small, EPS)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(res, unfused(*small)))
    monkeypatch.setattr(f, "TAIL_NORM", True)
    assert not f.tail_norm_ok(1, 48, torch.float32, torch.bfloat16, f.get_config(5, 11, torch.float32, 5))
    if DEV == "cpu":
        monkeypatch.setattr(d, "_FORCE", "ref")
        x, w13, w2, tw, ids, r, nw = small
        res = fused_moe_add_norm(*small, EPS)
        want = norm.add_rmsnorm_ref(fused_moe_ref(x, w13, w2, tw, ids), r, nw, EPS)
        assert torch.equal(res[0], want[0]) and torch.equal(res[1], want[1])


@needs_triton
def test_bench_tail_norm_smoke():
    """bench/moe.py --tail-norm code path at tiny shapes (--smoke); its bit comparison must hold."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KIMI_MOE_TAIL_NORM="1")   # opt-in
    r = subprocess.run([sys.executable, "bench/moe.py", "--smoke", "--tail-norm", "--tail-t", "1,5"], cwd=root,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("tail-norm T=")]
    assert len(lines) == 2 and all("bits equal: True" in ln for ln in lines), r.stdout[-2000:]
    assert "[tail," in lines[0] and "[fallback" in lines[1]


# ------------------------------------------------------------------------------------------------ offline (sm_90)
def _layouts() -> dict:
    """Compile kernels.norm's combine + add + norm kernel and GEMM2 with the tail (T = 1 default: direct rows, PDL,
    4 warps, L2 prefetches of the norm weight and residual) for sm_90 offline with the divisibility a Kimi-shape launch gets (D 2304, BD 4096) -> the layout of
    each tt.reduce operand over BD (the fp32 sum of squares; the same layout gives the same reduction tree)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.moe.fused import _moe_gemm2_kernel
    from kernels.norm import _combine_add_rmsnorm_kernel

    div = {"D", "N", "K", "stride_ys", "stride_r", "stride_o", "stride_h", "stride_xo", "stride_ho", "stride_os",
           "stride_om", "stride_am", "stride_we", "stride_wn"}
    i32 = {"cnt_ptr", "ids_ptr", "sorted_ptr", "expert_ids_ptr", "npost_ptr"}

    def reduce_layouts(fn, consts, stages):
        sig, cst, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            if p.is_constexpr or p.name in consts:
                sig[p.name] = "constexpr"
                cst[(i,)] = consts.get(p.name, p.default)
            elif p.name.endswith("_ptr"):
                sig[p.name] = "*i32" if p.name in i32 else "*fp32" if p.name == "tw_ptr" else "*bf16"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[p.name] = "fp32" if p.name == "eps" else "i32"
                if p.name in div:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cst, attrs=attrs),
                           target=GPUTarget("cuda", 90, 64), options=dict(num_warps=4, num_stages=stages))
        g = k.asm["ttgir"]
        lays = dict(re.findall(r"^(#\w+) = (.*)$", g, re.M))
        return [lays[m] for m in re.findall(r"\}\) : \(tensor<4096xf32, (#\w+)>\) -> f32", g)]

    norm = reduce_layouts(_combine_add_rmsnorm_kernel, dict(TOP_K=9, SPLIT=1, BD=4096, INTERP=False, EARLY_W=True,
                                                             GDC=True), 1)
    tail = reduce_layouts(_moe_gemm2_kernel, dict(BM=16, BN=64, BK=128, EVEN_K=True, MODE=0, INTERP=False,
                                                  IDS_BLOCK=-1, BLOCK_E=0, RAGGED=True, GDC=True, PREFETCH=0,
                                                  W_EVICT="", TAIL=True, TOP_K=9, SPLIT=1, BD=4096, TAIL_PF=64), 4)
    return dict(norm=norm, tail=tail)


def test_offline_same_reduction_layout():
    """On the GPU the tail's sum of squares must use the norm kernel's layout (then the same tree: bitwise equal
    outputs). Compiled offline in a subprocess without TRITON_INTERPRET (skipped where Triton cannot compile)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr or "PTXAS" in r.stderr):
        pytest.skip("no bundled ptxas: " + r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    lay = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(lay["norm"]) == 1 and lay["tail"] == lay["norm"], lay


# ------------------------------------------------------------------------------------------------ GPU, Kimi shapes
KIMI = dict(D=2304, I=1024, E=256, k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_kimi_tail_norm_gpu(T, monkeypatch):
    """E = 257 stacked (256 routed + the shared expert), D 2304, I 1024, top-8 + 1: fused_moe_add_norm (default
    config: PDL at T = 1 when KIMI_PDL is on; T = 8 above the cap: the two calls) == the unfused pair, bit for
    bit, eagerly and in a CUDA graph of 3 chained layers (x_next / h feed the next layer) replayed 3 times."""
    from kernels.moe.fused import TAIL_NORM_MAX_T, fused_moe_add_norm

    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"], KIMI["k"]
    x, w13, w2, tw, ids, r, nw = make_layer(T, D, I, E, k, torch.bfloat16, "cuda")
    fn = fused_tail_only if T <= TAIL_NORM_MAX_T else lambda _, *a: fused_moe_add_norm(*a)
    xn, h = fn(monkeypatch, x, w13, w2, tw, ids, r, nw, EPS)
    xn2, h2 = unfused(x, w13, w2, tw, ids, r, nw)
    assert torch.equal(h, h2), (h.float() - h2.float()).abs().max()
    assert torch.equal(xn, xn2), ((xn != xn2).sum().item(), (xn.float() - xn2.float()).abs().max().item())
    assert counter(h)[0].item() == 0

    def chain(fn):
        a, res = x, r
        outs = []
        for _ in range(3):
            a, res = fn(a, w13, w2, tw, ids, res, nw)
            outs += [a, res]
        return outs

    want = chain(unfused)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(lambda *a: fused_moe_add_norm(*a, EPS))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = chain(lambda *a: fused_moe_add_norm(*a, EPS))
    for _ in range(3):
        for o in got:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert counter(h)[0].item() == 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(_layouts()))
