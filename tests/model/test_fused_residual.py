"""The model's fused norms (kernels.norm): the decoder's residual add + the next RMSNorm (add_rmsnorm), and MLA's
kv_a_layernorm + rope-key copy into one cache row (rmsnorm_head); Triton kernels vs the torch ops they replace.
(Kernel tests; they live here with the model code that uses them.)"""
import os

import pytest
import torch

from kernels.norm import (add_rmsnorm, add_rmsnorm_ref, add_rmsnorm_triton, rmsnorm_head, rmsnorm_head_ref,
                          rmsnorm_head_triton, rmsnorm_ref)
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


def test_rmsnorm_head_ref_is_norm_then_cat():
    x, w = torch.randn(3, 24), torch.randn(16)
    y = rmsnorm_head_ref(x, w, 1e-6)
    assert torch.equal(y, torch.cat([rmsnorm_ref(x[:, :16], w, 1e-6), x[:, 16:]], dim=-1))
    assert torch.equal(rmsnorm_head(x, w, 1e-6), y)


@requires_triton
@pytest.mark.parametrize("T,D,P", [(1, 32, 8), (4, 512, 64), (3, 100, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_head_triton(T, D, P, dtype):
    big = (torch.randn(T, 3 * (D + P), device=DEV) * 3).to(dtype)
    x = big[:, D + P:2 * (D + P)]                         # a row view of a wider projection output
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    y = rmsnorm_head_triton(x, w, 1e-6)
    ref = rmsnorm_head_ref(x, w, 1e-6)
    assert y.dtype == dtype and y.is_contiguous() and y.shape == (T, D + P)
    assert torch.equal(y[:, D:], x[:, D:])               # the tail is copied, untouched
    assert_close("rmsnorm_head", y, ref, 1e-5 if dtype == torch.float32 else bf16_tol())
