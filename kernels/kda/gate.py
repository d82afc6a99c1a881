"""KDA forget gate: g = -exp(A_log[h]) * softplus(z + dt_bias), fp32, natural log (g <= 0, no lower bound).

kda_gate(z [T, H*K], A_log [H] f32, dt_bias [H*K] f32) -> g [T, H, K] fp32.
softplus(x) = x for x > 20, else max(x, 0) + log(1 + exp(-|x|)) (every exponent <= 0).
The fused decode kernel (recurrent.py) and the chunk kernel (chunk.py) compute the gate inline; this standalone
kernel serves other callers and tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._tensors import next_pow2
from kernels.kda.ref import kda_gate_ref


@triton.jit
def _kda_gate_kernel(z_ptr, alog_ptr, dtb_ptr, g_ptr, stride_z, H: tl.constexpr, K: tl.constexpr,
                     BK: tl.constexpr):
    # grid (T, H); z [T, H*K] (row stride stride_z), g [T, H, K] contiguous fp32
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK).to(tl.int64)
    m = o_k < K
    x = tl.load(z_ptr + i_t * stride_z + i_h * K + o_k, mask=m, other=0.0).to(tl.float32) + \
        tl.load(dtb_ptr + i_h * K + o_k, mask=m, other=0.0)
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    g = -tl.exp(tl.load(alog_ptr + i_h)) * sp
    tl.store(g_ptr + (i_t * H + i_h) * K + o_k, g, mask=m)


def kda_gate_triton(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    H = A_log.numel()
    z2 = z.reshape(-1, dt_bias.numel()) if z.shape[-1] != dt_bias.numel() or z.dim() != 2 else z
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    T, HK = z2.shape
    K = HK // H
    g = torch.empty(T, H, K, dtype=torch.float32, device=z.device)
    if T:
        _kda_gate_kernel[(T, H)](z2, A_log.reshape(H).float().contiguous(), dt_bias.reshape(HK).float().contiguous(),
                                 g, z2.stride(0), H=H, K=K, BK=next_pow2(K), num_warps=1)
    return g.reshape(*z.shape[:-1], H, K) if z.shape[-1] == HK else g.reshape(*z.shape[:-2], H, K)


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    if use_triton(z):
        return kda_gate_triton(z, A_log, dt_bias)
    return kda_gate_ref(z, A_log, dt_bias)
