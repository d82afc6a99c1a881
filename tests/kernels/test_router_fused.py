"""Decode router in one launch (kernels/moe/router.py): the last logits program of each token to arrive selects its
top-k. v1 `_router_fused_gemv_kernel`, v2 `_router_decode_kernel` (KIMI_ROUTER_DECODE, per BE / warps config).
Against the torch reference and the two-launch path, counters left at zero.

CPU: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_router_fused.py -q   (small shapes)
GPU: python -m pytest tests/kernels/test_router_fused.py -q                       (adds Kimi shapes, graph replay)
"""
import os

import pytest
import torch

from kernels.moe import moe_router_ref
from tests.kernels.conftest import poll_slot_buffers

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if HAS_CUDA else "cpu"


# (kernel, BE, warps): v1, v2 (arrival counter) and v3 (flag-in-data slots) at configs bench/router.py sweeps
KERNELS = [("v1", None, None), ("v2", 1, 1), ("v3", 1, 1), ("v2", 2, 1), ("v3", 4, 2), ("v3", 8, 4)]


def _fused(kern, x, g, b, k, scale, renorm, biased, extra):
    import kernels.moe.router as r

    if kern[0] == "v1":
        return r._router_decode_v1(x, g, b, k, scale, renorm, biased, extra)
    return r._router_decode_v2(x, g, b, k, scale, renorm, biased, extra, BE=kern[1], num_warps=kern[2],
                               poll=kern[0] == "v3")


def _both(x, g, b, k, scale, renorm, biased, extra, kern=KERNELS[0]):
    import kernels.moe.router as r

    fused = _fused(kern, x, g, b, k, scale, renorm, biased, extra)
    saved, r.FUSED_DECODE = r.FUSED_DECODE, False
    try:
        two = r.moe_router_triton(x, g, b, k, scale, renorm, biased, extra)
    finally:
        r.FUSED_DECODE = saved
    return fused, two


@needs_triton
@pytest.mark.parametrize("kern", KERNELS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("T,E,k,D", [(1, 12, 3, 48), (7, 12, 3, 48), (16, 12, 3, 48), (5, 7, 7, 20),
                                      (1, 256, 8, 40), (3, 256, 8, 40), (2, 40, 6, 300)])
def test_fused_router_matches(T, E, k, D, kern):
    from kernels._tensors import arrival_counters

    x, g = torch.randn(T, D, device=DEV).to(torch.bfloat16), torch.randn(E, D, device=DEV).to(torch.bfloat16)
    b = torch.randn(E, device=DEV) * 2.0 - 1.0  # selection scores of both signs
    every = [(bias, biased, renorm, extra) for bias in (b, None) for biased in (False, True)
             for renorm, extra in ((True, E), (False, None))]
    # the interpreter runs E/BE programs per token: at E = 256 or T = 16 two of the eight combinations (CI time)
    for bias, biased, renorm, extra in (every if (E < 64 and T < 16) or HAS_CUDA else [every[0], every[7]]):
        (w, ids), (w2, ids2) = _both(x, g, bias, k, 2.446, renorm, biased, extra, kern)
        wr, ir = moe_router_ref(x, g, bias, k, 2.446, renorm, biased, append_expert=extra)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == wr.shape
        assert torch.equal(ids, ir) and torch.equal(ids, ids2)
        if kern[0] == "v1":
            assert torch.equal(w, w2)  # the same fp32 logits and the same selection code
        torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    assert not arrival_counters(DEV, T)[:T].any()  # every launch resets its counters (v3: its slots)
    assert all(not b.any() for b in poll_slot_buffers())


@needs_triton
@pytest.mark.parametrize("kern", KERNELS, ids=lambda c: "-".join(map(str, c)))
def test_fused_router_ties_and_nan(kern):
    """Duplicated gate rows tie exactly: the lower expert index wins; a NaN logit row (NaN ranks first)."""
    x = torch.randn(5, 32, device=DEV)
    g = torch.randn(4, 32, device=DEV).repeat(2, 1)  # expert e and e + 4 tie
    w, ids = _fused(kern, x, g, None, 3, 1.0, True, False, None)
    wr, ir = moe_router_ref(x, g, None, 3, 1.0, True)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    x[1, 0] = float("nan")
    w, ids = _fused(kern, x, g, None, 2, 1.0, True, False, None)
    assert ids[1].tolist() == [0, 1] and torch.equal(ids[0], ir[0, :2])


@needs_triton
@pytest.mark.parametrize("kern", KERNELS[1:], ids=lambda c: "-".join(map(str, c)))
def test_v2_v3_biased_weights_and_switch(kern):
    """v2 / v3 take the picked weights from their registers: biased weights (s + bias) must come out exactly like
    the reference's; the module switches route _router_fused to them."""
    import kernels.moe.router as r

    T, E, k, D = 3, 24, 5, 72
    x, g = torch.randn(T, D, device=DEV), torch.randn(E, D, device=DEV)
    b = torch.randn(E, device=DEV)
    w, ids = _fused(kern, x, g, b, k, 0.5, True, True, None)
    wr, ir = moe_router_ref(x, g, b, k, 0.5, True, True)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    saved = r.ROUTER_DECODE, r.DECODE_BE, r.DECODE_WARPS
    r.ROUTER_DECODE, r.DECODE_BE, r.DECODE_WARPS = kern
    try:
        w2, ids2 = r.moe_router_triton(x, g, b, k, 0.5, True, True)
    finally:
        r.ROUTER_DECODE, r.DECODE_BE, r.DECODE_WARPS = saved
    assert torch.equal(ids2, ids) and torch.equal(w2, w)


@needs_triton
@pytest.mark.parametrize("poll", [False, True])
def test_v2_v3_many_k_chunks(poll):
    """BE = 64 experts per 1-warp program caps the K chunk at 32: D = 300 is 9 chunks + a 12-wide tail (the
    chunk-by-chunk loop after the first two)."""
    import kernels.moe.router as r

    assert r.decode_k_split(300, 64, 1) == (32, 9, 16)
    T, E, k, D = 2, 130, 8, 300
    x, g = torch.randn(T, D, device=DEV).to(torch.bfloat16), torch.randn(E, D, device=DEV).to(torch.bfloat16)
    b = torch.randn(E, device=DEV) * 0.3
    w, ids = r._router_decode_v2(x, g, b, k, 2.446, True, False, E, BE=64, num_warps=1, poll=poll)
    wr, ir = moe_router_ref(x, g, b, k, 2.446, True, False, append_expert=E)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("T", [17, 40])
def test_topk_row_kernel(T, monkeypatch):
    """v2 / v3 route 16 < T <= TOPK_ROW_MAX_T tokens in two launches: split-K logits, top-k one token per 1-warp
    program summing the partials."""
    import kernels.moe.router as r

    monkeypatch.setattr(r, "ROUTER_DECODE", "v3")
    E, k, D = 64, 6, 32
    x, g = torch.randn(T, D, device=DEV), torch.randn(E, D, device=DEV)
    b = torch.randn(E, device=DEV) * 0.5
    x[3, 0] = float("nan")                                  # NaN ranks first: ids 0..k-1 in order
    for bias, biased in ((b, False), (b, True), (None, False)):
        w, ids = r.moe_router_triton(x, g, bias, k, 2.446, True, biased, E)
        wr, ir = moe_router_ref(x, g, bias, k, 2.446, True, biased, append_expert=E)
        assert torch.equal(ids, ir)
        keep = torch.arange(T, device=DEV) != 3
        torch.testing.assert_close(w[keep], wr[keep], rtol=1e-5, atol=1e-6)
        # the row top-k alone over one logits tensor (router_topk_triton under v2 / v3)
        w1, ids1 = r.router_topk_triton(x.float() @ g.float().t(), bias, k, 2.446, True, biased, E)
        assert torch.equal(ids1, ir)
        torch.testing.assert_close(w1[keep], wr[keep], rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("T,D,dtype", [(20, 300, torch.bfloat16), (33, 100, torch.float32)])
def test_logits_splitk(T, D, dtype):
    """Split-K partials [S, T, E] sum (in order) to the reference logits; S = cdiv(D, KS), the last split ragged."""
    import kernels.moe.router as r

    E = 40
    x, g = torch.randn(T, D, device=DEV).to(dtype), torch.randn(E, D, device=DEV).to(dtype)
    parts = r.router_logits_splitk(x, g)
    BK = 64 if dtype == torch.float32 else 128
    assert parts.shape == (-(-D // (r.SPLITK_KS // BK * BK)), T, E)
    torch.testing.assert_close(parts.sum(0), x.float() @ g.float().t(), rtol=1e-5, atol=1e-4)


def test_decode_k_split():
    import kernels.moe.router as r

    assert r.decode_k_split(2304, 1, 1) == (2048, 1, 256)   # Kimi: no masked lanes but the tail's
    assert r.decode_k_split(2304, 4, 1) == (512, 4, 256)    # <= 64 elements per thread and chunk
    assert r.decode_k_split(2048, 2, 2) == (2048, 1, 0)
    assert r.decode_k_split(300, 2, 1) == (256, 1, 64)
    for D in (1, 16, 17, 40, 7168):
        BK, NK, tail = r.decode_k_split(D, 2, 1)
        assert NK * BK + (D % BK) == D and (tail == 0) == (D % BK == 0) and tail >= D % BK


@needs_triton
def test_dispatch_takes_fused_path_for_decode():
    import kernels.moe.router as r

    calls = []
    orig = r._router_fused
    r._router_fused = lambda *a: calls.append(a[0].shape[0]) or orig(*a)
    try:
        for T in (1, r.GEMV_MAX_T, r.GEMV_MAX_T + 1):
            x, g = torch.randn(T, 16, device=DEV), torch.randn(8, 16, device=DEV)
            w, ids = r.moe_router_triton(x, g, None, 2)
            assert torch.equal(ids, moe_router_ref(x, g, None, 2)[1])
    finally:
        r._router_fused = orig
    assert calls == ([1, r.GEMV_MAX_T] if r.FUSED_DECODE else [])


@pytest.mark.gpu
@pytest.mark.parametrize("kern", KERNELS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("T", [1, 8, 16])
def test_fused_router_kimi_graph(T, kern):
    """Kimi shapes (E=256, k=8, D=2304, shared expert appended), captured in a CUDA graph and replayed with new inputs:
    the counters (v3: slots) reset inside each replay."""
    from kernels._tensors import arrival_counters

    E, k, D = 256, 8, 2304
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(E, D, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, device="cuda") * 0.1
    _fused(kern, x, g, b, k, 2.446, True, False, E)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = _fused(kern, x, g, b, k, 2.446, True, False, E)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        wr, ir = moe_router_ref(x, g, b, k, 2.446, True, False, append_expert=E)
        assert torch.equal(ids, ir)
        torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    assert not arrival_counters("cuda", T)[:T].any()
    assert all(not b.any() for b in poll_slot_buffers())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [17, 64, 256])
def test_splitk_router_kimi_gpu(T, monkeypatch):
    """v3's two-launch path at Kimi shapes (split-K logits + row top-k), against the reference."""
    import kernels.moe.router as r

    monkeypatch.setattr(r, "ROUTER_DECODE", "v3")
    E, k, D = 256, 8, 2304
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    # unscaled gate: about a third of the logits saturate the fp32 sigmoid at 1.0, so the bias decides among them and
    # the pick does not hinge on the summation order (a near-tie of unsaturated scores could flip an id)
    g = torch.randn(E, D, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, device="cuda") * 0.1
    w, ids = r.moe_router_triton(x, g, b, k, 2.446, True, False, E)
    wr, ir = moe_router_ref(x, g, b, k, 2.446, True, False, append_expert=E)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
