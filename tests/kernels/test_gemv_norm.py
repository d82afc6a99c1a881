"""gemv_combine_norm (kernels/gemv_norm.py): MoE combine + residual add + RMSNorm in the next projection's gemv
prologue vs the two-launch path (kernels.norm.combine_add_rmsnorm_triton, then kernels.gemv.gemv_triton).

CPU: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_gemv_norm.py -q   (small shapes, offline sm_90 check)
GPU: python -m pytest tests/kernels/test_gemv_norm.py -q -m gpu      (Kimi shapes, a real GEMM2 y, PDL, CUDA graphs)
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels.gemv_norm as gn
from kernels.gemv import GemvConfig, gemv_ref, gemv_triton
from kernels.gemv_norm import NORM_IN_MAX_T, fused_config, gemv_combine_norm, gemv_combine_norm_ref
from kernels.norm import combine_add_rmsnorm_ref, combine_add_rmsnorm_triton
from kernels.testing import assert_bits_equal, assert_close, bf16_tol
from tests.kernels.conftest import requires_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = {torch.float32: 1e-5, torch.bfloat16: bf16_tol()}
EPS = 1e-6
# a one-split DOT config with several N tiles at the small shapes (the default config would split K there)
SMALL = GemvConfig(BN=32, BK=32, split=1, dot=True, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch):
    """CPU tensors take the Triton path (the interpreter), as KIMI_KERNELS=triton would."""
    import kernels._dispatch as d

    monkeypatch.setattr(d, "_FORCE", "triton")


@pytest.fixture
def poison(monkeypatch):
    """The fused path's buffers (out, h, x scratch) start NaN-filled: anything left unwritten shows."""
    def nan_empty(shape, like):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(gn, "_empty", nan_empty)


def _inputs(T, k, D, N, dtype, split, seed=0):
    """GEMM2-like y ([T*k, D] in dtype, or fp32 partials [split, T*k, D]), tw [T, k], a row-strided residual, the
    norm weight and the projection weight w [N, D]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(split, T * k, D, generator=g) * 2
    y = y[0].to(dtype) if split == 1 else y
    tw = torch.rand(T, k, generator=g) + 0.1
    r = (torch.randn(T, 2 * D, generator=g) * 3).to(dtype)[:, D:]
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    w = (torch.randn(N, D, generator=g) / D ** 0.5).to(dtype)
    return [t.to(DEV) for t in (y, tw, r, nw, w)]


def _ulps(a, b):
    """Elementwise distance in units in the last place of a's dtype (finite values of one sign per pair)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ai, bi = a.contiguous().view(it).long(), b.contiguous().view(it).long()
    same_sign = (ai < 0) == (bi < 0)
    return torch.where(same_sign, (ai - bi).abs(), torch.full_like(ai, 1 << 30))


def _check(y, tw, r, nw, w, cfg, pdl=None):
    """The fused call vs the two-launch path and the torch reference; returns the fused (out, h, x)."""
    y0, r0 = y.clone(), r.clone()
    assert fused_config(tw.shape[0], w.shape[0], w.shape[1], w.device, w.dtype, cfg) is not None
    out, h, x = gemv_combine_norm(y, tw, r, nw, EPS, w, pdl=pdl, cfg=cfg, return_x=True)
    x2, h2 = combine_add_rmsnorm_triton(y, tw, r, nw, EPS, pdl=pdl)
    out2 = gemv_triton(x2, w, cfg, pdl)
    T, N = tw.shape[0], w.shape[0]
    assert out.shape == (T, N) and h.shape == x.shape == r.shape and out.dtype == h.dtype == r.dtype
    assert_bits_equal("h", h, h2)
    assert int(_ulps(x, x2).max()) <= 1, "x more than 1 ulp from the two-launch x"
    assert torch.isfinite(out).all() and torch.isfinite(h).all()
    if torch.equal(x, x2):              # the same x: the same gemv loop, so the same bits
        assert_bits_equal("out", out, out2)
    assert_close("out vs two-launch", out, out2, TOL[w.dtype])
    ref_out, ref_h = gemv_combine_norm_ref(y, tw, r, nw, EPS, w)
    assert_close("out vs ref", out, ref_out, TOL[w.dtype])
    assert_close("h vs ref", h, ref_h, TOL[w.dtype])
    assert torch.equal(y, y0) and torch.equal(r, r0), "inputs written"
    return out, h, x


# --------------------------------------------------------------------------------------------------- CPU / any
@requires_triton
@pytest.mark.parametrize("split", [1, 3], ids=["y", "partials3"])
@pytest.mark.parametrize("k", [2, 9])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("N", [40, 200])
@pytest.mark.parametrize("D", [96, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_small(dtype, D, N, T, k, split, poison):
    _check(*_inputs(T, k, D, N, dtype, split), SMALL)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, NORM_IN_MAX_T])
def test_fused_ragged_k(T, dtype, poison):
    # D = 100: no power-of-2 BK >= 16 divides it, so the W / x loads are masked along K (EVEN_K False); 5 N tiles
    cfg = GemvConfig(BN=16, BK=32, split=1, dot=True, num_stages=3, evict=False)
    assert fused_config(T, 70, 100, DEV, dtype, cfg)[0].BK == 32
    _check(*_inputs(T, 9, 100, 70, dtype, 2, seed=T), cfg)


@requires_triton
@pytest.mark.parametrize("case", ["T8", "split2", "fma", "tma", "default split"])
def test_fallback_is_two_launch(case):
    # outside the fused path (T > NORM_IN_MAX_T, K split, FMA, TMA; the small shape's default config splits K):
    # exactly combine_add_rmsnorm_triton then gemv_triton with the same config
    T = 8 if case == "T8" else 2
    cfg = {"T8": SMALL, "split2": GemvConfig(BN=32, BK=32, split=2, dot=True),
           "fma": GemvConfig(BN=16, BK=64, split=1, dot=False), "tma": GemvConfig(BN=32, BK=32, split=1, dot=True,
                                                                                  tma=True),
           "default split": None}[case]
    y, tw, r, nw, w = _inputs(T, 3, 256, 40, torch.bfloat16, 1)
    assert fused_config(T, 40, 256, DEV, torch.bfloat16, cfg) is None
    out, h = gemv_combine_norm(y, tw, r, nw, EPS, w, cfg=cfg)
    x2, h2 = combine_add_rmsnorm_triton(y, tw, r, nw, EPS)
    assert torch.equal(h, h2) and torch.equal(out, gemv_triton(x2, w, cfg))


@requires_triton
def test_measured_only_follows_skinny_linear(monkeypatch):
    # measured_only (KIMI_GEMV=auto): fused only up to GEMV_WINS' rows for (N, D); above, F.linear as skinny_linear
    monkeypatch.setattr(gn, "GEMV_WINS", {(1, 40, 256): 1})
    y, tw, r, nw, w = _inputs(2, 3, 256, 40, torch.float32, 1)
    assert fused_config(1, 40, 256, DEV, torch.float32, SMALL, measured_only=True) is not None
    assert fused_config(2, 40, 256, DEV, torch.float32, SMALL, measured_only=True) is None
    out, h = gemv_combine_norm(y, tw, r, nw, EPS, w, cfg=SMALL, measured_only=True)
    x2, h2 = combine_add_rmsnorm_triton(y, tw, r, nw, EPS)
    assert torch.equal(h, h2) and torch.equal(out, F.linear(x2, w))


def test_cpu_reference_path(monkeypatch):
    # CPU without forced Triton: combine_add_rmsnorm's torch reference then F.linear (the model's CPU path)
    import kernels._dispatch as d

    monkeypatch.setattr(d, "_FORCE", "ref")
    y, tw, r, nw, w = [t.cpu() for t in _inputs(1, 9, 96, 40, torch.bfloat16, 3)]
    out, h = gemv_combine_norm(y, tw, r, nw, EPS, w)
    x2, h2 = combine_add_rmsnorm_ref(y, tw, r, nw, EPS)
    assert torch.equal(h, h2) and torch.equal(out, F.linear(x2, w))


def test_ref_formula():
    y, tw, r, nw, w = [t.cpu() for t in _inputs(3, 2, 24, 10, torch.float32, 1)]
    out, h = gemv_combine_norm_ref(y, tw, r, nw, EPS, w)
    x2, h2 = combine_add_rmsnorm_ref(y, tw, r, nw, EPS)
    assert torch.equal(h, h2) and torch.equal(out, gemv_ref(x2, w))
    torch.testing.assert_close(out, x2 @ w.T)


@pytest.mark.parametrize("N", [12576, 6720])
def test_fused_config_kimi(N):
    # the Kimi in_proj shapes at T = 1 take the fused path with SHAPE_CONFIGS' config (gemv_triton's)
    from kernels.gemv import SHAPE_CONFIGS, gemv_config

    c, k_split = fused_config(1, N, 2304, "cpu", torch.bfloat16)
    assert c == gemv_config(1, N, 2304, 1, "cpu")[0] and c.split == 1 and k_split == 2304
    assert (c.BN, c.BK, c.num_warps, c.num_stages) == (lambda s: (s.BN, s.BK, s.num_warps, s.num_stages))(
        SHAPE_CONFIGS[(1, N, 2304, 1)])


_OFFLINE = r"""
import json
from kernels.gemv_norm import compile_report, fused_config
import torch
out = {}
for N in (12576, 6720):
    for gdc in (False, True):
        r = compile_report(N=N, gdc=gdc)
        out[f"{N} {gdc}"] = dict(regs=r["regs"], stack=r["stack"], smem=r["smem"], events=r["events"], wgmma=r["wgmma"])
c = fused_config(1, 12576, 2304, "cpu", torch.bfloat16)[0]   # T = 4 itself would split K
r = compile_report(N=12576, T=4, gdc=True, cfg=c)
out["T4"] = dict(regs=r["regs"], stack=r["stack"], smem=r["smem"], events=r["events"], wgmma=r["wgmma"])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_offline():
    """Offline sm_90 compile (no GPU), y in bf16 (GEMM2's decode output; fp32 partials spill, see kernels/gemv_norm.py)
    at T = 1 and NORM_IN_MAX_T: no spills, shared memory within the H200's 227 KB, wgmma; with GDC one wait,
    before it only the W head prefetches and the norm weight loads (no store), launch_dependents right after it, then
    the after-wait W prefetch (NORM_IN_PF_MB; without GDC at the start), and otherwise the same memory instructions as
    without GDC."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _OFFLINE], cwd=ROOT, env=dict(env, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr or "cuobjdump" in r.stderr):
        pytest.skip("no bundled ptxas/cuobjdump: " + r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    W, L, P = "griddepcontrol.wait", "griddepcontrol.launch_dependents", "prefetch.global.L2"
    for name, v in res.items():
        assert v["stack"] == 0 and v["regs"] <= 168 and v["smem"] <= 232448 and v["wgmma"], (name, v)
    for N in (12576, 6720):
        off, on = res[f"{N} False"]["events"], res[f"{N} True"]["events"]
        assert W not in off and L not in off and on.count(W) == 1
        pre, post = on[:on.index(W)], on[on.index(W) + 1:]
        assert post[0] == L and set(pre) == {P, "ld.global"} and pre.index("ld.global") > pre.index(P), pre
        assert [e for e in on if e not in (W, L, P)] == [e for e in off if e != P]
        # NORM_IN_PF_MB: more of the W slab prefetched after the wait, before the prologue's y / residual loads
        assert post[1] == P and "ld.global" in post and P in off[:off.index("ld.global") + 8], (post[:8], off[:8])


def test_bench_smoke():
    # bench/gemv_norm.py --smoke (CPU, interpreter, tiny shapes) runs both paths end to end
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gemv_norm.py"), "--smoke"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "two-launch" in r.stdout and "fused" in r.stdout and "ratio" in r.stdout


# --------------------------------------------------------------------------------------------------- GPU
def _gemm2_y(T, D, E, I, k, seed=0):
    """A real GEMM2 output at T tokens: fused_moe_uncombined_triton on random experts (k - 1 routed + a shared
    expert with weight 1, as the model's router appends it) -> (y, tw, x, w13, w2, ids)."""
    from kernels.moe.fused import fused_moe_uncombined_triton

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E + 1, 2 * I, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E + 1, D, I, device="cuda", generator=g) / I ** 0.5).to(torch.bfloat16)
    routed = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k - 1] for _ in range(T)])
    ids = torch.cat([routed, torch.full((T, 1), E, device="cuda")], 1).to(torch.int32)
    tw = torch.cat([torch.rand(T, k - 1, device="cuda", generator=g) + 0.1, torch.ones(T, 1, device="cuda")], 1)
    return fused_moe_uncombined_triton(x, w13, w2, tw, ids), tw, x, w13, w2, ids


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["nopdl", "pdl"])
@pytest.mark.parametrize("N,T", [(12576, 1), (6720, 1), (6720, 4)])
def test_kimi_gpu(N, T, pdl, poison):
    # D 2304, 8 routed + 1 shared expert: y as GEMM2 produces it; and fp32 K partials (S = 3). T = 4: MLA's
    # in_proj keeps one K split there (the KDA in_proj's does not: two launches)
    D = 2304
    y, tw = _gemm2_y(T, D, 64, 1024, 9)[:2]
    _, _, r, nw, w = _inputs(T, 9, D, N, torch.bfloat16, 1)
    assert fused_config(T, N, D, "cuda", torch.bfloat16) is not None
    _check(y, tw, r, nw, w, None, pdl)
    yp = _inputs(T, 9, D, N, torch.bfloat16, 3, seed=5)[0]
    _check(yp, tw, r, nw, w, None, pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["nopdl", "pdl"])
@pytest.mark.parametrize("N", [12576, 6720])
def test_kimi_cuda_graph(N, pdl):
    # GEMM2 then the fused projection captured in one graph, replayed with a new MoE input: the same h bits and
    # out (within bf16) as the two-launch path on the graph's y
    from kernels.moe.fused import fused_moe_uncombined_triton

    D = 2304
    y, tw, x, w13, w2, ids = _gemm2_y(1, D, 64, 1024, 9)
    _, _, r, nw, w = _inputs(1, 9, D, N, torch.bfloat16, 1)

    def step():
        yy = fused_moe_uncombined_triton(x, w13, w2, tw, ids)
        return (yy,) + gemv_combine_norm(yy, tw, r, nw, EPS, w, pdl=pdl)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg, outg, hg = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        x2, h2 = combine_add_rmsnorm_triton(yg, tw, r, nw, EPS)
        assert_bits_equal("graph h", hg, h2)
        assert_close("graph out", outg, gemv_triton(x2, w), bf16_tol())
        assert_close("graph out vs ref", outg, gemv_combine_norm_ref(yg, tw, r, nw, EPS, w)[0], bf16_tol())
