"""Fused absorbed-MLA decode (kernels/mla/absorb.py) vs the unfused chain rmsnorm_head + store_latent + einsum +
mla_decode + einsum: mla_decode_prep (q_lat and the cache rows in one launch) and mla_decode(..., w_uv=) (the split
merge fused with the W_UV product; num_splits 1 and fused-merge configs read stage 1's latent rows instead).

CPU (interpreter): TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mla_fused_decode.py -q
GPU (Kimi shapes): python -m pytest tests/kernels/test_mla_fused_decode.py -q -m gpu
"""
import os

import pytest
import torch

from kernels.mla.absorb import mla_decode_prep_ref, mla_decode_prep_triton, mla_decode_uv_ref, uv_config
from kernels.mla.cache import store_latent_triton
from kernels.mla.decode import DECODE_VARIANTS, mla_decode_triton
from kernels.norm import rmsnorm_head_ref, rmsnorm_head_triton
from tests.kernels.conftest import run_offline
from tests.kernels.test_mla import check_close, make_paged

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
BF = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_triton():
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("Triton MLA kernels need CUDA or TRITON_INTERPRET=1")


def bits(t):
    return t.contiguous().view(torch.int16)


def ulp_close(a, b, ulps=1, frac=0.0):
    """bf16 tensors equal to within `ulps` units in the last place (integer distance of the sign-magnitude bit
    patterns; NaNs compare by bits). frac > 0 (GPU, Kimi shapes: another summation order than cuBLAS over 128-512
    terms): up to that fraction of the values may differ more -- results that cancel to far below their terms, where
    an fp32 rounding is more than a bf16 ulp -- but by no more than 2^-8 of max |b|."""
    ia, ib = bits(a).int(), bits(b).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> monotone integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (ia - ib).abs()
    bad = d > ulps
    assert bad.sum() <= frac * d.numel(), f"{bad.sum().item()} values differ by > {ulps} ulp (max {d.max().item()})"
    if bad.any():
        fa, fb = a.float()[bad], b.float()[bad]
        assert ((fa - fb).abs() <= b.float().abs().max() * 2 ** -8).all()


def make_layer(T, H, nope, R, L, V, dtype=BF, device=DEV):
    """y [T, H*(nope+R) + L + R] (y's latent part scaled away from 1 so the norm matters), kv_a norm weight,
    kv_b_proj weight views w_uk [H, nope, L], w_uv [H, V, L]."""
    q_dim = H * (nope + R)
    y = torch.randn(T, q_dim + L + R, device=device)
    y[:, q_dim:q_dim + L] *= 3.0
    w_norm = (1 + 0.1 * torch.randn(L, device=device)).to(dtype)
    kv_b = (torch.randn(H * (nope + V), L, device=device) / L ** 0.5).to(dtype).view(H, nope + V, L)
    return y.to(dtype), q_dim, w_norm, kv_b[:, :nope], kv_b[:, nope:]


def chain_prep(y, q_dim, w_norm, eps, w_uk, cache, slots, triton_ops=True):
    """The unfused head of the chain: rmsnorm_head + store_latent (Triton, or refs) + einsum -> q_lat."""
    H, nope, L = w_uk.shape
    lat = y[:, q_dim:]
    if triton_ops:
        store_latent_triton(rmsnorm_head_triton(lat, w_norm, eps, pdl=False), cache, slots)
    else:
        from kernels.mla.ref import store_latent_ref

        store_latent_ref(rmsnorm_head_ref(lat, w_norm, eps), cache, slots)
    q_nope = y[:, :q_dim].view(y.shape[0], H, -1)[..., :nope]
    return torch.einsum("thn,hnl->thl", q_nope, w_uk)


# T = 1 and T = 3 with a padded lane (slot -1); shuffled pages (make_paged), NaN everywhere unowned
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("H", [2, 3])
def test_prep_matches_chain(T, H):
    torch.manual_seed(T * 10 + H)
    nope, R, L, V, eps = 32, 16, 64, 32, 1e-6
    y, q_dim, w_norm, w_uk, _ = make_layer(T, H, nope, R, L, V)
    cache, bt, sl = make_paged([70, 5, 1][:T], BF, bs=16, l=L, r=R)
    slots = torch.tensor([bt[i, 0].item() * 16 + 3 + 5 * i for i in range(T)], dtype=torch.int64, device=DEV)
    if T == 3:
        slots[1] = -1
    c_chain, c_fused = cache.clone(), cache.clone()
    q_chain = chain_prep(y, q_dim, w_norm, eps, w_uk, c_chain, slots)
    q_fused = torch.full((T, H, L), float("nan"), dtype=BF, device=DEV)
    mla_decode_prep_triton(y, q_dim, w_norm, eps, w_uk, c_fused, slots, out=q_fused)
    ulp_close(q_fused, q_chain)
    check_close(q_fused, torch.einsum("thn,hnl->thl", y[:, :q_dim].view(T, H, -1)[..., :nope].float(),
                                      w_uk.float()), BF)
    # cache rows bitwise (same norm helpers / reduction), every other row (NaN or data) untouched
    assert torch.equal(bits(c_fused), bits(c_chain))
    flat, before = c_fused.view(-1, L + R), cache.view(-1, L + R)
    keep = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
    keep[slots[slots >= 0]] = False
    assert torch.equal(bits(flat[keep]), bits(before[keep]))
    # the torch reference (the CPU path): rows to bf16 rounding (rsqrt of the mean vs 1 / sqrt(sum / L), each
    # rounded twice), same q_lat
    c_ref = cache.clone()
    q_ref = mla_decode_prep_ref(y, q_dim, w_norm, eps, w_uk, c_ref, slots)
    torch.testing.assert_close(c_ref.float(), c_chain.float(), rtol=2 ** -6, atol=1e-6, equal_nan=True)
    ulp_close(q_fused, q_ref)


def test_prep_many_tokens_loops():
    """T = 20 > BLOCK_T (token loop) and > the 8 programs (norm programs take several tokens); L = 96 (masked
    columns of the last L block)."""
    torch.manual_seed(1)
    T, H, nope, R, L, V, eps = 20, 2, 24, 8, 96, 16, 1e-5
    y, q_dim, w_norm, w_uk, _ = make_layer(T, H, nope, R, L, V)
    cache = torch.full((6, 8, L + R), float("nan"), dtype=BF, device=DEV)
    slots = torch.randperm(6 * 8, device=DEV)[:T]
    slots[[0, 7, 19]] = -1
    c_chain, c_fused = cache.clone(), cache.clone()
    q_chain = chain_prep(y, q_dim, w_norm, eps, w_uk, c_chain, slots)
    q_fused = mla_decode_prep_triton(y, q_dim, w_norm, eps, w_uk, c_fused, slots, block_l=16)
    ulp_close(q_fused, q_chain)
    assert torch.equal(bits(c_fused), bits(c_chain))


def chain_decode(q_lat, q_pe, cache, bt, sl, scale, w_uv, **kw):
    out_lat = mla_decode_triton(q_lat, q_pe, cache, bt, sl, scale, **kw)
    return torch.einsum("thl,hvl->thv", out_lat, w_uv)


# lengths 1, 63, 65 and a padded lane (0); splits off (direct: the latent-row read), a few, many one-tile units; the
# small-smem tiles; V in two blocks; sequence groups + 2-unit merge steps; stage 2 kept (uv_cfg stage2) with the
# product on its rows
@pytest.mark.parametrize("num_splits,variant,uv", [
    (1, None, None), (3, None, None), (16, None, None), (3, "w4 n32", None), (16, None, dict(block_v=16)),
    (3, None, dict(block_v=32, groups=2, block_s=2)), (1, None, dict(block_v=16, groups=3)), (3, None, dict(stage2=1))])
def test_decode_uv_matches_chain(num_splits, variant, uv):
    torch.manual_seed(num_splits)
    H, L, R, V, scale = 3, 64, 16, 32, 0.2
    lens = [1, 63, 65, 0]
    N = len(lens)
    cache, bt, sl = make_paged(lens, BF, bs=16, l=L, r=R)
    q = torch.randn(N, H, L, device=DEV).to(BF)
    qp = torch.randn(N, H + 1, R, device=DEV).to(BF)[:, 1:]  # strided q_pe, as the model's view of y
    _, _, _, _, w_uv = make_layer(1, H, 32, R, L, V)
    cfg = DECODE_VARIANTS[variant] if variant else None
    kw = dict(num_splits=num_splits, min_split_tokens=16, config=cfg)
    before = cache.clone()
    ref = chain_decode(q, qp, cache, bt, sl, scale, w_uv, **kw)
    out = torch.full((N, H, V), float("nan"), dtype=BF, device=DEV)
    res = mla_decode_triton(q, qp, cache, bt, sl, scale, out=out, w_uv=w_uv, uv_cfg=uv, **kw)
    assert res is out
    ulp_close(out, ref)
    check_close(out, mla_decode_uv_ref(q.float(), qp.float(), cache.float(), bt, sl, scale, w_uv.float()), BF)
    assert (out[-1] == 0).all()  # padded lane
    assert torch.equal(bits(cache), bits(before))


@pytest.mark.parametrize("num_splits,units", [(1, 32), (3, 32), (16, 5)])
def test_early_tiles_same_bits_any_device(num_splits, units, monkeypatch):
    """decode.EARLY_TILES' code before the PDL wait (each unit's block-table reads and L2 hint addresses, for units
    < EARLY_UNITS) run without PDL (the interpreter has none; it skips the hint instruction itself): in-bounds, and
    the outputs the same bits as without it. Lengths 1, 63, 65 and a padded lane; one-tile units past EARLY_UNITS."""
    import kernels.mla.decode as dec

    monkeypatch.setattr(dec, "_EARLY_WITHOUT_GDC", True)
    monkeypatch.setattr(dec, "EARLY_UNITS", units)
    torch.manual_seed(num_splits)
    H, L, R, scale = 3, 64, 16, 0.2
    lens = [1, 63, 65, 0]
    cache, bt, sl = make_paged(lens, BF, bs=16, l=L, r=R)
    q = torch.randn(len(lens), H, L, device=DEV).to(BF)
    qp = torch.randn(len(lens), H, R, device=DEV).to(BF)
    outs = []
    for early in (0, 2):
        monkeypatch.setattr(dec, "EARLY_TILES", early)
        outs.append(mla_decode_triton(q, qp, cache, bt, sl, scale, num_splits=num_splits, min_split_tokens=16))
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    assert torch.isfinite(outs[0]).all()


def test_decode_uv_gpu_default_tiles():
    """The GPU-default decode tiles (64-key page tiles, latent halves) and uv default picks, one long sequence
    split into many one-tile units, Kimi-like head dims at H=2; and the chunk loop of a wide V block (block_v 64 =
    two UV_VC chunks)."""
    if HAS_CUDA:
        pytest.skip("covered by the GPU test at Kimi shapes")
    torch.manual_seed(2)
    H, L, R, V, scale = 2, 128, 32, 64, 0.1
    lens = [450, 0, 64]
    cache, bt, sl = make_paged(lens, BF, bs=64, l=L, r=R)
    q = torch.randn(3, H, L).to(BF)
    qp = torch.randn(3, H, R).to(BF)
    _, _, _, _, w_uv = make_layer(1, H, 16, R, L, V)
    kw = dict(num_splits=40, block_n=64, min_split_tokens=64, config=DECODE_VARIANTS["ls n64 w4"])
    ref = chain_decode(q, qp, cache, bt, sl, scale, w_uv, **kw)
    out = mla_decode_triton(q, qp, cache, bt, sl, scale, w_uv=w_uv, **kw)
    ulp_close(out, ref)
    assert (out[1] == 0).all()
    wide = mla_decode_triton(q, qp, cache, bt, sl, scale, w_uv=w_uv, uv_cfg=dict(block_v=64), **kw)
    ulp_close(wide, ref)
    assert (wide[1] == 0).all()


@pytest.mark.parametrize("splits", [1, 16, 46, 256])
def test_uv_config_narrow_blocks(splits):
    """The W_UV merge kernel takes one 32-column chunk per program at every split count (H200 12-04: narrow beat the
    old 128-column blocks for merges of > 32 splits at every context); cfg overrides still widen it."""
    c = uv_config(1, 32, 128, splits, 132)
    assert (c["BLOCK_V"], c["VC"], c["NG"]) == (32, 32, 1) and c["BLOCK_S"] == min(16, splits)
    assert uv_config(1, 32, 128, splits, 132, dict(block_v=128))["BLOCK_V"] == 128


# ----------------------------------------------------------------------------------------- GPU, Kimi shapes
KIMI = dict(H=32, L=512, R=64, nope=128, V=128)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("S", [1024, 8192])
@pytest.mark.parametrize("variant", [None, "w4 n32"])
def test_gpu_fused_chain_kimi(B, S, variant):
    """The whole fused chain (prep + decode with w_uv) vs the unfused chain at Kimi shapes; lengths S, S-1, ..., a
    padded last lane when B > 1; default splits, and num_splits 1."""
    H, L, R, nope, V = KIMI["H"], KIMI["L"], KIMI["R"], KIMI["nope"], KIMI["V"]
    torch.manual_seed(B * 7 + S)
    lens = [S - i for i in range(B)]
    if B > 1:
        lens[-1] = 0
    cache, bt, sl = make_paged(lens, BF, bs=64, l=L, r=R)
    y, q_dim, w_norm, w_uk, w_uv = make_layer(B, H, nope, R, L, V)
    # the new token's slot: the row after the cached ones (same page when it fits), -1 for the padded lane
    slots = torch.tensor([(bt[i, (s - 1) // 64].item() * 64 + (s - 1) % 64) if s > 0 else -1
                          for i, s in enumerate(lens)], dtype=torch.int64, device=DEV)
    q_pe = y[:, :q_dim].view(B, H, nope + R)[..., nope:]
    cfg = DECODE_VARIANTS[variant] if variant else None
    for ns in (None, 1):
        c_chain, c_fused = cache.clone(), cache.clone()
        q_chain = chain_prep(y, q_dim, w_norm, 1e-6, w_uk, c_chain, slots)
        ref = chain_decode(q_chain, q_pe, c_chain, bt, sl, 192 ** -0.5, w_uv, num_splits=ns, config=cfg)
        q_fused = mla_decode_prep_triton(y, q_dim, w_norm, 1e-6, w_uk, c_fused, slots)
        ulp_close(c_fused, c_chain)  # bit-equal expected (same norm helpers); NaN rows compare by bits
        ulp_close(q_fused, q_chain, frac=1e-3)
        ref_f = chain_decode(q_fused, q_pe, c_fused, bt, sl, 192 ** -0.5, w_uv, num_splits=ns, config=cfg)
        for pdl in (False, True):
            out = mla_decode_triton(q_fused, q_pe, c_fused, bt, sl, 192 ** -0.5, num_splits=ns, config=cfg,
                                    w_uv=w_uv, pdl=pdl)
            check_close(out, ref, BF)  # vs the whole unfused chain
            ulp_close(out, ref_f, frac=1e-3)  # vs the unfused decode + einsum on the same q_lat / cache
            if B > 1:
                assert (out[-1] == 0).all()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("B,S", [(1, 1024), (1, 131072), (8, 8192), (64, 1000)])
@pytest.mark.parametrize("early", [1, 2])
def test_gpu_early_tiles_same_bits(B, S, early, monkeypatch):
    """decode.EARLY_TILES (stage 1's schedule and L2 hints of each unit's first tiles before the PDL wait, while the
    prep kernel before it still writes the new token's cache row) changes no value: prep + the w_uv decode, both PDL
    launches, give the same bits as without the hints, at the default split count and at num_splits 1."""
    import kernels.mla.decode as dec

    H, L, R, nope, V = KIMI["H"], KIMI["L"], KIMI["R"], KIMI["nope"], KIMI["V"]
    torch.manual_seed(B + S)
    lens = [S - 3 * i for i in range(B)]
    cache, bt, sl = make_paged(lens, BF, bs=64, l=L, r=R)
    y, q_dim, w_norm, w_uk, w_uv = make_layer(B, H, nope, R, L, V)
    slots = torch.tensor([bt[i, (s - 1) // 64].item() * 64 + (s - 1) % 64 for i, s in enumerate(lens)],
                         dtype=torch.int64, device=DEV)
    q_pe = y[:, :q_dim].view(B, H, nope + R)[..., nope:]
    for ns in (None, 1):
        outs = []
        for e in (0, early):
            monkeypatch.setattr(dec, "EARLY_TILES", e)
            c = cache.clone()
            q = mla_decode_prep_triton(y, q_dim, w_norm, 1e-6, w_uk, c, slots, pdl=True)
            outs.append(mla_decode_triton(q, q_pe, c, bt, sl, 192 ** -0.5, num_splits=ns, w_uv=w_uv, pdl=True))
        assert torch.equal(outs[0], outs[1]), (ns, (outs[0].float() - outs[1].float()).abs().max())


# ----------------------------------------------------------------------------------------- PDL lowering (offline)
_LOWERING = r"""
import json
from kernels._pdl import ptx_events
from kernels.mla import absorb, decode as dec
bf = "*bf16"
mem = dict(q_ptr=bf, lat_ptr=bf, nw_ptr=bf, wuk_ptr=bf, cache_ptr=bf, slot_ptr="*i64", qlat_ptr=bf)
prep = dict(NOPE=128, BLOCK_NOPE=128, BLOCK_L=64, BLOCK_T=16, BC=1024, BS=64, EARLY_W=True, IEEE=False, UPCAST=False)
uvp = dict(seqlen_ptr="*i32", opart_ptr="*fp32", lse_ptr="*fp32", lat_ptr=bf, wuv_ptr=bf, out_ptr=bf)
uv = dict(L=512, BLOCK_L=512, VC=32, BLOCK_S=16, BLOCK_N=64, BLOCK_B=128, MIN_TILES=1)
s1p = dict(q_ptr=bf, qpe_ptr=bf, cache_ptr=bf, bt_ptr="*i32", seqlen_ptr="*i32", out_ptr=bf, opart_ptr="*fp32",
           lse_ptr="*fp32")
s1 = dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, BS=64, BLOCK_N=64, BLOCK_H=32, BLOCK_B=128, MIN_TILES=1,
          DIRECT=False, IEEE=False, UPCAST=False, PAGE_TILE=True, LSPLIT=True)
cases = {"prep": (absorb._prep_kernel, prep, mem, 4),
         "uv_merge_v128": (absorb._uv_kernel, dict(uv, BLOCK_V=128, MERGE=True), uvp, 8),
         "uv_row": (absorb._uv_kernel, dict(uv, BLOCK_V=32, MERGE=False), uvp, 8)}
if STAGE1:  # ~45 s more (stage-1 compiles): the stage-1 GDC build reads nothing before the wait; with EARLY_TILES
    # the schedule and block-table loads and the L2 hints go before it
    cases["stage1"] = (dec._mla_decode_stage1, s1, s1p, 8)
    cases["stage1_early"] = (dec._mla_decode_stage1, dict(s1, EARLY_TILES=2, EARLY_UNITS=32, EPL=64, LP=16), s1p, 8)
print(json.dumps({k: {str(on): ptx_events(fn, dict(c, GDC=on), pt, nw) for on in (False, True)}
                  for k, (fn, c, pt, nw) in cases.items()}))
"""


@pytest.mark.slow
def test_sm90_pdl_lowering():
    """Offline sm_90 PTX (Triton's compiler, no GPU) of the GDC builds: one griddepcontrol.wait, launch_dependents
    right after it; before it no store / atomic, only the weight loads (prep: w_uk tile + norm weight; uv: the held
    w_uv chunk, plus L2 prefetches of the rest when BLOCK_V > VC) and nothing at all in stage 1 (compiled on GPU
    machines or with KIMI_TEST_STAGE1_LOWERING=1: CI time); the same memory instructions as the non-GDC build."""
    stage1 = "STAGE1 = " + str(HAS_CUDA or os.environ.get("KIMI_TEST_STAGE1_LOWERING") == "1") + "\n"
    res = run_offline(stage1 + _LOWERING, 600, unset=("KIMI_PDL",))
    W, LD = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    for name, ev in res.items():
        off, on = ev["False"], ev["True"]
        # stage1_early: the compiler gives the path of a program without a unit its own copy of the wait (one per path)
        assert (on.count(W) == 1 or name == "stage1_early") and W not in off and LD not in off, name
        assert all(on[i + 1] == LD for i, e in enumerate(on) if e == W), name
        pre, post = on[:on.index(W)], on[on.index(W) + 1:]
        assert post[0] == LD and LD not in pre, (name, post[:3])
        assert "st.global" not in pre and "atom." not in pre, (name, pre)
        assert ("ld.global" in pre) == (name != "stage1"), (name, pre)
        assert ("prefetch.global.L2" in pre) == (name in ("uv_merge_v128", "stage1_early")), (name, pre)
        if name == "stage1_early":   # the same events as without GDC (which hints too), the wait after the hints
            assert [e for e in on if e not in (W, LD)] == off and "ld.global" in pre, name
            assert on.count(W) == 2 and on[-2:] == [W, LD], name         # the second: a program without a unit
            continue
        assert [e for e in on if e not in (W, LD, "prefetch.global.L2")] == off, name
