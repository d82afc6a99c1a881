"""kernels/argmax.py argmax_rows against torch.argmax: ties across blocks, NaN, +-inf, all -inf rows, awkward widths
(interpreter at small shapes with small blocks: many partials per row); Kimi's vocabulary on the GPU, in a graph."""
import pytest
import torch

from kernels._tensors import arrival_counters
from kernels.argmax import argmax_rows
from tests.kernels.conftest import requires_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(M, V, kind, gen, dtype=torch.float32):
    x = torch.randn(M, V, generator=gen)
    for r in range(M):
        a, b = sorted(torch.randint(0, V, (2,), generator=gen).tolist())
        if kind == "tie":                       # the maximum twice, usually in different blocks: the first wins
            x[r, a] = x[r, b] = 100.0
        elif kind == "nan":                     # NaN beats +inf, the first NaN wins
            x[r, b] = float("nan")
            x[r, a] = float("inf")
            if r % 2:
                x[r, a] = float("nan")
        elif kind == "inf":                     # +inf twice
            x[r, b] = x[r, a] = float("inf")
        elif kind == "neginf":                  # every value -inf: index 0 (row 1: one finite value at the end)
            x[r] = float("-inf")
            if r == 1:
                x[r, V - 1] = -1e30
        elif kind == "last":                    # the maximum in the last, partial block
            x[r, V - 1] = 100.0
    return x.to(dtype).to(DEV)


@requires_triton
@pytest.mark.parametrize("kind", ["random", "tie", "nan", "inf", "neginf", "last"])
@pytest.mark.parametrize("M,V,block", [(1, 1, 64), (3, 37, 16), (2, 1000, 64), (5, 4097, 256), (65, 300, 128),
                                       (1, 5000, 4096)])
def test_argmax_rows(M, V, block, kind):
    gen = torch.Generator().manual_seed(M * 7919 + V)
    x = _case(M, V, kind, gen)
    got = argmax_rows(x, block=block)
    assert torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, dim=-1))
    assert not arrival_counters(x.device, M)[:M].any()          # counters back to zero: the next launch sees zeros
    assert torch.equal(argmax_rows(x, block=block), got)        # and gets the same answer


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_rows_half(dtype):
    gen = torch.Generator().manual_seed(3)
    x = _case(4, 777, "tie", gen, dtype)
    assert torch.equal(argmax_rows(x, block=128), torch.argmax(x.float(), dim=-1))


@requires_triton
def test_argmax_rows_strided_and_empty():
    gen = torch.Generator().manual_seed(5)
    x = _case(6, 900, "tie", gen)[::2, :700]                   # row stride 1800, not contiguous rows
    assert torch.equal(argmax_rows(x, block=128), torch.argmax(x, dim=-1))
    assert argmax_rows(torch.zeros(0, 10, device=DEV)).shape == (0,)
    t = torch.randn(8, 33, device=DEV).t()                      # column stride 33: copied first
    assert torch.equal(argmax_rows(t, block=16), torch.argmax(t, dim=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("kind", ["random", "tie", "nan"])
def test_argmax_rows_kimi_gpu(M, kind):
    gen = torch.Generator().manual_seed(M)
    x = _case(M, 163840, kind, gen)
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


@pytest.mark.gpu
def test_argmax_rows_cuda_graph():
    x = torch.randn(2, 163840, device="cuda")
    out = argmax_rows(x)                                        # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = argmax_rows(x)
    for seed in range(3):
        x.copy_(torch.randn(2, 163840, generator=torch.Generator().manual_seed(seed)).cuda())
        g.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
