"""MoE entry points (design.md): CUDA tensors -> Triton kernels, CPU tensors -> torch references
(unless KIMI_KERNELS=triton, which forces Triton, e.g. with TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

from kernels._dispatch import use_triton
from kernels.moe.ref import fused_moe_ref, moe_router_ref
from kernels.moe.fused import fused_moe_add_norm  # noqa: F401,E402 (MoE + combine + add + next norm)

__all__ = ["moe_router", "fused_moe", "moe_router_ref", "fused_moe_ref"]


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
