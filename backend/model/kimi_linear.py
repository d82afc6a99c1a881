"""Kimi-Linear (KDA + NoPE MLA hybrid, MoE FFN) over a paged latent cache and a KDA state pool.

Shapes: T tokens in the step (decodes first), D hidden, H heads, K = V KDA head dim, L kv_lora_rank,
R qk_rope_head_dim, E experts, I expert dim. Every heavy op is a kernels.* call (docs/design.md).
Tensor parallel (tp.world = W > 1, backend/model/parallel.py): modules hold this rank's heads, experts, vocab rows and
1/W of the dense MLPs; mixers and FFNs return partial sums that DecoderLayer all-reduces.
"""
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.model.batch import ForwardBatch, KimiCache
from backend.model.parallel import TP, all_gather_last, all_reduce, folds_shared_expert
from kernels._dispatch import use_triton
from kernels.gemv import gemv_triton, skinny_bmm_nt, skinny_linear, skinny_linear_takes
from kernels.kda import KDAPrefillMeta, kda_decode, kda_prefill, kda_prefill_meta
from kernels.mla import key_offsets, mla_decode, mla_decode_prep, mla_extend, mla_prefill, store_latent
from kernels.moe import fused_moe, fused_moe_add_norm, moe_router, moe_router_add_norm
from kernels.moe.fused import fused_moe_uncombined_triton
from kernels.norm import add_rmsnorm, combine_add_rmsnorm, rmsnorm, rmsnorm_head


# Prefill segments with at least this many new tokens attend in expanded form (kernels.mla.mla_prefill: gather +
# kv_b_proj + flash attention, ~3.4x fewer FLOPs than absorbed for large chunks), per device type; CPU: absorbed refs.
MLA_EXPANDED_MIN_TOKENS = {"cuda": 256}
# Decode-only steps of at most this many tokens run the fused absorbed chain on the Triton path (kernels/mla/absorb.py:
# mla_decode_prep = kv_a norm + cache store + W_UK product in one launch, the W_UV product fused into the split merge;
# 3 launches instead of 6; H200 12-03 e2e b1: 45 us per step faster). Capped at 4 tokens until larger batches are
# timed (e2e b64 got slower with every decode fusion on). KIMI_MLA_FUSED=0 (read when the model is built): off.
MLA_FUSED_MAX_T = 4 if os.environ.get("KIMI_MLA_FUSED", "1") != "0" else 0
# MiB of the folded shared expert's weights (w13[E] first, then w2[E]) the fused decode router hints into L2 after its
# logits, for the MoE GEMM1 that follows (HBM idles through the router's top-k handshake); 0: off. 9 = w13[E] at Kimi
# shapes: H200 12-04 (bench/ablate.py --batch 1 --steps 60 --set ...ROUTER_L2_HINT_MB=...) b1 step 2.261-2.268 ms vs
# 2.270-2.274 for four controls in the same run (~8 us); 4.5 MiB 2.269, 13.5 (w2[E] too, evicted by GEMM1's stream) 2.272
# The same hint of o_proj's weight from the KDA decode kernel (issued once its state tile had arrived) lost: b1 step
# +5-10 us at 4 MiB, +18 at 8, +34 at 12, +52 at 18 (whole o_proj) against interleaved controls (H200 12-04): the
# decode's own tail and o_proj's PDL head compete with it; removed
ROUTER_L2_HINT_MB = float(os.environ.get("KIMI_ROUTER_L2_HINT_MB", "9"))
# compute_logits(out=...) (the decode graphs): a kernels.gemv lm_head stores fp32 logits into the graph's buffer
# itself, rounded through x's dtype (same bits); False: x.dtype logits, then a conversion and a copy (A/B switch:
# bench/ablate.py --set backend.model.kimi_linear.LOGITS_INTO=False). KIMI_LOGITS_INTO=0: off
LOGITS_INTO = os.environ.get("KIMI_LOGITS_INTO", "1") != "0"
# Dense MLP rows on the gemv path (layer 0 at decode): silu(gate) * up in the gate|up gemv's epilogue
# (kernels.gemv glu=True) instead of two elementwise launches after it: b1 step 2-4 us shorter on the H200 (12-04,
# BENCHMARKS fifteenth round). KIMI_MLP_GLU=0: off (A/B: bench/ablate.py --set backend.model.kimi_linear.MLP_GLU=False)
MLP_GLU = os.environ.get("KIMI_MLP_GLU", "1") != "0"


class UncombinedMoE(NamedTuple):
    """A MoE layer's output before the combine: y [T*k, D] per-assignment expert outputs (fused_moe_uncombined_triton;
    or fp32 K partials [S, T*k, D]) and weights [T, k] fp32. The next RMSNorm combines it with the residual add."""
    y: torch.Tensor
    weights: torch.Tensor


class PendingMoE(NamedTuple):
    """A MoE layer not launched yet (KIMI_FUSE_MOE_NORMS, unsharded Triton path): the attention output and the residual
    before the post-attention norm. The next norm (the following layer's input norm or the final norm) runs the whole
    layer in launch order: post-attention add + RMSNorm fused with the router (kernels.moe.moe_router_add_norm),
    then the experts with combine + residual add + its own RMSNorm in one kernel after GEMM2
    (kernels.moe.fused_moe_add_norm). Each falls back to the separate launches where it has no fused form (CPU,
    larger batches) or is switched off (docs/design.md)."""
    moe: "KimiMoE"
    attn: torch.Tensor
    residual: torch.Tensor
    norm: "RMSNorm"


def _fuse_moe_norms_enabled() -> bool:
    """KIMI_FUSE_MOE_NORMS (on unless "0"; read when the model is built): MoE layers run as PendingMoE (above)."""
    return os.environ.get("KIMI_FUSE_MOE_NORMS", "1") != "0"


def _fuse_combine_norm_enabled() -> bool:
    """KIMI_FUSE_COMBINE_NORM (on unless "0"; default since H200 12-03; read when the model is built): an unsharded
    MoE layer on the Triton path skips fused_moe's combine launch; the next layer's input norm (or the final norm)
    runs combine + residual add + RMSNorm in one kernel (kernels.norm.combine_add_rmsnorm; the same bits as the two
    launches)."""
    return os.environ.get("KIMI_FUSE_COMBINE_NORM", "1") != "0"


def mla_expands(prefill_tokens: int, device: torch.device) -> bool:
    """Whether a step's prefill part attends in the expanded MLA form (MLA_EXPANDED_MIN_TOKENS)."""
    min_tokens = MLA_EXPANDED_MIN_TOKENS.get(device.type)
    return min_tokens is not None and prefill_tokens >= min_tokens


class StepMeta(NamedTuple):
    """Per-forward metadata of the prefill rows, shared by the layers (KimiModel.step_meta; Triton path)."""
    kda: KDAPrefillMeta | None                 # the KDA prefill's varlen metadata (6 launches, once)
    mla_key_offsets: torch.Tensor | None       # [P+1] i32 key prefix sums, when the MLA prefill is expanded


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor | UncombinedMoE | PendingMoE, residual: torch.Tensor | None = None):
        """-> rmsnorm(x); with residual: (rmsnorm(residual + x), residual + x) in one kernel (x may be an
        UncombinedMoE: combined in the same kernel; or a PendingMoE, whose residual it holds: the MoE layer runs
        first, its combine fused into this norm)."""
        if isinstance(x, PendingMoE):
            return x.moe.forward_norms(x.attn, x.residual, x.norm, self)
        if isinstance(x, UncombinedMoE):
            return combine_add_rmsnorm(x.y, x.weights, residual, self.weight, self.eps)
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return add_rmsnorm(x, residual, self.weight, self.eps)


def _gemv_mode() -> str:
    """KIMI_GEMV (read when a module is built): "1" every M <= 16 projection runs kernels.gemv on CUDA; "auto" (the
    default since H200 12-03: e2e b1 2.62 -> 2.51 ms/step) only the shapes of kernels.gemv.GEMV_WINS (measured
    faster than cuBLAS), cuBLAS for the rest; "0" cuBLAS everywhere."""
    mode = os.environ.get("KIMI_GEMV", "auto")
    return mode if mode in ("1", "auto") else ""


def _gemv_enabled() -> bool:
    return _gemv_mode() != ""


class _GemvLinear(nn.Linear):
    measured_only = False                                # KIMI_GEMV=auto

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.measured_only)   # F.linear for M > 16 rows and on CPU


def _linear(in_dim: int, out_dim: int, dtype: torch.dtype) -> nn.Linear:
    if not _gemv_enabled():
        return nn.Linear(in_dim, out_dim, bias=False, dtype=dtype)
    lin = _GemvLinear(in_dim, out_dim, bias=False, dtype=dtype)
    lin.measured_only = _gemv_mode() == "auto"
    return lin


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_index: int, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        d, h, k = cfg.hidden_size, cfg.kda_num_heads // tp.world, cfg.kda_head_dim
        self.cache_index, self.eps = cache_index, cfg.rms_norm_eps
        # one input projection (checkpoint q/k/v/f_a/g_a/b_proj rows, loader.py) -> [T, 3HK + 2K + H]
        self.in_proj = _linear(d, 3 * h * k + 2 * k + h, dtype)
        # fp32 like vLLM: the gate and the conv are sensitive to bf16 rounding
        self.conv_weight = nn.Parameter(torch.empty(3 * h * k, cfg.conv_size, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(h * k, dtype=torch.float32))
        # f_b_proj and g_b_proj weights stacked [2, HK, K]: both rank-K up-projections in one batched matmul
        self.fg_b_proj = nn.Parameter(torch.empty(2, h * k, k, dtype=dtype))
        self.qkv_dim, self.head_dim = 3 * h * k, k
        self.o_norm = RMSNorm(k, cfg.rms_norm_eps, dtype)
        self.o_proj = _linear(h * k, d, dtype)
        self.gemv = _gemv_enabled()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KimiCache) -> torch.Tensor:
        y = self.in_proj(x)                         # [T, 3HK + 2K + H]
        c, k = self.qkv_dim, self.head_dim
        qkv, b = y[:, :c], y[:, c + 2 * k:]         # [T, 3HK] pre-conv q | k | v, [T, H] beta logits (row views)
        fg_a = y[:, c:c + 2 * k].view(-1, 2, k).transpose(0, 1)                  # [2, T, K] f_a | g_a outputs
        conv, rec = cache.conv_state[self.cache_index], cache.rec_state[self.cache_index]
        w, nd, T, outs = self.o_norm.weight, batch.num_decodes, x.shape[0], []
        if nd:
            if self.gemv:
                # the rank-K f_b | g_b up-projection of the decode tokens runs inside kda_decode (in the decode kernel
                # for small batches, else a skinny_bmm_nt there): no launch of its own. fg_a, fg_b positional (bench/
                # ablate.py's stand-in takes *args)
                z = r = None
                fa, fb = fg_a[:, :nd], self.fg_b_proj
            else:                                                                # KIMI_GEMV=0: cuBLAS, then decode
                z, r = torch.bmm(fg_a[:, :nd], self.fg_b_proj.transpose(1, 2)).unbind(0)      # [nd, HK] each
                fa = fb = None
            outs.append(kda_decode(qkv[:nd], self.conv_weight, z, b[:nd], self.A_log, self.dt_bias, r, w, self.eps,
                                   conv, rec, batch.state_slots[:nd], fa, fb))
        if nd < T:
            fa = fg_a[:, nd:]                                                    # [2, T - nd, K] prefill rows only
            zr = skinny_bmm_nt(fa, self.fg_b_proj) if self.gemv else torch.bmm(fa, self.fg_b_proj.transpose(1, 2))
            z, r = zr.unbind(0)                                                  # [T - nd, HK] forget, output gates
            outs.append(kda_prefill(qkv[nd:], self.conv_weight, z, b[nd:], self.A_log, self.dt_bias, r, w, self.eps,
                                    conv, rec, batch.prefill_cu_seqlens, batch.state_slots[nd:],
                                    batch.has_initial_state[nd:], meta=batch.meta and batch.meta.kda))
        return self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])


class KimiMLA(nn.Module):
    """NoPE MLA. Runtime form is absorbed over the latent: q_lat = W_UK^T q_nope, attn = W_UV out_lat."""

    def __init__(self, cfg: ModelConfig, cache_index: int, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        # the latent (kv_a_proj_with_mqa, kv_a_layernorm, cache) is replicated; attention runs over the local heads
        d, h, lat = cfg.hidden_size, cfg.num_attention_heads // tp.world, cfg.kv_lora_rank
        self.cache_index, self.num_heads, self.kv_lora_rank = cache_index, h, lat
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim ** -0.5
        self.expanded = False  # test switch: decompress keys/values and attend per head
        # one input projection: checkpoint q_proj rows (local heads) | kv_a_proj_with_mqa rows -> [T, H*(nope+R) + L+R]
        self.q_dim = h * cfg.qk_head_dim
        self.in_proj = _linear(d, self.q_dim + lat + self.rope, dtype)
        self.kv_a_layernorm = RMSNorm(lat, cfg.kv_a_layernorm_eps, dtype)
        self.kv_b_proj = _linear(lat, h * (self.nope + self.v_dim), dtype)
        self.o_proj = _linear(h * self.v_dim, d, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KimiCache) -> torch.Tensor:
        y = self.in_proj(x)
        q = y[:, :self.q_dim].view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]          # [T, H, nope], [T, H, R] (no rotary)
        if batch.num_decodes == y.shape[0] <= MLA_FUSED_MAX_T and not self.expanded and use_triton(y):
            return self.o_proj(self._decode_fused(y, q_pe, cache.latent[self.cache_index], batch).flatten(1))
        # cache rows [T, L+R]: kv_a_layernorm(latent) | k_pe, from the row view y[:, q_dim:] in one launch
        latent = rmsnorm_head(y[:, self.q_dim:], self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        latent_cache = cache.latent[self.cache_index]
        store_latent(latent, latent_cache, batch.slot_mapping)
        attend = self._attend_expanded if self.expanded else self._attend_absorbed
        out = attend(q_nope, q_pe, latent_cache, batch)  # [T, H, V]; the MLA kernels take q_pe's row/head strides
        return self.o_proj(out.flatten(1))

    def _decode_fused(self, y, q_pe, latent_cache, batch: ForwardBatch) -> torch.Tensor:
        """Decode-only step: cache store + q_lat in one launch, attention with the W_UV product in its merge ->
        [T, H, V]."""
        w_uk, w_uv = self._w_uk_uv()
        q_lat = mla_decode_prep(y, self.q_dim, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, w_uk,
                                latent_cache, batch.slot_mapping)                                  # [T, H, L]
        n = y.shape[0]
        return mla_decode(q_lat, q_pe, latent_cache, batch.block_table[:n], batch.seq_lens[:n], self.scale,
                          w_uv=w_uv)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]                      # [H, nope, L], [H, V, L]

    def _attend_absorbed(self, q_nope, q_pe, latent_cache, batch: ForwardBatch) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        nd, T = batch.num_decodes, q_nope.shape[0]
        expand = mla_expands(T - nd, q_nope.device)                   # prefill part in expanded form
        n_lat = nd if expand else T
        q_lat = torch.einsum("thn,hnl->thl", q_nope[:n_lat], w_uk) if n_lat else None   # [n_lat, H, L]
        outs = []
        if nd:
            outs.append(mla_decode(q_lat[:nd], q_pe[:nd], latent_cache, batch.block_table[:nd],
                                   batch.seq_lens[:nd], self.scale))
        if nd < n_lat:
            outs.append(mla_extend(q_lat[nd:], q_pe[nd:], latent_cache, batch.block_table[nd:],
                                   batch.prefill_cu_seqlens, batch.seq_lens[nd:], self.scale, batch.max_query_len))
        if outs:
            out_lat = torch.cat(outs) if len(outs) > 1 else outs[0]   # [n_lat, H, L]
            outs = [torch.einsum("thl,hvl->thv", out_lat, w_uv)]
        if expand:
            outs.append(mla_prefill(q_nope[nd:], q_pe[nd:], latent_cache, batch.block_table[nd:],
                                    batch.prefill_cu_seqlens, batch.seq_lens[nd:], self.kv_b_proj.weight,
                                    self.scale, batch.max_query_len,
                                    total_keys=batch.prefill_keys if batch.prefill_keys >= 0 else None,
                                    cu_seqlens_k=batch.meta and batch.meta.mla_key_offsets))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_expanded(self, q_nope, q_pe, latent_cache, batch: ForwardBatch) -> torch.Tensor:
        """Plain multi-head attention over keys/values decompressed from the cached latents (testing)."""
        cu, seq_lens = batch.cu_seqlens.tolist(), batch.seq_lens.tolist()
        block_size = latent_cache.shape[1]
        outs = []
        for n in range(len(seq_lens)):
            pages = batch.block_table[n, :(seq_lens[n] + block_size - 1) // block_size].long()
            lat = latent_cache[pages].flatten(0, 1)[:seq_lens[n]]          # [S, L+R]
            kv = self.kv_b_proj(lat[:, :self.kv_lora_rank]).view(-1, self.num_heads, self.nope + self.v_dim)
            k_pe = lat[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
            k = torch.cat([kv[..., :self.nope], k_pe], dim=-1)            # [S, H, nope+R]
            q = torch.cat([q_nope[cu[n]:cu[n + 1]], q_pe[cu[n]:cu[n + 1]]], dim=-1)   # [Q, H, nope+R]
            start = seq_lens[n] - q.shape[0]
            mask = torch.ones(q.shape[0], seq_lens[n], dtype=torch.bool, device=q.device).tril(start)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                 kv[..., self.nope:].transpose(0, 1), attn_mask=mask,
                                                 scale=self.scale)
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)


class KimiMLP(nn.Module):
    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = _linear(dim, 2 * inter, dtype)  # checkpoint gate_proj rows | up_proj rows
        self.down_proj = _linear(inter, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.gate_up_proj
        if MLP_GLU and isinstance(lin, _GemvLinear) and skinny_linear_takes(x.shape[0], lin.weight, lin.measured_only):
            return self.down_proj(gemv_triton(x, lin.weight, glu=True))         # silu(gate) * up in the gemv
        gu = lin(x)                                             # [T, 2I]
        return self.down_proj(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])


class KimiRouter(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        # selection-only bias, fp32 like the HF router math
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32))


class KimiMoE(nn.Module):
    """Sigmoid router (bias for selection), top-k routed SwiGLU experts, plus an always-on unscaled shared expert.

    Expert parallel: rank r holds experts [r*E/W, (r+1)*E/W) and routes every token with the replicated router; the
    assignments to other ranks' experts go to local expert 0 with weight 0 (fused_moe needs ids in [0, E/W)), so the
    rank's output is its experts' share of the sum. One expert takes all the dummy rows: at decode that reads one
    extra expert's weights, not up to E/W of them.

    Unsharded (W = 1, one shared expert; parallel.folds_shared_expert) the shared expert is stacked as expert E:
    w13 [E+1, 2I, D], w2 [E+1, D, I], and the router appends the column (id E, weight 1.0) to every token's top-k,
    so one fused_moe call runs routed and shared experts (summed in fp32; HF adds the shared output in x.dtype
    after rounding the routed sum, so the two differ by rounding only). W > 1 keeps shared_experts, a 1/W slice.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        e, d, inter = cfg.num_experts // tp.world, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.scaling = cfg.num_experts_per_token, cfg.routed_scaling_factor
        self.renormalize, self.biased_weights = cfg.moe_renormalize, cfg.router_biased_weights
        self.tp, self.num_local_experts = tp, e
        self.fold_shared = folds_shared_expert(cfg, tp)
        self.gate = KimiRouter(cfg, dtype)
        stacked = e + int(self.fold_shared)  # the shared expert, when folded, is expert e
        self.w13 = nn.Parameter(torch.empty(stacked, 2 * inter, d, dtype=dtype))  # per expert cat(w1 gate, w3 up)
        self.w2 = nn.Parameter(torch.empty(stacked, d, inter, dtype=dtype))
        self.shared_experts = None if self.fold_shared else \
            KimiMLP(d, inter * cfg.num_shared_experts // tp.world, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_router(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.scaling,
                                  self.renormalize, self.biased_weights,
                                  self.num_local_experts if self.fold_shared else None)
        if self.fold_shared:
            return fused_moe(x, self.w13, self.w2, weights, ids)
        if self.tp.world > 1:
            local = ids - self.tp.rank * self.num_local_experts
            mine = (local >= 0) & (local < self.num_local_experts)
            weights, ids = torch.where(mine, weights, 0.0), torch.where(mine, local, 0)
        return fused_moe(x, self.w13, self.w2, weights, ids) + self.shared_experts(x)

    def forward_norms(self, attn: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, next_norm: RMSNorm):
        """PendingMoE: (attention output, residual) -> (next_norm(h2), h2) with h = residual + attn,
        x = norm(h), h2 = h + moe(x) (folded shared expert)."""
        assert self.fold_shared
        x, h, weights, ids = moe_router_add_norm(attn, residual, norm.weight, norm.eps, self.gate.weight,
                                                 self.gate.e_score_correction_bias, self.top_k, self.scaling,
                                                 self.renormalize, self.biased_weights, self.num_local_experts,
                                                 l2_hint=self.shared_l2_hint(ROUTER_L2_HINT_MB))
        return fused_moe_add_norm(x, self.w13, self.w2, weights, ids, h, next_norm.weight, next_norm.eps)

    def shared_l2_hint(self, mb: float) -> tuple:
        """The first `mb` MB of the folded shared expert's weights (w13[E], then w2[E]) as contiguous views: the
        router hints them into L2 for the GEMMs that follow (every token selects expert E); () for mb <= 0."""
        if mb <= 0 or not self.fold_shared:
            return ()
        budget, out = int(mb * (1 << 20)) // self.w13.element_size(), []
        for w in (self.w13[self.num_local_experts].view(-1), self.w2[self.num_local_experts].view(-1)):
            if budget > 0:
                out.append(w[:budget])
                budget -= out[-1].numel()
        return tuple(out)

    def forward_uncombined(self, x: torch.Tensor) -> UncombinedMoE:
        """forward without the combine (folded shared expert, Triton path only); see UncombinedMoE."""
        assert self.fold_shared
        weights, ids = moe_router(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.scaling,
                                  self.renormalize, self.biased_weights, self.num_local_experts)
        return UncombinedMoE(fused_moe_uncombined_triton(x, self.w13, self.w2, weights, ids), weights)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        self.tp = tp
        if cfg.is_kda(i):
            self.self_attn = KimiDeltaAttention(cfg, cfg.kda_layers.index(i), dtype, tp)
        else:
            self.self_attn = KimiMLA(cfg, cfg.mla_layers.index(i), dtype, tp)
        self.is_moe = cfg.is_moe(i)
        if self.is_moe:
            self.block_sparse_moe = KimiMoE(cfg, dtype, tp)
        else:
            self.mlp = KimiMLP(cfg.hidden_size, cfg.intermediate_size // tp.world, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # unsharded only: with W > 1 an all-reduce sits between the MoE output and the next residual add
        self.defer_combine = (_fuse_combine_norm_enabled() and self.is_moe and tp.world == 1
                              and self.block_sparse_moe.fold_shared)
        self.pending_moe = self.defer_combine and _fuse_moe_norms_enabled()

    def forward(self, out: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KimiCache):
        """(previous layer's FFN output, residual stream before it; None for the first layer with the embedding as
        out) -> (this layer's FFN output, residual stream before it). Each residual add runs fused with the norm
        after it: h = residual + out, then norm(h) (the same two roundings as h + out followed by the norm).
        With defer_combine (Triton path) the FFN output is an UncombinedMoE, combined by the next norm; with
        pending_moe the whole MoE layer is returned as a PendingMoE (residual None), run by the next norm."""
        if residual is None and not isinstance(out, PendingMoE):
            x, h = self.input_layernorm(out), out
        else:
            x, h = self.input_layernorm(out, residual)
        attn = all_reduce(self.self_attn(x, batch, cache), self.tp)
        if self.pending_moe and use_triton(attn):
            return PendingMoE(self.block_sparse_moe, attn, h, self.post_attention_layernorm), None
        x, h = self.post_attention_layernorm(attn, h)
        if self.defer_combine and use_triton(x):
            return self.block_sparse_moe.forward_uncombined(x), h
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return all_reduce(ffn(x), self.tp), h


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        self.tp = tp
        # vocab parallel: rank r holds rows [r*V/W, (r+1)*V/W)
        self.embed_tokens = nn.Embedding(cfg.vocab_size // tp.world, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.has_kda, self.has_mla = bool(cfg.kda_layers), bool(cfg.mla_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def step_meta(self, batch: ForwardBatch) -> StepMeta | None:
        """The prefill rows' metadata every KDA / MLA layer needs, computed once per forward (always here, never
        cached on a reused batch: a CUDA graph capture must record it)."""
        nd, T = batch.num_decodes, batch.input_ids.shape[0]
        if nd == T or not use_triton(batch.input_ids):
            return None
        kda = kda_prefill_meta(batch.prefill_cu_seqlens, batch.has_initial_state[nd:]) if self.has_kda else None
        mla = (key_offsets(batch.seq_lens[nd:]) if self.has_mla and mla_expands(T - nd, batch.input_ids.device)
               else None)
        return StepMeta(kda, mla)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return self.embed_tokens(ids)
        n = self.embed_tokens.num_embeddings
        local = ids - self.tp.rank * n
        other = (local < 0) | (local >= n)
        h = self.embed_tokens(local.masked_fill(other, 0)).masked_fill_(other[:, None], 0.0)
        return all_reduce(h, self.tp)

    def forward(self, batch: ForwardBatch, cache: KimiCache) -> torch.Tensor:
        batch.meta = self.step_meta(batch)
        out, residual = self.embed(batch.input_ids), None
        for layer in self.layers:
            out, residual = layer(out, residual, batch, cache)
        return self.norm(out, residual)[0]


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TP = TP()):
        super().__init__()
        self.config, self.dtype, self.tp = cfg, dtype, tp
        self.model = KimiModel(cfg, dtype, tp)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size // tp.world, dtype)  # vocab rows like the embedding

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KimiCache) -> torch.Tensor:
        """-> final-normed hidden states [T, D]; updates KDA state slots and MLA pages in place."""
        return self.model(batch, cache)

    def _logits_into(self) -> bool:
        """compute_logits(out=...) hands `out` to the lm_head's skinny_linear: LOGITS_INTO, one rank, a gemv lm_head."""
        return LOGITS_INTO and self.tp.world == 1 and isinstance(self.lm_head, _GemvLinear)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, logits_index: Optional[torch.Tensor],
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """lm_head on the sampled positions only (logits_index None: every row, no gather) -> fp32 [M, vocab] (on
        every rank). out: an fp32 [M, vocab] buffer to fill and return (the decode graphs' static logits); where the
        lm_head runs kernels.gemv (LOGITS_INTO) it stores the x.dtype-rounded logits there itself, the same bits as
        the x.dtype result upcast, without the conversion and copy launches."""
        x = hidden if logits_index is None else hidden[logits_index]
        if out is not None and self._logits_into():
            return skinny_linear(x, self.lm_head.weight, self.lm_head.measured_only, out=out)
        logits = self.lm_head(x)
        if self.tp.world > 1:
            logits = all_gather_last(logits, self.tp)
        return logits.float() if out is None else out.copy_(logits)

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int) -> KimiCache:
        """Zeroed KDA state pool (slot 0 null) and MLA latent pages (page 0 null)."""
        cfg, dev = self.config, self.device
        h, k = cfg.kda_num_heads // self.tp.world, cfg.kda_head_dim
        n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
        return KimiCache(
            conv_state=[torch.zeros(num_slots, cfg.conv_size - 1, 3 * h * k, dtype=self.dtype, device=dev)
                        for _ in range(n_kda)],
            rec_state=[torch.zeros(num_slots, h, k, k, dtype=torch.float32, device=dev) for _ in range(n_kda)],
            latent=[torch.zeros(num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=self.dtype,
                                device=dev) for _ in range(n_mla)],
            block_size=block_size,
        )
