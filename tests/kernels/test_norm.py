"""rmsnorm / gated_rmsnorm / combine_add_rmsnorm Triton kernels vs torch references (and, for the last, vs the
two-launch sequence it replaces, bit for bit)."""
import pytest
import torch

from kernels.norm import (add_rmsnorm_triton, combine_add_rmsnorm, combine_add_rmsnorm_ref,
                          combine_add_rmsnorm_triton, gated_rmsnorm, gated_rmsnorm_ref, gated_rmsnorm_triton, rmsnorm,
                          rmsnorm_ref, rmsnorm_triton)
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


# ------------------------------------------------------------------------------------------------ combine + add + norm
def _combine_inputs(T, k, D, dtype, split):
    y = torch.randn(split, T * k, D, device=DEV) * 2                   # gemm2's fp32 K partials
    y = y[0].to(dtype) if split == 1 else y                          # one split: y in x.dtype
    tw = torch.rand(T, k, device=DEV) + 0.1
    r = (torch.randn(T, 2 * D, device=DEV) * 3).to(dtype)[:, D:]      # a row-strided residual
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    return y, tw, r, w


@pytest.mark.parametrize("T,k,D,split", [(1, 9, 2304, 1), (3, 2, 100, 1), (17, 9, 100, 1), (3, 9, 1000, 3),
                                         (17, 2, 37, 2), (1, 2, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_add_rmsnorm_bits(T, k, D, split, dtype):
    """The fused kernel == moe_combine then add_rmsnorm_triton (what fused_moe + the next norm launch), bit for bit."""
    from kernels.moe.fused import moe_combine

    y, tw, r, w = _combine_inputs(T, k, D, dtype, split)
    o, h = combine_add_rmsnorm_triton(y, tw, r, w, 1e-6)
    x = moe_combine(y, tw, torch.empty(T, D, dtype=dtype, device=DEV))
    o2, h2 = add_rmsnorm_triton(x, r, w, 1e-6)
    assert o.dtype == h.dtype == dtype and o.shape == h.shape == (T, D)
    assert torch.equal(h, h2) and torch.equal(o, o2)
    yr, hr = combine_add_rmsnorm_ref(y, tw, r, w, 1e-6)                 # and close to the torch reference
    tol = 1e-5 if dtype == torch.float32 else bf16_tol()
    assert_close("combine h", h, hr, tol)
    assert_close("combine y", o, yr, tol)


def test_combine_add_rmsnorm_ref_formula():
    T, k, D = 3, 2, 24
    y, tw, r, w = _combine_inputs(T, k, D, torch.float32, 1)
    x = (tw[:, :, None] * y.view(T, k, D)).sum(1)
    o, h = combine_add_rmsnorm_ref(y, tw, r, w, 1e-6)
    torch.testing.assert_close(h, r + x)
    torch.testing.assert_close(o, rmsnorm_ref(r + x, w, 1e-6))
    assert combine_add_rmsnorm_triton(y[:0], tw[:0], r[:0], w, 1e-6)[0].shape == (0, D)
    o2, h2 = combine_add_rmsnorm(y.cpu(), tw.cpu(), r.cpu(), w.cpu(), 1e-6)  # CPU dispatch (ref or interpreter)
    torch.testing.assert_close(h2, h.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("T,split", [(1, 1), (64, 1), (5, 3), (4097, 1)])
def test_combine_add_rmsnorm_kimi_gpu(T, split):
    """Kimi-Linear shapes (D 2304, 8 routed + 1 shared expert) on the GPU: compiled fp contraction and reduction
    trees must give the same bits as the two kernels."""
    from kernels.moe.fused import moe_combine

    y, tw, r, w = _combine_inputs(T, 9, 2304, torch.bfloat16, split)
    o, h = combine_add_rmsnorm_triton(y, tw, r, w, 1e-6)
    o2, h2 = add_rmsnorm_triton(moe_combine(y, tw, torch.empty(T, 2304, dtype=torch.bfloat16, device="cuda")), r, w,
                                1e-6)
    assert torch.equal(h, h2) and torch.equal(o, o2)


def _tiny_logits(path, dtype, monkeypatch, fuse):
    from backend.model.batch import ForwardBatch
    from backend.model.loader import load_model

    monkeypatch.setenv("KIMI_FUSE_COMBINE_NORM", "1" if fuse else "0")
    model = load_model(path, DEV, dtype)
    assert any(getattr(layer, "defer_combine", False) for layer in model.model.layers) == fuse
    # one mixed step: a decode (T = 1 part) and a 5-token prefill
    seqs = [([7], 0, 1, [1, 2]), (list(range(20, 25)), 0, 2, [3, 4])]
    batch = ForwardBatch.build(seqs, 1, 4, model.device, logits_positions=list(range(6)))
    return model.compute_logits(model(batch, model.allocate_cache(3, 8, 4)), batch.logits_index)


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_model_fused_combine_norm_same_logits(tmp_path_factory, monkeypatch, kernels):
    """Tiny checkpoint: logits with KIMI_FUSE_COMBINE_NORM=1 == without (bf16; a decode and a prefill in one step).
    "triton" runs the Triton path (the interpreter on CPU), where the MoE layers skip the combine; "ref" checks that
    the switch leaves the torch reference path alone."""
    import kernels._dispatch as d
    from tools.tiny_checkpoint import write_tiny_checkpoint

    if kernels == "ref" and DEV == "cuda":
        pytest.skip("CUDA tensors always run Triton")
    monkeypatch.setattr(d, "_FORCE", kernels)
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_fuse")), tokenizer=None, seed=3)
    off = _tiny_logits(path, torch.bfloat16, monkeypatch, False)
    on = _tiny_logits(path, torch.bfloat16, monkeypatch, True)
    assert torch.isfinite(off).all() and torch.equal(on, off)
