"""Torch references for the paged MLA ops (absorbed form over the latent cache).

Cache layout (docs/design.md): per MLA layer ``[NB, BS, L + R]`` holding ``[normed c_kv (L) | k_pe (R)]`` per token.
Page 0 is the null page. ``block_table [N, MB] int32``; ``slot_mapping [T] int64 = page * BS + offset`` (-1 = skip).
``seq_lens [N] int32`` = keys per sequence after this step.

Math (fp32): ``score_h(j) = (q_lat_h . c_j + q_pe_h . kpe_j) * scale``, ``out_h = sum_j softmax(score_h)_j c_j``.
These references gather pages per sequence, use a plain softmax and run in fp32; the output has q's dtype. They do
host syncs (``.tolist()``) and are meant for the CPU path and for tests.
"""
import torch


def store_latent_ref(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.view(-1, L+R)[slot] = latent for every slot >= 0 (in place)."""
    assert latent.dim() == 2 and cache.dim() == 3 and latent.shape[1] == cache.shape[2]
    assert slot_mapping.shape[0] == latent.shape[0]
    if latent.shape[0] == 0:
        return
    flat = cache.view(-1, cache.shape[2])
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    flat[slots[keep]] = latent[keep].to(cache.dtype)


def gather_latent_ref(cache: torch.Tensor, block_row: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The first ``n_keys`` cached rows of one sequence, ``[n_keys, L+R]`` (cache dtype)."""
    bs = cache.shape[1]
    nblk = (n_keys + bs - 1) // bs
    pages = block_row[:nblk].to(torch.long)
    return cache[pages].reshape(nblk * bs, cache.shape[2])[:n_keys]


def _attend(q_lat, q_pe, kv, scale, mask=None):
    """q_lat [M, H, L], q_pe [M, H, R], kv [S, L+R] -> [M, H, L] fp32. mask [M, S] bool (True = visible)."""
    L = q_lat.shape[-1]
    c = kv[:, :L].float()
    kpe = kv[:, L:].float()
    s = torch.einsum("mhl,sl->mhs", q_lat.float(), c) + torch.einsum("mhr,sr->mhs", q_pe.float(), kpe)
    s = s * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    # rows with no visible key -> zeros, not NaN
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("mhs,sl->mhl", p, c)


def mla_decode_ref(q_lat, q_pe, cache, block_table, seq_lens, scale):
    """One query per sequence attending to all ``seq_lens[n]`` cached keys. Returns ``[N, H, L]`` in q's dtype.

    Lanes with ``seq_lens == 0`` produce zeros.
    """
    N, H, L = q_lat.shape
    assert q_pe.shape[:2] == (N, H) and cache.shape[2] == L + q_pe.shape[2]
    out = torch.zeros(N, H, L, dtype=torch.float32, device=q_lat.device)
    for n, s in enumerate(seq_lens.tolist()):
        if s <= 0:
            continue
        kv = gather_latent_ref(cache, block_table[n], s)
        out[n] = _attend(q_lat[n : n + 1], q_pe[n : n + 1], kv, scale)[0]
    return out.to(q_lat.dtype)


def mla_extend_ref(q_lat, q_pe, cache, block_table, cu_seqlens, seq_lens, scale):
    """Varlen causal attention of new tokens over the cached prefix plus themselves (already in the cache).

    Query ``i`` of sequence ``p`` (``q_len = cu[p+1] - cu[p]``) sits at key position ``seq_lens[p] - q_len + i`` and
    sees keys ``<=`` that position (bottom-right aligned causal mask). Returns ``[T, H, L]`` in q's dtype; tokens not
    covered by ``cu_seqlens`` and queries with no visible key give zeros.
    """
    T, H, L = q_lat.shape
    out = torch.zeros(T, H, L, dtype=torch.float32, device=q_lat.device)
    cu = cu_seqlens.tolist()
    for p, s in enumerate(seq_lens.tolist()):
        b, e = cu[p], cu[p + 1]
        ql = e - b
        if ql <= 0 or s <= 0:
            continue
        kv = gather_latent_ref(cache, block_table[p], s)
        pos = torch.arange(ql, device=q_lat.device) + (s - ql)
        mask = torch.arange(s, device=q_lat.device)[None, :] <= pos[:, None]
        out[b:e] = _attend(q_lat[b:e], q_pe[b:e], kv, scale, mask)
    return out.to(q_lat.dtype)


def gather_latent_batch_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Every sequence's first ``seq_lens[p]`` cached rows, packed: ``[sum(seq_lens), L+R]`` (cache dtype)."""
    rows = [gather_latent_ref(cache, block_table[p], s) for p, s in enumerate(seq_lens.tolist()) if s > 0]
    if not rows:
        return cache.new_zeros(0, cache.shape[2])
    return torch.cat(rows)


def mla_prefill_expanded_ref(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale, q_pe=None):
    """Expanded-form varlen causal attention (kernels/mla/prefill.py). q [T, H, nope+R] (or q_nope with q_pe),
    k_nope [S, H, nope], k_pe [S, R] (shared by the heads), v [S, H, V]. Query i of sequence p sits at key position
    ``k_len - q_len + i``. Returns ``[T, H, V]`` in q's dtype; rows not covered by cu_seqlens_q are zero."""
    dn = k_nope.shape[2]
    if q_pe is None:
        q, q_pe = q[..., :dn], q[..., dn:]
    T, H = q.shape[:2]
    out = torch.zeros(T, H, v.shape[2], dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for p in range(len(cq) - 1):
        b, e, kb, ke = cq[p], cq[p + 1], ck[p], ck[p + 1]
        ql, kl = e - b, ke - kb
        if ql <= 0 or kl <= 0:
            continue
        s = torch.einsum("mhd,shd->hms", q[b:e].float(), k_nope[kb:ke].float())
        s = s + torch.einsum("mhr,sr->hms", q_pe[b:e].float(), k_pe[kb:ke].float())
        pos = torch.arange(ql, device=q.device) + (kl - ql)
        mask = torch.arange(kl, device=q.device)[None, :] <= pos[:, None]
        pr = torch.softmax((s * scale).masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        out[b:e] = torch.einsum("hms,shv->mhv", pr, v[kb:ke].float())
    return out.to(q.dtype)
