"""What an engine step launches, counted through the Triton kernels under the interpreter (tools/launches.py).

A small prefill step on the H200 is bound by its launches (BENCHMARKS.md, twentieth round), and a host sync inside
a step stalls the GPU (and cannot be captured in a CUDA graph). These tests pin what was removed: the KDA varlen
metadata built per layer, and the expanded MLA's per-layer read of its key count."""
import os

import pytest

import kernels._dispatch as dispatch
from backend.model import kimi_linear
from tools.launches import LaunchCounter, build_engine, count_steps

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts the Triton path on CPU tensors: needs TRITON_INTERPRET=1")

LAYERS = "KMKK"   # three KDA layers, one MLA layer (layer 0 dense, the rest MoE)


@pytest.fixture(scope="module")
def counted():
    """(prefill counter, decode counter): two fresh prompts in one step, the MLA in its expanded form (as CUDA runs
    prefill parts of >= 256 tokens); then an eager decode step of three sequences."""
    mp = pytest.MonkeyPatch()
    mp.setattr(dispatch, "_FORCE", "triton")
    mp.setitem(kimi_linear.MLA_EXPANDED_MIN_TOKENS, "cpu", 1)
    eng = build_engine("cpu", LAYERS, 40)
    try:
        yield count_steps(eng, [list(range(1, 25)), list(range(50, 66))], 3, warmup=False)  # interpreter: no JIT
    finally:
        eng.shutdown()
        mp.undo()


def _torch_launches(c: LaunchCounter, prefixes) -> int:
    return sum(n for (site, what), n in c.sites.items() if what.startswith("torch") and site.startswith(prefixes))


def test_steps_never_sync(counted):
    """No `.item()` / nonzero in a prefill or a decode step: the expanded MLA's key gather is sized by the batch's
    host-side key count (ForwardBatch.prefill_keys), not read from the device per layer."""
    pre, dec = counted
    assert pre.total("triton") > 0 and dec.total("triton") > 0
    assert not pre.syncs, pre.report("prefill", LAYERS)
    assert not dec.syncs, dec.report("decode", LAYERS)
    assert any("mla_prefill_expanded" in what or "_mla_prefill_kernel" in what for (_, what) in pre.sites)


def test_kda_metadata_once_per_step(counted):
    """The KDA prefill's varlen metadata (initial-state flags as int8, chunk offsets) is built once per step for
    all KDA layers (KimiModel.step_meta): torch launches from kernels/kda and kernels/conv.py do not grow with the
    layer count (they were 7 per KDA layer, 21 here)."""
    pre, _ = counted
    assert LAYERS.count("K") == 3
    n = _torch_launches(pre, ("kernels/kda", "kernels/conv"))
    assert n <= 6, pre.report("prefill", LAYERS)
    per_kda = pre.per_layer(LAYERS)["K"]
    assert per_kda[1] / per_kda[0] >= 5, per_kda   # conv, prep, akk, wu, hpass, gated norm: the kernels themselves


def test_counter_attributes_sites():
    """The counter itself: a torch op and a Triton launch are counted at the calling line; views and empty
    allocations are not counted; .item() is a sync."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.zeros((N,), tl.float32) + 1.0)

    x = torch.zeros(16)
    with LaunchCounter() as c:
        y = x.view(4, 4).t()        # views: nothing
        z = torch.empty(3)          # allocation: nothing
        w = y + 1                   # one launch
        _fill[(1,)](x, N=16)        # one Triton launch
        s = w.sum().item()          # one launch + one sync
    assert z.numel() == 3 and s == 16.0 and float(x.sum()) == 16.0
    assert c.total("torch") == 2 and c.total("triton") == 1
    assert sum(c.syncs.values()) == 1
