"""KDA references: chunk form == recurrent form (fp64), gate/l2norm formulas, varlen/slot-pool helper."""
import pytest
import torch

from kernels.kda.ref import (
    kda_chunk_ref,
    kda_gate_ref,
    kda_recurrent_ref,
    kda_varlen_ref,
    l2norm_ref,
)
from kernels.testing import assert_close


def _inputs(B, T, H, K, V, gmin=-5.0, dtype=torch.float64):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = l2norm_ref(torch.randn(B, T, H, K, dtype=dtype))
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = torch.rand(B, T, H, K, dtype=dtype) * gmin
    beta = torch.rand(B, T, H, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("KV", [(16, 32), (32, 16)])
@pytest.mark.parametrize("h0", [False, True])
def test_chunk_equals_recurrent_fp64(T, KV, h0):
    K, V = KV
    q, k, v, g, beta = _inputs(2, T, 2, K, V)
    s0 = torch.randn(2, 2, K, V, dtype=torch.float64) if h0 else None
    o1, s1 = kda_recurrent_ref(q, k, v, g, beta, 0.25, s0)
    o2, s2 = kda_chunk_ref(q, k, v, g, beta, 0.25, s0)
    assert torch.allclose(o1, o2, atol=1e-10, rtol=1e-9)
    assert torch.allclose(s1, s2, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_sizes(chunk_size):
    q, k, v, g, beta = _inputs(1, 100, 2, 16, 16)
    o1, s1 = kda_recurrent_ref(q, k, v, g, beta, None)
    o2, s2 = kda_chunk_ref(q, k, v, g, beta, None, chunk_size=chunk_size)
    assert torch.allclose(o1, o2, atol=1e-10) and torch.allclose(s1, s2, atol=1e-10)


def test_strong_gates_no_overflow():
    # per-step gates down to -20 (and a few -200): decays flush to zero, nothing overflows
    q, k, v, g, beta = _inputs(1, 130, 2, 16, 16, gmin=-20.0)
    g[0, 5:9] = -200.0
    s0 = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    o1, s1 = kda_recurrent_ref(q, k, v, g, beta, None, s0)
    o2, s2 = kda_chunk_ref(q, k, v, g, beta, None, s0)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert torch.allclose(o1, o2, atol=1e-10) and torch.allclose(s1, s2, atol=1e-10)
    # fp32 chunk form too
    o3, s3 = kda_chunk_ref(*(t.float() for t in (q, k, v, g, beta)), None, s0.float())
    assert_close("o fp32", o3, o1, 1e-5)
    assert_close("s fp32", s3, s1, 1e-5)


def test_recurrent_step_order():
    # one step by hand: decay, delta, write, read with the updated state
    K, V = 4, 3
    q, k, v, g, beta = (t[0, 0, 0] for t in _inputs(1, 1, 1, K, V))
    S = torch.randn(K, V, dtype=torch.float64)
    Sd = torch.exp(g)[:, None] * S
    u = beta * (v - Sd.t() @ k)
    S1 = Sd + torch.outer(k, u)
    o = S1.t() @ (q * 0.5)
    o_ref, s_ref = kda_recurrent_ref(q[None, None, None], k[None, None, None], v[None, None, None],
                                     g[None, None, None], beta[None, None, None], 0.5, S[None, None])
    assert torch.allclose(o_ref[0, 0, 0], o) and torch.allclose(s_ref[0, 0], S1)


def test_initial_state_continuation():
    # recurrence over T == recurrence over T1 then T-T1 from its final state (both forms)
    q, k, v, g, beta = _inputs(1, 90, 2, 16, 16)
    o, s = kda_chunk_ref(q, k, v, g, beta, None)
    oa, sa = kda_chunk_ref(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], None)
    ob, sb = kda_recurrent_ref(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], None, sa)
    assert torch.allclose(torch.cat([oa, ob], 1), o, atol=1e-10) and torch.allclose(sb, s, atol=1e-10)


def test_unbatched_shapes():
    q, k, v, g, beta = (t[0] for t in _inputs(1, 5, 2, 8, 4))
    o, s = kda_chunk_ref(q, k, v, g, beta, None, torch.zeros(2, 8, 4, dtype=torch.float64))
    assert o.shape == (5, 2, 4) and s.shape == (2, 8, 4)
    o2, s2 = kda_recurrent_ref(q, k, v, g, beta, None)
    assert torch.allclose(o, o2, atol=1e-12) and torch.allclose(s, s2, atol=1e-12)


def test_gate_ref():
    H, K = 2, 8
    z = torch.randn(3, H * K) * 30
    A_log = torch.randn(H)
    dt_bias = torch.randn(H * K)
    g = kda_gate_ref(z, A_log, dt_bias)
    x = (z + dt_bias).double()
    sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    ref = -torch.exp(A_log.double())[:, None] * sp.view(3, H, K)
    assert g.dtype == torch.float32 and g.shape == (3, H, K)
    assert torch.allclose(g.double(), ref, rtol=1e-5, atol=1e-6)
    assert (g <= 0).all()
    # [1, 1, H, 1] A_log and [.., H, K] z are accepted
    g2 = kda_gate_ref(z.view(3, H, K).bfloat16().float(), A_log.view(1, 1, H, 1), dt_bias)
    assert g2.shape == (3, H, K)


def test_l2norm_ref():
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    y = l2norm_ref(x)
    xf = x.float()
    assert torch.allclose(y, xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose(l2norm_ref(torch.zeros(2, 4)), torch.zeros(2, 4))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_pool(mode):
    H, K, V, S = 2, 16, 8, 6
    lens = [5, 1, 0, 70]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v, g, beta = (t[0] for t in _inputs(1, T, H, K, V, dtype=torch.float32))
    pool = torch.randn(S, H, K, V)
    slots = torch.tensor([3, 1, 5, 2], dtype=torch.int32)
    his = torch.tensor([True, False, True, True])
    pool0 = pool.clone()
    o = kda_varlen_ref(q, k, v, g, beta, None, cu, pool, slots, his, mode=mode)
    for p in range(4):
        b, e = int(cu[p]), int(cu[p + 1])
        h0 = pool0[slots[p]] if his[p] else torch.zeros(H, K, V)
        o_p, s_p = kda_recurrent_ref(q[b:e], k[b:e], v[b:e], g[b:e], beta[b:e], None, h0)
        assert torch.allclose(o[b:e], o_p, atol=1e-5)
        assert torch.allclose(pool[slots[p]], s_p, atol=1e-5)
    for s in (0, 4):   # untouched slots
        assert torch.equal(pool[s], pool0[s])


@pytest.mark.skipif(not (torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_kernel(dtype):
    from kernels.kda.gate import kda_gate_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    H, K, T = 2, 16, 5
    z = (torch.randn(T, H * K, device=dev) * 30).to(dtype)
    A_log = torch.tensor([3.0, -1.0], device=dev)
    dt_bias = torch.randn(H * K, device=dev)
    g = kda_gate_triton(z, A_log, dt_bias)
    ref = kda_gate_ref(z, A_log, dt_bias)
    assert g.shape == (T, H, K) and g.dtype == torch.float32
    assert torch.allclose(g, ref, rtol=1e-5, atol=1e-6)
    assert (g <= 0).all()
