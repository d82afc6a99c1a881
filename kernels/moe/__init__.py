"""MoE entry points (design.md): CUDA tensors -> Triton kernels, CPU tensors -> torch references
(unless KIMI_KERNELS=triton, which forces Triton, e.g. with TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

from kernels._dispatch import use_triton
from kernels.moe.ref import fused_moe_ref, moe_router_ref
from kernels.moe.fused import fused_moe_add_norm  # MoE + combine + add + next norm

__all__ = ["moe_router", "moe_router_add_norm", "fused_moe", "fused_moe_add_norm", "moe_router_ref", "fused_moe_ref"]


def moe_router(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    biased_weights: bool = False,
    append_expert: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights [T, k] fp32, topk_ids [T, k] int32). See kernels/moe/ref.py for the exact semantics.

    append_expert: also a last column (id append_expert, weight 1.0) -> [T, k + 1]: an always-on expert (the model's
    shared expert, stacked as expert E) in the same fused_moe call. The Triton path writes it in the top-k kernel."""
    if use_triton(x):
        from kernels.moe.router import moe_router_triton

        return moe_router_triton(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights,
                                 append_expert)
    return moe_router_ref(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights, append_expert)


def moe_router_add_norm(
    attn: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    biased_weights: bool = False,
    append_expert: int | None = None,
    l2_hint: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (x, h, topk_weights, topk_ids) with (x, h) = kernels.norm.add_rmsnorm(attn, residual, norm_w, eps) and
    the router of x (moe_router's arguments). The Triton path runs decode batches (T <= 16, router v2 / v3) in one
    launch (kernels.moe.router.moe_router_add_norm_triton; KIMI_ROUTER_NORM=0: two); elsewhere the two ops.
    l2_hint: up to two contiguous weight tensors that launch hints into L2 after its logits (a hint: same results)."""
    if use_triton(attn):
        from kernels.moe.router import moe_router_add_norm_triton

        return moe_router_add_norm_triton(attn, residual, norm_w, eps, gate_w, bias, top_k, routed_scaling_factor,
                                          renormalize, biased_weights, append_expert, l2_hint=l2_hint)
    from kernels.norm import add_rmsnorm_ref   # kernels.norm imports kernels.moe (no module-level import here)

    x, h = add_rmsnorm_ref(attn, residual, norm_w, eps)
    w, ids = moe_router_ref(x, gate_w, bias, top_k, routed_scaling_factor, renormalize, biased_weights, append_expert)
    return x, h, w, ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts, weighted and summed in fp32 -> [T, D] in x.dtype. w13 = cat(w1, w3) [E, 2I, D], w2 [E, D, I]."""
    if use_triton(x):
        from kernels.moe.fused import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
