"""Paged MLA decode variants (kernels/mla/decode.py DECODE_VARIANTS: page tiles, latent halves, bf16 partials, 4- and
8-warp tiles) and split schedules (one-tile units, direct path, stage-2 merge tiles) vs the torch reference, on
shuffled pages whose unowned rows (page 0, each last page's tail) are NaN.

CPU (interpreter): TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mla_decode.py -q
GPU (Kimi shapes, every variant's real tiles): python -m pytest tests/kernels/test_mla_decode.py -q -m gpu
"""
import os

import pytest
import torch

from kernels.mla.decode import (DECODE_VARIANTS, MERGE_MAX_S, default_num_splits, merge_config, merge_units,
                                mla_decode_triton)
from kernels.mla.ref import mla_decode_ref
from tests.kernels.test_mla import check_close, make_paged  # shared paged-cache builder (NaN outside owned rows)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
H, L, R = 4, 32, 16
SCALE = 0.2
LENS = [1, 63, 64, 65, 150, 0]  # last: padded lane (block-table row = page 0)


def poison_for(variant):
    """make_paged's poison for a variant: NaN outside the owned rows, large finite values for ROWIMM (it reads the
    rows past seq_len of a sequence's last tile and needs them finite; an A/B variant for that reason)."""
    return "finite" if DECODE_VARIANTS[variant].get("rowimm") else True


@pytest.fixture(autouse=True)
def _needs_triton():
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("Triton MLA kernels need CUDA or TRITON_INTERPRET=1")


# Interpreter tiles: BLOCK_N 16 by default; block_n=32 with 16-token pages takes the per-row gather (page_tile needs
# BS % BLOCK_N == 0), 64-token pages hold several 16-token tiles (page_tile offsets inside a page).
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("bs,block_n", [(16, None), (64, None), (16, 32)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_variant_matches_ref(variant, bs, block_n, num_splits):
    dtype = torch.bfloat16
    cache, bt, sl = make_paged(LENS, dtype, bs=bs, l=L, r=R, poison=poison_for(variant))
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


@pytest.mark.parametrize("variant", ["base", "w4 n32 ls", "ls n64 w4"])
def test_decode_variant_fp32_and_odd_heads(variant):
    """fp32 cache (IEEE dots) and H=3 (masked head rows), splits on and off."""
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
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_default_gpu_tiles(num_splits):
    """The 16-bit default ('ls n64 w4') at its GPU tile (BLOCK_N 64 = one 64-token page, Kimi L/R/H) under the
    interpreter, which the tests above run at BLOCK_N 16/32: pins the math and the schedule at the real tile (an
    empty lane included), so a GPU failure is the lowering's."""
    lens = [1, 63, 64, 65, 300, 0]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64)
    q = torch.randn(len(lens), 32, 512).bfloat16()
    qp = torch.randn(len(lens), 32, 64).bfloat16()
    out = torch.full((len(lens), 32, 512), float("nan"), dtype=torch.bfloat16)
    cfg = DECODE_VARIANTS["ls n64 w4"]
    mla_decode_triton(q, qp, cache, bt, sl, 192 ** -0.5, num_splits=num_splits, out=out, block_n=cfg["block_n"],
                      config=cfg)
    check_close(out, mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, 192 ** -0.5), torch.bfloat16)
    assert (out[-1] == 0).all()


@pytest.mark.parametrize("variant", ["ls n64 w4 lz8", "ls n64 w4 lz8 ri2"])
@pytest.mark.parametrize("spike", [0.0, 10.0, 250.0, 700.0])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_lazy_rescale(variant, spike, num_splits):
    """The lazy online-softmax rescale (LAZY: the reference max moves only when a head's max grew by more than 8 in
    log2 units) against the reference. With scale 0.05 the scores stay within a few log2 units, and key 230 (tile 14
    of 16-key tiles) gets head 0's query direction times `spike`: a late tile raises that head's max by about 0 (no
    spike), by ~4 (10: under the threshold, p up to 2^4 on a stale reference), by ~100 (250: the rescale branch
    runs mid-unit, the other heads' maxima unchanged) or by ~280 (700: p would overflow fp32 on a stale reference).
    fp32 (IEEE dots), so the stale reference's p (up to 2^8) is held to the fp32 tolerance."""
    lens = [300, 17, 0]
    cache, bt, sl = make_paged(lens, torch.float32, bs=16, l=L, r=R, poison=poison_for(variant))
    N = len(lens)
    q = torch.randn(N, H, L, device=DEV)
    qp = torch.randn(N, H, R, device=DEV)
    if spike:
        page, row = int(bt[0, 230 // 16]), 230 % 16
        cache[page, row, :L] = q[0, 0] / q[0, 0].norm() * spike
        cache[page, row, L:] = 0.0
    out = torch.full((N, H, L), float("nan"), device=DEV)
    mla_decode_triton(q, qp, cache, bt, sl, 0.05, num_splits=num_splits, out=out, min_split_tokens=16,
                      config=DECODE_VARIANTS[variant])
    check_close(out, mla_decode_ref(q, qp, cache, bt, sl, 0.05), torch.float32)
    assert (out[-1] == 0).all()


def test_decode_lazy_bf16_error():
    """The lazy rescale's bf16 error is no larger than the eager update's. On a stale reference max the largest p is
    no longer exactly 1, so its bf16 rounding (in the P·V dot) must also be in l: the lazy l sums the rounded p.
    Over these cases: 0.74x the eager rms error; summing the unrounded p (as the eager update does) 1.23x."""
    def rms_err(variant, seed):
        torch.manual_seed(seed)
        lens = [1, 63, 65, 200, 0]
        cache, bt, sl = make_paged(lens, torch.bfloat16, bs=16, l=L, r=R)
        q = torch.randn(len(lens), H, L, device=DEV).bfloat16()
        qp = torch.randn(len(lens), H, R, device=DEV).bfloat16()
        out = mla_decode_triton(q, qp, cache, bt, sl, SCALE, num_splits=1, min_split_tokens=16,
                                config=DECODE_VARIANTS[variant])
        ref = mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE)
        return (out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()

    lazy = sum(rms_err("ls n64 w4 lz8", s) for s in range(6))
    eager = sum(rms_err("ls n64 w4", s) for s in range(6))
    assert lazy <= 1.04 * eager, (float(lazy), float(eager))


LONG = [4097, 1, 65, 0, 64]


# One long sequence (4097 keys = 65 64-key tiles and 1 key) among short and padded ones: num_splits 1 (direct), a few
# units, one-tile units (min_split_tokens 64 = BLOCK_N; budget 16 x 5 = 80 units > 69 tiles); the merge with one
# unit per step, several heads per program and split columns, or wide steps over all heads.
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("merge", [None, dict(BLOCK_S=1, BLOCK_H2=2, BLOCK_L2=16), dict(BLOCK_S=32, BLOCK_H2=4,
                                                                                         BLOCK_L2=32),
                                   dict(BLOCK_S=128, BLOCK_H2=1, BLOCK_L2=64)])
@pytest.mark.parametrize("variant", ["base", "ls n64 r128", "ls n64 w4"])
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


# ---------------------------------------------------------------- GPU, Kimi shapes

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_decode_variant_kimi(variant, num_splits):
    lens = [1, 63, 64, 65, 4097, 0, 1000]
    cache, bt, sl = make_paged(lens, torch.bfloat16, bs=64, l=512, r=64, device="cuda", max_blocks=80,
                               poison=poison_for(variant))
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
@pytest.mark.parametrize("variant", ["base", "w4 n32", "ls n64 r128", "w4 n32 ls", "ls n64 w4", "ls n64 w4 lz8",
                                     "ls n64 w4 lz8 ri2"])
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
@pytest.mark.parametrize("variant", ["ls n64 w4", "w4 n32", "w4 n32 mt32", "ls n64 w4 p16"])
@pytest.mark.parametrize("lens", [[1024], [8192], [1, 63, 0], [65, 1000, 0, 4097, 64, 1, 8192, 300]],
                         ids=["b1_1k", "b1_8k", "b3", "b8"])
def test_gpu_decode_graph(variant, lens):
    """Split decode at Kimi shapes inside a CUDA graph (default splits: stage 1 + merge): two replays give the
    reference and the same bits, padded lanes zero."""
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


def test_bench_split_candidates():
    """bench/mla.py --split-sweep's split counts: around the default (half, neighbours, double) and 1, at B = 1 also
    fractions and multiples of the SM count, never above MAX_SPLITS."""
    from tests.bench_module import load_bench

    bench = load_bench("mla")
    assert bench.split_candidates(64, 4) == [1, 2, 3, 4, 5, 8]
    assert bench.split_candidates(128, 2) == [1, 2, 3, 4]
    assert bench.split_candidates(1, 256, 132) == [1, 66, 132, 198, 256]
