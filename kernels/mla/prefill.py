"""Expanded-form MLA prefill: varlen causal flash attention, qk = nope | rope (128 + 64), v 128, per head.

Large prefill chunks are cheaper in this form than absorbed over the latent (per query-key pair and head
2 * (192 + 128) FLOPs instead of 2 * (576 + 512); the one-off up-projection of the S latent rows, 2 * L * H * (nope + v)
per key, is amortised over the chunk: crossover ~171 new tokens, /work/shared/reference/mla-kernels.md §1.2).

    q [T, H, nope + R] (q_nope | q_pe), or q_nope [T, H, nope] with q_pe [T, H, R] given apart
    k_nope [S, H, nope], k_pe [S, R] (one per key, shared by the heads), v [S, H, V]
    cu_seqlens_q [P + 1], cu_seqlens_k [P + 1] (int32)  ->  out [T, H, V]

Sequence p's queries are its LAST q_len keys: query i sits at key position ``k_len - q_len + i`` and sees keys ``<=``
that position (bottom-right aligned causal mask). Strided views are fine (last dim contiguous): the model passes
slices of kv_b_proj's output [S, H, nope + V] and of the gathered latent [S, L + R] as they are.

Grid (H, cdiv(max_q_len, BLOCK_M), P): a program owns BLOCK_M queries of one head; query tiles run last to first (the
longest causal rows start first) and the heads of a tile are adjacent in launch order (k_pe tiles shared in L2).
Each program runs the keys every row of its tile sees without masks, then the diagonal tiles with the causal mask.
Online softmax in base 2 (scale * log2 e folded in), fp32 accumulation; the two QK dots keep K = nope and K = R.
"""
import torch
import triton
import triton.language as tl

from kernels._tensors import H200_SMEM, cdiv, max_shared_mem, unit_last_stride

from .decode import LOG2E, _check_dots, _dot, _dot_dim, _gpu_cfg, _upcast

# GPU tiles per dtype. ptxas (sm_90, Triton 3.9, `python bench/mla.py --ptxas --only prefill`), bf16:
# BLOCK_M 128 / BLOCK_N 64 / 8 warps / 3 stages (default): wgmma, 168 KB smem, 254 regs, no spill (one CTA per SM
# either way: 254 regs x 256 threads); 2 stages: 128 KB, 254 regs, no spill; BLOCK_N 128 / 2 stages: 208 KB + 256 B
# stack; 64 / 64 / 4 warps / 3 stages: 144 KB + 8 B stack. bench/mla.py times the alternatives (EXPANDED_ALT).
# fp32 (tests only; IEEE dots run on FMA units): small tiles, one stage.
# "16bit-small-smem" (a block may opt into < PREFILL_LARGE_SMEM, e.g. GB10 sm_121: 99 KB): the default needs 128 KB
# on sm_120a (Triton 3.9: mma.sync, no wgmma on sm_12x; 255 regs + 80 B stack) and would fail to launch; BLOCK_N 32
# keeps the 3 stages: 88 KB, 184 regs, no spill (2 stages at BLOCK_N 64: 88 KB but 112 B stack;
# tests/kernels/test_gb10_offline.py).
PREFILL_CFG = {
    "16bit": dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "16bit-small-smem": dict(block_m=128, block_n=32, num_warps=8, num_stages=3),
    "fp32": dict(block_m=32, block_n=32, num_warps=4, num_stages=1),
}
PREFILL_LARGE_SMEM = 176 * 1024   # bytes per block PREFILL_CFG["16bit"] needs room for (sm_90: 168 KB)


def prefill_config(DN: int, R: int, DV: int, dtype, on_gpu: bool, block_m=None, block_n=None, config=None,
                   smem: int = H200_SMEM):
    """-> (launch cfg, constexpr blocks) for mla_prefill_expanded_triton; every tl.dot dim >= MIN_DOT (asserted).
    smem: shared memory a block may opt into (kernels._tensors.max_shared_mem) picks the 16-bit default."""
    cfg = _gpu_cfg(PREFILL_CFG, dtype, smem, PREFILL_LARGE_SMEM)
    if config:
        cfg.update(config)
    b = dict(
        BLOCK_M=_dot_dim(block_m or (cfg["block_m"] if on_gpu else 16)),
        BLOCK_N=_dot_dim(block_n or (cfg["block_n"] if on_gpu else 16)),
        BLOCK_DN=_dot_dim(DN),
        BLOCK_R=_dot_dim(R),
        BLOCK_DV=_dot_dim(DV),
    )
    # S = q_nope k_nope^T + q_pe k_pe^T, acc += P v
    _check_dots("mla_prefill_expanded", [(b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_DN"]),
                                         (b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_R"]),
                                         (b["BLOCK_M"], b["BLOCK_DV"], b["BLOCK_N"])])
    return cfg, b


@triton.jit
def _tile(ptrs, rows_ok, cols_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
    if ROW_MASK and COL_MASK:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif ROW_MASK:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif COL_MASK:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _prefill_inner(
    acc,
    l_i,
    m_i,
    q,
    qpe,
    kn_ptrs,
    kpe_ptrs,
    v_ptrs,
    lo,
    hi,
    pos,
    s_kt,
    s_et,
    s_vt,
    qk_scale,
    dn_ok,
    r_ok,
    dv_ok,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAD_DN: tl.constexpr,
    PAD_R: tl.constexpr,
    PAD_DV: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Keys [lo, hi) (relative to the sequence start; the pointers point at key lo). CAUSAL: mask keys >= hi and
    keys after each row's position, and guard rows with nothing visible yet; else every key is visible to every row."""
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(lo, hi, BLOCK_N):
        tok = k0 + offs_n
        tok_ok = tok < hi
        kn = _tile(kn_ptrs, tok_ok, dn_ok, CAUSAL, PAD_DN)
        kpe = _tile(kpe_ptrs, tok_ok, r_ok, CAUSAL, PAD_R)
        s = _dot(q, tl.trans(kn), IEEE, UPCAST)
        s += _dot(qpe, tl.trans(kpe), IEEE, UPCAST)
        s = s * qk_scale
        if CAUSAL:
            s = tl.where(tok_ok[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(v_ptrs, tok_ok, dv_ok, CAUSAL, PAD_DV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
        kn_ptrs += BLOCK_N * s_kt
        kpe_ptrs += BLOCK_N * s_et
        v_ptrs += BLOCK_N * s_vt
    return acc, l_i, m_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    qpe_ptr,
    kn_ptr,
    kpe_ptr,
    v_ptr,
    cuq_ptr,
    cuk_ptr,
    out_ptr,
    qk_scale,  # scale * log2(e)
    s_qt,
    s_qh,
    s_pt,
    s_ph,
    s_kt,
    s_kh,
    s_et,
    s_vt,
    s_vh,
    s_ot,
    s_oh,
    DN: tl.constexpr,
    R: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    p = tl.program_id(2)
    q_begin = tl.load(cuq_ptr + p)
    q_len = tl.load(cuq_ptr + p + 1) - q_begin
    k_begin = tl.load(cuk_ptr + p)
    k_len = tl.load(cuk_ptr + p + 1) - k_begin
    m0 = mb * BLOCK_M
    PAD_DN: tl.constexpr = BLOCK_DN != DN
    PAD_R: tl.constexpr = BLOCK_R != R
    PAD_DV: tl.constexpr = BLOCK_DV != DV
    if m0 < q_len:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        off = k_len - q_len  # key position of query 0
        pos = off + offs_m
        offs_dn = tl.arange(0, BLOCK_DN)
        offs_r = tl.arange(0, BLOCK_R)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_n = tl.arange(0, BLOCK_N)
        dn_ok = offs_dn < DN
        r_ok = offs_r < R
        dv_ok = offs_dv < DV
        tok_q = (q_begin + offs_m).to(tl.int64)
        q = tl.load(q_ptr + tok_q[:, None] * s_qt + h * s_qh + offs_dn[None, :],
                    mask=m_ok[:, None] & dn_ok[None, :], other=0.0)
        qpe = tl.load(qpe_ptr + tok_q[:, None] * s_pt + h * s_ph + offs_r[None, :],
                      mask=m_ok[:, None] & r_ok[None, :], other=0.0)

        # keys seen by the tile's last row; keys [0, full) are seen by every row (whole tiles only)
        kv_end = tl.minimum(k_len, off + tl.minimum(m0 + BLOCK_M, q_len))
        full = tl.maximum(tl.minimum(off + m0 + 1, kv_end), 0) // BLOCK_N * BLOCK_N

        kb = k_begin.to(tl.int64)
        kn_ptrs = kn_ptr + kb * s_kt + h * s_kh + offs_n[:, None] * s_kt + offs_dn[None, :]
        kpe_ptrs = kpe_ptr + kb * s_et + offs_n[:, None] * s_et + offs_r[None, :]
        v_ptrs = v_ptr + kb * s_vt + h * s_vh + offs_n[:, None] * s_vt + offs_dv[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, qpe, kn_ptrs, kpe_ptrs, v_ptrs, 0, full, pos,
                                       s_kt, s_et, s_vt, qk_scale, dn_ok, r_ok, dv_ok,
                                       BLOCK_N, False, PAD_DN, PAD_R, PAD_DV, IEEE, UPCAST)
        fo = full.to(tl.int64)
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, qpe, kn_ptrs + fo * s_kt, kpe_ptrs + fo * s_et,
                                       v_ptrs + fo * s_vt, full, kv_end, pos,
                                       s_kt, s_et, s_vt, qk_scale, dn_ok, r_ok, dv_ok,
                                       BLOCK_N, True, PAD_DN, PAD_R, PAD_DV, IEEE, UPCAST)
        has = l_i > 0
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        tl.store(out_ptr + tok_q[:, None] * s_ot + h * s_oh + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & dv_ok[None, :])


def mla_prefill_expanded_triton(
    q,
    k_nope,
    k_pe,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    scale,
    max_query_len=None,
    out=None,
    q_pe=None,
    block_m=None,
    block_n=None,
    config=None,
):
    """See the module docstring. ``max_query_len`` (host int) sizes the grid (default: T). ``out`` [T, H, V]: the
    rows covered by cu_seqlens_q are written (a new ``out`` is uninitialised elsewhere)."""
    S, H, DN = k_nope.shape
    DV = v.shape[2]
    R = k_pe.shape[1]
    if q_pe is None:
        assert q.shape[2] == DN + R, f"q last dim {q.shape[2]} != nope {DN} + rope {R}"
        q_pe = q[..., DN:]
        q = q[..., :DN]
    T = q.shape[0]
    P = cu_seqlens_q.shape[0] - 1
    assert q.shape == (T, H, DN) and q_pe.shape == (T, H, R), (q.shape, q_pe.shape)
    assert k_pe.shape == (S, R) and v.shape[:2] == (S, H) and cu_seqlens_k.shape[0] == P + 1
    q, q_pe, k_nope, k_pe, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, q_pe, k_nope, k_pe, v))
    cu_seqlens_q = unit_last_stride(cu_seqlens_q, torch.int32)
    cu_seqlens_k = unit_last_stride(cu_seqlens_k, torch.int32)
    if out is None:
        out = torch.empty(T, H, DV, dtype=q.dtype, device=q.device)
    assert out.shape == (T, H, DV) and out.stride(2) == 1
    if T == 0 or P == 0:
        return out
    on_gpu = q.is_cuda
    cfg, blocks = prefill_config(DN, R, DV, k_nope.dtype, on_gpu, block_m, block_n, config, max_shared_mem(q.device))
    mq = T if max_query_len is None else max(1, int(max_query_len))
    grid = (H, cdiv(mq, blocks["BLOCK_M"]), P)
    kw = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) if on_gpu else {}
    _mla_prefill_kernel[grid](
        q,
        q_pe,
        k_nope,
        k_pe,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        out,
        float(scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_pe.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        DN=DN,
        R=R,
        DV=DV,
        **blocks,
        IEEE=k_nope.dtype == torch.float32,
        UPCAST=_upcast(k_nope.dtype),
        **kw,
    )
    return out
