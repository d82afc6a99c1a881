"""MoE router + fused MoE: Triton kernels vs torch references.

CPU: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_moe.py -q   (small shapes)
GPU: python -m pytest tests/kernels/test_moe.py -q                       (adds the Kimi-shape tests)
"""
import os

import pytest
import torch

from kernels.moe import fused_moe, fused_moe_ref, moe_router, moe_router_ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if HAS_CUDA else "cpu"


def rms_ratio(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_moe(T, D, I, E, k, dtype, device=DEV, ids=None):
    x = torch.randn(T, D, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, device=device) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) / I**0.5).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]) if T else \
            torch.empty(0, k, dtype=torch.long, device=device)
    w = torch.rand(T, k, device=device) + 0.1
    return x, w13, w2, w, ids.to(torch.int32)


# ------------------------------------------------------------------------------------------------ references
def test_router_ref_semantics():
    T, D, E, k = 6, 16, 8, 3
    x, g, b = torch.randn(T, D), torch.randn(E, D), torch.randn(E) * 0.5
    w, ids = moe_router_ref(x, g, b, k, 2.446, True)
    s = torch.sigmoid(x.float() @ g.float().T)
    exp_ids = torch.topk(s + b, k, dim=-1).indices
    assert torch.equal(ids.long(), exp_ids)
    ws = s.gather(1, exp_ids)
    torch.testing.assert_close(w, ws / ws.sum(-1, keepdim=True) * 2.446)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    # biased weights: HF remote-code aliasing, weights from s + bias
    wb, idsb = moe_router_ref(x, g, b, k, 2.446, True, biased_weights=True)
    assert torch.equal(idsb, ids)
    wsb = (s + b).gather(1, exp_ids)
    torch.testing.assert_close(wb, wsb / wsb.sum(-1, keepdim=True) * 2.446)
    # no renormalize: raw scores times the factor
    wn, _ = moe_router_ref(x, g, b, k, 2.0, False)
    torch.testing.assert_close(wn, ws * 2.0)
    # zero bias: both flags agree
    w0, _ = moe_router_ref(x, g, torch.zeros(E), k, 1.0, True)
    w1, _ = moe_router_ref(x, g, torch.zeros(E), k, 1.0, True, biased_weights=True)
    torch.testing.assert_close(w0, w1)


def test_fused_moe_ref_matches_dense_loop():
    T, D, I, E, k = 5, 16, 8, 4, 2
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.float32, "cpu")
    out = fused_moe_ref(x, w13, w2, w, ids)
    exp = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            h = w13[e] @ x[t]
            exp[t] += w[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-5)


def test_cpu_dispatch_uses_ref(monkeypatch):
    import kernels._dispatch as d

    monkeypatch.setattr(d, "_FORCE", "")
    x, g, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    w, ids = moe_router(x, g, b, 2, 2.446, True)
    wr, ir = moe_router_ref(x, g, b, 2, 2.446, True)
    assert torch.equal(w, wr) and torch.equal(ids, ir)
    xx, w13, w2, ww, ii = make_moe(4, 16, 8, 8, 2, torch.float32, "cpu")
    assert torch.equal(fused_moe(xx, w13, w2, ww, ii), fused_moe_ref(xx, w13, w2, ww, ii))


# ------------------------------------------------------------------------------------------------ router
@needs_triton
@pytest.mark.parametrize("T", [1, 3, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_triton(T, dtype):
    from kernels.moe.router import moe_router_triton

    D, E, k = 48, 12, 3
    x = torch.randn(T, D, device=DEV).to(dtype)
    g = torch.randn(E, D, device=DEV).to(dtype)
    b = torch.randn(E, device=DEV) * 0.3
    for biased in (False, True):
        for renorm in (True, False):
            w, ids = moe_router_triton(x, g, b, k, 2.446, renorm, biased)
            wr, ir = moe_router_ref(x, g, b, k, 2.446, renorm, biased)
            assert ids.dtype == torch.int32 and w.dtype == torch.float32
            assert torch.equal(ids, ir)
            torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    for biased in (False, True):  # no bias: biased_weights changes nothing
        w, ids = moe_router_triton(x, g, None, k, 1.0, True, biased)
        wr, ir = moe_router_ref(x, g, None, k, 1.0, True, biased)
        assert torch.equal(ids, ir)
        torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("T", [1, 16, 17])
def test_router_triton_many_experts(T):
    """E = 256 (one 256-wide key row per program; T <= 16 takes the GEMV logits path), negative and positive
    selection scores (bias), and a NaN row (NaN ranks first, like the reference's sort)."""
    from kernels.moe.router import GEMV_MAX_T, moe_router_triton, router_topk_triton

    D, E, k = 40, 256, 8
    assert (T <= GEMV_MAX_T) == (T < 17)
    x, g = torch.randn(T, D, device=DEV).to(torch.bfloat16), torch.randn(E, D, device=DEV).to(torch.bfloat16)
    b = torch.randn(E, device=DEV) * 2.0 - 1.0  # many selection scores below 0
    w, ids = moe_router_triton(x, g, b, k, 2.446, True, False, E)
    wr, ir = moe_router_ref(x, g, b, k, 2.446, True, False, append_expert=E)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    logits = torch.randn(T, E, device=DEV)
    logits[0, 7] = float("nan")
    w, ids = router_topk_triton(logits, b, k, 1.0, False)
    exp = torch.sort(torch.sigmoid(logits) + b, dim=-1, descending=True, stable=True)[1][:, :k]
    assert torch.equal(ids.long(), exp) and ids[0, 0] == 7


def test_router_append_expert_ref():
    T, D, E, k = 5, 16, 8, 3
    x, g, b = torch.randn(T, D), torch.randn(E, D), torch.randn(E) * 0.5
    w, ids = moe_router_ref(x, g, b, k, 2.446, True)
    wa, ia = moe_router_ref(x, g, b, k, 2.446, True, append_expert=E)
    assert wa.shape == ia.shape == (T, k + 1) and ia.dtype == torch.int32 and wa.dtype == torch.float32
    assert torch.equal(wa[:, :k], w) and torch.equal(ia[:, :k], ids)
    assert torch.all(wa[:, k] == 1.0) and torch.all(ia[:, k] == E)
    wd, idd = moe_router(x, g, b, k, 2.446, True, append_expert=E)  # dispatch passes it on
    assert idd.shape == (T, k + 1)


@needs_triton
@pytest.mark.parametrize("T", [1, 17, 40])
@pytest.mark.parametrize("k", [1, 3])
def test_router_triton_append_expert(T, k):
    """append_expert: the top-k kernel writes a last column (id, weight 1.0) into a [T, k+1] output."""
    from kernels.moe.router import moe_router_triton

    D, E = 48, 12
    x, g, b = torch.randn(T, D, device=DEV), torch.randn(E, D, device=DEV), torch.randn(E, device=DEV) * 0.3
    for renorm in (True, False):
        w, ids = moe_router_triton(x, g, b, k, 2.446, renorm, False, E)
        wr, ir = moe_router_ref(x, g, b, k, 2.446, renorm, False, append_expert=E)
        assert w.shape == ids.shape == (T, k + 1) and ids.dtype == torch.int32 and w.dtype == torch.float32
        assert w.is_contiguous() and ids.is_contiguous()
        assert torch.equal(ids, ir)
        torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
        assert torch.all(w[:, k] == 1.0) and torch.all(ids[:, k] == E)


@needs_triton
def test_router_ties_lower_index_first():
    from kernels.moe.router import moe_router_triton, router_topk_triton

    # logits with exact ties: expert pairs (0,5), (2,3,7) share a score
    logits = torch.tensor([[1.0, -1.0, 2.0, 2.0, 0.0, 1.0, -3.0, 2.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], device=DEV)
    for k in (1, 3, 5):
        w, ids = router_topk_triton(logits, None, k, 1.0, True)
        # reference on the same logits: stable descending sort
        s = torch.sigmoid(logits)
        exp = torch.sort(s, dim=-1, descending=True, stable=True)[1][:, :k]
        assert torch.equal(ids.long(), exp)
    assert ids[0].tolist() == [2, 3, 7, 0, 5]
    assert ids[1].tolist() == [0, 1, 2, 3, 4]
    # the full path (x @ gate) with duplicated gate rows -> identical logits
    x = torch.randn(5, 32, device=DEV)
    g = torch.randn(4, 32, device=DEV).repeat(2, 1)  # expert e and e+4 tie
    w, ids = moe_router_triton(x, g, None, 3, 1.0, True)
    wr, ir = moe_router_ref(x, g, None, 3, 1.0, True)
    assert torch.equal(ids, ir)


# ------------------------------------------------------------------------------------------------ align
def _check_align(ids, E, BM, sorted_ids, expert_ids, num_post):
    M = ids.numel()
    flat = ids.reshape(-1).long().cpu()
    n = int(num_post.item())
    s = sorted_ids[:n].long().cpu()
    ex = expert_ids[: n // BM].long().cpu()
    counts = torch.bincount(flat, minlength=E)
    assert n == int(((counts + BM - 1) // BM * BM).sum())
    real = s[s < M]
    assert torch.equal(torch.sort(real)[0], torch.arange(M))  # every assignment exactly once
    assert torch.all(s[s >= M] == M)  # padding = sentinel M
    for blk in range(n // BM):
        rows = s[blk * BM:(blk + 1) * BM]
        rows = rows[rows < M]
        assert rows.numel() > 0
        assert torch.all(flat[rows] == ex[blk])
        assert torch.all(rows[1:] > rows[:-1])  # stable within an expert


@needs_triton
@pytest.mark.parametrize("T,k,E,BM", [(1, 2, 8, 16), (17, 3, 8, 16), (40, 2, 8, 32), (5, 1, 256, 16)])
def test_align(T, k, E, BM):
    from kernels.moe.fused import max_padded_size, moe_align

    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).int()
    sorted_ids, expert_ids, num_post = moe_align(ids, E, BM)
    assert sorted_ids.numel() == max_padded_size(T * k, E, BM)
    _check_align(ids, E, BM, sorted_ids, expert_ids, num_post)


@needs_triton
@pytest.mark.parametrize("T,k,E,BM", [(40, 3, 8, 16), (455, 9, 257, 64)])
def test_align_torch_path_matches_kernel(monkeypatch, T, k, E, BM):
    """The single-program align kernel gives the torch path's arrays; (455, 9, 257): M = 4095 at Kimi's 257 stacked
    experts, the kernel's 4096-lane, 16-warp form (ALIGN_SMALL_MAX raised to 8192, an A/B knob)."""
    import kernels.moe.fused as fm

    monkeypatch.setattr(fm, "ALIGN_SMALL_MAX", 8192)
    ids = torch.randint(0, E, (T, k), device=DEV, dtype=torch.int32)
    ids[:, 0] = 2  # a heavy expert
    a = fm.moe_align(ids, E, BM)
    monkeypatch.setattr(fm, "ALIGN_SMALL_MAX", 0)
    monkeypatch.setattr(fm, "ALIGN_CHUNKED", False)
    b = fm.moe_align(ids, E, BM)
    _check_align(ids, E, BM, *b)
    n = int(a[2].item())
    assert torch.equal(a[2], b[2]) and torch.equal(a[0][:n], b[0][:n]) and torch.equal(a[1][: n // BM], b[1][: n // BM])


def test_align_chunked_default_on_cuda_only(monkeypatch):
    """ALIGN_CHUNKED's default (None): prefill-size steps take the chunked Triton align on CUDA tensors and torch ops
    elsewhere (the interpreter would take minutes per step); KIMI_MOE_ALIGN=torch's False keeps torch ops on CUDA."""
    import kernels.moe.fused as fm

    calls = []
    real = fm._moe_align_chunked
    monkeypatch.setattr(fm, "_moe_align_chunked", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fm, "ALIGN_SMALL_MAX", 0)
    ids = torch.randint(0, 8, (3000, 1), dtype=torch.int32, device=DEV)
    for setting, want in ((None, DEV == "cuda"), (False, False)):
        calls.clear()
        monkeypatch.setattr(fm, "ALIGN_CHUNKED", setting)
        _check_align(ids, 8, 16, *fm.moe_align(ids, 8, 16))
        assert bool(calls) == want, (setting, DEV)


@needs_triton
@pytest.mark.parametrize("M,E,BM,chunk", [(700, 8, 16, 64), (3000, 256, 16, 1024), (1000, 257, 64, 128),
                                          (129, 5, 32, 64), (64, 8, 16, 64),
                                          pytest.param(73728, 257, 128, 1024, marks=pytest.mark.skipif(
                                              not HAS_CUDA, reason="an 8k-token step (x 9 ids): CUDA only"))])
def test_align_chunked_equals_torch_path(M, E, BM, chunk, monkeypatch):
    """The chunked Triton align (large M: histograms, plan, per-chunk sort + scatter) gives the torch path's arrays
    bit for bit, sentinels and the block -> expert table past the padded total included; skewed ids, a partial last
    chunk, experts with no rows."""
    import kernels.moe.fused as fm

    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(0, E, (M,), generator=g, dtype=torch.int32)
    ids[: M // 3] = torch.randint(0, max(1, E // 4), (M // 3,), generator=g, dtype=torch.int32)  # heavy experts
    ids = ids[torch.randperm(M, generator=g)].to(DEV)
    monkeypatch.setattr(fm, "ALIGN_SMALL_MAX", 0)
    monkeypatch.setattr(fm, "ALIGN_CHUNK", chunk)
    monkeypatch.setattr(fm, "ALIGN_CHUNKED", True)
    got = fm.moe_align(ids, E, BM)
    monkeypatch.setattr(fm, "ALIGN_CHUNKED", False)
    want = fm.moe_align(ids, E, BM)
    _check_align(ids.view(-1, 1), E, BM, *got)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ fused_moe
def _tol(dtype):
    return 5e-3 if dtype == torch.bfloat16 else 1e-5


@needs_triton
@pytest.mark.parametrize("T", [1, 3, 17, 40])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe(T, k, dtype):
    from kernels.moe.fused import fused_moe_triton

    D, I, E = 64, 32, 8
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, dtype)
    out = fused_moe_triton(x, w13, w2, w, ids)
    assert out.dtype == dtype and out.shape == (T, D)
    # vs the fp32 reference on the same (rounded) inputs; bf16 kernel rounds inter and expert outputs to bf16
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    assert rms_ratio(out, ref32) <= _tol(dtype)
    if dtype == torch.bfloat16:  # vs the HF-like bf16 reference (which rounds more often itself)
        assert rms_ratio(out, fused_moe_ref(x, w13, w2, w, ids)) <= 1e-2


@needs_triton
@pytest.mark.parametrize("case", ["one_expert", "zero_token_experts", "sparse_ids"])
def test_fused_moe_routing_patterns(case):
    from kernels.moe.fused import fused_moe_triton

    T, D, I, E, k = 20, 32, 32, 8, 2
    if case == "one_expert":  # all tokens to expert 5 (both slots: duplicate ids must also work)
        ids = torch.full((T, k), 5, device=DEV)
    elif case == "zero_token_experts":  # only experts 1 and 6 used
        ids = torch.stack([torch.tensor([1, 6]), torch.tensor([6, 1])] * (T // 2)).to(DEV)
    else:  # E larger than the number of assignments; top expert E-1
        E = 64
        ids = torch.stack([torch.tensor([E - 1, t % 7]) for t in range(T)]).to(DEV)
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.float32, ids=ids)
    out = fused_moe_triton(x, w13, w2, w, ids)
    assert rms_ratio(out, fused_moe_ref(x, w13, w2, w, ids)) <= 1e-5


@needs_triton
@pytest.mark.parametrize("T", [1, 5, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_always_on_extra_expert(T, dtype):
    """The model's folded shared expert: E routed experts plus expert E that every token uses with weight 1.0
    (last column), so one expert gets all T tokens while the others get a few; vs the reference and vs routed +
    a separate dense expert."""
    from kernels.moe.fused import fused_moe_triton

    D, I, E, k = 64, 32, 8, 3
    x, w13, w2, w, ids = make_moe(T, D, I, E + 1, k, dtype,
                                  ids=torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEV))
    ids = torch.cat([ids, torch.full((T, 1), E, dtype=torch.int32, device=DEV)], dim=1)
    w = torch.cat([w, torch.ones(T, 1, device=DEV)], dim=1)
    out = fused_moe_triton(x, w13, w2, w, ids)
    assert out.dtype == dtype and out.shape == (T, D)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    assert rms_ratio(out, ref32) <= _tol(dtype)
    # the same sum as routed experts plus the extra expert on its own (fp32 operands)
    routed = fused_moe_ref(x.float(), w13[:E].float(), w2[:E].float(), w[:, :k], ids[:, :k])
    h = x.float() @ w13[E].float().T
    dense = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[E].float().T
    assert rms_ratio(ref32, routed + dense) <= 1e-5
    assert torch.equal(out, fused_moe_triton(x, w13, w2, w, ids))


@needs_triton
def test_fused_moe_nan_prefill_and_deterministic():
    from kernels.moe.fused import fused_moe_triton

    T, D, I, E, k = 17, 64, 32, 8, 3
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.bfloat16)
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    fused_moe_triton(x, w13, w2, w, ids, out=out)
    assert torch.isfinite(out).all()
    again = fused_moe_triton(x, w13, w2, w, ids)
    assert torch.equal(out, again)


@needs_triton
@pytest.mark.parametrize("bm", [32, 64])
def test_fused_moe_other_tiles_and_torch_align(bm, monkeypatch):
    import kernels.moe.fused as fm

    T, D, I, E, k = 40, 48, 24, 8, 3
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.float32)
    cfg = fm.MoEConfig(bm, 16, 32, 32 if bm == 32 else 16, 4, 2)  # D=48, I=24: K and N tails (bm=32)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    out = fm.fused_moe_triton(x, w13, w2, w, ids, config=cfg)
    assert rms_ratio(out, ref) <= 1e-5
    monkeypatch.setattr(fm, "ALIGN_SMALL_MAX", 0)
    out2 = fm.fused_moe_triton(x, w13, w2, w, ids, config=cfg)
    assert torch.equal(out, out2)


@needs_triton
@pytest.mark.parametrize("pattern", ["spread", "one_heavy", "all_one"])
@pytest.mark.parametrize("T,k", [(1, 9), (3, 5), (11, 3)])
def test_fused_moe_rows_from_ids_equal_align(pattern, T, k, monkeypatch):
    """Decode sizes (M <= ALIGN_IN_GEMM_MAX): the GEMM programs derive their rows from the ids; bit-identical to the
    moe_align path, also when one expert spans several BLOCK_M blocks (one_heavy / all_one at M = 33 > 16)."""
    import kernels.moe.fused as fm

    D, I, E = 32, 16, 12
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).int()
    if pattern == "one_heavy":
        ids[:, 0] = 4
    elif pattern == "all_one":
        ids = torch.full((T, k), 7, dtype=torch.int32, device=DEV)
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.float32, ids=ids)
    M = T * k
    monkeypatch.setattr(fm, "ALIGN_IN_GEMM_MAX", max(M, 32))
    out = fm.fused_moe_triton(x, w13, w2, w, ids)
    assert rms_ratio(out, fused_moe_ref(x, w13, w2, w, ids)) <= 1e-5
    monkeypatch.setattr(fm, "ALIGN_IN_GEMM_MAX", 0)
    assert torch.equal(out, fm.fused_moe_triton(x, w13, w2, w, ids))
    cfg = fm.get_config(M, E, x.dtype, k, fm.num_sms(x.device), I, D)  # the same through MoEConfig.ids_rows
    assert torch.equal(out, fm.fused_moe_triton(x, w13, w2, w, ids, config=fm.replace(cfg, ids_rows=M)))


def test_balanced_tiles_and_decode_config():
    """Decode N tile counts from shapes: batch 1 (9 blocks) on 132 SMs -> 44 tiles per block, 396 programs = 3 per
    SM for both GEMMs (BN-wide: 288 / 324 programs, a third tile on 24 / 60 SMs only)."""
    from kernels.moe.fused import balanced_tiles, expected_blocks, get_config

    assert expected_blocks(9, 257, 9) == 9 and expected_blocks(8, 256, 8) == 8
    assert 60 <= expected_blocks(72, 257, 9) <= 66
    assert balanced_tiles(1024, 32, 9, 132) == 44 and balanced_tiles(2304, 64, 9, 132) == 44
    for N, BN, blocks, sms in [(1024, 32, 9, 132), (1024, 64, 64, 132), (2304, 64, 17, 132), (1024, 16, 33, 114)]:
        lo = -(-N // BN)
        nt = balanced_tiles(N, BN, blocks, sms) or lo
        assert lo <= nt <= 2 * lo and -(-N // nt) <= BN
        busiest = lambda t: -(-blocks * t // sms) / t  # noqa: E731 - busiest SM's share of one block's columns
        assert busiest(nt) <= busiest(lo) and busiest(nt) >= blocks / sms
    assert balanced_tiles(1024, 64, 33, 132) == 0  # 16 BN-wide tiles are already even (528 = 4 x 132)
    c = get_config(9, 257, torch.bfloat16, 9, 132)
    assert (c.BM, c.nt1, c.nt2, c.split2) == (16, 44, 44, 1)
    assert get_config(9, 257, torch.bfloat16) == get_config(9, 257, torch.bfloat16, None, 132)  # no top_k: BN-wide
    assert get_config(8192 * 9, 257, torch.bfloat16, 9).nt1 == 0  # prefill unchanged


def test_decode_l2_blocks(monkeypatch):
    """DECODE_L2_BLOCKS = 1 (the router-hinted shared expert): one token's GEMM1 balances the 8 routed blocks (33
    tiles each: 264 programs, 2 per SM); GEMM2 and larger batches keep their tiles."""
    import kernels.moe.fused as fm

    base1, base8 = fm.get_config(9, 257, torch.bfloat16, 9, 132), fm.get_config(72, 257, torch.bfloat16, 9, 132)
    monkeypatch.setattr(fm, "DECODE_L2_BLOCKS", 1)
    c1, c8 = fm.get_config(9, 257, torch.bfloat16, 9, 132), fm.get_config(72, 257, torch.bfloat16, 9, 132)
    assert fm.balanced_tiles(1024, 32, 8, 132) == 33
    assert (c1.nt1, c1.nt2) == (33, base1.nt2) and c8 == base8


def test_decode_switches(monkeypatch):
    """KIMI_MOE_DIRECT / KIMI_MOE_PDL (module flags): direct rows only at one token (M == top_k), PDL / prefetch of
    GEMM2's whole K / evict_first on every BLOCK_M-16 decode config, prefill configs untouched."""
    import kernels.moe.fused as fm

    monkeypatch.setattr(fm, "DECODE_DIRECT", True)
    monkeypatch.setattr(fm, "DECODE_PDL", True)
    monkeypatch.setattr(fm, "DECODE_PREFETCH", True)
    monkeypatch.setattr(fm, "DECODE_EVICT", True)
    c1, c8 = fm.get_config(9, 257, torch.bfloat16, 9, 132), fm.get_config(72, 257, torch.bfloat16, 9, 132)
    assert c1.direct and not c8.direct and c1.pdl and c8.pdl and c1.prefetch2 == c8.prefetch2 == 1024 and c1.evict
    assert not c1.pdl1
    assert c1.nt1 == 44 and c8.BM == 16
    pre = fm.get_config(8192 * 9, 257, torch.bfloat16, 9, 132)
    assert not (pre.direct or pre.pdl or pre.evict or pre.prefetch2)
    assert not fm.get_config(9, 257, torch.bfloat16).direct  # no top_k: no switches
    monkeypatch.setattr(fm, "DECODE_PREFETCH_K", 128)                          # the head of each row only
    assert fm.get_config(9, 257, torch.bfloat16, 9, 132).prefetch2 == 128
    monkeypatch.setattr(fm, "DECODE_PREFETCH_K", 4096)                         # capped at the row
    assert fm.get_config(9, 257, torch.bfloat16, 9, 132).prefetch2 == 1024
    monkeypatch.setattr(fm, "DECODE_PDL", False)                               # one token: PDL by DECODE_PDL_T1
    monkeypatch.setattr(fm, "DECODE_PREFETCH_K", 0)
    assert fm.get_config(9, 257, torch.bfloat16, 9, 132).prefetch2 == 1024
    monkeypatch.setattr(fm, "DECODE_PREFETCH", False)
    assert fm.get_config(9, 257, torch.bfloat16, 9, 132).prefetch2 == 0


def test_decode_defaults(monkeypatch):
    """Defaults (no env): one token gets the H200-measured chain (direct rows, GEMM1 3 stages, GEMM2 4, PDL without
    prefetch); T = 8 keeps the plain config; KIMI_MOE_PDL=0 / KIMI_MOE_DIRECT=0 (flags off) restore the old T = 1."""
    import kernels.moe.fused as fm

    for name, val in (("DECODE_DIRECT", True), ("DECODE_PDL", False), ("DECODE_PDL_T1", True),
                      ("DECODE_PREFETCH", False), ("DECODE_EVICT", False), ("DECODE_PDL1", False)):
        monkeypatch.setattr(fm, name, val)
    c1, c8 = fm.get_config(9, 257, torch.bfloat16, 9, 132), fm.get_config(72, 257, torch.bfloat16, 9, 132)
    assert c1.direct and c1.pdl and c1.prefetch2 == 0 and (c1.num_stages, c1.stages2) == (3, 4)
    assert not (c8.direct or c8.pdl) and c8.num_stages == 4 and c8.stages2 == 0
    f32 = fm.get_config(9, 257, torch.float32, 9, 132)
    assert f32.num_stages == 2 and f32.stages2 == 2
    monkeypatch.setattr(fm, "DECODE_PDL_T1", False)
    monkeypatch.setattr(fm, "DECODE_DIRECT", False)
    c1 = fm.get_config(9, 257, torch.bfloat16, 9, 132)
    assert not (c1.direct or c1.pdl) and c1.num_stages == 4 and c1.stages2 == 0


def _gemm_cfgs():
    from kernels.moe.fused import MoEConfig

    return [MoEConfig(16, 16, 32, 16, 4, 2, nt1=3, nt2=5),                         # ragged N tiles (I=24, D=48)
            MoEConfig(16, 32, 32, 16, 4, 2, nt2=2, split2=2),                      # split-K, 2 K steps per split
            MoEConfig(16, 32, 64, 32, 4, 2, split2=3, BK2=16, warps2=4, stages2=3),  # 3 splits of 1 step (K=24 ->
            MoEConfig(16, 16, 16, 32, 4, 2, nt1=2, nt2=4, split2=4, BK2=16),         # 2 steps: S <= steps); K tail
            MoEConfig(16, 16, 32, 16, 4, 2, nt1=3, nt2=5, direct=True),            # one block per assignment
            MoEConfig(16, 32, 32, 16, 4, 2, nt2=2, split2=2, direct=True, evict=True)]


@needs_triton
@pytest.mark.parametrize("T,k", [(1, 9), (13, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_ragged_tiles_and_split_k(T, k, dtype):
    """Ragged N tiles and GEMM2 split-K (fp32 partials summed by the combine kernel) vs the fp32 reference, with the
    rows from the ids (M <= 32) and from moe_align (M = 52); bit-identical when run again (no atomics)."""
    from kernels.moe.fused import fused_moe_triton

    D, I, E = 48, 24, 12
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, dtype)
    if T > 1:
        ids[:, 0] = 3  # one expert in every token (the folded shared expert's pattern; > BLOCK_M rows at T = 13)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    for cfg in _gemm_cfgs():
        out = fused_moe_triton(x, w13, w2, w, ids, config=cfg)
        assert rms_ratio(out, ref32) <= _tol(dtype), cfg
        if cfg.split2 > 1:
            assert torch.equal(out, fused_moe_triton(x, w13, w2, w, ids, config=cfg)), cfg


@needs_triton
@pytest.mark.parametrize("T,k", [(1, 9), (4, 3)])
def test_direct_rows(T, k):
    """Direct rows (one block per assignment, expert ids[b]): at T = 1 (distinct ids) the same blocks as the grouped
    layout, so bit-identical to it; with repeated experts (T = 4, expert 2 in every token) still the reference."""
    import kernels.moe.fused as fm

    D, I, E = 32, 48, 10
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.bfloat16)
    if T > 1:
        ids[:, 0] = 2
    ids = ids[:, torch.randperm(k)]  # unsorted ids: block b keeps assignment b's row, whatever its expert
    rows = fm.moe_rows(ids, E, 16, direct=True)
    assert rows.max_blocks == T * k and rows.ids_block < 0
    cfg = fm.MoEConfig(16, 16, 32, 16, 4, 2, nt1=4, nt2=1)
    out = fm.fused_moe_triton(x, w13, w2, w, ids, config=fm.replace(cfg, direct=True))
    assert rms_ratio(out, fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)) <= _tol(torch.bfloat16)
    if T == 1:
        assert torch.equal(out, fm.fused_moe_triton(x, w13, w2, w, ids, config=cfg))


@needs_triton
def test_gemm2_split_partials():
    """moe_gemm2 with split2 = S: fp32 partials [S, M, D] (no empty split: 4 K steps in split2 3 -> 2 splits of 2)
    whose split-order sum is the one-split y (fp32 operands: equal up to summation order); the combine sums them in
    split order and rounds each expert output to out's dtype before weighting it (as the one-split y is stored)."""
    import kernels.moe.fused as fm

    T, k, D, I, E = 3, 3, 32, 64, 6
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, torch.float32)
    rows = fm.moe_rows(ids, E, 16)
    one = fm.MoEConfig(16, 32, 32, 16, 4, 2)
    inter = fm.moe_gemm1(x, w13, rows, one)
    y = fm.moe_gemm2(inter, w2, rows, one)
    assert y.shape == (T * k, D) and y.dtype == torch.float32
    assert fm.moe_gemm2(inter, w2, rows, fm.MoEConfig(16, 32, 32, 16, 4, 2, split2=3)).shape == (2, T * k, D)
    p = fm.moe_gemm2(inter, w2, rows, fm.MoEConfig(16, 32, 32, 16, 4, 2, split2=4))
    assert p.shape == (4, T * k, D) and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(0), y, rtol=1e-5, atol=1e-5)
    psum = ((p[0] + p[1]) + p[2]) + p[3]
    for dt in (torch.float32, torch.bfloat16):
        out = fm.moe_combine(p, w, torch.empty(T, D, device=DEV, dtype=dt))
        yr = psum.to(dt).float().view(T, k, D)
        exp = torch.zeros(T, D, device=DEV)
        for j in range(k):  # the kernel's order: j ascending, fp32
            exp += w[:, j, None] * yr[:, j]
        if INTERPRET:  # same operations in the same order (the GPU may fuse multiply-adds)
            assert torch.equal(out, exp.to(dt))
        else:
            torch.testing.assert_close(out.float(), exp.to(dt).float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-5,
                                       atol=1e-5)


def test_bench_sweep_decode_smoke():
    """bench/moe.py --sweep-decode code paths (candidate lists, routings, timing loop, the combine variants) at tiny
    shapes in a subprocess (CPU: interpreter, eager timing)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0" if HAS_CUDA else "1")
    r = subprocess.run([sys.executable, "bench/moe.py", "--sweep-decode", "--smoke"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("<- get_config") == 4 and "combine split2=4" in r.stdout, r.stdout[-2000:]


@needs_triton
def test_fused_moe_empty():
    from kernels.moe.fused import fused_moe_triton

    x, w13, w2, w, ids = make_moe(0, 32, 16, 8, 2, torch.float32)
    assert fused_moe_triton(x, w13, w2, w, ids).shape == (0, 32)


@needs_triton
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_add_norm(T, dtype, monkeypatch):
    """fused_moe_add_norm (the model's PendingMoE path: GEMM1 + GEMM2, then kernels.norm.combine_add_rmsnorm) ==
    fused_moe_triton then add_rmsnorm_triton (the combine and the norm in their own kernels) bit for bit, row-strided
    residual; CPU tensors without forced Triton take the torch references."""
    import kernels._dispatch as d
    from kernels.moe import fused_moe_add_norm
    from kernels.moe.fused import fused_moe_triton
    from kernels.norm import add_rmsnorm_ref, add_rmsnorm_triton

    monkeypatch.setattr(d, "_FORCE", "triton")
    D, I, E, k = 64, 32, 8, 3
    x, w13, w2, w, ids = make_moe(T, D, I, E, k, dtype)
    r = (torch.randn(T, 2 * D, device=DEV) * 3).to(dtype)[:, D:]
    nw = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    xn, h = fused_moe_add_norm(x, w13, w2, w, ids, r, nw, 1e-6)
    xn2, h2 = add_rmsnorm_triton(fused_moe_triton(x, w13, w2, w, ids), r, nw, 1e-6)
    assert xn.dtype == h.dtype == dtype and xn.shape == h.shape == (T, D)
    assert torch.equal(h, h2) and torch.equal(xn, xn2)
    if DEV == "cpu":
        monkeypatch.setattr(d, "_FORCE", "ref")
        xr, hr = fused_moe_add_norm(x, w13, w2, w, ids, r, nw, 1e-6)
        want = add_rmsnorm_ref(fused_moe_ref(x, w13, w2, w, ids), r, nw, 1e-6)
        assert torch.equal(xr, want[0]) and torch.equal(hr, want[1])
        assert rms_ratio(h, hr) <= _tol(dtype)


# ------------------------------------------------------------------------------------------------ GPU, Kimi shapes
KIMI = dict(D=2304, I=1024, E=256, k=8, scale=2.446)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_kimi_router_gpu(T):
    D, E, k = KIMI["D"], KIMI["E"], KIMI["k"]
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    g = (torch.randn(E, D, device="cuda") / D**0.5).to(torch.bfloat16)
    b = torch.randn(E, device="cuda") * 0.05
    w, ids = moe_router(x, g, b, k, KIMI["scale"], True)
    wr, ir = moe_router_ref(x, g, b, k, KIMI["scale"], True)
    # ids must match except where the k-th / (k+1)-th selection scores are within fp32 summation noise
    sel = torch.sigmoid(x.float() @ g.float().T) + b
    top = torch.sort(sel, dim=-1, descending=True)[0]
    clear = (top[:, k - 1] - top[:, k]) > 1e-5
    same = (ids == ir).all(-1)
    assert bool(same[clear].all())
    torch.testing.assert_close(w[same], wr[same], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_kimi_fused_moe_gpu(T):
    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"], KIMI["k"]
    x, w13, w2, _, _ = make_moe(T, D, I, E, k, torch.bfloat16, "cuda", ids=torch.zeros(T, k, dtype=torch.long))
    g = (torch.randn(E, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w, ids = moe_router(x, g, torch.randn(E, device="cuda") * 0.05, k, KIMI["scale"], True)
    out = fused_moe(x, w13, w2, w, ids)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    assert rms_ratio(out, ref32) <= 5e-3
    assert rms_ratio(out, fused_moe_ref(x, w13, w2, w, ids)) <= 1e-2
    assert torch.equal(out, fused_moe(x, w13, w2, w, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_kimi_fused_moe_shared_expert_gpu(T):
    """The model's unsharded path: the shared expert stacked as expert E, appended by the router to every token."""
    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"], KIMI["k"]
    x, w13, w2, _, _ = make_moe(T, D, I, E + 1, k, torch.bfloat16, "cuda", ids=torch.zeros(T, k, dtype=torch.long))
    g = (torch.randn(E, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w, ids = moe_router(x, g, torch.randn(E, device="cuda") * 0.05, k, KIMI["scale"], True, append_expert=E)
    assert ids.shape == (T, k + 1) and bool((ids[:, k] == E).all()) and bool((w[:, k] == 1.0).all())
    out = fused_moe(x, w13, w2, w, ids)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    assert rms_ratio(out, ref32) <= 5e-3
    assert torch.equal(out, fused_moe(x, w13, w2, w, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 3000])
def test_kimi_fused_moe_cuda_graph(T):
    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"], KIMI["k"]
    x, w13, w2, _, _ = make_moe(T, D, I, E, k, torch.bfloat16, "cuda", ids=torch.zeros(T, k, dtype=torch.long))
    g = (torch.randn(E, D, device="cuda") / D**0.5).to(torch.bfloat16)
    b = torch.randn(E, device="cuda") * 0.05

    def step(inp):
        w, ids = moe_router(inp, g, b, k, KIMI["scale"], True)
        return fused_moe(inp, w13, w2, w, ids)

    step(x)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    x2 = torch.randn_like(x)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step(x2))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_kimi_decode_configs_gpu(T):
    """The --sweep-decode candidates at Kimi shapes (E = 257 with the folded shared expert): ragged balanced N tiles,
    BK 256, GEMM2 split-K; vs the fp32 reference, and bit-identical when run again."""
    from kernels._tensors import num_sms
    from kernels.moe.fused import expected_blocks, fused_moe_triton
    from tests.bench_module import load_bench

    bench = load_bench("moe")
    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"] + 1, KIMI["k"] + 1
    x, w13, w2, _, _ = make_moe(T, D, I, E, k, torch.bfloat16, "cuda", ids=torch.zeros(T, k, dtype=torch.long))
    g = (torch.randn(E - 1, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w, ids = moe_router(x, g, torch.randn(E - 1, device="cuda") * 0.05, k - 1, KIMI["scale"], True,
                        append_expert=E - 1)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    g1, g2 = bench._decode_candidates(T * k, expected_blocks(T * k, E, k), num_sms("cuda"))
    # the direct-rows twins differ only in where the rows come from: three of each list (compile time)
    g1 = [c for c in g1 if not c.direct] + [c for c in g1 if c.direct][:3]
    g2 = [c for c in g2 if not c.direct] + [c for c in g2 if c.direct][:3]
    for i in range(max(len(g1), len(g2))):  # every candidate of both lists (~40 compiles at T = 1)
        c1, c2 = g1[i % len(g1)], g2[i % len(g2)]
        cfg = bench._merge(c1, c2, c1.direct)
        out = fused_moe_triton(x, w13, w2, w, ids, config=cfg)
        assert rms_ratio(out, ref32) <= 5e-3, cfg
        assert torch.equal(out, fused_moe_triton(x, w13, w2, w, ids, config=cfg)), cfg
    assert torch.equal(fused_moe_triton(x, w13, w2, w, ids), fused_moe(x, w13, w2, w, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_kimi_pdl_gpu(T):
    """PDL path (GEMM1 signals at once, GEMM2 computes its rows and prefetches its weight rows into L2 before
    griddepcontrol.wait, the combine waits too; also with evict_first weight loads and a PDL GEMM1 prefetching expert
    E - 1): bit-identical to the same tiles without PDL, eager and replayed in a CUDA graph (programmatic edges), with
    inter / y / out buffers reused between layers as the model does."""
    from dataclasses import replace

    from kernels.moe.fused import fused_moe_triton, get_config

    D, I, E, k = KIMI["D"], KIMI["I"], KIMI["E"] + 1, KIMI["k"] + 1
    x, w13, w2, w, _ = make_moe(T, D, I, E, k, torch.bfloat16, "cuda")
    ids = torch.cat([torch.stack([torch.randperm(E - 1, device="cuda")[:k - 1] for _ in range(T)]),
                     torch.full((T, 1), E - 1, device="cuda")], 1).to(torch.int32)
    ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    base = get_config(T * k, E, torch.bfloat16, k)
    for cfg in [base, replace(base, direct=T == 1), replace(base, ids_rows=256)]:
        exp = fused_moe_triton(x, w13, w2, w, ids, config=cfg)
        assert rms_ratio(exp, ref32) <= 5e-3
        for pf, ev, p1 in ((0, False, False), (I, False, False), (I, True, False), (I, True, True)):
            c = replace(cfg, pdl=True, prefetch2=pf, evict=ev, pdl1=p1)
            assert torch.equal(fused_moe_triton(x, w13, w2, w, ids, config=c), exp), c
            # a graph of 4 dependent layers (each layer's output is the next one's input) vs the same eagerly
            outs = [torch.empty(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

            def layers():
                h = x
                for o in outs:
                    h = fused_moe_triton(h, w13, w2, w, ids, out=o, config=c)

            layers()
            want = [o.clone() for o in outs]
            for o in outs:
                o.zero_()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            for o, wo in zip(outs, want):
                assert torch.equal(o, wo), c


@needs_triton
def test_pdl_config_host_path():
    """pdl / prefetch2 configs through the host code (the interpreter has no griddepcontrol: GDC off there, so the
    result is the non-PDL one exactly); the PDL kernels themselves run in test_kimi_pdl_gpu."""
    from dataclasses import replace

    from kernels.moe.fused import MoEConfig, fused_moe_triton

    x, w13, w2, w, ids = make_moe(1, 32, 48, 10, 9, torch.bfloat16)
    cfg = MoEConfig(16, 16, 32, 16, 4, 2, nt1=4, nt2=1, direct=True)
    exp = fused_moe_triton(x, w13, w2, w, ids, config=cfg)
    assert rms_ratio(exp, fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)) <= _tol(torch.bfloat16)
    for pf in (0, 48):
        assert torch.equal(fused_moe_triton(x, w13, w2, w, ids, config=replace(cfg, pdl=True, prefetch2=pf)), exp)


def test_get_config_memo(monkeypatch):
    """get_config is memoised (the same object again) and its table stays bounded; a switch it reads is part of the
    key (a --set A/B or a test's monkeypatch takes effect)."""
    import kernels.moe.fused as fm

    monkeypatch.setattr(fm, "_CONFIGS", {})
    a = fm.get_config(9 * 700, 257, torch.bfloat16, 9, 132)
    assert fm.get_config(9 * 700, 257, torch.bfloat16, 9, 132) is a
    for T in range(1, 9000):
        fm.get_config(9 * T, 257, torch.bfloat16, 9, 132)
    assert 0 < len(fm._CONFIGS) <= 8192
    assert fm.get_config(9 * 700, 257, torch.bfloat16, 9, 132) == a
    one = fm.get_config(9, 257, torch.bfloat16, 9, 132)
    monkeypatch.setattr(fm, "DECODE_DIRECT", not fm.DECODE_DIRECT)
    assert fm.get_config(9, 257, torch.bfloat16, 9, 132).direct != one.direct
