"""Paged MLA decode variants (kernels/mla/decode.py DECODE_VARIANTS: keys-as-M, page tiles, bf16 partials, heads padded
to 64, 4-warp tiles) and split schedules (one-tile units, direct path, stage-2 merge tiles) vs the torch reference, on
shuffled pages whose unowned rows (page 0, each last page's tail) are NaN.

CPU (interpreter): TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mla_decode.py -q
GPU (Kimi shapes, every variant's real tiles): python -m pytest tests/kernels/test_mla_decode.py -q -m gpu
"""
import os

import pytest
import torch

from kernels.mla.decode import (DECODE_VARIANTS, GPU_BROKEN, MERGE_MAX_S, default_num_splits, merge_config,
                                merge_units, mla_decode_triton)
from kernels.mla.ref import mla_decode_ref
from tests.kernels.test_mla import check_close, make_paged  # shared paged-cache builder (NaN outside owned rows)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
H, L, R = 4, 32, 16
SCALE = 0.2
LENS = [1, 63, 64, 65, 150, 0]  # last: padded lane (block-table row = page 0)


@pytest.fixture(autouse=True)
def _needs_triton():
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("Triton MLA kernels need CUDA or TRITON_INTERPRET=1")


# Interpreter tiles: BLOCK_N 16 by default; block_n=32 with 16-token pages takes the per-row gather (page_tile needs
# BS % BLOCK_N == 0), 64-token pages hold several 16-token tiles (page_tile offsets inside a page).
@pytest.mark.parametrize("variant", ["base", "base page", "keys_m", "keys_m page", "keys_m p16", "keys_m tma", "w4 n32",
                                     "h64 n16", "h64 n32", "h64 n32 p16", "pf n32", "pf2 n32", "keys_m pf n64",
                                     "keys_m pf n64 nd", "keys_m pf n64 nd p16", "keys_m s1", "keys_m n32 w4",
                                     "w4 n32 p16", "w4 n32 ls", "ls n64 r128", "ls n64 r128 p16", "w4 n32 fm",
                                     "w4 n32 mt32", "ls n64 w4", "ls n64 w4 p16", "ls n32 w4 cp s3",
                                     "keys_m n64 w4 cp", "keys_m n32 w4 cp s3", "h64 n32 cp s3"])
@pytest.mark.parametrize("bs,block_n", [(16, None), (64, None), (16, 32)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_variant_matches_ref(variant, bs, block_n, num_splits):
    dtype = torch.bfloat16
    cache, bt, sl = make_paged(LENS, dtype, bs=bs, l=L, r=R)
    N = len(LENS)
    q = torch.randn(N, H, L, device=DEV).to(dtype)
    qp = torch.randn(N, H, R, device=DEV).to(dtype)
    before = cache.clone()
    out = torch.full((N, H, L), float("nan"), dtype=dtype, device=DEV)
    mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=num_splits, out=out, block_n=block_n,
                      min_split_tokens=16, config=DECODE_VARIANTS[variant])
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE), dtype)
    assert (out[-1] == 0).all()  # padded lane
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16))  # decode never writes the cache


@pytest.mark.parametrize("variant", ["keys_m", "keys_m page", "keys_m tma", "pf2 n32", "keys_m pf n64", "keys_m pf n64 nd",
                                     "w4 n32 ls", "keys_m n64 w4 cp"])
def test_decode_variant_fp32_and_odd_heads(variant):
    """fp32 cache (IEEE dots) and H=3 (masked head columns of the transposed tiles), splits on and off."""
    lens = [150, 97, 17, 1]
    cache, bt, sl = make_paged(lens, torch.float32, bs=16, l=L, r=R)
    q = torch.randn(len(lens), 3, L, device=DEV)
    qp = torch.randn(len(lens), 3, R, device=DEV)
    ref = mla_decode_ref(q, qp, cache, bt, sl, SCALE)
    for ns in (1, 3, 64):
        o = mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=ns, min_split_tokens=16,
                              config=DECODE_VARIANTS[variant])
        check_close(o, ref, torch.float32)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter check of the GPU tiles; on a GPU test_gpu_decode_variant_kimi runs them")
@pytest.mark.parametrize("variant", ["keys_m pf n64", "keys_m pf n64 nd"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_prefetch_gpu_tiles(variant, num_splits):
    """The register-prefetch keys-as-M variant at its GPU tile (BLOCK_N 64 = one 64-token page, Kimi L/R/H): the
    interpreter tests above run BLOCK_N 16/32. 'keys_m pf n64' was wrong on the H200 (direct path, rel err 28, call 2)
    while passing here: this pins the math and the schedule (empty lane: the clamped prefetch page) at the real tile,
    so a GPU failure is the lowering's."""
    lens = [1, 63, 64, 65, 300, 0]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64)
    q = torch.randn(len(lens), 32, 512).bfloat16()
    qp = torch.randn(len(lens), 32, 64).bfloat16()
    out = torch.full((len(lens), 32, 512), float("nan"), dtype=torch.bfloat16)
    cfg = DECODE_VARIANTS[variant]
    mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, num_splits=num_splits, out=out, block_n=cfg["block_n"],
                      config=cfg)
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, 192 ** -0.5), torch.bfloat16)
    assert (out[-1] == 0).all()


LONG = [4097, 1, 65, 0, 64]


# One long sequence (4097 keys = 65 64-key tiles and 1 key) among short and padded ones: num_splits 1 (direct), a few
# units, one-tile units (min_split_tokens 64 = BLOCK_N; budget 16 x 5 = 80 units > 69 tiles); the merge with one
# unit per step, several heads per program and split columns, or wide steps over all heads.
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("merge", [None, dict(BLOCK_S=1, BLOCK_H2=2, BLOCK_L2=16), dict(BLOCK_S=32, BLOCK_H2=4,
                                                                                         BLOCK_L2=32),
                                   dict(BLOCK_S=128, BLOCK_H2=1, BLOCK_L2=64)])
@pytest.mark.parametrize("variant", ["base", "h64 n32", "pf n32", "pf2 n32", "ls n64 r128"])
def test_decode_schedule_long_and_short(num_splits, merge, variant):
    if num_splits == 1 and merge is not None:
        pytest.skip("no merge without splits")
    cache, bt, sl = make_paged(LONG, torch.bfloat16, bs=64, l=L, r=R)
    N = len(LONG)
    q = torch.randn(N, H, L, device=DEV).bfloat16()
    qp = torch.randn(N, H, R, device=DEV).bfloat16()
    out = torch.full((N, H, L), float("nan"), dtype=torch.bfloat16, device=DEV)
    cfg = dict(DECODE_VARIANTS[variant], **({"merge": merge} if merge else {}))
    mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=num_splits, out=out, block_n=64, min_split_tokens=64,
                      config=cfg)
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE), torch.bfloat16)
    assert (out[3] == 0).all()


def test_decode_default_schedule_one_tile_units():
    """Default num_splits / min_split_tokens (host ints only): a short batch-1 context runs as one-tile units."""
    lens = [200]
    cache, bt, sl = make_paged(lens, torch.float32, bs=16, l=L, r=R, max_blocks=16)
    q = torch.randn(1, H, L, device=DEV)
    qp = torch.randn(1, H, R, device=DEV)
    assert default_num_splits(1, 16, 16, H) == 4  # 256-key table -> 4 units of >= 64 keys
    o = mla_decode_triton(q, qp, cache, bt, sl, SCALE)
    check_close(o, mla_decode_ref(q, qp, cache, bt, sl, SCALE), torch.float32)


@pytest.mark.parametrize("n,h,ns", [(1, 32, 132), (1, 32, 16), (1, 32, 256), (8, 32, 33), (64, 32, 2), (128, 32, 2),
                                    (6, 4, 5), (2, 3, 40), (1, 32, 1000)])
def test_merge_config(n, h, ns):
    mc = merge_config(n, h, 512, ns, 132)
    bs, bh, bl = mc["BLOCK_S"], mc["BLOCK_H2"], mc["BLOCK_L2"]
    assert all(x >= 1 and x & (x - 1) == 0 for x in (bs, bh, bl))
    assert bs * bh * bl <= 8192 and bs <= MERGE_MAX_S and bh <= 32 and bl <= 512
    assert bs >= min(ns, MERGE_MAX_S)  # a uniform batch's units (ns per sequence) in one step while they fit
    programs = n * -(-h // bh) * (512 // bl)
    assert programs >= 2 * 132 or (bh == 1 and bl <= 64)  # enough programs, or as split as the tiles allow


@pytest.mark.parametrize("b,s,bs", [(8, 8192, 32), (1, 131072, 256), (1, 8192, 128), (64, 8192, 4), (8, 131072, 64),
                                    (1, 1024, 16)])
def test_merge_units_uniform(b, s, bs):
    """A full-length uniform batch: merge_units is _unit_plan's unit count per sequence (the same arithmetic on the
    host) and the merge covers it in one step (B=8 S=8k: 33 splits, 32 units -> BLOCK_S 32, not 64)."""
    ns = default_num_splits(b, s // 64, 64, 32, 132, 2)
    units = merge_units(s // 64, 64, 64, ns)
    tiles = s // 64
    split = -(-(b * tiles) // (b * ns))
    assert units == -(-tiles // split)
    assert merge_config(b, 32, 512, ns, 132, units=units)["BLOCK_S"] == bs


FUSED_VARIANTS = ["w4 n32 fm", "w4 n32 fm u4", "w4 n32 fm u8 p16"]
FUSED_LENS = [[1], [63], [64], [65], [1000], [65, 0, 1000], [1, 63, 64, 65, 1000, 0, 17, 300]]


def _check_loose(out, ref):
    """bf16 p / output rounding alone gives rms ~5e-3 on one short sequence at these tiny shapes (the two-launch path
    measures the same), above check_close's 5e-3."""
    err = (out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert torch.isfinite(out.float()).all() and err < 1e-2, err


def _counters_zero(device):
    from kernels._tensors import arrival_counters

    return bool((arrival_counters(device, 1) == 0).all())


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("lens", FUSED_LENS, ids=lambda x: "_".join(map(str, x)))
@pytest.mark.parametrize("num_splits", [None, 5])
def test_decode_fused_merge(variant, lens, num_splits):
    """One-launch split decode (the last unit of a sequence to arrive merges): matches the reference from a NaN-filled
    out (every row written, empty sequences zero), leaves the cache and the arrival counters as it found them, and a
    second launch gives the same bits (counters were reset)."""
    from kernels.mla import decode as dec

    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=16, l=L, r=R)
    N = len(lens)
    q = torch.randn(N, H, L, device=DEV).bfloat16()
    qp = torch.randn(N, H, R, device=DEV).bfloat16()
    before = cache.clone()
    outs = []
    for _ in range(2):
        out = torch.full((N, H, L), float("nan"), dtype=torch.bfloat16, device=DEV)
        mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=num_splits, out=out, min_split_tokens=16,
                          config=dec.DECODE_VARIANTS[variant])
        outs.append(out)
        assert _counters_zero(out.device)
    # the merge itself is checked against the two-launch path (stage 2) on the same schedule
    _check_loose(outs[0], mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE))
    if num_splits is not None:
        two = mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=num_splits, min_split_tokens=16,
                                config=dict(dec.DECODE_VARIANTS[variant], fused_merge=False))
        torch.testing.assert_close(outs[0].float(), two.float(), rtol=8e-3, atol=1e-3)
    for i, s_ in enumerate(lens):
        if s_ == 0:
            assert (outs[0][i] == 0).all()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("merge_s", [4, 16])
def test_decode_fused_merge_many_units(merge_s):
    """More units than one merge chunk (merge_s 4: the unit-chunk loop; 16 at 40 splits: both paths across the batch),
    matching the two-launch path; the counters come back to 0."""
    from kernels.mla import decode as dec

    lens = [1000, 0, 300, 17]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=16, l=L, r=R)
    q = torch.randn(len(lens), H, L, device=DEV).bfloat16()
    qp = torch.randn(len(lens), H, R, device=DEV).bfloat16()
    cfg = dict(dec.DECODE_VARIANTS["w4 n32 fm"], merge_s=merge_s)
    out = torch.full((len(lens), H, L), float("nan"), dtype=torch.bfloat16, device=DEV)
    mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=40, out=out, min_split_tokens=16, config=cfg)
    assert _counters_zero(out.device)
    two = mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=40, min_split_tokens=16,
                            config=dict(cfg, fused_merge=False))
    torch.testing.assert_close(out.float(), two.float(), rtol=8e-3, atol=1e-3)
    _check_loose(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE))
    assert (out[1] == 0).all()


def test_decode_fused_merge_env(monkeypatch):
    """KIMI_MLA_FUSED_MERGE=1 (alone: variant 'w4 n32 fm'; with KIMI_MLA_DECODE_VARIANT: that variant's tiles) or
    KIMI_MLA_DECODE_VARIANT naming an 'fm' variant runs the one-launch path: no stage-2 launch, same result."""
    from kernels.mla import decode as dec

    lens = [65, 0, 300]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=16, l=L, r=R)
    q = torch.randn(len(lens), H, L, device=DEV).bfloat16()
    qp = torch.randn(len(lens), H, R, device=DEV).bfloat16()
    ref = mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE)

    class NoStage2:
        def __getitem__(self, grid):
            raise AssertionError("stage 2 launched on the fused path")

    monkeypatch.setenv("KIMI_MLA_FUSED_MERGE", "1")
    monkeypatch.setattr(dec, "_mla_decode_stage2", NoStage2())
    out = torch.full((len(lens), H, L), float("nan"), dtype=torch.bfloat16, device=DEV)
    mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=4, out=out, min_split_tokens=16)
    _check_loose(out, ref)
    assert (out[1] == 0).all() and _counters_zero(out.device)
    monkeypatch.setenv("KIMI_MLA_FUSED_MERGE", "0")
    with pytest.raises(AssertionError, match="stage 2"):
        mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=4, out=out, min_split_tokens=16)
    monkeypatch.setenv("KIMI_MLA_DECODE_VARIANT", "w4 n32 fm u4")  # a fused variant by name: no stage 2 either
    out.fill_(float("nan"))
    mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=4, out=out, min_split_tokens=16)
    _check_loose(out, ref)


def test_decode_fused_max_splits():
    """fused_max_splits caps the default split count (bounds the partials the merging program reads)."""
    from kernels.mla import decode as dec

    lens = [1000]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=16, l=L, r=R, max_blocks=64)
    q = torch.randn(1, H, L, device=DEV).bfloat16()
    qp = torch.randn(1, H, R, device=DEV).bfloat16()
    seen = []
    real = dec.arrival_counters

    def spy(device, n):
        seen.append(n)
        return real(device, n)

    dec.arrival_counters = spy
    try:
        o = mla_decode_triton(q, qp, cache, bt, sl, SCALE, min_split_tokens=16,
                              config=dec.DECODE_VARIANTS["w4 n32 fm u4"])
    finally:
        dec.arrival_counters = real
    assert seen == [1]  # fused path taken (default splits > 1), one counter for one sequence x one head block
    _check_loose(o, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE))
    four = mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=4, min_split_tokens=16,
                             config=dec.DECODE_VARIANTS["w4 n32 fm u4"])
    assert default_num_splits(1, 64, 16, H) > 4 and torch.equal(o.view(torch.int16), four.view(torch.int16))


# ---------------------------------------------------------------- GPU, Kimi shapes

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# GPU_BROKEN ('keys_m tma', 'keys_m s1', 'keys_m pf n64*') gave wrong results or an illegal memory access on the
# H200 (12-02 / 12-03, Triton 3.6), which poisons the CUDA context for every later test: they stay out of the GPU run
# until fixed (the interpreter tests above still cover their math; mla_decode_triton refuses them on CUDA)
@pytest.mark.parametrize("variant", [v for v in DECODE_VARIANTS if v not in GPU_BROKEN])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_decode_variant_kimi(variant, num_splits):
    lens = [1, 63, 64, 65, 4097, 0, 1000]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64, device="cuda", max_blocks=80)
    N = len(lens)
    q = torch.randn(N, 32, 512, device="cuda").bfloat16()
    qp = torch.randn(N, 32, 64, device="cuda").bfloat16()
    out = torch.full((N, 32, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, num_splits=num_splits, out=out,
                      config=DECODE_VARIANTS[variant])
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, 192 ** -0.5), torch.bfloat16)
    assert (out[5] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["base", "w4 n32", "h64 n16", "h64 n32", "pf n32", "pf2 n32", "ls n64 r128",
                                     "w4 n32 ls", "ls n64 w4", "ls n32 w4 cp s3", "keys_m n64 w4 cp"])
@pytest.mark.parametrize("lens", [[1024], [8192], [300] * 128, [20000] + [700] * 63], ids=["b1_1k", "b1_8k", "b128",
                                                                                             "mixed64"])
def test_gpu_decode_default_schedule_kimi(variant, lens):
    """Default schedules at Kimi shapes: B=1 one-tile units, B=128 direct (no merge), a mixed batch of 64 (merge)."""
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64, device="cuda", poison=False)
    N = len(lens)
    q = torch.randn(N, 32, 512, device="cuda").bfloat16()
    qp = torch.randn(N, 32, 64, device="cuda").bfloat16()
    out = torch.full((N, 32, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, out=out, config=DECODE_VARIANTS[variant])
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, 192 ** -0.5), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant", FUSED_VARIANTS + ["w4 n32 mt32"])
@pytest.mark.parametrize("lens", [[1024], [8192], [1, 63, 0], [65, 1000, 0, 4097, 64, 1, 8192, 300]],
                         ids=["b1_1k", "b1_8k", "b3", "b8"])
def test_gpu_decode_fused_graph(variant, lens):
    """Fused merge at Kimi shapes inside a CUDA graph: two replays give the reference and the same bits (the arrival
    counters come back to 0), padded lanes zero."""
    from kernels._tensors import arrival_counters

    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64, device="cuda")
    N = len(lens)
    q = torch.randn(N, 32, 512, device="cuda").bfloat16()
    qp = torch.randn(N, 32, 64, device="cuda").bfloat16()
    out = torch.full((N, 32, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = DECODE_VARIANTS[variant]
    mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, out=out, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, out=out, config=cfg)
    res = []
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        res.append(out.clone())
    check_close(res[0], mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, 192 ** -0.5), torch.bfloat16)
    assert torch.equal(res[0].view(torch.int16), res[1].view(torch.int16))
    for i, s_ in enumerate(lens):
        if s_ == 0:
            assert (res[0][i] == 0).all()
    assert (arrival_counters(q.device, 1) == 0).all()


# ------------------------------------------------------------------------------ in-loop L2 hints (l2_ahead)
def test_l2_ahead_rule(monkeypatch):
    """l2_ahead: the config's look-ahead (or the module's L2_AHEAD, KIMI_MLA_L2_AHEAD) on the GPU, with one block-table entry per tile, for
    the LSPLIT and plain loops only; 0 under the interpreter (no prefetch instruction there)."""
    from kernels.mla.decode import l2_ahead

    import kernels.mla.decode as dec

    monkeypatch.setattr(dec, "L2_AHEAD", 0)
    a2 = DECODE_VARIANTS["ls n64 w4 a2"]
    assert l2_ahead(a2, True, True) == 2 and l2_ahead(DECODE_VARIANTS["w4 n32 a2"], True, True) == 2
    assert l2_ahead(a2, True, False) == 0 and l2_ahead(a2, False, True) == 0
    assert l2_ahead(DECODE_VARIANTS["ls n64 w4"], True, True) == 0
    for other in ("pf n32", "keys_m page", "keys_m n64 w4 cp"):      # register prefetch, keys-as-M, carried entry
        assert l2_ahead(dict(DECODE_VARIANTS[other], l2_ahead=2), True, True) == 0, other
    assert l2_ahead(dict(DECODE_VARIANTS["ls n32 w4 cp s3"], l2_ahead=2), True, True) == 2   # lsplit + carried
    monkeypatch.setattr(dec, "L2_AHEAD", 3)                                   # the defaults (no key of their own)
    assert l2_ahead(DECODE_VARIANTS["ls n64 w4"], True, True) == 3 and l2_ahead(a2, True, True) == 2

    class Cache:                                 # a [NB, BS, D] bf16 cache's layout, as _hint_tile_l2 addresses it
        def __init__(self, D=576, row=576, page=64 * 576, base=1 << 20):
            self.shape, self._st, self._base = (8, 64, D), (page, row, 1), base

        def element_size(self):
            return 2

        def stride(self, i):
            return self._st[i]

        def data_ptr(self):
            return self._base

    assert l2_ahead(a2, True, True, Cache()) == 2                            # Kimi: 1,152-byte rows, 72 KB pages
    assert l2_ahead(a2, True, True, Cache(row=640)) == 0                     # rows not back to back
    assert l2_ahead(a2, True, True, Cache(D=40, row=40, page=64 * 40)) == 0  # 80-byte rows: not whole lines
    assert l2_ahead(a2, True, True, Cache(base=(1 << 20) + 64)) == 0         # base off a 128-byte line


_L2_AHEAD_BUILD = r"""
import json
from kernels._offline import compile_offline
from kernels.mla import decode as dec
bf = "*bf16"
sig = dict(q_ptr=bf, qpe_ptr=bf, cache_ptr=bf, bt_ptr="*i32", seqlen_ptr="*i32", out_ptr=bf, opart_ptr="*fp32",
           lse_ptr="*fp32", N="i32", H="i32", G="i32", qk_scale="fp32", **{s: "i32" for s in (
           "s_qn", "s_qh", "s_pn", "s_ph", "s_cp", "s_cr", "s_btn", "s_on", "s_oh", "s_wu", "s_wh", "s_lu")})
div = [n for n in sig if n not in ("qk_scale", "N", "H", "G")]
res = {}
for name in ("ls n64 w4 a2", "w4 n32 a2"):
    c = dec.DECODE_VARIANTS[name]
    for a in (0, 2):
        k = compile_offline(dec._mla_decode_stage1, sig, dict(
            L=512, R=64, BLOCK_L=512, BLOCK_R=64, BS=64, BLOCK_N=c["block_n"], BLOCK_H=32, BLOCK_B=128, MIN_TILES=1,
            DIRECT=False, IEEE=False, UPCAST=False, PAGE_TILE=True, LSPLIT=c.get("lsplit", False), L2_AHEAD=a,
            LANES=32 * c["num_warps"]), num_warps=c["num_warps"], num_stages=c["num_stages"], arch=90, divisible=div)
        res[f"{name}/{a}"] = dict(prefetch=k.ptx.count("prefetch.global.L2"), stack=k.stack, smem=k.smem)
print(json.dumps(res))
"""


@pytest.mark.slow
def test_sm90_l2_ahead_build():
    """Offline sm_90 (no GPU): the L2_AHEAD builds of the 16-bit default ('ls n64 w4') and the small-smem tiles
    ('w4 n32') hint L2 in the loop, the builds without it not at all; no more shared memory, at most 64 B of stack."""
    from tests.kernels.conftest import run_offline

    res = run_offline(_L2_AHEAD_BUILD, 600)
    for name in ("ls n64 w4 a2", "w4 n32 a2"):
        off, on = res[f"{name}/0"], res[f"{name}/2"]
        assert off["prefetch"] == 0 and on["prefetch"] > 0, (name, off, on)
        assert on["smem"] == off["smem"] and on["stack"] <= 64, (name, off, on)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("base,hinted", [("ls n64 w4", "ls n64 w4 a1"), ("ls n64 w4", "ls n64 w4 a2"),
                                         ("ls n64 w4", "ls n64 w4 a3"), ("w4 n32", "w4 n32 a2")])
@pytest.mark.parametrize("lens", [[131072], [8192] * 64, [1, 63, 64, 65, 4097, 0, 1000]], ids=["b1_128k", "b64_8k",
                                                                                                  "mixed"])
def test_gpu_l2_ahead_same_bits(base, hinted, lens):
    """L2 hints change no result: the hinted variant gives the bits of its base at the default split count and on the
    direct path (one program per sequence), long units and short ones, an empty lane."""
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64, device="cuda", poison=False)
    N = len(lens)
    q = torch.randn(N, 32, 512, device="cuda").bfloat16()
    qp = torch.randn(N, 32, 64, device="cuda").bfloat16()
    for ns in (None, 1):
        outs = [mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, num_splits=ns, config=DECODE_VARIANTS[v])
                for v in (base, hinted)]
        assert torch.equal(outs[0], outs[1]), (ns, (outs[0].float() - outs[1].float()).abs().max())
