"""Kimi Delta Attention, mixer level: short conv + SiLU, gate, L2 norm, beta, delta rule, gated RMSNorm.

kda_prefill(qkv [T, 2HK+HV], conv_w [C, W] f32, z [T, HK], b [T, H], A_log [H] f32, dt_bias [HK] f32,
            r [T, HV], o_norm_w [V], eps, conv_state [S, W-1, C], rec_state [S, H, K, V] f32,
            cu_seqlens [P+1] i32, state_slots [P] i32, has_initial_state [P] bool) -> [T, HV] (qkv.dtype)
kda_decode(qkv [N, C], conv_w, z [N, HK], b [N, H], A_log, dt_bias, r [N, HV], o_norm_w, eps,
           conv_state, rec_state, state_slots [N] i32, fg_a=None, fg_b=None) -> [N, HV]
    low-rank gates instead of z and r (z = r = None): fg_a [2, N, R] (f_a | g_a rows; a strided view of the
    projection output is fine, or a pair of [N, R]) and fg_b [2, HK, R] (f_b | g_b weights, or a pair
    f_b [HK, R], g_b [HV, R]); z, r = (fg_a @ fg_b^T in fp32, rounded to fg_a.dtype), i.e. what
    kernels.gemv.skinny_bmm_nt(fg_a, fg_b) returns. The Triton path runs skinny_bmm_nt, then the decode kernel.

Both update conv_state and rec_state in place at the given slots. H = b.shape[1], K = z.shape[1] // H,
V = r.shape[1] // H (K = V = 128 for Kimi; K != V is supported for tests). scale = K ** -0.5.
On CUDA (or KIMI_KERNELS=triton) the Triton kernels run, otherwise the torch references (docs/design.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kernels._dispatch import use_triton
from kernels.conv import short_conv_decode_ref, short_conv_prefill_ref, short_conv_prefill_triton
from kernels.kda.ref import (
    kda_chunk_ref,
    kda_core_ref,
    kda_gate_ref,
    kda_recurrent_ref,
    kda_varlen_ref,
    l2norm_ref,
)
from kernels.kda.chunk import chunk_kda_fwd, chunk_offsets_of
from kernels.kda.recurrent import kda_decode_triton
from kernels.gemv import gemv_ref
from kernels.norm import gated_rmsnorm_ref, gated_rmsnorm_triton

__all__ = [
    "kda_prefill", "kda_prefill_meta", "KDAPrefillMeta", "kda_decode", "kda_prefill_ref", "kda_decode_ref",
    "kda_prefill_triton", "kda_decode_triton",
    "kda_gate_ref", "l2norm_ref", "kda_recurrent_ref", "kda_chunk_ref", "kda_varlen_ref", "kda_core_ref",
]


def _fg_ref(fg_a, fg_b):
    """(z, r) from the low-rank inputs with gemv_ref semantics: fp32 matmul, rounded to fg_a's dtype."""
    fa, ga, fb, gb = fg_a[0], fg_a[1], fg_b[0], fg_b[1]
    return gemv_ref(fa, fb), gemv_ref(ga, gb)


def _dims(z: torch.Tensor, b: torch.Tensor, r: torch.Tensor):
    H = b.shape[-1]
    K = z.shape[-1] // H
    V = r.shape[-1] // H
    return H, K, V


def _split_qkv(y: torch.Tensor, H: int, K: int, V: int):
    T = y.shape[0]
    q = y[:, : H * K].reshape(T, H, K)
    k = y[:, H * K: 2 * H * K].reshape(T, H, K)
    v = y[:, 2 * H * K:].reshape(T, H, V)
    return q, k, v


# --------------------------------------------------------------------------------------------------- prefill
def kda_prefill_ref(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                    cu_seqlens, state_slots, has_initial_state=None, mode: str = "chunk"):
    H, K, V = _dims(z, b, r)
    T = qkv.shape[0]
    y = short_conv_prefill_ref(qkv, conv_w, conv_state, cu_seqlens, state_slots, has_initial_state)
    q, k, v = _split_qkv(y, H, K, V)
    o = kda_core_ref(q, k, v, z, A_log, dt_bias, b, K ** -0.5, rec_state, cu_seqlens, state_slots,
                     has_initial_state, mode=mode)                        # [T, H, V] qkv.dtype
    return gated_rmsnorm_ref(o, r.reshape(T, H, V), o_norm_w, eps).reshape(T, H * V)


class KDAPrefillMeta(NamedTuple):
    """A step's varlen metadata for the Triton prefill, the same for every KDA layer: computed once per step
    (kda_prefill_meta), it saves each layer seven small launches (six once per step)."""
    has_initial_state: torch.Tensor   # [P] i8
    chunk_offsets: torch.Tensor       # [P+1] i32: 64-token chunks before each sequence (kernels/kda/chunk.py)


def kda_prefill_meta(cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor) -> KDAPrefillMeta:
    return KDAPrefillMeta(has_initial_state.to(torch.int8), chunk_offsets_of(cu_seqlens))


def kda_prefill(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                cu_seqlens, state_slots, has_initial_state: Optional[torch.Tensor] = None,
                meta: Optional[KDAPrefillMeta] = None):
    """meta (Triton path; ignored by the reference): kda_prefill_meta(cu_seqlens, has_initial_state)."""
    if not use_triton(qkv):
        return kda_prefill_ref(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                               cu_seqlens, state_slots, has_initial_state)
    return kda_prefill_triton(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                              cu_seqlens, state_slots, has_initial_state, meta=meta)


def kda_prefill_triton(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                       cu_seqlens, state_slots, has_initial_state: Optional[torch.Tensor] = None,
                       out: Optional[torch.Tensor] = None, meta: Optional[KDAPrefillMeta] = None):
    """Triton path: conv kernels -> chunk_kda_fwd (kernels/kda/chunk.py) -> gated RMSNorm kernel.
    `out` [T, H*V] (optional) is fully written; tokens outside [cu[0], cu[-1]) get zeros. meta: see kda_prefill
    (it replaces has_initial_state)."""
    H, K, V = _dims(z, b, r)
    T = qkv.shape[0]
    if meta is None:
        if has_initial_state is None:
            has_initial_state = torch.ones(state_slots.shape[0], dtype=torch.bool, device=qkv.device)
        meta = kda_prefill_meta(cu_seqlens, has_initial_state)
    hi = meta.has_initial_state
    y = short_conv_prefill_triton(qkv, conv_w, conv_state, cu_seqlens, state_slots, hi)  # [T, C]
    q, k, v = _split_qkv(y, H, K, V)                     # strided views: chunk_kda_fwd takes a token stride
    o = chunk_kda_fwd(q, k, v, z, A_log, dt_bias, b, K ** -0.5, rec_state, cu_seqlens, state_slots, hi,
                      chunk_offsets=meta.chunk_offsets)
    y = gated_rmsnorm_triton(o, r.reshape(T, H, V), o_norm_w, eps, out=out)
    return y.reshape(T, H * V)


# --------------------------------------------------------------------------------------------------- decode
def kda_decode_ref(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state, state_slots,
                   fg_a=None, fg_b=None):
    """Reference decode step. Lanes with slot <= 0 (padding) read/write no state and output zeros, like the kernel.
    fg_a / fg_b (with z = r = None): the low-rank gate inputs (module doc), turned into z, r by _fg_ref."""
    if fg_a is not None:
        assert z is None and r is None, "pass z and r, or fg_a and fg_b"
        z, r = _fg_ref(fg_a, fg_b)
    H, K, V = _dims(z, b, r)
    N = qkv.shape[0]
    slots = state_slots.long()
    live = slots > 0
    cs = conv_state[slots].clone()                                        # [N, W-1, C]
    cs[~live] = 0
    y = short_conv_decode_ref(qkv, conv_w, cs, torch.arange(N, device=qkv.device))   # shifts cs
    conv_state[slots[live]] = cs[live]
    q, k, v = _split_qkv(y, H, K, V)
    g = kda_gate_ref(z, A_log, dt_bias)                                   # [N, H, K] fp32
    beta = torch.sigmoid(b.float())                                       # [N, H]
    h0 = rec_state[slots].clone()                                         # [N, H, K, V]
    h0[~live] = 0
    o, ht = kda_recurrent_ref(l2norm_ref(q)[:, None], l2norm_ref(k)[:, None], v.float()[:, None], g[:, None],
                              beta[:, None], K ** -0.5, initial_state=h0)
    rec_state[slots[live]] = ht[live].to(rec_state.dtype)
    o = o[:, 0].float()
    o[~live] = 0
    return gated_rmsnorm_ref(o, r.reshape(N, H, V), o_norm_w, eps).to(qkv.dtype).reshape(N, H * V)


def kda_decode(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state, state_slots,
               fg_a=None, fg_b=None):
    """Fused Triton decode (kernels/kda/recurrent.py: 1 launch, graph-capturable) or the torch reference.
    z, r or (z = r = None) the low-rank fg_a, fg_b (module doc).

    Triton path: lanes with slot 0 (padding) touch no state and output zeros."""
    if not use_triton(qkv):
        return kda_decode_ref(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                              state_slots, fg_a=fg_a, fg_b=fg_b)
    return kda_decode_triton(qkv, conv_w, z, b, A_log, dt_bias, r, o_norm_w, eps, conv_state, rec_state,
                             state_slots, fg_a=fg_a, fg_b=fg_b)
