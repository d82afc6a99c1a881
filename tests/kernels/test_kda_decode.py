"""Fused KDA decode (kernels/kda/recurrent.py) vs the mixer-level reference; slot-pool semantics; continuity."""
import pytest
import torch

from kernels.kda import kda_decode_ref, kda_decode_triton, kda_prefill_ref
from kernels.kda.recurrent import TAIL_LAST, TAIL_LOOP, TAIL_POST, TAIL_SINGLE, decode_config, loop_grid
from kernels.testing import (
    assert_bits_equal,
    assert_close,
    bf16_tol,
    make_kda_layer,
    make_kda_tokens,
    slice_tokens,
)
from tests.kernels.conftest import requires_triton, run_offline

pytestmark = requires_triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _clone(L):
    return {k: v.clone() for k, v in L.items()}


def _decode(fn, L, tok, slots, **kw):
    return fn(tok["qkv"], L["conv_w"], tok["z"], tok["b"], L["A_log"], L["dt_bias"], tok["r"], L["o_norm_w"], EPS,
              L["conv_state"], L["rec_state"], slots, **kw)


def _prefill(L, tok, cu, slots, his, mode="chunk"):
    return kda_prefill_ref(tok["qkv"], L["conv_w"], tok["z"], tok["b"], L["A_log"], L["dt_bias"], tok["r"],
                           L["o_norm_w"], EPS, L["conv_state"], L["rec_state"], cu, slots, his, mode=mode)


def _i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("KV", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_vs_ref(N, KV, dtype):
    K, V = KV
    H, S = 2, 12
    L = make_kda_layer(H, K, V, S, device=DEV, conv_dtype=dtype)
    tok = make_kda_tokens(N, H, K, V, dtype=dtype, device=DEV)
    slots = (torch.randperm(S - 1, device=DEV)[:N] + 1).to(torch.int32)
    A, B = _clone(L), _clone(L)
    y_ref = _decode(kda_decode_ref, A, tok, slots)
    y_tri = _decode(kda_decode_triton, B, tok, slots)
    tol = 2e-5 if dtype == torch.float32 else bf16_tol()
    assert y_tri.dtype == dtype and y_tri.shape == (N, H * V)
    assert_close("o", y_tri, y_ref, tol)
    assert_close("rec_state", B["rec_state"], A["rec_state"], 1e-5 if dtype == torch.float32 else bf16_tol())
    assert torch.equal(B["conv_state"], A["conv_state"])          # shifted copies of the inputs: exact
    untouched = [s for s in range(S) if s not in slots.tolist()]
    for s in untouched:
        assert_bits_equal(f"rec slot {s}", B["rec_state"][s], L["rec_state"][s])
        assert_bits_equal(f"conv slot {s}", B["conv_state"][s], L["conv_state"][s])


@pytest.mark.parametrize("BV,tail,sa", [(8, TAIL_LAST, False), (16, TAIL_LAST, False), (8, TAIL_LAST, True),
                                        (16, TAIL_LAST, True), (8, TAIL_POST, False), (16, TAIL_POST, False),
                                        (32, TAIL_SINGLE, False)])
@pytest.mark.parametrize("early", [True, False])
def test_decode_tile_sizes(BV, tail, sa, early):
    # BV = 32 = V: one program per head (norm + conv shift in it); BV < V: the last-arriving tile program does the
    # head's tail (TAIL_LAST, one launch; sa: state stored after the arrival) or a second kernel does (TAIL_POST);
    # padded lane included
    H, K, V, N, S = 2, 32, 32, 4, 5
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["rec_state"][0] = float("nan")
    tok = make_kda_tokens(N, H, K, V, device=DEV)
    slots = _i32([4, 1, 0, 2])
    A, B = _clone(L), _clone(L)
    cnt = torch.zeros(N * H, dtype=torch.int32, device=DEV)
    y_ref = _decode(kda_decode_ref, A, tok, slots)
    y_tri = _decode(kda_decode_triton, B, tok, slots, BV=BV, tail=tail, counters=cnt, early=early,
                    out=torch.full((N, H * V), float("nan"), device=DEV), maxnreg=128 if early else None,
                    store_after=sa)
    assert torch.equal(cnt, torch.zeros_like(cnt))                # TAIL_LAST leaves its counters zeroed
    assert_close("o", y_tri, y_ref, 2e-5)
    assert_close("state", B["rec_state"][1:], A["rec_state"][1:], 1e-5)
    assert torch.equal(B["conv_state"], A["conv_state"])
    assert_bits_equal("null slot", B["rec_state"][0], L["rec_state"][0])


@pytest.mark.parametrize("n_sm", [1, 8, 66, 132, 264])
def test_decode_config(n_sm, monkeypatch):
    # tile choice by N and SM count (from the H200 sweep): BV 32 with a late state load while the grid is small,
    # BV 64 with an early load once BV 64 gives >= _WIDE_PER_SM programs per SM; BV non-decreasing in N
    from kernels.kda import recurrent as R
    monkeypatch.setattr(R, "_LOOP_DEFAULT", False)
    monkeypatch.setattr(R, "_WIDE_MAXNREG", 128)
    monkeypatch.setattr(R, "_STORE_AFTER", True)
    H, K, V = 32, 128, 128
    last = 0
    for N in (1, 2, 3, 4, 8, 16, 32, 33, 64, 256, 1024):
        BV, nw, tail, early, pps, maxnreg, sa = decode_config(N, H, K, V, n_sm)
        wide = N * H * (V // 64) >= R._WIDE_PER_SM * n_sm
        assert (BV, nw, early, maxnreg) == ((64, 4, True, 128) if wide else (32, 4, False, 0))
        assert tail == TAIL_LAST and pps == 0 and sa
        assert BV >= last
        last = BV
    assert decode_config(32, H, K, V, 132)[0] == 32 and decode_config(33, H, K, V, 132)[0] == 64
    assert decode_config(1, H, K, V, 132, BV=128) == (128, 16, TAIL_SINGLE, False, 0, 0, False)   # explicit
    assert decode_config(1, 2, 16, 16, 132)[0] == 16         # tiny V: tile capped by V
    assert decode_config(4096, 2, 16, 8, 132)[0] == 8             # V = 8: tile capped by V


def test_decode_config_loop(monkeypatch):
    # with the loop kernel as the large-grid default (KIMI_KDA_DECODE_LOOP / _LOOP_DEFAULT), wide grids take it,
    # small ones keep the per-tile kernel; loop_grid gives every program the same number of heads
    from kernels.kda import recurrent as R
    monkeypatch.setattr(R, "_LOOP_DEFAULT", True)
    monkeypatch.setattr(R, "_LOOP", (16, 4, 5, 96))
    assert decode_config(64, 32, 128, 128, 132)[:7] == (16, 4, TAIL_LOOP, True, 5, 96, False)
    assert decode_config(8, 32, 128, 128, 132)[2] == TAIL_LAST
    assert decode_config(64, 32, 128, 128, 132, BV=64)[2] == TAIL_LAST          # an explicit tile: per-tile kernel
    for units in (1, 7, 32, 256, 2048, 2049, 8192):
        for pps, n_sm in ((1, 1), (4, 132), (5, 132), (3, 7)):
            G = loop_grid(units, pps, n_sm)
            per = -(-units // G)
            assert 1 <= G <= min(units, pps * n_sm) and (G - 1) * per < units <= G * per
    assert loop_grid(2048, 4, 132) == 512 and loop_grid(8192, 4, 132) == 512


@pytest.mark.parametrize("BV,nw", [(8, 1), (16, 2), (32, 4)])
@pytest.mark.parametrize("grid", [1, 3, None])
def test_decode_loop(BV, nw, grid):
    # persistent loop kernel: programs walk whole heads (grid 1: one program does every head of every lane; 3: heads
    # split unevenly across programs; None: the pps-sized grid = one head each here); the next tile's state is
    # prefetched across head and lane boundaries, including into and out of padded lanes (slot 0, NaN) and lanes at
    # the end. Slots outside the batch stay bit-identical; padded lanes output zeros; 3 steps chain.
    H, K, V, S = 3, 32, 32, 8
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["rec_state"][0] = float("nan")
    L["conv_state"][0] = float("nan")
    L["rec_state"][5] = 1e30
    L["conv_state"][6] = float("nan")
    slots = _i32([4, 0, 1, 2, 0])
    A, B = _clone(L), _clone(L)
    for step in range(3):
        tok = make_kda_tokens(5, H, K, V, device=DEV, seed=20 + step)
        y_ref = _decode(kda_decode_ref, A, tok, slots)
        y_tri = _decode(kda_decode_triton, B, tok, slots, BV=BV, num_warps=nw, tail=TAIL_LOOP, grid=grid,
                        out=torch.full((5, H * V), float("nan"), device=DEV))
        assert_close(f"o step {step}", y_tri, y_ref, 2e-5)
        assert torch.equal(y_tri[1], torch.zeros_like(y_tri[1])) and torch.equal(y_tri[4], torch.zeros_like(y_tri[4]))
        assert_close("state", B["rec_state"][1:5], A["rec_state"][1:5], 1e-5)
        assert torch.equal(B["conv_state"][1:5], A["conv_state"][1:5])
    for s in (0, 3, 5, 6, 7):
        assert_bits_equal(f"rec slot {s}", B["rec_state"][s], L["rec_state"][s])
        assert_bits_equal(f"conv slot {s}", B["conv_state"][s], L["conv_state"][s])


def test_decode_loop_odd_shapes():
    # K, V not powers of two (masked rows / columns), V not a multiple of BV (last tile partial), bf16, strong gates
    H, K, V, S, N = 2, 24, 40, 5, 3
    L = make_kda_layer(H, K, V, S, device=DEV, conv_dtype=torch.bfloat16)
    L["A_log"] = torch.tensor([3.0, 0.0], device=DEV)
    slots = _i32([3, 1, 4])
    A, B = _clone(L), _clone(L)
    for step in range(2):
        tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device=DEV, seed=30 + step, z_scale=30.0)
        y_ref = _decode(kda_decode_ref, A, tok, slots)
        y_tri = _decode(kda_decode_triton, B, tok, slots, BV=16, num_warps=2, tail=TAIL_LOOP, grid=4, maxnreg=96)
        assert_close(f"o step {step}", y_tri, y_ref, bf16_tol())
    assert_close("state", B["rec_state"], A["rec_state"], bf16_tol())
    assert torch.equal(B["conv_state"], A["conv_state"])


def test_padded_lanes_and_poison():
    # lanes pointing at the null slot 0 change no real slot, read nothing (slot 0 full of NaN) and output zeros;
    # slots outside the batch stay bit-identical (1e30 / NaN)
    H, K, V, S = 2, 16, 16, 8
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["rec_state"][0] = float("nan")
    L["conv_state"][0] = float("nan")
    L["rec_state"][5] = 1e30
    L["conv_state"][6] = float("nan")
    tok = make_kda_tokens(5, H, K, V, device=DEV)
    slots = _i32([3, 0, 1, 0, 2])
    B = _clone(L)
    out = torch.full((5, H * V), float("nan"), device=DEV)       # NaN-prefilled output comes back fully written
    y = _decode(kda_decode_triton, B, tok, slots, out=out)
    assert y is out and torch.isfinite(y).all()
    assert torch.equal(y[1], torch.zeros_like(y[1])) and torch.equal(y[3], torch.zeros_like(y[3]))
    for s in (0, 4, 5, 6, 7):
        assert_bits_equal(f"rec slot {s}", B["rec_state"][s], L["rec_state"][s])
        assert_bits_equal(f"conv slot {s}", B["conv_state"][s], L["conv_state"][s])
    # real lanes equal a batch without the padding
    A = _clone(L)
    real = [0, 2, 4]
    y_real = _decode(kda_decode_triton, A, {k: v[real] for k, v in tok.items()}, slots[real])
    assert torch.equal(y[real], y_real)
    assert torch.equal(A["rec_state"][1:4], B["rec_state"][1:4])
    # the reference has the same padded-lane semantics
    R = _clone(L)
    y_ref = _decode(kda_decode_ref, R, tok, slots)
    assert torch.equal(y_ref[1], torch.zeros_like(y_ref[1]))
    assert_close("o", y, y_ref, 2e-5)
    assert_bits_equal("ref slot 0", R["rec_state"][0], L["rec_state"][0])


def test_strong_gates():
    # gate magnitudes far below -20 per step: decays flush to zero, nothing overflows
    H, K, V, S = 2, 16, 16, 4
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["A_log"] = torch.tensor([3.0, 0.0], device=DEV)               # exp(A_log) = 20, 1
    tok = make_kda_tokens(3, H, K, V, device=DEV, z_scale=30.0)     # softplus up to ~100 -> g down to ~ -2000
    slots = _i32([1, 2, 3])
    A, B = _clone(L), _clone(L)
    for step in range(3):
        t = {k: v.roll(step, 0) for k, v in tok.items()}
        y_ref = _decode(kda_decode_ref, A, t, slots)
        y_tri = _decode(kda_decode_triton, B, t, slots)
        assert torch.isfinite(y_tri).all() and torch.isfinite(B["rec_state"]).all()
        assert_close("o", y_tri, y_ref, 2e-5)
        assert_close("state", B["rec_state"], A["rec_state"], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("BV", [8, 32])
def test_multi_step_decode(dtype, BV):
    H, K, V, S, N = 2, 16, 32, 6, 4
    L = make_kda_layer(H, K, V, S, device=DEV, conv_dtype=dtype)
    slots = _i32([5, 2, 3, 1])
    A, B = _clone(L), _clone(L)
    tol = 2e-5 if dtype == torch.float32 else bf16_tol()
    for step in range(4):
        tok = make_kda_tokens(N, H, K, V, dtype=dtype, device=DEV, seed=10 + step)
        y_ref = _decode(kda_decode_ref, A, tok, slots)
        y_tri = _decode(kda_decode_triton, B, tok, slots, BV=BV)   # BV=8: the shared counters are reused
        assert_close(f"o step {step}", y_tri, y_ref, tol)
    assert_close("state", B["rec_state"], A["rec_state"], 1e-5 if dtype == torch.float32 else bf16_tol())


@pytest.mark.parametrize("T,k", [(1, 3), (63, 3), (64, 2), (65, 4)])
def test_decode_continues_ref_prefill(T, k):
    # ONE state layout for prefill and decode (guards the vLLM #41292 class of bug, K != V so a transpose
    # cannot pass): ref prefill(T) + k Triton decode steps == ref prefill(T + k), outputs and states
    H, K, V, S = 2, 16, 32, 4
    L = make_kda_layer(H, K, V, S, device=DEV)
    tok = make_kda_tokens(T + k, H, K, V, device=DEV)
    slot = _i32([2])
    A = _clone(L)
    y_full = _prefill(A, tok, _i32([0, T + k]), slot, torch.tensor([False], device=DEV), mode="recurrent")
    B = _clone(L)
    ys = [_prefill(B, slice_tokens(tok, 0, T), _i32([0, T]), slot, torch.tensor([False], device=DEV))]
    for t in range(T, T + k):
        ys.append(_decode(kda_decode_triton, B, slice_tokens(tok, t, t + 1), slot))
    assert_close("o", torch.cat(ys)[T:], y_full[T:], 2e-5)
    assert_close("o prefix", torch.cat(ys)[:T], y_full[:T], 2e-5)
    assert_close("rec", B["rec_state"][2], A["rec_state"][2], 1e-5)
    assert torch.equal(B["conv_state"][2], A["conv_state"][2])


# ------------------------------------------------------------------------------------- low-rank gates (fg_a, fg_b)
def _fg_inputs(N, H, K, V, R, dtype, seed=5, stacked=True):
    """Low-rank gate inputs as the model passes them: fg_a [2, N, R] a strided view of a projection output
    [N, C + 2R + H] (row stride C + 2R + H, batch stride R), fg_b [2, HK, R]; with K != V (stacked=False) pairs
    (f_a, g_a), (f_b [HK, R], g_b [HV, R])."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * H * K + H * V
    y = torch.randn(N, C + 2 * R + H, generator=gen)
    f_b = torch.randn(H * K, R, generator=gen) * (2.0 / R ** 0.5)         # z ~ N(0, 4) like make_kda_tokens
    g_b = torch.randn(H * V, R, generator=gen) / R ** 0.5
    y, f_b, g_b = y.to(dtype).to(DEV), f_b.to(dtype).to(DEV), g_b.to(dtype).to(DEV)
    fg_a = y[:, C:C + 2 * R].view(-1, 2, R).transpose(0, 1)
    if stacked:
        return fg_a, torch.stack([f_b, g_b])
    return (fg_a[0], fg_a[1]), (f_b, g_b)


def _decode_fg(fn, L, tok, slots, fg_a, fg_b, **kw):
    return fn(tok["qkv"], L["conv_w"], None, tok["b"], L["A_log"], L["dt_bias"], None, L["o_norm_w"], EPS,
              L["conv_state"], L["rec_state"], slots, fg_a=fg_a, fg_b=fg_b, **kw)


def test_fg_ref_is_bmm_then_ref():
    # the reference with low-rank inputs == the bf16 batched matmul's z, r fed to the z / r reference
    H, K, V, S, R = 2, 16, 16, 5, 24
    L = make_kda_layer(H, K, V, S, device=DEV, conv_dtype=torch.bfloat16)
    tok = make_kda_tokens(3, H, K, V, dtype=torch.bfloat16, device=DEV)
    fg_a, fg_b = _fg_inputs(3, H, K, V, R, torch.bfloat16)
    slots = _i32([2, 0, 4])
    A, B = _clone(L), _clone(L)
    y = _decode_fg(kda_decode_ref, A, tok, slots, fg_a, fg_b)
    z, r = torch.matmul(fg_a.float(), fg_b.float().transpose(1, 2)).to(torch.bfloat16).unbind(0)
    y2 = _decode(kda_decode_ref, B, dict(tok, z=z, r=r), slots)
    assert torch.equal(y, y2) and torch.equal(A["rec_state"], B["rec_state"])


# (BV, tail, early): V = 32 -> BV 32 one program per head; BV < V: last-tile tail, store-after, the two-launch tail,
# the loop kernel
_LR_CFGS = [(None, None, None), (32, TAIL_SINGLE, True), (8, TAIL_LAST, False), (16, "sa", True),
            (8, TAIL_POST, False), (16, TAIL_LOOP, True)]


@pytest.mark.parametrize("cfg", _LR_CFGS, ids=[str(c) for c in _LR_CFGS])
@pytest.mark.parametrize("N", [1, 3])
def test_decode_fg_vs_ref(cfg, N):
    # low-rank inputs (the model's path): bit for bit skinny_bmm_nt's z, r fed to the z / r kernel, and the
    # reference with the same low-rank inputs; R = 24 (not a power of two); N = 3 has a padded lane (slot 0, NaN
    # state) in the middle; slots outside the batch stay bit-identical; the NaN-prefilled output comes back fully
    # written
    from kernels.gemv import skinny_bmm_nt
    BV, tail, early = cfg
    H, K, V, S, R = 2, 32, 32, 6, 24
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["rec_state"][0] = float("nan")
    L["conv_state"][0] = float("nan")
    L["rec_state"][5] = 1e30
    tok = make_kda_tokens(N, H, K, V, device=DEV, seed=7)
    fg_a, fg_b = _fg_inputs(N, H, K, V, R, torch.float32)
    slots = _i32([3, 0, 1][:N] if N == 3 else [2])
    A, B, C = _clone(L), _clone(L), _clone(L)
    kw = dict(BV=BV, early=early)
    if tail == "sa":
        kw.update(tail=TAIL_LAST, store_after=True)
    elif tail == TAIL_LOOP:
        kw.update(tail=TAIL_LOOP, num_warps=2, grid=2)
    else:
        kw.update(tail=tail)
    cnt = torch.zeros(N * H, dtype=torch.int32, device=DEV)
    for step in range(2):
        y_ref = _decode_fg(kda_decode_ref, A, tok, slots, fg_a, fg_b)
        y = _decode_fg(kda_decode_triton, B, tok, slots, fg_a, fg_b,
                       out=torch.full((N, H * V), float("nan"), device=DEV), counters=cnt, **kw)
        z, r = skinny_bmm_nt(fg_a, fg_b).unbind(0)
        y_zr = _decode(kda_decode_triton, C, dict(tok, z=z, r=r), slots, counters=cnt, **kw)
        assert_bits_equal(f"o vs z / r step {step}", y, y_zr)
        assert_close(f"o step {step}", y, y_ref, 2e-5)
        tok = make_kda_tokens(N, H, K, V, device=DEV, seed=8 + step)
    assert torch.equal(cnt, torch.zeros_like(cnt))
    assert_bits_equal("rec vs z / r", B["rec_state"], C["rec_state"])
    if N == 3:
        assert torch.equal(y[1], torch.zeros_like(y[1]))
    live = slots[slots > 0].long()
    assert_close("state", B["rec_state"][live], A["rec_state"][live], 1e-5)
    assert torch.equal(B["conv_state"][live], A["conv_state"][live])
    for s in sorted(set(range(S)) - set(live.tolist())):
        assert_bits_equal(f"rec slot {s}", B["rec_state"][s], L["rec_state"][s])
        assert_bits_equal(f"conv slot {s}", B["conv_state"][s], L["conv_state"][s])


@pytest.mark.parametrize("KV", [(16, 16), (16, 32)])
def test_decode_fg_bf16(KV):
    # bf16 activations and weights (skinny_bmm_nt rounds z, r to bf16 like the reference's matmul; the interpreter
    # truncates fp32 -> bf16, hence bf16_tol); K != V takes the pair form
    K, V = KV
    H, S, N, R = 2, 6, 3, 16
    L = make_kda_layer(H, K, V, S, device=DEV, conv_dtype=torch.bfloat16)
    tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device=DEV, seed=3)
    fg_a, fg_b = _fg_inputs(N, H, K, V, R, torch.bfloat16, stacked=K == V)
    slots = _i32([5, 0, 2])
    A, B = _clone(L), _clone(L)
    y_ref = _decode_fg(kda_decode_ref, A, tok, slots, fg_a, fg_b)
    y = _decode_fg(kda_decode_triton, B, tok, slots, fg_a, fg_b, BV=8)
    assert y.dtype == torch.bfloat16
    assert_close("o", y, y_ref, bf16_tol())
    assert_close("state", B["rec_state"], A["rec_state"], bf16_tol())
    assert torch.equal(B["conv_state"], A["conv_state"])


# shared head of the offline sm_90 scripts below (run in a subprocess without TRITON_INTERPRET):
# compile(N, early_state) -> (cfg, kernel, registers, stack bytes) for decode_config's pick at Kimi shapes
_OFFLINE_HEAD = r"""
import json, re
from kernels._offline import compile_offline
from kernels._pdl import ptx_events
from kernels.kda import recurrent as rec
fn = rec._kda_decode_kernel
names = fn.arg_names
f32 = dict(convw_ptr="*fp32", alog_ptr="*fp32", dtb_ptr="*fp32", state_ptr="*fp32", o_ptr="*fp32", cnt_ptr="*i32",
           slot_ptr="*i32")
types = {n: "*bf16" for n in names if n.endswith("_ptr")}
types.update(f32, scale="fp32", eps="fp32", **{n: "i32" for n in names if n.startswith("stride")})
div = [n for n in names if types.get(n, "").startswith("*") or n.startswith("stride")]


def consts(cfg, es):
    return dict(H=32, K=128, V=128, W=4, BK=128, BV=cfg.BV, NV=128 // cfg.BV, BVF=128, TAIL=cfg.tail,
                EARLY=cfg.early, STORE_AFTER=cfg.store_after, GDC=True, EARLY_STATE=es)


def compile(N, es):
    cfg = rec.decode_config(N, 32, 128, 128, 132)
    c = consts(cfg, es)
    b = compile_offline(fn, types, c, num_warps=cfg.num_warps, arch=90, divisible=div)
    return cfg, c, b.kernel, b.regs, b.stack
"""

# -------------------------------------------------------------------------- early state (EARLY_STATE, recurrent.py)
# (BV, tail, early, fg): the last-tile tail with the low-rank inputs (the model's path) and with z / r given (late
# and early state load), one program per head, the two-launch tail, state stored after the arrival
_ES_CFGS = [(8, TAIL_LAST, False, True), (8, TAIL_LAST, False, False), (16, TAIL_LAST, True, False),
            (32, TAIL_SINGLE, False, True), (8, TAIL_POST, False, True), (16, "sa", True, True)]


@pytest.mark.parametrize("cfg", _ES_CFGS, ids=[str(c) for c in _ES_CFGS])
def test_decode_early_state_same_bits(cfg):
    # early_state 1 / 2 only move the slot / state loads (before griddepcontrol.wait under PDL; the interpreter has no
    # GDC, so here the code paths run without it): outputs, pools and counters bit-identical to early_state 0 over 2
    # chained steps, a padded lane (slot 0, NaN pools) included; early_state 0 matches the reference
    BV, tail, early, fg = cfg
    H, K, V, S, R, N = 2, 32, 32, 6, 24, 3
    L = make_kda_layer(H, K, V, S, device=DEV)
    L["rec_state"][0] = float("nan")
    L["conv_state"][0] = float("nan")
    fg_a, fg_b = _fg_inputs(N, H, K, V, R, torch.float32)
    slots = _i32([3, 0, 1])
    kw = dict(BV=BV, early=early, tail=TAIL_LAST if tail == "sa" else tail, store_after=tail == "sa")
    A = _clone(L)
    res = {}
    for es in (0, 1, 2):
        B = _clone(L)
        cnt = torch.zeros(N * H, dtype=torch.int32, device=DEV)
        ys = []
        for step in range(2):
            tok = make_kda_tokens(N, H, K, V, device=DEV, seed=50 + step)
            out = torch.full((N, H * V), float("nan"), device=DEV)
            if fg:
                ys.append(_decode_fg(kda_decode_triton, B, tok, slots, fg_a, fg_b, out=out, counters=cnt,
                                     early_state=es, **kw))
                if es == 0:
                    assert_close(f"o step {step}", ys[-1], _decode_fg(kda_decode_ref, A, tok, slots, fg_a, fg_b), 2e-5)
            else:
                ys.append(_decode(kda_decode_triton, B, tok, slots, out=out, counters=cnt, early_state=es, **kw))
                if es == 0:
                    assert_close(f"o step {step}", ys[-1], _decode(kda_decode_ref, A, tok, slots), 2e-5)
        assert torch.equal(cnt, torch.zeros_like(cnt))
        res[es] = (ys, B)
    for es in (1, 2):
        for step in range(2):
            assert_bits_equal(f"o es {es} step {step}", res[es][0][step], res[0][0][step])
        assert_bits_equal(f"rec es {es}", res[es][1]["rec_state"], res[0][1]["rec_state"])
        assert_bits_equal(f"conv es {es}", res[es][1]["conv_state"], res[0][1]["conv_state"])
    assert_bits_equal("null slot", res[2][1]["rec_state"][0], L["rec_state"][0])


def test_early_state_switch(monkeypatch):
    # early_state=None: recurrent._EARLY_STATE (KIMI_KDA_EARLY_STATE) under PDL, 0 without; an explicit value wins.
    # Kernels replaced by recorders (no launch): the EARLY_STATE constexpr each call passes
    import kernels._pdl as pdl_mod
    from kernels.kda import recurrent as Rm
    seen = []
    monkeypatch.setattr(Rm, "_kda_decode_kernel", type("Rec", (), {
        "__getitem__": lambda self, grid: lambda *a, **kw: seen.append((kw["EARLY_STATE"], kw.get("GDC", False)))})())
    monkeypatch.setattr(pdl_mod, "INTERPRET", False)
    H, K, V = 2, 16, 16
    L = make_kda_layer(H, K, V, 4)
    tok = make_kda_tokens(2, H, K, V)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    for mode in (0, 1, 2):
        monkeypatch.setattr(Rm, "_EARLY_STATE", mode)
        for pdl, es in ((True, None), (False, None), (True, 0), (False, 2)):
            seen.clear()
            _decode(kda_decode_triton, _clone(L), tok, slots, BV=8, pdl=pdl, early_state=es)
            assert seen == [((mode if pdl else 0) if es is None else es, pdl)], (mode, pdl, es, seen)


_ES_OFFLINE = _OFFLINE_HEAD + r"""
out = {}
for N in (1, 8):
    for es in (0, 1, 2):
        cfg, c, k, reg, stack = compile(N, es)
        ev = re.findall(r"griddepcontrol\.\w+|(?:ld|st|atom|prefetch)\.global[.\w:]*", k.asm["ptx"])
        out[f"{N}/{es}"] = dict(BV=cfg.BV, nw=cfg.num_warps, reg=reg, stack=stack, ev=ev,
                                coarse=ptx_events(fn, c, f32, cfg.num_warps))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_early_state_offline_sm90():
    """Offline sm_90 compile (Triton's ptxas, no GPU) of the defaults at Kimi shapes under PDL, N = 1 and 8,
    early_state 0 / 1 / 2: the same loads in every mode (only their position moves); before griddepcontrol.wait 0
    loads nothing, 1 adds exactly the slot load (one b32) and L2 prefetches, 2 also the state tile (its evict_first
    16-byte loads, none left after the wait); never an activation (bf16 b16 loads: qkv, z, b, r, and the conv state,
    prefetched only), store or atomic before it; launch_dependents right after it; no spills."""
    import collections

    res = run_offline(_ES_OFFLINE, 600, unset=("KIMI_PDL",))
    W, LD = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    for N in (1, 8):
        parts = {}
        for es in (0, 1, 2):
            c = res[f"{N}/{es}"]
            ev = c["ev"]
            assert ev.count(W) == 1 and ev[ev.index(W) + 1] == LD, (N, es)
            pre, post = ev[:ev.index(W)], ev[ev.index(W) + 1:]
            loads = lambda xs: collections.Counter(e for e in xs if e.startswith("ld."))   # noqa: E731
            parts[es] = (loads(pre), loads(post), pre.count("prefetch.global.L2"))
            assert not any(e.startswith(("st.", "atom.")) for e in pre), (N, es, pre)
            assert not any(e.startswith("ld.") and e.endswith(".b16") for e in pre), (N, es, pre)   # activations
            assert c["stack"] == 0 and c["reg"] <= 255, (N, es, c["reg"], c["stack"])
            # the coarse event list of kernels._pdl.ptx_events (no alignment hints: scalar loads) agrees
            co = c["coarse"]
            assert co.count(W) == 1 and co[co.index(W) + 1] == LD and "st.global" not in co[:co.index(W)]
            assert ("ld.global" in co[:co.index(W)]) == (es > 0), (N, es)
        (pre0, post0, pf0), (pre1, post1, pf1), (pre2, post2, pf2) = parts[0], parts[1], parts[2]
        assert pre0 + post0 == pre1 + post1 == pre2 + post2, N                    # the same loads in every mode
        assert pre1 - pre0 == collections.Counter({"ld.global.b32": 1}) and not pre0 - pre1, N    # + the slot
        assert pf1 > pf0 and pf2 == pf1, (N, pf0, pf1, pf2)                       # + state / conv-state hints
        tile = {k: v for k, v in (pre2 - pre1).items()}
        n_vec = 128 * res[f"{N}/2"]["BV"] * 4 // 16 // (32 * res[f"{N}/2"]["nw"])   # [K, BV] fp32, 16-byte vectors
        assert tile == {"ld.global.L1::evict_first.L2::cache_hint.v4.b32": n_vec} and not pre1 - pre2, (N, tile)
        assert not any("evict_first" in e for e in post2), N                       # not loaded again after the wait
        assert any("evict_first" in e for e in post1), N                            # 1: loaded after the wait


# ----------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64, 256])
@pytest.mark.parametrize("BV,tail,mr,sa", [(None, None, None, None), (128, None, None, None), (64, None, None, None),
                                           (64, None, 128, None), (64, None, 128, True), (32, None, None, True),
                                           (8, TAIL_POST, None, None), (16, TAIL_LOOP, None, None),
                                           (16, TAIL_LOOP, 96, None), (32, TAIL_LOOP, 128, None)])
def test_decode_kimi_gpu(N, BV, tail, mr, sa):
    # default pick (one launch, last-tile tail), one program per head, BV=64 (register cap 128: 4 programs per SM),
    # state stored after the arrival (sa), the 2-launch tail, the loop kernel (capped: ptxas spills a few bytes on
    # Triton 3.6)
    H, K, V = 32, 128, 128
    S = N + 2
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    slots = (torch.randperm(S - 1, device="cuda")[:N] + 1).to(torch.int32)
    A, B = _clone(L), _clone(L)
    for step in range(4):
        tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device="cuda", seed=step)
        y_ref = _decode(kda_decode_ref, A, tok, slots)
        y_tri = _decode(kda_decode_triton, B, tok, slots, BV=BV, tail=tail, maxnreg=mr, store_after=sa)
        assert_close("o", y_tri, y_ref, 5e-3)
    assert_close("state", B["rec_state"], A["rec_state"], 5e-3)
    assert torch.equal(B["conv_state"], A["conv_state"])


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(BV=16, num_warps=4, tail=TAIL_LOOP, pps=2, maxnreg=96)])
def test_decode_cuda_graph_gpu(kw):
    H, K, V, N, S = 32, 128, 128, 8, 12
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device="cuda")
    slots = _i32([3, 1, 0, 0, 7, 2, 0, 11])
    A, B = _clone(L), _clone(L)
    y_eager = [_decode(kda_decode_triton, A, tok, slots, **kw) for _ in range(3)]
    _decode(kda_decode_triton, _clone(L), tok, slots, **kw)   # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                           # recorded, not executed: B's pools are untouched
        y_static = _decode(kda_decode_triton, B, tok, slots, **kw)
    for step in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, y_eager[step])
    assert torch.equal(B["rec_state"], A["rec_state"]) and torch.equal(B["conv_state"], A["conv_state"])
    assert_bits_equal("null slot", B["rec_state"][0], L["rec_state"][0])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64, 256])
def test_decode_fg_kimi_gpu(N):
    # Kimi shapes: the low-rank inputs give bit for bit skinny_bmm_nt's bf16 z, r fed to the kernel, over 3 chained
    # steps, on output and state
    H, K, V = 32, 128, 128
    S = N + 2
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    slots = (torch.randperm(S - 1, device="cuda")[:N] + 1).to(torch.int32)
    A, B = _clone(L), _clone(L)
    from kernels.gemv import skinny_bmm_nt
    for step in range(3):
        tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device="cuda", seed=step)
        fg_a, fg_b = _fg_inputs(N, H, K, V, K, torch.bfloat16, seed=40 + step)
        z, r = skinny_bmm_nt(fg_a, fg_b).unbind(0)
        y_ref = _decode(kda_decode_triton, A, dict(tok, z=z, r=r), slots)
        y = _decode_fg(kda_decode_triton, B, tok, slots, fg_a, fg_b)
        assert torch.equal(y, y_ref), step
    assert torch.equal(B["rec_state"], A["rec_state"])
    assert torch.equal(B["conv_state"], A["conv_state"])


@pytest.mark.gpu
def test_decode_fg_cuda_graph_gpu():
    # the low-rank path (skinny_bmm_nt, then the kernel) replays bit-identically to eager, padded lanes included
    H, K, V, N, S = 32, 128, 128, 8, 12
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device="cuda")
    fg_a, fg_b = _fg_inputs(N, H, K, V, K, torch.bfloat16)
    slots = _i32([3, 1, 0, 0, 7, 2, 0, 11])
    A, B = _clone(L), _clone(L)
    y_eager = [_decode_fg(kda_decode_triton, A, tok, slots, fg_a, fg_b) for _ in range(3)]
    _decode_fg(kda_decode_triton, _clone(L), tok, slots, fg_a, fg_b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_static = _decode_fg(kda_decode_triton, B, tok, slots, fg_a, fg_b)
    for step in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, y_eager[step])
        assert torch.equal(y_static[2], torch.zeros_like(y_static[2]))
    assert torch.equal(B["rec_state"], A["rec_state"]) and torch.equal(B["conv_state"], A["conv_state"])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8])
def test_decode_early_state_pdl_graph_gpu(N):
    # Kimi shapes in the model's launch order, captured in a CUDA graph with every launch PDL: the in_proj gemv
    # (writes qkv | f_a g_a | b) -> kda_decode (low-rank gates, default config) -> gemv -> kda_decode: two steps of the
    # same layer with one kernel between, the least separation the early-state premise allows (module doc); replayed
    # 3 times with the pools carried. Per early_state 0 / 1 / 2: vs the unfused chain (skinny_bmm_nt's z, r, then the
    # kernel, eager without PDL) on the graph's own in_proj outputs; the three modes bit-identical
    from kernels.gemv import gemv_triton, skinny_bmm_nt
    H, K, V, D = 32, 128, 128, 2304
    C = 2 * H * K + H * V
    S = N + 2
    gen = torch.Generator(device="cuda").manual_seed(N)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    W_in = rnd(C + 2 * K + H, D, scale=D ** -0.5)
    fg_b = torch.stack([rnd(H * K, K, scale=2.0 / K ** 0.5), rnd(H * V, K, scale=K ** -0.5)])
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    slots = (torch.randperm(S - 1, device="cuda", generator=gen)[:N] + 1).to(torch.int32)
    xs = [rnd(N, D), rnd(N, D)]                                  # static graph inputs, refilled before each replay

    def layer(st, x, es):
        y = gemv_triton(x, W_in, pdl=True)                        # [N, C + 2K + H]
        fg_a = y[:, C:C + 2 * K].view(-1, 2, K).transpose(0, 1)
        o = kda_decode_triton(y[:, :C], st["conv_w"], None, y[:, C + 2 * K:], st["A_log"], st["dt_bias"], None,
                              st["o_norm_w"], EPS, st["conv_state"], st["rec_state"], slots, fg_a=fg_a, fg_b=fg_b,
                              pdl=True, early_state=es)
        return y, o

    def unfused(st, y):
        z, r = skinny_bmm_nt(y[:, C:C + 2 * K].view(-1, 2, K).transpose(0, 1), fg_b).unbind(0)
        return kda_decode_triton(y[:, :C], st["conv_w"], z, y[:, C + 2 * K:], st["A_log"], st["dt_bias"], r,
                                 st["o_norm_w"], EPS, st["conv_state"], st["rec_state"], slots, pdl=False,
                                 early_state=0)

    graphs, outs, pools = {}, {}, {}
    for es in (0, 1, 2):
        layer(_clone(L), xs[0], es)                               # compile outside the capture
        torch.cuda.synchronize()
        pools[es] = _clone(L)
        graphs[es] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[es]):
            outs[es] = [layer(pools[es], x, es) for x in xs]
    A = _clone(L)
    for step in range(3):
        for x in xs:
            x.copy_(rnd(N, D))
        for es in (0, 1, 2):
            graphs[es].replay()
        torch.cuda.synchronize()
        for i in range(2):
            y, o = outs[0][i]
            assert_close(f"o step {step}.{i}", o, unfused(A, y), 5e-3)
            for es in (1, 2):
                assert torch.equal(outs[es][i][0], y), (step, i, es)
                assert torch.equal(outs[es][i][1], o), (step, i, es)
    assert_close("state", pools[0]["rec_state"], A["rec_state"], 5e-3)
    assert torch.equal(pools[0]["conv_state"], A["conv_state"])
    for es in (1, 2):
        assert torch.equal(pools[es]["rec_state"], pools[0]["rec_state"]), es
        assert torch.equal(pools[es]["conv_state"], pools[0]["conv_state"]), es
    assert not torch.equal(A["rec_state"], L["rec_state"])
