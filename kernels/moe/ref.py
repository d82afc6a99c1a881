"""Torch references for the Kimi-Linear MoE router and routed-expert FFN (spec §3.3, §3.4 item 1).

These run on the CPU path of the dispatch rule and are the ground truth for the Triton kernels.

Tie-breaking (router): experts are ranked by the selection score ``sigmoid(logits) + bias`` in descending order;
equal scores are broken by the LOWER expert index first. The reference gets this with a stable descending sort
(identical to ``torch.topk`` whenever there are no ties, and deterministic when there are). ``topk_ids[:, 0]`` is
the best expert. The Triton router uses the same rule.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_router_ref(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    biased_weights: bool = False,
    append_expert: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias.

    x [T, D], gate_w [E, D], bias [E] (or None) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    logits = x.float() @ gate_w.float().T; s = sigmoid(logits); pick top-k of s + bias;
    weights = s at the picked ids (biased_weights=True: s + bias, reproducing the HF remote-code in-place aliasing);
    renormalize: w / (sum(w) + 1e-20); then w * routed_scaling_factor.
    append_expert (int): one more column [T, k + 1], id append_expert with weight 1.0 (an always-on expert, e.g. the
    shared expert stacked after the routed ones); it takes no part in the selection, renormalisation or scaling.
    """
    logits = x.float() @ gate_w.float().t()
    scores = torch.sigmoid(logits)
    sel = scores + bias.float() if bias is not None else scores
    ids = torch.sort(sel, dim=-1, descending=True, stable=True)[1][:, :top_k]
    w = (sel if biased_weights else scores).gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * routed_scaling_factor
    w, ids = w.float(), ids.to(torch.int32)
    if append_expert is not None:
        w = torch.cat([w, w.new_ones(w.shape[0], 1)], dim=1)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], 1), append_expert)], dim=1)
    return w.contiguous(), ids.contiguous()


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: y[t] = sum_j w[t, j] * E_{ids[t, j]}(x[t]), summed in fp32, cast to x.dtype.

    x [T, D], w13 [E, 2I, D] (rows: gate w1 | up w3), w2 [E, D, I], topk_weights [T, k] fp32, topk_ids [T, k].
    E(x) = w2 (silu(w1 x) * w3 x), computed in x.dtype like HF (F.linear per expert).
    Ids outside [0, E) are ignored (contribute nothing).
    """
    T, D = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    ids = topk_ids.long()
    flat_ids = ids.reshape(-1)
    flat_w = topk_weights.float().reshape(-1)
    flat_tok = torch.arange(T, device=x.device).repeat_interleave(ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        if e < 0 or e >= E:
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        tok = flat_tok[sel]
        h = F.linear(x[tok], w13[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, w2[e])
        out.index_add_(0, tok, y.float() * flat_w[sel, None])
    return out.to(x.dtype)
