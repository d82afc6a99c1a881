"""moe_router_add_norm (kernels/moe/router.py): the post-attention residual add + RMSNorm computed by the one-launch
decode router (v2 / v3, NORM) against kernels.norm.add_rmsnorm followed by moe_router (the two launches it replaces).

CPU: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_router_norm.py -q   (small shapes + Kimi D)
GPU: python -m pytest tests/kernels/test_router_norm.py -q -m gpu               (Kimi shapes, CUDA graph, PDL on/off)

h is one rounded add (bitwise equal to add_rmsnorm's). x: the fused kernel sums the squares per D chunk
(decode_k_split), add_rmsnorm in one [next_pow2(D)] reduction, so x may differ in the last bit of some elements
(at most 1 bf16 ulp); the weights / ids are always those of the x the kernel returns.
"""
import os

import pytest
import torch

import kernels._dispatch as dispatch
from kernels.moe import moe_router_add_norm, moe_router_ref
from kernels.norm import add_rmsnorm_ref
from tests.kernels.conftest import poll_slot_buffers
from tests.kernels.conftest import run_offline

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if HAS_CUDA else "cpu"
EPS, SCALE = 1e-6, 2.446

# (decode kernel, BE, warps): the default v3 config, v2's arrival counter, wider programs, and 64 experts per 1-warp
# program (D 300 -> 9 chunks of 32 + a tail: the chunk loop, h recomputed in a second pass)
KERNELS = [("v3", 1, 1), ("v2", 1, 1), ("v3", 4, 2), ("v3", 64, 1)]


@pytest.fixture(autouse=True)


def _all_decode_batches(monkeypatch):
    """The fused launch up to T = 16 (GEMV_MAX_T) in these tests; the default cap is ROUTER_NORM_MAX_T."""
    from kernels.moe import router

    monkeypatch.setattr(router, "ROUTER_NORM_MAX_T", router.GEMV_MAX_T)


def _inputs(T, E, D, dtype=torch.bfloat16, dev=DEV):
    attn = torch.randn(T, D, device=dev).to(dtype)
    res = (torch.randn(T, D, device=dev) * 4).to(dtype)
    nw = (torch.rand(D, device=dev) + 0.5).to(dtype)
    g = (torch.randn(E, D, device=dev) * 0.2).to(dtype)
    b = torch.randn(E, device=dev) * 0.5
    return attn, res, nw, g, b


def _ulps(a, b):
    """|bit distance| of two bf16 tensors of the same signs (0 where equal)."""
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return torch.where(a == b, 0, d)


def _cfg(monkeypatch, kern):
    import kernels.moe.router as r

    monkeypatch.setattr(r, "ROUTER_DECODE", kern[0])
    monkeypatch.setattr(r, "DECODE_BE", kern[1])
    monkeypatch.setattr(r, "DECODE_WARPS", kern[2])
    monkeypatch.setattr(r, "NORM_BE", kern[1])
    monkeypatch.setattr(r, "NORM_WARPS", kern[2])


def _router_as_fused(x, g, bias, k, renorm, biased, extra, pdl=None):
    """The plain decode router at the fused path's config (NORM_BE / NORM_WARPS): the same dot products."""
    import kernels.moe.router as r

    return r._router_decode_v2(x, g, bias, k, SCALE, renorm, biased, extra, BE=r.NORM_BE, num_warps=r.NORM_WARPS,
                               pdl=pdl)


def _fused(*args):
    import kernels.moe.router as r

    return r.moe_router_add_norm_triton(*args)


def _unfused(attn, res, nw, g, bias, k, renorm, biased, extra):
    """add_rmsnorm_triton, then moe_router_triton (the same decode kernel without NORM)."""
    import kernels.moe.router as r
    from kernels.norm import add_rmsnorm_triton

    x, h = add_rmsnorm_triton(attn, res, nw, EPS)
    return (x, h) + r.moe_router_triton(x, g, bias, k, SCALE, renorm, biased, extra)


def _check(got, two, g, bias, k, renorm, biased, extra, kimi_d=False):
    x, h, w, ids = got
    x2, h2, w2, ids2 = two
    assert x.dtype == h.dtype == x2.dtype and x.is_contiguous() and h.is_contiguous()
    assert torch.equal(h, h2)
    if x.dtype == torch.bfloat16:
        assert _ulps(x, x2).max() <= 1
    else:
        torch.testing.assert_close(x, x2, rtol=1e-6, atol=1e-6)
    if kimi_d and INTERPRET:
        # D 2304 = 2048 + 256: the chunk sums add up in the order of numpy's pairwise sum over the padded 4096
        # (the interpreter's tl.sum in _add_rmsnorm_kernel): the same rstd, the same x
        assert torch.equal(x, x2)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=0, atol=1e-6)
    # the weights / ids are the router's of the x written: the unfused kernel on it gives the same bits
    w3, ids3 = _router_as_fused(x, g, bias, k, renorm, biased, extra)
    assert torch.equal(ids, ids3) and torch.equal(w, w3)
    wr, ir = moe_router_ref(x, g, bias, k, SCALE, renorm, biased, append_expert=extra)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


def _no_leftovers(T):
    from kernels._tensors import arrival_counters

    assert not arrival_counters(DEV, T)[:T].any()
    assert all(not b.any() for b in poll_slot_buffers())


# (T, E, k, D, kernel): small shapes under three configs (T 16: the default); D 300 under BE 64 (9 K chunks + tail,
# one program per token); E 256 under BE 4 (interpreter time)
CASES = [(T, 12, 3, 48, kern) for T in (1, 3) for kern in KERNELS[:3]] + \
    [(16, 12, 3, 48, KERNELS[0]), (2, 40, 6, 300, KERNELS[3]), (3, 256, 8, 40, KERNELS[2])]


@needs_triton
@pytest.mark.parametrize("T,E,k,D,kern", CASES, ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else None)
def test_router_norm_matches(T, E, k, D, kern, monkeypatch):
    import kernels.moe.router as r

    _cfg(monkeypatch, kern)
    assert r.norm_fused(T)
    attn, res, nw, g, b = _inputs(T, E, D)
    every = [(bias, biased, renorm, extra) for bias in (b, None) for biased in (False, True)
             for renorm, extra in ((True, E), (False, None))]
    # all eight combinations once per config at T = 1; elsewhere biased + bias + shared and neither (CI time)
    for bias, biased, renorm, extra in (every if T == 1 and E < 64 else [every[2], every[5]]):
        got = _fused(attn, res, nw, EPS, g, bias, k, SCALE, renorm, biased, extra)
        two = _unfused(attn, res, nw, g, bias, k, renorm, biased, extra)
        _check(got, two, g, bias, k, renorm, biased, extra)
    _no_leftovers(T)


@needs_triton
@pytest.mark.parametrize("T,E", [(1, 64), (3, 32), (16, 16)])
def test_router_norm_kimi_d(T, E, monkeypatch):
    """Kimi D 2304 (chunks 2048 + 256 tail), the default v3 config (E 256: the GPU test; interpreter time), shared
    expert appended."""
    _cfg(monkeypatch, KERNELS[0])
    attn, res, nw, g, b = _inputs(T, E, 2304)
    got = _fused(attn, res, nw, EPS, g, b, 8, SCALE, True, False, E)
    two = _unfused(attn, res, nw, g, b, 8, True, False, E)
    _check(got, two, g, b, 8, True, False, E, kimi_d=True)
    _no_leftovers(T)


@needs_triton
@pytest.mark.parametrize("kern", KERNELS[:2], ids=lambda c: "-".join(map(str, c)))
def test_router_norm_ties_fp32_strided(kern, monkeypatch):
    """Duplicated gate rows tie exactly (lower expert first); fp32 activations; attn / residual as row-strided
    views (the x / h outputs are contiguous)."""
    _cfg(monkeypatch, kern)
    T, E, k, D = 5, 8, 3, 40
    attn, res, nw, g, b = _inputs(T, E // 2, D, torch.float32)
    g = g.repeat(2, 1)                                   # expert e and e + 4 tie
    wide = torch.randn(T, 2 * D, device=DEV)
    wide[:, 3:3 + D] = attn
    attn_v = wide[:, 3:3 + D]
    res_wide = torch.randn(T, D + 8, device=DEV)
    res_wide[:, :D] = res
    res_v = res_wide[:, :D]
    got = _fused(attn_v, res_v, nw, EPS, g, None, k, SCALE, True, False, None)
    two = _unfused(attn, res, nw, g, None, k, True, False, None)
    _check(got, two, g, None, k, True, False, None)
    ids = got[3]
    for e in range(4):   # e + 4 never precedes its twin
        row, col = (ids == e + 4).nonzero(as_tuple=True)
        for t, c in zip(row.tolist(), col.tolist()):
            assert e in ids[t, :c].tolist()


@needs_triton
def test_router_norm_dispatch(monkeypatch):
    """One launch (the decode kernel with NORM, no add_rmsnorm kernel) only for T <= 16 under v2 / v3 with
    FUSED_DECODE and ROUTER_NORM; T > 16, v1, KIMI_ROUTER_FUSED=0 and KIMI_ROUTER_NORM=0 run add_rmsnorm + the
    router (same results)."""
    import kernels.moe.router as r
    import kernels.norm as n

    launches = []

    def spy(mod, name):
        kern = getattr(mod, name)

        class _Spy:
            def __getitem__(self, grid):
                def run(*a, **kw):
                    launches.append((name, kw.get("NORM", False)))
                    return kern[grid](*a, **kw)
                return run
        monkeypatch.setattr(mod, name, _Spy())

    spy(r, "_router_decode_kernel")
    spy(n, "_add_rmsnorm_kernel")
    E, k, D = 8, 2, 32
    for T, switch, fused in [(1, {}, True), (16, {}, True), (17, {}, False), (2, dict(ROUTER_NORM=False), False),
                             (2, dict(FUSED_DECODE=False), False), (2, dict(ROUTER_DECODE="v1"), False),
                             (2, dict(ROUTER_DECODE="v2"), True),
                             (4, dict(ROUTER_NORM_MAX_T=4), True), (5, dict(ROUTER_NORM_MAX_T=4), False)]:
        with monkeypatch.context() as m:
            for key, val in switch.items():
                m.setattr(r, key, val)
            attn, res, nw, g, b = _inputs(T, E, D)
            launches.clear()
            got = _fused(attn, res, nw, EPS, g, b, k, SCALE, True, False, E)
            assert r.norm_fused(T) == fused
            if fused:
                assert launches == [("_router_decode_kernel", True)], (T, switch)
            else:
                assert ("_add_rmsnorm_kernel", False) in launches and ("_router_decode_kernel", True) not in launches
            two = _unfused(attn, res, nw, g, b, k, True, False, E)
            assert torch.equal(got[1], two[1]) and _ulps(got[0], two[0]).max() <= 1 and torch.equal(got[3], two[3])


def test_router_norm_entry_point(monkeypatch):
    """kernels.moe.moe_router_add_norm: CPU tensors (KIMI_KERNELS unset) -> add_rmsnorm_ref, then moe_router_ref;
    KIMI_KERNELS=triton -> moe_router_add_norm_triton with the same arguments."""
    import kernels.moe.router as r

    attn, res, nw, g, b = _inputs(3, 16, 24, dev="cpu")
    monkeypatch.setattr(dispatch, "_FORCE", "")
    x, h, w, ids = moe_router_add_norm(attn, res, nw, EPS, g, b, 4, SCALE, True, True, 16)
    xr, hr = add_rmsnorm_ref(attn, res, nw, EPS)
    wr, ir = moe_router_ref(xr, g, b, 4, SCALE, True, True, append_expert=16)
    assert torch.equal(x, xr) and torch.equal(h, hr) and torch.equal(w, wr) and torch.equal(ids, ir)
    seen = []
    monkeypatch.setattr(r, "moe_router_add_norm_triton", lambda *a, **kw: seen.append((a, kw)) or "triton")
    monkeypatch.setattr(dispatch, "_FORCE", "triton")
    assert moe_router_add_norm(attn, res, nw, EPS, g, b, 4, SCALE, True, True, 16, l2_hint=(g,)) == "triton"
    assert seen == [((attn, res, nw, EPS, g, b, 4, SCALE, True, True, 16), dict(l2_hint=(g,)))]


_LOWERING = r"""
import json
from kernels._pdl import ptx_events
from kernels.moe import router as r
rt = dict(logits_ptr="*i64", cnt_ptr="*i64", bias_ptr="*fp32", w_out_ptr="*fp32", id_out_ptr="*i32")
topk = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=256, HAS_BIAS=True, BIASED_WEIGHTS=False, RENORM=True, HAS_EXTRA=True,
            OUT_K=9, POLL=True, MAX_SPINS=1 << 20, GDC=True, NORM=True)
out = {}
for be, nw, d in ((1, 1, 2304), (64, 1, 300)):
    BK, NK, BKT = r.decode_k_split(d, be, nw)
    c = dict(topk, BE=be, BK=BK, NK=NK, BK_TAIL=BKT)
    out[f"{be}-{d}"] = {str(on): ptx_events(r._router_decode_kernel, dict(c, WAIT=on), rt, nw) for on in (0, 1)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_lowering_norm():
    """Offline sm_90 PTX of the NORM decode kernel under PDL (WAIT): one griddepcontrol.wait; before it loads only
    (gate rows, norm weight, bias: weights), no store or atomic; after it the attn / residual loads; without WAIT
    the same memory instructions."""
    W = "griddepcontrol.wait"
    for name, ev in run_offline(_LOWERING, 600, unset=("KIMI_PDL",)).items():
        off, on = ev["0"], ev["1"]
        assert on.count(W) == 1 and W not in off, name
        pre, post = on[:on.index(W)], on[on.index(W) + 1:]
        assert "st.global" not in pre and "atom." not in pre and "ld.global" in pre, (name, pre)
        assert "ld.global" in post and "st.global" in post, name
        assert [e for e in on if e != W] == off, name


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("T", [1, 8, 16])
def test_router_norm_kimi_graph(T, pdl):
    """Kimi shapes (E 256, k 8, D 2304, shared expert appended, bf16), default decode config, captured in a CUDA
    graph after the unfused pair's graph and replayed with new inputs: h bitwise, x within 1 ulp, ids equal,
    weights within 1e-6; the weights / ids bit-equal to the router's on the x written."""
    import kernels.moe.router as r
    from kernels.norm import add_rmsnorm_triton

    E, k, D = 256, 8, 2304
    attn, res, nw, g, b = _inputs(T, E, D)
    g = torch.randn(E, D, device="cuda", dtype=torch.bfloat16)   # unscaled: saturated sigmoids, the bias decides

    def fused():
        return r.moe_router_add_norm_triton(attn, res, nw, EPS, g, b, k, SCALE, True, False, E, pdl=pdl)

    def two():
        x, h = add_rmsnorm_triton(attn, res, nw, EPS, pdl=pdl)
        return (x, h) + r.moe_router_triton(x, g, b, k, SCALE, True, False, E, pdl=pdl)

    assert r.norm_fused(T)
    fused(), two()   # compile outside the captures
    graphs, outs = [], []
    for fn in (fused, two):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn())
        graphs.append(graph)
    for _ in range(3):
        attn.copy_(torch.randn_like(attn))
        res.copy_(torch.randn_like(res) * 4)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        (x, h, w, ids), (x2, h2, w2, ids2) = outs
        assert torch.equal(h, h2) and _ulps(x, x2).max() <= 1
        assert torch.equal(ids, ids2)
        torch.testing.assert_close(w, w2, rtol=0, atol=1e-6)
        w3, ids3 = _router_as_fused(x, g, b, k, True, False, E, pdl=pdl)
        assert torch.equal(ids3, ids) and torch.equal(w3, w)
        wr, ir = moe_router_ref(x, g, b, k, SCALE, True, False, append_expert=E)
        assert torch.equal(ids, ir)
    _no_leftovers(T)
