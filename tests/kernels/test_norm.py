"""rmsnorm / gated_rmsnorm Triton kernels vs torch references."""
import pytest
import torch

from kernels.norm import gated_rmsnorm, gated_rmsnorm_ref, gated_rmsnorm_triton, rmsnorm, rmsnorm_ref, rmsnorm_triton
from kernels.testing import assert_close, bf16_tol
from tests.kernels.conftest import requires_triton

pytestmark = requires_triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: bf16_tol()}


@pytest.mark.parametrize("T,D", [(1, 16), (5, 100), (3, 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm(T, D, dtype):
    x = (torch.randn(T, D, device=DEV) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    y = rmsnorm_triton(x, w, 1e-5)
    ref = rmsnorm_ref(x, w, 1e-5)
    assert y.dtype == dtype
    assert_close("rmsnorm", y, ref, TOL[dtype])


def test_rmsnorm_ref_formula():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rmsnorm_ref(x, w, 1e-5), ref)


@pytest.mark.parametrize("T,H,V", [(1, 2, 16), (3, 2, 32), (65, 2, 16), (2, 3, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm(T, H, V, dtype):
    o = (torch.randn(T, H, V, device=DEV) * 2).to(dtype)
    r = (torch.randn(T, H, V, device=DEV) * 3).to(dtype)
    w = 1 + 0.1 * torch.randn(V, device=DEV)
    y = gated_rmsnorm_triton(o, r, w, 1e-5)
    assert y.dtype == dtype and y.shape == o.shape
    assert_close("gated_rmsnorm", y, gated_rmsnorm_ref(o, r, w, 1e-5), TOL[dtype])


def test_gated_rmsnorm_formula_and_strides():
    T, H, V = 4, 2, 16
    o = torch.randn(T, H, V, device=DEV)
    big = torch.randn(T, 2 * H * V, device=DEV)
    r = big[:, H * V:].view(T, H, V)                     # non-contiguous rows
    w = torch.randn(V, device=DEV)
    ref = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(r)
    assert torch.allclose(gated_rmsnorm_ref(o, r, w, 1e-5), ref, atol=1e-6)
    assert torch.allclose(gated_rmsnorm_triton(o, r, w, 1e-5), ref, atol=1e-5)
    # flattened [T, H*V] gate is accepted by the dispatcher, zero rows stay finite
    z = torch.zeros(T, H, V, device=DEV)
    assert torch.isfinite(gated_rmsnorm(z, r.reshape(T, H * V), w, 1e-5)).all()
    assert torch.allclose(rmsnorm(o.reshape(T, -1), torch.ones(H * V, device=DEV), 1e-5),
                          rmsnorm_ref(o.reshape(T, -1), torch.ones(H * V, device=DEV), 1e-5), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4097])
def test_gated_rmsnorm_kimi_gpu(T):
    o = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(128, device="cuda")
    assert_close("gated", gated_rmsnorm_triton(o, r, w, 1e-5), gated_rmsnorm_ref(o, r, w, 1e-5), 5e-3)
    x = torch.randn(T, 2304, device="cuda", dtype=torch.bfloat16)
    wx = torch.rand(2304, device="cuda", dtype=torch.bfloat16)
    assert_close("rms", rmsnorm_triton(x, wx, 1e-5), rmsnorm_ref(x, wx, 1e-5), 5e-3)


def test_gated_rmsnorm_out_fully_written():
    o = torch.randn(3, 2, 16, device=DEV)
    r = torch.randn(3, 2, 16, device=DEV)
    w = torch.randn(16, device=DEV)
    out = torch.full((3, 32), float("nan"), device=DEV)
    y = gated_rmsnorm_triton(o, r, w, 1e-5, out=out)
    assert y is out and torch.isfinite(out).all()
    assert_close("out", out.view(3, 2, 16), gated_rmsnorm_ref(o, r, w, 1e-5), 1e-5)
