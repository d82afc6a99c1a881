"""Pure-torch references for Kimi Delta Attention (KDA).

Conventions (docs/design.md, reference/kimi-linear.md §3.1):

* q, k: [..., T, H, K], v: [..., T, H, V], g: [..., T, H, K] **natural-log** per-token gate (g <= 0, no lower
  bound), beta: [..., T, H] in (0, 1) (already sigmoided).
* Recurrent state S: [H, K, V] per sequence (fla layout: S[k, v], the decay scales the K rows). The slot pools are
  [S, H, K, V] fp32; slot 0 is the null slot.
* Math is done in fp32, or in fp64 when the inputs are fp64 (for oracle tests).

Order of one step (spec §3.1 step 7):
    S = diag(exp(g_t)) S ; u = beta_t (v_t - S^T k_t) ; S = S + k_t u^T ; o_t = S^T (scale q_t)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


# --------------------------------------------------------------------------------------------------- gate / norms
def kda_gate_ref(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log[h]) * softplus(z + dt_bias), fp32 (fp64 if z is fp64), natural log.

    z: [..., H*K] (or [..., H, K]); A_log: [H] (any shape with H elements, e.g. [1, 1, H, 1]); dt_bias: [H*K].
    Returns [..., H, K]. softplus is linear above 20 (torch's default threshold).
    """
    H = A_log.numel()
    acc = _acc_dtype(z)
    if z.shape[-1] != dt_bias.numel():                                # [..., H, K] given
        z = z.reshape(*z.shape[:-2], -1)
    HK = z.shape[-1]
    assert HK == dt_bias.numel() and HK % H == 0, (z.shape, dt_bias.shape, A_log.shape)
    K = HK // H
    x = z.to(acc) + dt_bias.reshape(-1).to(acc)
    sp = F.softplus(x, beta=1.0, threshold=20.0)
    g = -torch.exp(A_log.reshape(-1).to(acc))[:, None] * sp.reshape(*sp.shape[:-1], H, K)
    return g


def l2norm_ref(x: torch.Tensor, eps: float = L2NORM_EPS, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, fp32 math (fp64 kept). Returns `dtype` (default: fp32/fp64)."""
    acc = _acc_dtype(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)
    return y if dtype is None else y.to(dtype)


# --------------------------------------------------------------------------------------------------- recurrence
def kda_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    use_qk_l2norm: bool = False,
):
    """Token-by-token KDA (the oracle).

    q, k: [B, T, H, K] or [T, H, K]; v: [.., T, H, V]; g: [.., T, H, K] natural-log gate; beta: [.., T, H].
    initial_state: [B, H, K, V] (or [H, K, V] for unbatched input), read as fp32/fp64.
    Returns (o [.., T, H, V] in v.dtype, final_state [.., H, K, V] fp32 (fp64 if computing in fp64) or None).
    q is multiplied by `scale` (default K**-0.5); q, k are used as given unless use_qk_l2norm.
    """
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
        if initial_state is not None:
            initial_state = initial_state.unsqueeze(0)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    acc = _acc_dtype(q, k, v, g, initial_state)
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=acc, device=q.device)
    if initial_state is not None:
        S = S + initial_state.to(acc)
    o = torch.empty(B, T, H, V, dtype=acc, device=q.device)
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None]                         # decay K rows        [B,H,K,V]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)               # S^T k               [B,H,V]
        u = beta[:, t][..., None] * (v[:, t] - pred)                   # delta               [B,H,V]
        S = S + k[:, t][..., None] * u[:, :, None, :]                  # rank-1 write
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)            # read updated state
    o = o.to(v.dtype)
    if unbatched:
        o, S = o[0], S[0]
    return o, (S if output_final_state else None)


def kda_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    output_final_state: bool = True,
    use_qk_l2norm: bool = False,
):
    """Chunked WY/UT form (spec §1.2), mathematically identical to kda_recurrent_ref.

    Same shapes as kda_recurrent_ref. Any T (partial last chunk, T=1, T=0). Every exponential formed is exp of a
    non-positive number (pairwise G[r]-G[s] with s <= r, G, G_last - G), so gates down to any magnitude are safe.
    """
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
        if initial_state is not None:
            initial_state = initial_state.unsqueeze(0)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    acc = _acc_dtype(q, k, v, g, initial_state)
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    dev = q.device
    # head-major: [B, H, T, *]
    q, k, v, g = (t.to(acc).transpose(1, 2) for t in (q, k, v, g))
    beta = beta.to(acc).transpose(1, 2)
    q = q * scale
    S = torch.zeros(B, H, K, V, dtype=acc, device=dev)
    if initial_state is not None:
        S = S + initial_state.to(acc)
    o = torch.empty(B, H, T, V, dtype=acc, device=dev)
    for s0 in range(0, T, chunk_size):
        s1 = min(s0 + chunk_size, T)
        C = s1 - s0
        qc, kc, vc, bc = q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], beta[:, :, s0:s1]
        G = g[:, :, s0:s1].cumsum(2)                                   # [B,H,C,K] chunk-local inclusive cumsum
        idx = torch.arange(C, device=dev)
        incl = idx[:, None] >= idx[None, :]                            # s <= r
        strict = idx[:, None] > idx[None, :]                           # s <  r
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]               # [B,H,C(r),C(s),K] = G[r]-G[s]
        diff = diff.masked_fill(~incl[:, :, None], float("-inf"))      # never exp a positive number
        E = torch.exp(diff)
        Dkk = torch.einsum("bhrd,bhsd,bhrsd->bhrs", kc, kc, E) * strict
        Dqk = torch.einsum("bhrd,bhsd,bhrsd->bhrs", qc, kc, E) * incl
        L = bc[..., None] * Dkk                                        # diag(beta) Dkk
        eye = torch.eye(C, dtype=acc, device=dev)
        gam = torch.exp(G)                                             # <= 1
        rhs_w = bc[..., None] * (kc * gam)                             # [B,H,C,K]
        rhs_u = bc[..., None] * vc                                     # [B,H,C,V]
        Wm = torch.linalg.solve_triangular(eye + L, rhs_w, upper=False, unitriangular=True)
        Um = torch.linalg.solve_triangular(eye + L, rhs_u, upper=False, unitriangular=True)
        Vn = Um - Wm @ S                                               # [B,H,C,V]
        o[:, :, s0:s1] = (qc * gam) @ S + Dqk @ Vn
        Glast = G[:, :, -1]                                            # [B,H,K] last valid row
        kg = kc * torch.exp(Glast[:, :, None, :] - G)                  # exponent <= 0
        S = torch.exp(Glast)[..., None] * S + kg.transpose(-1, -2) @ Vn
    o = o.transpose(1, 2).to(v.dtype)
    if unbatched:
        o, S = o[0], S[0]
    return o, (S if output_final_state else None)


# --------------------------------------------------------------------------------------------------- varlen / pools
def kda_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    cu_seqlens: torch.Tensor,
    rec_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: Optional[torch.Tensor] = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> torch.Tensor:
    """Packed varlen KDA over a slot pool, in place on the pool.

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] natural-log gate; beta: [T, H]; cu_seqlens [P+1];
    rec_state [S, H, K, V]; state_slots [P]; has_initial_state [P] bool (False -> start from zeros).
    Writes each sequence's final state into rec_state[slot] (cast to the pool dtype). Returns o [T, H, V]
    (v.dtype); tokens outside [cu[0], cu[-1]) are zero.
    """
    fn = kda_chunk_ref if mode == "chunk" else kda_recurrent_ref
    cu = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in state_slots.tolist()]
    his = [True] * len(slots) if has_initial_state is None else [bool(x) for x in has_initial_state.tolist()]
    o = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    for p, slot in enumerate(slots):
        bos, eos = cu[p], cu[p + 1]
        h0 = rec_state[slot] if his[p] else torch.zeros_like(rec_state[slot])
        if eos == bos:
            rec_state[slot] = h0
            continue
        kw = dict(chunk_size=chunk_size) if mode == "chunk" else {}
        o_p, ht = fn(q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], scale,
                     initial_state=h0, output_final_state=True, **kw)
        o[bos:eos] = o_p
        rec_state[slot] = ht.to(rec_state.dtype)
    return o


def kda_core_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    rec_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: Optional[torch.Tensor] = None,
    mode: str = "chunk",
) -> torch.Tensor:
    """Reference of chunk_kda_fwd's contract (kernels/kda/chunk.py).

    q, k [T, H, K], v [T, H, V] post-conv+SiLU (pre-L2-norm); z [T, H*K] raw gate input; b [T, H] beta logits.
    Does gate, L2 norm, sigmoid(beta) and the delta rule over the slot pool. Returns o [T, H, V] in v.dtype.
    """
    g = kda_gate_ref(z, A_log, dt_bias)
    beta = torch.sigmoid(b.float())
    return kda_varlen_ref(l2norm_ref(q), l2norm_ref(k), v, g, beta, scale, cu_seqlens, rec_state, state_slots,
                          has_initial_state, mode=mode)
