"""Test helpers shared by kernel tests (fla-style relative RMS error)."""
from __future__ import annotations

import torch


def err_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    """sqrt(mean((x-ref)^2)) / sqrt(mean(ref^2)) in fp64 (fla's get_err_ratio)."""
    x = x.detach().double()
    ref = ref.detach().double()
    err = (x - ref).pow(2).mean().sqrt().item()
    base = ref.pow(2).mean().sqrt().item()
    return err / max(base, 1e-30)


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, ratio: float, atol: float = 0.0) -> None:
    """Passes when the RMS error ratio is <= ratio, or the absolute max error is <= atol. Always checks finiteness."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    abs_err = (x.detach().double() - ref.detach().double()).abs().max().item() if x.numel() else 0.0
    r = err_ratio(x, ref) if x.numel() else 0.0
    assert r <= ratio or abs_err <= atol, f"{name}: err ratio {r:.3e} > {ratio:.1e} (max abs err {abs_err:.3e})"


def make_kda_layer(H: int, K: int, V: int, S: int, W: int = 4, device="cpu", seed: int = 0,
                   a_log_scale: float = 1.0, conv_dtype=torch.float32):
    """Random KDA layer parameters and state pools: dict(conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state).

    conv_state [S, W-1, 2HK+HV] (conv_dtype) and rec_state [S, H, K, V] fp32 are filled with random values
    (slot 0 too), so that tests notice reads of slots that should be treated as zeros.
    """
    gen = torch.Generator().manual_seed(seed)
    C = 2 * H * K + H * V

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s)

    return dict(
        conv_w=rn(C, W, s=0.5).to(device),
        A_log=(rn(H) * a_log_scale).to(device),
        dt_bias=rn(H * K).to(device),
        o_norm_w=(1.0 + 0.1 * rn(V)).to(device),
        conv_state=rn(S, W - 1, C).to(conv_dtype).to(device),
        rec_state=rn(S, H, K, V, s=0.1).to(device),
    )


def make_kda_tokens(T: int, H: int, K: int, V: int, dtype=torch.float32, device="cpu", seed: int = 1,
                    z_scale: float = 2.0):
    """Random per-token mixer inputs: dict(qkv [T, 2HK+HV], z [T, HK], b [T, H], r [T, HV])."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * H * K + H * V
    return dict(
        qkv=torch.randn(T, C, generator=gen).to(dtype).to(device),
        z=(torch.randn(T, H * K, generator=gen) * z_scale).to(dtype).to(device),
        b=torch.randn(T, H, generator=gen).to(dtype).to(device),
        r=torch.randn(T, H * V, generator=gen).to(dtype).to(device),
    )


def slice_tokens(tok: dict, a: int, b: int) -> dict:
    return {k: v[a:b] for k, v in tok.items()}


def bf16_tol() -> float:
    """fla's bf16 tolerance (5e-3) on a GPU. Triton's CPU interpreter *truncates* fp32 -> bf16 casts (round toward
    zero, measured with triton 3.9), which roughly doubles the error of each rounding point, so interpreter runs get
    1.5e-2."""
    return 5e-3 if torch.cuda.is_available() else 1.5e-2


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (NaN-safe exact comparisons)."""
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(it)


def assert_bits_equal(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(bits(a), bits(b)), f"{name}: not bit-identical"
