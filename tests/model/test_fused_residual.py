"""The decoder's residual add fused with the next RMSNorm (kernels.norm.add_rmsnorm): Triton kernel vs the two torch
ops it replaces. (A kernel test; it lives here with the model code that uses it.)"""
import os

import pytest
import torch

from kernels.norm import add_rmsnorm, add_rmsnorm_ref, add_rmsnorm_triton, rmsnorm_ref
from kernels.testing import assert_close, bf16_tol

DEV = "cuda" if torch.cuda.is_available() else "cpu"
requires_triton = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                     reason="needs CUDA or TRITON_INTERPRET=1")


def test_ref_is_add_then_norm():
    x, r, w = torch.randn(3, 40, dtype=torch.bfloat16), torch.randn(3, 40, dtype=torch.bfloat16), torch.randn(40)
    y, h = add_rmsnorm_ref(x, r, w.bfloat16(), 1e-5)
    assert torch.equal(h, r + x) and torch.equal(y, rmsnorm_ref(r + x, w.bfloat16(), 1e-5))
    y2, h2 = add_rmsnorm(x, r, w.bfloat16(), 1e-5)  # CPU dispatch -> the reference
    assert torch.equal(y2, y) and torch.equal(h2, h)


@requires_triton
@pytest.mark.parametrize("T,D", [(1, 16), (5, 100), (3, 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_triton(T, D, dtype):
    big = (torch.randn(T, 2 * D, device=DEV) * 3).to(dtype)
    x = big[:, D:]                                       # a row-strided view (a slice of a wider output)
    r = (torch.randn(T, D, device=DEV) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    y, h = add_rmsnorm_triton(x, r, w, 1e-5)
    yr, hr = add_rmsnorm_ref(x, r, w, 1e-5)
    assert y.dtype == h.dtype == dtype and y.is_contiguous() and h.is_contiguous()
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(h, hr)  # one rounding of the fp32 sum (the interpreter truncates bf16 instead)
    tol = 1e-5 if dtype == torch.float32 else bf16_tol()
    assert_close("add_rmsnorm h", h, hr, tol)
    assert_close("add_rmsnorm y", y, yr, tol)
    assert add_rmsnorm_triton(x[:0], r[:0], w, 1e-5)[0].shape == (0, D)
