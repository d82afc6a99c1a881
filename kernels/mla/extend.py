"""Paged absorbed-MLA extend (chunked prefill / continuation): varlen, causal, flash-attention-style online softmax.

New tokens' latents are already in the cache (store_latent ran first). Query i of sequence p (q_len = cu[p+1]-cu[p])
sits at key position ``seq_lens[p] - q_len + i`` and sees keys ``<=`` that position (bottom-right aligned).

Grid (cdiv(max_query_len, BLOCK_T), P, cdiv(H, BLOCK_H)), query tiles last to first. A program packs BLOCK_T query tokens x BLOCK_H heads into the
M = BLOCK_T * BLOCK_H rows of one tile (row m: token m // BLOCK_H, head m % BLOCK_H): every latent tile it loads feeds
all of them (MQA), both as K (S = q_lat c^T + q_pe kpe^T) and as V (acc += P c).
"""
import torch
import triton
import triton.language as tl

from kernels._tensors import H200_SMEM, cdiv, max_shared_mem, next_pow2, unit_last_stride

from .decode import LOG2E, _check_dots, _dot, _dot_dim, _gpu_cfg, _upcast

# rows = BLOCK_T * BLOCK_H. ptxas (sm_90, Triton 3.9, `python bench/mla.py --ptxas --only extend`), bf16:
# * rows 64 / BLOCK_N 32 / 8 warps / 2 stages (default): wgmma (two warpgroups, each 64 x 256 of the fp32 acc =
#   128 regs/thread), 144 KB smem, 255 regs + 64 B stack: 4 LDL per key tile, L1-resident. Measured on the H200:
#   2x the rows-32 config (13.0 vs 26.1 ms for an 8k prefill, 14.9 vs 30.5 ms for 512 new after 64k).
# * tried to remove the spill: 1 stage 352 B stack; BLOCK_N 64: 232 B (2 stages) / 424 B (1); 4 warps 1.8 KB;
#   BLOCK_N 16 / 2 stages spill-free but its QK wgmma is 64x8 per warpgroup (N = BLOCK_N / 2), so not the default.
#   Splitting the 512-wide acc into two 256 halves keeps the same 128 regs/thread (each warpgroup already owns half).
# * rows 32 / BLOCK_N 32 / 8 warps / 3 stages (previous default): mma.sync, 74 KB, 172 regs, no spill.
# bench/mla.py times rows 64 and rows 32. Large prefill chunks (>= 256 new tokens) use the expanded form (prefill.py).
# * "16bit-small-smem" (a block may opt into < EXTEND_LARGE_SMEM, e.g. GB10 sm_121: 99 KB): the rows-64 default needs
#   112 KB there (sm_120a, Triton 3.9: mma.sync, no wgmma on sm_12x; 255 regs + 56 B stack) and would fail to launch;
#   rows 32 / BLOCK_N 32 / 8 warps / 3 stages: 74 KB, 178 regs, no spill (tests/kernels/test_gb10_offline.py).
EXTEND_CFG = {
    "16bit": dict(rows=64, block_n=32, num_warps=8, num_stages=2),
    "16bit-small-smem": dict(rows=32, block_n=32, num_warps=8, num_stages=3),
    "fp32": dict(rows=32, block_n=32, num_warps=8, num_stages=1),
}
EXTEND_LARGE_SMEM = 160 * 1024   # bytes per block EXTEND_CFG["16bit"] needs room for (sm_90: 144 KB)


def extend_config(H: int, L: int, R: int, dtype, on_gpu: bool, block_n=None, rows=None, config=None,
                  smem: int = H200_SMEM) -> tuple[dict, dict]:
    """-> (launch cfg, constexpr blocks) for mla_extend_triton. rows = BLOCK_T * BLOCK_H is the M of every tl.dot;
    all dot dims are >= MIN_DOT (padded, masked; asserted). smem: shared memory a block may opt into
    (kernels._tensors.max_shared_mem) picks the 16-bit default."""
    cfg = _gpu_cfg(EXTEND_CFG, dtype, smem, EXTEND_LARGE_SMEM)
    if config:
        cfg.update(config)
    rows = _dot_dim(rows or (cfg["rows"] if on_gpu else 64))
    block_h = min(next_pow2(H), rows)
    b = dict(
        BLOCK_H=block_h,
        BLOCK_T=max(1, rows // block_h),
        BLOCK_N=_dot_dim(block_n or (cfg["block_n"] if on_gpu else 16)),
        BLOCK_L=_dot_dim(L),
        BLOCK_R=_dot_dim(R),
    )
    m = b["BLOCK_T"] * b["BLOCK_H"]
    _check_dots("mla_extend", [(m, b["BLOCK_N"], b["BLOCK_L"]), (m, b["BLOCK_N"], b["BLOCK_R"]),
                               (m, b["BLOCK_L"], b["BLOCK_N"])])
    return cfg, b


@triton.jit
def _mla_extend_kernel(
    q_ptr,
    qpe_ptr,
    cache_ptr,
    bt_ptr,
    cu_ptr,
    seqlen_ptr,
    out_ptr,
    H,
    qk_scale,
    s_qt,
    s_qh,
    s_pt,
    s_ph,
    s_cp,
    s_cr,
    s_btn,
    s_ot,
    s_oh,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # query tiles run last-to-first (grid axis 0 is launched first): the longest causal rows start first
    tb = tl.num_programs(0) - 1 - tl.program_id(0)
    p = tl.program_id(1)
    hb = tl.program_id(2)
    q_begin = tl.load(cu_ptr + p)
    q_len = tl.load(cu_ptr + p + 1) - q_begin
    seq_len = tl.load(seqlen_ptr + p)
    t0 = tb * BLOCK_T
    M: tl.constexpr = BLOCK_T * BLOCK_H
    if t0 < q_len:
        offs_m = tl.arange(0, M)
        t_rel = t0 + offs_m // BLOCK_H
        heads = hb * BLOCK_H + offs_m % BLOCK_H
        rmask_m = (t_rel < q_len) & (heads < H)
        tok_q = (q_begin + t_rel).to(tl.int64)
        pos = seq_len - q_len + t_rel  # key position of each row's query
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        lmask = offs_l < L
        rmask = offs_r < R
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(
            q_ptr + tok_q[:, None] * s_qt + heads[:, None] * s_qh + offs_l[None, :],
            mask=rmask_m[:, None] & lmask[None, :],
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)
        qpe = tl.load(
            qpe_ptr + tok_q[:, None] * s_pt + heads[:, None] * s_ph + offs_r[None, :],
            mask=rmask_m[:, None] & rmask[None, :],
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_L], tl.float32)
        bt_row = bt_ptr + p.to(tl.int64) * s_btn
        # keys needed by the last query of this tile
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(t0 + BLOCK_T, q_len))
        for k0 in range(0, kv_end, BLOCK_N):
            tok = k0 + offs_n
            tmask = tok < kv_end
            page = tl.load(bt_row + tok // BS, mask=tmask, other=0).to(tl.int64)
            row = cache_ptr + page * s_cp + (tok % BS).to(tl.int64) * s_cr
            c = tl.load(row[:, None] + offs_l[None, :], mask=tmask[:, None] & lmask[None, :], other=0.0)
            kpe = tl.load(row[:, None] + L + offs_r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
            s = _dot(q, tl.trans(c), IEEE, UPCAST)
            s += _dot(qpe, tl.trans(kpe), IEEE, UPCAST)
            s = s * qk_scale
            vis = tmask[None, :] & (tok[None, :] <= pos[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + _dot(pr.to(c.dtype), c, IEEE, UPCAST)
            m_i = m_new

        has = l_i > 0
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        tl.store(
            out_ptr + tok_q[:, None] * s_ot + heads[:, None] * s_oh + offs_l[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=rmask_m[:, None] & lmask[None, :],
        )


def mla_extend_triton(
    q_lat,
    q_pe,
    cache,
    block_table,
    cu_seqlens,
    seq_lens,
    scale,
    max_query_len=None,
    out=None,
    block_n=None,
    rows=None,
    config=None,
):
    """``max_query_len`` (host int) sizes the grid; without it the grid covers T query tokens per sequence (correct,
    programs past a sequence's end exit at once) — pass it for large batches. Without ``out`` the result is zero
    outside ``cu_seqlens``; a given ``out`` [T, H, L] is written on the rows ``cu_seqlens`` covers only."""
    T, H, L = q_lat.shape
    R = q_pe.shape[2]
    NB, BS, D = cache.shape
    P = seq_lens.shape[0]
    assert D == L + R and q_pe.shape[:2] == (T, H) and cu_seqlens.shape[0] == P + 1
    assert cache.stride(2) == 1
    q_lat = unit_last_stride(q_lat)
    q_pe = unit_last_stride(q_pe)
    block_table = unit_last_stride(block_table, torch.int32)
    seq_lens = unit_last_stride(seq_lens, torch.int32)
    cu_seqlens = unit_last_stride(cu_seqlens, torch.int32)
    # rows not covered by cu_seqlens stay zero (matches the reference)
    if out is None:
        out = torch.zeros(T, H, L, dtype=q_lat.dtype, device=q_lat.device)
    assert out.shape == (T, H, L) and out.stride(2) == 1
    if T == 0 or P == 0:
        return out
    on_gpu = q_lat.is_cuda
    cfg, blocks = extend_config(H, L, R, cache.dtype, on_gpu, block_n, rows, config, max_shared_mem(q_lat.device))
    BLOCK_T, BLOCK_H = blocks["BLOCK_T"], blocks["BLOCK_H"]
    mq = T if max_query_len is None else max(1, int(max_query_len))
    grid = (cdiv(mq, BLOCK_T), P, cdiv(H, BLOCK_H))
    kw = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) if on_gpu else {}
    _mla_extend_kernel[grid](
        q_lat,
        q_pe,
        cache,
        block_table,
        cu_seqlens,
        seq_lens,
        out,
        H,
        float(scale) * LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        L=L,
        R=R,
        BS=BS,
        **blocks,
        IEEE=cache.dtype == torch.float32,
        UPCAST=_upcast(cache.dtype),
        **kw,
    )
    return out
