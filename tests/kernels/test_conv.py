"""Short conv + SiLU: Triton varlen prefill and single-token decode vs references, state pool semantics."""
import pytest
import torch
import torch.nn.functional as F

from kernels.conv import (
    PrefillConfig,
    short_conv_decode_ref,
    short_conv_decode_triton,
    short_conv_prefill_ref,
    short_conv_prefill_triton,
)
from kernels.testing import assert_bits_equal, assert_close, bf16_tol
from tests.kernels.conftest import requires_triton

pytestmark = requires_triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
W = 4


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def _setup(lens, C, S=8, dtype=torch.float32, state_dtype=None):
    T = sum(lens)
    x = torch.randn(T, C, device=DEV).to(dtype)
    w = torch.randn(C, W, device=DEV) * 0.5
    state = torch.randn(S, W - 1, C, device=DEV).to(state_dtype or dtype)
    return x, w, state


def test_ref_matches_conv1d():
    # one sequence from zero history == F.conv1d with left zero padding (w[:, W-1] multiplies the current token)
    C, T = 6, 9
    x, w, state = _setup([T], C)
    y = short_conv_prefill_ref(x, w, state, _cu([T]), torch.tensor([1], device=DEV), torch.tensor([False], device=DEV))
    ref = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=W - 1, groups=C)[0, :, :T].t())
    assert torch.allclose(y, ref, atol=1e-5)
    assert torch.equal(state[1], x[T - (W - 1):])


@pytest.mark.parametrize("lens", [[1], [63], [64, 65], [5, 1, 2, 0, 70], [2, 1, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["stream", "tile"])
def test_prefill_varlen(lens, dtype, impl):
    C = 48
    x, w, state = _setup(lens, C, dtype=dtype)
    P = len(lens)
    slots = torch.tensor([2 + i for i in range(P)], dtype=torch.int32, device=DEV)
    his = torch.tensor([i % 2 == 0 for i in range(P)], device=DEV)
    # poison: slots without initial state hold NaN (a fresh slot must be read as zeros); other slots 1e30
    for i in range(P):
        if not his[i]:
            state[int(slots[i])] = float("nan")
    state[0] = 1e30
    state[1] = float("nan")
    s_ref = state.clone()
    s_tri = state.clone()
    y_ref = short_conv_prefill_ref(x, w, s_ref, _cu(lens), slots, his)
    y_tri = short_conv_prefill_triton(x, w, s_tri, _cu(lens), slots, his, impl=impl)
    tol = 1e-5 if dtype == torch.float32 else bf16_tol()
    assert_close("y", y_tri, y_ref, tol)
    used = slots.long()
    assert torch.equal(s_tri[used], s_ref[used])                       # state = copies of inputs: exact
    untouched = [s for s in range(state.shape[0]) if s not in used.tolist()]
    for s in untouched:
        assert_bits_equal(f"slot {s}", s_tri[s], state[s])


def test_prefill_short_sequence_shifts_state():
    # a sequence shorter than W-1 keeps the newest old-state rows in front of its tokens
    C = 8
    x, w, state = _setup([2], C)
    old = state[3].clone()
    s = state.clone()
    short_conv_prefill_triton(x, w, s, _cu([2]), torch.tensor([3], dtype=torch.int32, device=DEV),
                              torch.tensor([True], device=DEV))
    assert torch.equal(s[3], torch.cat([old[2:], x], 0))
    s = state.clone()
    short_conv_prefill_triton(x, w, s, _cu([2]), torch.tensor([3], dtype=torch.int32, device=DEV),
                              torch.tensor([False], device=DEV))
    assert torch.equal(s[3], torch.cat([torch.zeros(1, C, device=DEV), x], 0))


@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(N, dtype):
    C = 300
    x, w, state = _setup([N], C, S=N + 2, dtype=dtype)
    slots = torch.randperm(N + 1, device=DEV)[:N].to(torch.int32) + 1
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = short_conv_decode_ref(x, w, s_ref, slots)
    y_tri = short_conv_decode_triton(x, w, s_tri, slots)
    assert_close("y", y_tri, y_ref, 1e-5 if dtype == torch.float32 else bf16_tol())
    assert torch.equal(s_tri, s_ref)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_prefill_then_decode_equals_prefill(split):
    # prefill(T) then decode steps == prefill(T + k), outputs and state; also split prefill == one-shot
    C, T = 24, 10
    x, w, state = _setup([T], C)
    slot = torch.tensor([2], dtype=torch.int32, device=DEV)
    s1 = state.clone()
    y1 = short_conv_prefill_triton(x, w, s1, _cu([T]), slot, torch.tensor([False], device=DEV))
    s2 = state.clone()
    y2 = [short_conv_prefill_triton(x[:split], w, s2, _cu([split]), slot, torch.tensor([False], device=DEV))]
    for t in range(split, T - 2):   # decode steps
        y2.append(short_conv_decode_triton(x[t:t + 1], w, s2, slot))
    y2.append(short_conv_prefill_triton(x[T - 2:], w, s2, _cu([2]), slot, torch.tensor([True], device=DEV)))
    assert torch.allclose(torch.cat(y2), y1, atol=1e-6)
    assert torch.equal(s1, s2)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [4096], [1, 700, 33, 1500]])
def test_conv_kimi_gpu(lens):
    C = 3 * 32 * 128
    x, w, state = _setup(lens, C, S=80, dtype=torch.bfloat16)
    P = len(lens)
    slots = torch.arange(1, P + 1, dtype=torch.int32, device=DEV)
    his = torch.tensor([i % 2 == 1 for i in range(P)], device=DEV)
    s_ref, s_tri = state.clone(), state.clone()
    assert_close("prefill", short_conv_prefill_triton(x, w, s_tri, _cu(lens), slots, his),
                 short_conv_prefill_ref(x, w, s_ref, _cu(lens), slots, his), 5e-3)
    assert torch.equal(s_ref, s_tri)
    xd = torch.randn(64, C, device=DEV, dtype=torch.bfloat16)
    sl = (torch.randperm(79, device=DEV)[:64] + 1).to(torch.int32)
    assert_close("decode", short_conv_decode_triton(xd, w, s_tri, sl), short_conv_decode_ref(xd, w, s_ref, sl), 5e-3)
    assert torch.equal(s_ref, s_tri)


def test_outputs_fully_written_and_uncovered_tokens():
    # NaN-prefilled outputs come back fully written; tokens outside [cu[0], cu[-1]) are zero and read nothing
    C, T = 40, 12
    x, w, state = _setup([T], C)
    cu = torch.tensor([2, 3, 9], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, 4], dtype=torch.int32, device=DEV)
    his = torch.tensor([True, False], device=DEV)
    s_ref, s_tri = state.clone(), state.clone()
    out = torch.full((T, C), float("nan"), device=DEV)
    y = short_conv_prefill_triton(x, w, s_tri, cu, slots, his, out=out)
    y_ref = short_conv_prefill_ref(x, w, s_ref, cu, slots, his)
    assert y is out and torch.isfinite(out).all()
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[9:], torch.zeros_like(out[9:]))
    assert_close("y", out, y_ref, 1e-5)
    assert torch.equal(s_tri, s_ref)
    outd = torch.full((2, C), float("nan"), device=DEV)
    short_conv_decode_triton(x[:2], w, s_tri, slots, out=outd)
    assert_close("decode", outd, short_conv_decode_ref(x[:2], w, s_ref, slots), 1e-5)


# small chunks (BT rows) and channel blocks (BC) so the interpreter covers the streaming kernel's tiling edges:
# sequences crossing chunk boundaries and ending exactly on one, several sequences (empty, length 1..3) between two
# chunk starts, a partial last channel block, both loop step sizes and the prefetching loop
STREAM_CFGS = [PrefillConfig(BT=8, BC=32, num_warps=1, RS=4), PrefillConfig(BT=8, BC=32, num_warps=1, RS=8, PF=True),
               PrefillConfig(BT=16, BC=64, num_warps=1, RS=8)]


def _check_prefill(x, w, state, cu, slots, his, cfg, tol):
    # y (NaN-filled out, fully written) and state vs the reference; slots outside the batch bit-identical
    T, C = x.shape
    s_ref, s_tri = state.clone(), state.clone()
    out = torch.full((T, C), float("nan"), device=DEV, dtype=x.dtype)
    y = short_conv_prefill_triton(x, w, s_tri, cu, slots, his, out=out, cfg=cfg)
    y_ref = short_conv_prefill_ref(x, w, s_ref, cu, slots, his)
    assert y is out and not out.isnan().any()
    assert_close("y", out, y_ref, tol)
    assert torch.equal(s_tri[slots.long()], s_ref[slots.long()])
    for s in sorted(set(range(state.shape[0])) - set(slots.tolist())):
        assert_bits_equal(f"slot {s}", s_tri[s], state[s])


@pytest.mark.parametrize("cfg", STREAM_CFGS, ids=lambda c: f"BT{c.BT}-BC{c.BC}-RS{c.RS}-PF{int(c.PF)}")
@pytest.mark.parametrize("lens", [[17, 8, 9, 31], [1, 2, 3, 0, 1, 5, 2, 16, 1], [0, 40, 0], [7], [24, 3]])
def test_prefill_stream_chunks(cfg, lens):
    C = 40                                                               # two channel blocks at BC 32, one at 64
    x, w, state = _setup(lens, C, S=len(lens) + 4)
    P = len(lens)
    slots = torch.randperm(state.shape[0] - 1, device=DEV)[:P].to(torch.int32) + 1
    his = torch.tensor([i % 3 != 1 for i in range(P)], device=DEV)
    state[slots[~his].long()] = float("nan")                            # no initial state: must read as zeros
    state[0] = float("nan")
    _check_prefill(x, w, state, _cu(lens), slots, his, cfg, 1e-5)


@pytest.mark.parametrize("cfg", STREAM_CFGS[:2], ids=lambda c: f"BT{c.BT}-RS{c.RS}")
def test_prefill_stream_offset_batch(cfg):
    # cu[0] > 0 and cu[-1] < T: zero rows before and after the batch, which starts and ends mid-chunk
    C, T = 40, 30
    x, w, state = _setup([T], C)
    cu = torch.tensor([5, 6, 15, 15, 27], dtype=torch.int32, device=DEV)
    slots = torch.tensor([3, 1, 6, 4], dtype=torch.int32, device=DEV)
    his = torch.tensor([True, False, True, True], device=DEV)
    _check_prefill(x, w, state, cu, slots, his, cfg, 1e-5)


def test_prefill_stream_many_sequences():
    # 37 sequences (segment table of 64) with empty ones, default launch config, bf16 state and inputs
    lens = [int(v) for v in torch.randint(0, 6, (37,))]
    C = 24
    x, w, state = _setup(lens, C, S=40, dtype=torch.bfloat16)
    slots = torch.arange(2, 39, dtype=torch.int32, device=DEV)
    his = torch.rand(37, device=DEV) < 0.5
    _check_prefill(x, w, state, _cu(lens), slots, his, None, bf16_tol())


@pytest.mark.parametrize("Wk", [2, 3])
def test_prefill_stream_short_kernels(Wk):
    # kernel widths 2 and 3 (the window keeps only W-1 rows; the stream kernel takes W <= 4)
    lens = [1, 9, 2, 0, 12]
    C = 40
    x, _, state = _setup(lens, C, S=8)
    w = torch.randn(C, Wk, device=DEV) * 0.5
    state = state[:, :Wk - 1].contiguous()
    slots = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32, device=DEV)
    his = torch.tensor([True, False, True, True, False], device=DEV)
    _check_prefill(x, w, state, _cu(lens), slots, his, STREAM_CFGS[0], 1e-5)


def test_bench_smoke():
    # bench/conv.py --smoke (CPU, interpreter, tiny shapes): reference checks and timing loop of both kernels
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "conv.py"), "--smoke"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("tile (old)") == 2 and r.stdout.count("stream BT64") == 2
