"""MLA decode with the weight absorption fused into the neighbouring kernels (issue 6: launches per decode step).

The unfused decode chain of one MLA layer, after y = in_proj(x) [T, H*(nope+R) + L + R]:
  latent = rmsnorm_head(y[:, q_dim:], w_norm, eps); store_latent(latent, cache, slot_mapping)     2 launches
  q_lat = einsum("thn,hnl->thl", q_nope, w_uk)                                                     1 (cuBLAS)
  out_lat = mla_decode(q_lat, q_pe, ...)                                                          1-2
  out = einsum("thl,hvl->thv", out_lat, w_uv)                                                      1 (cuBLAS)
becomes
  q_lat = mla_decode_prep(y, q_dim, w_norm, eps, w_uk, cache, slot_mapping)                        1
  out = mla_decode(q_lat, q_pe, ..., w_uv=w_uv)      stage 1 + merge fused with the W_UV product   2

* mla_decode_prep (_prep_kernel): grid (H, L / BLOCK_L): program (h, lb) holds w_uk[h][:, lb-block] (BLOCK_NOPE x
  BLOCK_L, loaded before griddepcontrol.wait: the 4 MB of w_uk stream over H x L/BLOCK_L programs while in_proj
  runs) and computes q_lat[t, h, lb-block] = q_nope[t, h] @ tile for every token (BLOCK_T rows per tl.dot, fp32
  accumulation, rounded to y.dtype like the einsum). Token t's cache row (kv_a RMSNorm of y[t, q_dim:q_dim+L], the
  R rope columns copied, stored at slot_mapping[t] unless < 0) is written by program t % (H x L/BLOCK_L), with the
  same jit helpers, block shape and warps as kernels.norm's rmsnorm_head (same bits) and store_latent's cast.
* _uv_kernel (called by decode.mla_decode_triton when w_uv is given): grid (H, V / BLOCK_V, NG): program (h, vb, g)
  holds w_uv[h][vb-block, :] (weights: before the wait, V chunks of <= VC rows each), then for the sequences
  n = g, g + NG, ... merges head h's split partials over all L columns (the stage-2 math: LSE weights over the
  sequence's non-empty units, _unit_plan) -- or reads the latent row stage 1 wrote (MERGE=False: num_splits 1) --
  rounds the merged latent to the output dtype (the chain's out_lat) and multiplies:
  out[n, h, vb-block] = w_uv[h][vb-block] @ o (fp32). Every (h, vb) program re-merges the head's partials (L2
  reads, ne x L x 4 B each); uv_config trades that against the weight spread.
Torch references: mla_decode_prep_ref, mla_decode_uv_ref (the CPU path of kernels.mla).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._pdl import gdc_enter, pdl_launch, pdl_on, prefetch_l2
from kernels._tensors import cdiv, next_pow2, num_sms, unit_last_stride
from kernels.norm import _load_w, _rms_weighted, rmsnorm_head_ref, row_config

from .decode import MIN_DOT, _dot, _seq_units, _unit_plan, _upcast
from .ref import mla_decode_ref, store_latent_ref

PREP_BLOCK_L = 64   # q_lat columns per prep program: Kimi H=32, L=512 -> 256 programs, 16 KB of w_uk each
PREP_BLOCK_T = 16   # tokens per tl.dot (M >= 16); T > 16 loops, the w_uk tile stays in registers
UV_VC = 32          # w_uv rows per chunk held in registers ([32, 512] bf16 = 32 KB per program)
UV_MAX_S = 16        # uv_config: most units per merge step


# --------------------------------------------------------------------------------------------------- references
def _split_y(y: torch.Tensor, q_dim: int, H: int, nope: int):
    """y [T, q_dim + L + R] -> q_nope [T, H, nope] (view), latent part [T, L + R] (view)."""
    return y[:, :q_dim].view(y.shape[0], H, q_dim // H)[..., :nope], y[:, q_dim:]


def mla_decode_prep_ref(y, q_dim, kv_norm_w, eps, w_uk, latent_cache, slot_mapping):
    """rmsnorm_head + store_latent (in place) + einsum: -> q_lat [T, H, L] (y.dtype)."""
    H, nope, L = w_uk.shape
    q_nope, lat = _split_y(y, q_dim, H, nope)
    store_latent_ref(rmsnorm_head_ref(lat[:, :latent_cache.shape[2]], kv_norm_w, eps), latent_cache, slot_mapping)
    return torch.einsum("thn,hnl->thl", q_nope, w_uk)


def mla_decode_uv_ref(q_lat, q_pe, cache, block_table, seq_lens, scale, w_uv):
    """mla_decode followed by the W_UV product: -> [N, H, V] in q_lat.dtype (latent rounded to it in between)."""
    out_lat = mla_decode_ref(q_lat, q_pe, cache, block_table, seq_lens, scale)
    return torch.einsum("thl,hvl->thv", out_lat, w_uv.to(out_lat.dtype))


# --------------------------------------------------------------------------------------------------- prep
@triton.jit
def _prep_kernel(
    q_ptr, lat_ptr, nw_ptr, wuk_ptr, cache_ptr, slot_ptr, qlat_ptr,
    T, H, L, C, eps,
    s_qt, s_qh, s_lt, s_wh, s_wn, s_cp, s_cr, s_ot, s_oh,
    NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr, BC: tl.constexpr,
    BS: tl.constexpr, EARLY_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, GDC: tl.constexpr = False,
):
    h = tl.program_id(0)
    lb = tl.program_id(1)
    pid = h * tl.num_programs(1) + lb
    nprog = tl.num_programs(0) * tl.num_programs(1)
    offs_n = tl.arange(0, BLOCK_NOPE)
    nmask = offs_n < NOPE
    offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = offs_l < L
    # weights only before the wait: this program's w_uk tile [BLOCK_NOPE, BLOCK_L] and, for the norm programs, the
    # kv_a_layernorm weight (w_uk rows are L contiguous: the tile is BLOCK_NOPE runs of BLOCK_L * 2 bytes)
    w = tl.load(wuk_ptr + h.to(tl.int64) * s_wh + offs_n[:, None] * s_wn + offs_l[None, :],
                mask=nmask[:, None] & lmask[None, :], other=0.0)
    offs_c = tl.arange(0, BC)
    head = offs_c < L
    nw = _load_w(nw_ptr, offs_c, tl.where(pid < T, head, False), EARLY_W)  # where: the interpreter's bool & int
    gdc_enter(GDC)
    odt = qlat_ptr.dtype.element_ty
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tmask = offs_t < T
        q = tl.load(q_ptr + offs_t[:, None].to(tl.int64) * s_qt + h * s_qh + offs_n[None, :],
                    mask=tmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(q, w, IEEE, UPCAST)  # [BLOCK_T, BLOCK_L] fp32
        tl.store(qlat_ptr + offs_t[:, None].to(tl.int64) * s_ot + h * s_oh + offs_l[None, :], acc.to(odt),
                 mask=tmask[:, None] & lmask[None, :])
    # cache rows: rmsnorm_head's math (_rmsnorm_head_kernel) then store_latent's cast, token t by program t % nprog
    for t in range(pid, T, nprog):
        xr = tl.load(lat_ptr + t * s_lt + offs_c, mask=offs_c < C, other=0.0)
        x = tl.where(head, xr.to(tl.float32), 0.0)
        yv = _rms_weighted(x, nw, nw_ptr, offs_c, head, L, eps, odt, EARLY_W)
        yv = tl.where(head, yv.to(odt), xr.to(odt))
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # padded lanes (-1) store nothing
            dst = cache_ptr + (slot // BS) * s_cp + (slot % BS) * s_cr + offs_c
            tl.store(dst, yv.to(cache_ptr.dtype.element_ty), mask=offs_c < C)


def mla_decode_prep_triton(y, q_dim, kv_norm_w, eps, w_uk, latent_cache, slot_mapping, out=None, pdl=None,
                           block_l=None):
    """See kernels/mla/__init__.py mla_decode_prep. ``pdl``: PDL launch (kernels._pdl; None: KIMI_PDL)."""
    T = y.shape[0]
    H, nope, L = w_uk.shape
    NB, BS, C = latent_cache.shape
    assert q_dim % H == 0 and q_dim // H >= nope and y.shape[1] >= q_dim + C and C > L
    assert kv_norm_w.shape == (L,) and slot_mapping.shape[0] == T and latent_cache.stride(2) == 1
    assert y.stride(1) == 1 and w_uk.stride(2) == 1
    q_nope, lat = _split_y(y, q_dim, H, nope)
    if out is None:
        out = torch.empty(T, H, L, dtype=y.dtype, device=y.device)
    assert out.shape == (T, H, L) and out.stride(2) == 1 and out.dtype == y.dtype
    if T == 0:
        return out
    slot_mapping = unit_last_stride(slot_mapping, torch.int64)
    bl = max(MIN_DOT, min(next_pow2(L), block_l or PREP_BLOCK_L))
    BC = next_pow2(C)
    warps, early = row_config(BC)  # rmsnorm_head's warps and weight order: the norm's reduction gives its bits
    _prep_kernel[(H, cdiv(L, bl))](
        q_nope, lat, kv_norm_w, w_uk, latent_cache, slot_mapping, out,
        T, H, L, C, eps,
        q_nope.stride(0), q_nope.stride(1), lat.stride(0), w_uk.stride(0), w_uk.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, BLOCK_NOPE=max(MIN_DOT, next_pow2(nope)), BLOCK_L=bl, BLOCK_T=PREP_BLOCK_T, BC=BC,
        BS=BS, EARLY_W=early, IEEE=y.dtype == torch.float32, UPCAST=_upcast(y.dtype), num_warps=warps,
        **pdl_launch(pdl),
    )
    return out


# --------------------------------------------------------------------------------------------------- merge + W_UV
@triton.jit
def _merge_head(opart_ptr, lse_ptr, n, h, offs_b, tiles, nsp, slen, first, s_wu, s_wh, s_lu, offs_l, lmask,
                BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """Stage 2 for one (sequence n, head h) over all columns, from the _unit_plan vectors: -> [BLOCK_L] fp32 (zeros
    without a unit)."""
    u0, cnt, sl, nt = _seq_units(offs_b, n, tiles, nsp, slen, first)
    offs_s = tl.arange(0, BLOCK_S)
    mx = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for k0 in range(0, cnt, BLOCK_S):
        k = k0 + offs_s
        ok = (k < cnt) & (k * sl < nt)  # non-empty units only
        mx = tl.maximum(mx, tl.load(lse_ptr + (u0 + k).to(tl.int64) * s_lu + h, mask=ok, other=float("-inf")))
    m = tl.max(mx, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for k0 in range(0, cnt, BLOCK_S):
        k = k0 + offs_s
        ok = (k < cnt) & (k * sl < nt)
        uu = (u0 + k).to(tl.int64)
        wgt = tl.where(ok, tl.exp2(tl.load(lse_ptr + uu * s_lu + h, mask=ok, other=float("-inf")) - m), 0.0)
        o = tl.load(opart_ptr + uu[:, None] * s_wu + h * s_wh + offs_l[None, :], mask=ok[:, None] & lmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(wgt[:, None] * o, 0)
        den += wgt
    d = tl.sum(den, 0)
    return tl.where(d > 0, acc / tl.where(d > 0, d, 1.0), 0.0)


@triton.jit
def _uv_kernel(
    seqlen_ptr, opart_ptr, lse_ptr, lat_ptr, wuv_ptr, out_ptr,
    N, H, G, V,
    s_wu, s_wh, s_lu, s_ln, s_lh, s_vh, s_vv, s_on, s_oh,
    L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr, VC: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr, MERGE: tl.constexpr,
    GDC: tl.constexpr = False,
):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    g = tl.program_id(2)
    offs_l = tl.arange(0, BLOCK_L)
    lmask = offs_l < L
    wrow = wuv_ptr + h.to(tl.int64) * s_vh
    v0 = vb * BLOCK_V
    offs_c = tl.arange(0, VC)
    # weights only before the wait: one chunk is held in registers; wider programs L2-prefetch their rows
    w_held = tl.load(wrow + (v0 + offs_c)[:, None] * s_vv + offs_l[None, :],
                     mask=((v0 + offs_c) < V)[:, None] & lmask[None, :], other=0.0)
    if GDC and BLOCK_V > VC:
        offs_p = v0 + tl.arange(0, BLOCK_V)
        prefetch_l2(wrow + offs_p * s_vv, offs_p < V)
    gdc_enter(GDC)
    if MERGE:
        offs_b, bm, lens, tiles, nsp, slen, first, last = _unit_plan(seqlen_ptr, N, G, BLOCK_B, BLOCK_N, MIN_TILES)
    odt = out_ptr.dtype.element_ty
    for n in range(g, N, tl.num_programs(2)):
        if MERGE:
            o = _merge_head(opart_ptr, lse_ptr, n, h, offs_b, tiles, nsp, slen, first, s_wu, s_wh, s_lu, offs_l, lmask,
                            BLOCK_S, BLOCK_L)
        else:  # the latent row stage 1 wrote (num_splits 1)
            o = tl.load(lat_ptr + n * s_ln + h * s_lh + offs_l, mask=lmask, other=0.0)
        o = o.to(odt).to(tl.float32)  # the chain's out_lat rounding
        for c in tl.static_range(0, BLOCK_V, VC):
            rows = v0 + c + offs_c
            if c == 0:
                w = w_held
            else:
                w = tl.load(wrow + rows[:, None] * s_vv + offs_l[None, :], mask=(rows < V)[:, None] & lmask[None, :],
                            other=0.0)
            r = tl.sum(w.to(tl.float32) * o[None, :], 1)  # [VC] fp32
            tl.store(out_ptr + n * s_on + h * s_oh + rows, r.to(odt), mask=rows < V)


def uv_config(N: int, H: int, V: int, num_splits: int, sms: int, cfg: dict | None = None) -> dict:
    """Host launch picks of _uv_kernel: BLOCK_V output columns per program (one UV_VC chunk), NG sequence groups.
    Each (h, vb) program merges the head's partials itself (~units x L x 4 B per sequence from L2), so narrow V
    blocks re-read them V / BLOCK_V times; they still win at every context: B=1 with a 128k-wide table (256 splits),
    chain graph us at S = 1k / 8k / 32k / 128k, BLOCK_V 32 vs 128: 15.6 / 29.2 / 53.5 / 87.4 vs 19.7 / 36.5 / 64.5 /
    99.3 (H200 12-04; the b1 decode step 16 us faster). NG then fills ~2 programs per SM, each program looping over
    its sequences with its weight chunk kept. cfg (bench / tests): block_v, groups, block_s override; stage2=True (read
    by decode.mla_decode_triton) keeps stage 2 for the merge."""
    cfg = cfg or {}
    vp = next_pow2(V)
    bv = cfg.get("block_v") or min(vp, UV_VC)
    bv = max(1, min(next_pow2(bv), vp))
    per = H * cdiv(V, bv)
    ng = cfg.get("groups") or max(1, min(N, (2 * sms) // per))
    bs = cfg.get("block_s") or max(1, min(UV_MAX_S, next_pow2(max(1, num_splits))))
    return dict(BLOCK_V=bv, VC=min(bv, UV_VC), NG=int(ng), BLOCK_S=bs)


def launch_uv(seq_lens, opart, lse, lat, w_uv, out, N, H, G, L, BLOCK_L, BLOCK_N, BLOCK_B, MIN_TILES, merge,
              num_splits, pdl=None, cfg=None):
    """out [N, H, V] = w_uv[h] @ merged latent (merge: from opart / lse of the split schedule; else from the latent
    rows lat [N, H, L])."""
    V = w_uv.shape[1]
    assert w_uv.shape == (H, V, L) and w_uv.stride(2) == 1 and out.shape == (N, H, V) and out.stride(2) == 1
    c = uv_config(N, H, V, num_splits, num_sms(out.device), cfg)
    wstr = opart.stride()[:2] if merge else (0, 0)
    lstr = lse.stride(0) if merge else 0
    lat_str = lat.stride()[:2] if not merge else (0, 0)
    _uv_kernel[(H, cdiv(V, c["BLOCK_V"]), c["NG"])](
        seq_lens, opart if merge else out, lse if merge else seq_lens, lat if not merge else out, w_uv, out,
        N, H, G, V,
        *wstr, lstr, *lat_str, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        L=L, BLOCK_L=BLOCK_L, BLOCK_V=c["BLOCK_V"], VC=c["VC"], BLOCK_S=c["BLOCK_S"], BLOCK_N=BLOCK_N,
        BLOCK_B=BLOCK_B, MIN_TILES=MIN_TILES, MERGE=merge, num_warps=8 if out.is_cuda else 4, **pdl_launch(pdl),
    )
    return out


__all__ = ["mla_decode_prep_ref", "mla_decode_uv_ref", "mla_decode_prep_triton", "launch_uv", "uv_config",
           "pdl_on"]
