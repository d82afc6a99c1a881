"""Skinny GEMM (kernels/gemv.py) vs the fp32 torch reference: awkward small shapes under the interpreter, Kimi
decode projection shapes on the GPU."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kernels.gemv
from kernels._tensors import arrival_counters
from kernels.gemv import (
    FMA_CONFIG, FMA_MAX_M, GemvConfig, gemv_config, gemv_ref, gemv_triton, skinny_bmm_nt, skinny_linear,
)
from kernels.testing import assert_close, bf16_tol
from tests.kernels.conftest import requires_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: bf16_tol()}
# small configs that force each path: tl.dot / FMA, split K with a ragged last split, K not a multiple of BK
CONFIGS = {
    "auto": None,
    "dot split3": GemvConfig(BN=16, BK=32, split=3, dot=True),
    "fma split2": GemvConfig(BN=16, BK=64, split=2, dot=False),
    "fma bk16": GemvConfig(BN=8, BK=16, split=1, dot=False),
    "dot split2 2launch": GemvConfig(BN=32, BK=16, split=2, dot=True, fused=False, evict=False),
    "fma split3 2launch cg": GemvConfig(BN=16, BK=32, split=3, dot=False, fused=False, cg=True),
    "dot split5 cg": GemvConfig(BN=16, BK=16, split=5, dot=True, cg=True),
    "fma prefetch split2": GemvConfig(BN=16, BK=32, split=2, dot=False, prefetch=True),
    "dot tma split2": GemvConfig(BN=16, BK=32, split=2, dot=True, tma=True),
    "fma prefetch bk64": GemvConfig(BN=32, BK=64, split=1, dot=False, prefetch=True, evict=False),
    "dot ragged split2": GemvConfig(BN=32, BK=32, split=2, dot=True, ragged=True),
    "fma ragged": GemvConfig(BN=16, BK=64, split=1, dot=False, ragged=True),
    "dot ragged tma": GemvConfig(BN=64, BK=16, split=1, dot=True, ragged=True, tma=True),
}
# (N, K, what) Kimi-Linear-48B decode projections (D = 2304)
KIMI = [
    (12576, 2304, "KDA in_proj q|k|v|f_a|g_a|b"),
    (2304, 4096, "KDA / MLA o_proj"),
    (6720, 2304, "MLA q | kv_a"),
    (18432, 2304, "dense MLP gate|up"),
    (2304, 9216, "dense MLP down"),
    (163840, 2304, "lm_head"),
]


def _xw(M, N, K, dtype, B=None):
    lead = () if B is None else (B,)
    x = torch.randn(*lead, M, K, device=DEV).to(dtype)
    w = (torch.randn(*lead, N, K, device=DEV) / K ** 0.5).to(dtype)
    return x, w


@requires_triton
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (3, 70, 256), (16, 5, 48), (3, 130, 40), (9, 33, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_small(M, N, K, dtype, cfg):
    x, w = _xw(M, N, K, dtype)
    y = gemv_triton(x, w, CONFIGS[cfg])
    assert y.dtype == dtype
    assert_close("gemv", y, gemv_ref(x, w), TOL[dtype])


@requires_triton
@pytest.mark.parametrize("cfg", [GemvConfig(BN=16, BK=16, split=2, dot=True),
                                 GemvConfig(BN=16, BK=16, split=3, dot=False, prefetch=True),
                                 GemvConfig(BN=32, BK=16, split=1, dot=True, tma=True)], ids=["dot", "fma", "tma"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_batched_strided(dtype, T, cfg):
    # the KDA f_b / g_b pair: x [2, T, K] is a transposed view of the input projection's output columns
    K, N = 32, 48
    y = torch.randn(T, 5 + 2 * K, device=DEV).to(dtype)
    x = y[:, 5:5 + 2 * K].view(T, 2, K).transpose(0, 1)
    w = torch.randn(2, N, K, device=DEV).to(dtype)
    out = gemv_triton(x, w, cfg)
    assert out.shape == (2, T, N)
    assert_close("gemv batched", out, gemv_ref(x, w), TOL[dtype])
    assert_close("skinny_bmm_nt", skinny_bmm_nt(x, w), torch.bmm(x.float(), w.float().transpose(1, 2)), TOL[dtype])


def test_ragged_tiles():
    from kernels.gemv import _ragged_tiles
    assert _ragged_tiles(12576, 128, 1, 1, 132) == 132       # in_proj: one program per SM, 95-96 rows each
    assert _ragged_tiles(12576, 64, 1, 1, 132) == 264
    assert _ragged_tiles(2304, 64, 1, 3, 132) == 44          # o_proj at 3 K splits: 132 programs
    assert _ragged_tiles(12576, 128, 1, 1, 48) == 144        # a 48-SM part: three waves
    assert _ragged_tiles(20, 16, 1, 1, 132) == 20            # capped at one row per tile
    for N, BN, B, S, sms in [(12576, 128, 1, 1, 132), (2304, 64, 1, 3, 132), (6720, 64, 2, 2, 48), (37, 16, 1, 2, 7)]:
        nt = _ragged_tiles(N, BN, B, S, sms)
        widths = [(n + 1) * N // nt - n * N // nt for n in range(nt)]
        assert max(widths) <= BN and min(widths) >= 1 and sum(widths) == N
        assert nt == N or (B * S * nt) % sms == 0


@requires_triton
@pytest.mark.parametrize("sms", [3, 7, 132])
@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("B", [1, 2])
def test_gemv_ragged_any_sm_count(monkeypatch, sms, dot, B):
    # tile counts and widths vary with the SM count; every row is written once (NaN-poisoned output buffer)
    monkeypatch.setattr(kernels.gemv, "num_sms", lambda device: sms)
    N, K, M = 70, 96, 3
    x, w = _xw(M, N, K, torch.float32, B=B)
    real_empty = torch.empty
    monkeypatch.setattr(kernels.gemv.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    y = gemv_triton(x, w, GemvConfig(BN=16, BK=32, split=2, dot=dot, ragged=True))
    assert not y.isnan().any()
    assert_close("gemv ragged", y, gemv_ref(x, w), TOL[torch.float32])


def test_gemv_ref_formula():
    x, w = _xw(3, 7, 9, torch.bfloat16)
    assert torch.equal(gemv_ref(x, w), (x.float() @ w.float().T).to(torch.bfloat16))


def test_skinny_linear_falls_back():
    # CPU without KIMI_KERNELS=triton, or M > 16: exactly F.linear
    x, w = _xw(17, 8, 16, torch.float32)
    assert torch.equal(skinny_linear(x, w), F.linear(x, w))
    if DEV == "cpu":
        assert torch.equal(skinny_linear(x[:2], w), F.linear(x[:2], w))


@pytest.mark.parametrize("N,K,what", KIMI, ids=[k[2] for k in KIMI])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gemv_config_kimi(M, N, K, what):
    # every Kimi shape gets unmasked 16-byte K loads, splits whose K ranges are whole BK steps, and a split that
    # keeps the busiest of 132 SMs within 20% of an even share (plus one program's steps: the granularity)
    cfg, k_split = gemv_config(M, N, K, 1, "cpu")
    assert K % cfg.BK == 0 and k_split % cfg.BK == 0 and cfg.split == -(-K // k_split), (cfg, k_split)
    assert cfg.dot == (M > FMA_MAX_M)
    tiles, steps, k_steps = -(-N // cfg.BN), K // cfg.BK, k_split // cfg.BK
    busiest = -(-tiles * cfg.split // 132) * k_steps
    assert busiest <= 1.2 * tiles * steps / 132 + k_steps, (what, cfg, busiest)


@requires_triton
@pytest.mark.parametrize("dot", [True, False])
def test_gemv_fused_split_leaves_counters_zero(dot):
    # the one-launch split: the last-arriving program per tile reduces and resets its counter, so a second call
    # (a graph replay) sees zeros again; bit-identical to the two-launch reduce (same fixed order of the partials)
    x, w = _xw(2, 50, 96, torch.bfloat16)
    cfg = GemvConfig(BN=16, BK=16, split=3, dot=dot)
    y1 = gemv_triton(x, w, cfg)
    assert not arrival_counters(x.device, 4)[:4].any()
    y2 = gemv_triton(x, w, cfg)
    y3 = gemv_triton(x, w, GemvConfig(BN=16, BK=16, split=3, dot=dot, fused=False))
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    assert_close("fused split", y1, gemv_ref(x, w), bf16_tol())


def test_shape_configs_table(monkeypatch):
    # a SHAPE_CONFIGS entry (exact M first, then any M) replaces the default config for its shape only
    per_m, any_m = GemvConfig(BN=32, BK=64, split=2, dot=False), GemvConfig(BN=128, BK=128, split=1, dot=True)
    monkeypatch.setattr(kernels.gemv, "SHAPE_CONFIGS", {(1, 2304, 4096, 1): per_m, (1, 2304, 4096): any_m})
    assert gemv_config(1, 2304, 4096, 1, "cpu")[0] == per_m
    assert gemv_config(4, 2304, 4096, 1, "cpu")[0] == any_m
    assert gemv_config(1, 6720, 2304, 1, "cpu")[0].BN == kernels.gemv.DOT_CONFIG.BN


def test_shape_overrides(monkeypatch):
    # SHAPE_OVERRIDES (literal field dicts, for bench/ablate.py --set) change fields of the shape's config only;
    # a shape without a SHAPE_CONFIGS entry gets them on the default config
    base = GemvConfig(BN=64, BK=128, split=3, dot=True, num_warps=4, num_stages=2)
    monkeypatch.setattr(kernels.gemv, "SHAPE_CONFIGS", {(1, 2304, 4096): base})
    monkeypatch.setattr(kernels.gemv, "SHAPE_OVERRIDES", {(1, 2304, 4096): {"split": 4, "BN": 32},
                                                          (1, 6720, 2304, 1): {"split": 2}})
    c, _ = gemv_config(1, 2304, 4096, 1, "cpu")
    assert (c.BN, c.split, c.num_warps, c.num_stages) == (32, 4, 4, 2)
    c, _ = gemv_config(1, 6720, 2304, 1, "cpu")
    assert c.split == 2 and c.BN == kernels.gemv.DOT_CONFIG.BN
    with_ov = gemv_config(4, 6720, 2304, 1, "cpu")
    monkeypatch.setattr(kernels.gemv, "SHAPE_OVERRIDES", {})
    assert gemv_config(4, 6720, 2304, 1, "cpu") == with_ov               # M = 4: the M = 1 override does not apply


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,what", KIMI, ids=[k[2] for k in KIMI])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gemv_kimi_gpu(M, N, K, what):
    x, w = _xw(M, N, K, torch.bfloat16)
    y = gemv_triton(x, w)
    assert_close(what, y, gemv_ref(x, w), bf16_tol())
    assert_close(what + " vs cuBLAS", y, F.linear(x, w), bf16_tol())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("N,K,what", KIMI[:3], ids=[k[2] for k in KIMI[:3]])
@pytest.mark.parametrize("cfg", [GemvConfig(BN=128, BK=128, split=1, dot=True, num_stages=4, ragged=True),
                                 GemvConfig(BN=64, BK=128, split=3, dot=True, num_stages=6, ragged=True),
                                 GemvConfig(BN=32, BK=512, split=2, dot=False, ragged=True)],
                         ids=["dot128", "dot64 split3", "fma"])
def test_gemv_ragged_kimi_gpu(M, N, K, what, cfg):
    x, w = _xw(M, N, K, torch.bfloat16)
    assert_close(what + " ragged", gemv_triton(x, w, cfg), gemv_ref(x, w), bf16_tol())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
def test_gemv_glu_dense_mlp_gpu(M):
    # Kimi's dense MLP (I 9216, D 2304) with its own config: torch's bf16 roundings, so the torch path's values
    x, w = _xw(M, 2 * 9216, 2304, torch.bfloat16)
    gu = F.linear(x, w)
    assert_close("glu kimi", gemv_triton(x, w, glu=True), F.silu(gu[:, :9216]) * gu[:, 9216:], bf16_tol())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("N,K", [(2304, 4096), (6720, 2304)])
def test_gemv_fma_gpu(M, N, K):
    # the FMA path (not the default; in bench/gemv.py --sweep), split and unsplit
    x, w = _xw(M, N, K, torch.bfloat16)
    assert_close("fma", gemv_triton(x, w, replace(FMA_CONFIG, dot=False)), gemv_ref(x, w), bf16_tol())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
def test_gemv_fg_b_gpu(M):
    # KDA f_b / g_b: [2, M, 128] x [2, 4096, 128]^T, x a strided view
    y = torch.randn(M, 12576, device=DEV, dtype=torch.bfloat16)
    x = y[:, 12288:12544].view(M, 2, 128).transpose(0, 1)
    w = (torch.randn(2, 4096, 128, device=DEV) / 128 ** 0.5).to(torch.bfloat16)
    assert_close("fg_b", gemv_triton(x, w), gemv_ref(x, w), bf16_tol())


@pytest.mark.gpu
def test_gemv_cuda_graph():
    # static grid and buffers: a captured call replays with new inputs (split-K path: o_proj shape)
    x, w = _xw(4, 2304, 4096, torch.bfloat16)
    gemv_triton(x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gemv_triton(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert_close("graph", y, gemv_ref(x, w), bf16_tol())


def _decode_logits(model, steps=3):
    """A 5-token prefill then `steps` single-token decodes of one sequence (tiny model) -> fp32 logits [steps+1, V]."""
    from backend.model.batch import ForwardBatch

    ids = torch.randint(0, 250, (5 + steps,), generator=torch.Generator().manual_seed(0)).tolist()
    cache, out = model.allocate_cache(2, 8, 4), []
    for j, seq in [(0, ids[:5])] + [(5 + i, [ids[5 + i]]) for i in range(steps)]:
        batch = ForwardBatch.build([(seq, j, 1, list(range(1, 7)))], int(j > 0), 4, model.device,
                                   logits_positions=[len(seq) - 1])
        out.append(model.compute_logits(model(batch, cache), batch.logits_index)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    from tools.tiny_checkpoint import write_tiny_checkpoint
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("gemv_tiny")), tokenizer=None, seed=1, dtype="float32")


def test_model_gemv_off_is_nn_linear(tiny_fp32, monkeypatch):
    from backend.model import kimi_linear
    from backend.model.loader import load_model

    monkeypatch.setenv("KIMI_GEMV", "0")
    model = load_model(tiny_fp32, "cpu", torch.float32)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert lins and all(type(m) is torch.nn.Linear for m in lins)
    assert not any(isinstance(m, kimi_linear._GemvLinear) for m in model.modules())


@requires_triton
def test_model_opt_in_matches_default(tiny_fp32, monkeypatch):
    # KIMI_GEMV=1 with the gemv kernel forced on (interpreter on CPU): decode logits match the default model
    import kernels.gemv
    from backend.model import kimi_linear
    from backend.model.loader import load_model

    monkeypatch.setenv("KIMI_GEMV", "0")
    ref = _decode_logits(load_model(tiny_fp32, DEV, torch.float32))
    monkeypatch.setenv("KIMI_GEMV", "1")
    model = load_model(tiny_fp32, DEV, torch.float32)
    assert isinstance(model.lm_head, kimi_linear._GemvLinear)
    calls = []
    real = kernels.gemv.gemv_triton
    monkeypatch.setattr(kernels.gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels.gemv, "gemv_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _decode_logits(model)
    assert len(calls) > 0
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


@requires_triton
@pytest.mark.parametrize("cfg", [GemvConfig(BN=16, BK=32, split=1, dot=True), GemvConfig(BN=16, BK=32, split=3, dot=True),
                                 GemvConfig(BN=16, BK=32, split=2, dot=False, fused=False),
                                 GemvConfig(BN=32, BK=32, split=2, dot=True, ragged=True)],
                         ids=["dot", "split3", "2launch", "ragged"])
def test_gemv_fp32_out_is_upcast(cfg):
    # out= an fp32 buffer (the lm_head's logits): the x.dtype result upcast, bit for bit, in every split mode
    x, w = _xw(2, 70, 96, torch.bfloat16)
    ref = gemv_triton(x, w, cfg).float()
    out = torch.full((2, 70), float("nan"), device=DEV)
    assert gemv_triton(x, w, cfg, out=out) is out
    assert torch.equal(out, ref)
    # F.linear fallback (M > GEMV_MAX_M) fills out the same way
    xl = torch.randn(20, 96, device=DEV).to(torch.bfloat16)
    out = torch.full((20, 70), float("nan"), device=DEV)
    assert skinny_linear(xl, w, out=out) is out and torch.equal(out, F.linear(xl, w).float())
    with pytest.raises(AssertionError):
        gemv_triton(x, w, cfg, out=torch.empty(2, 70, dtype=torch.float16, device=DEV))


@requires_triton
@pytest.mark.parametrize("into", [True, False])
def test_compute_logits_into_buffer(tiny_fp32, monkeypatch, into):
    # the decode graphs' call: every row, fp32 logits stored into the static buffer by the lm_head gemv itself
    # (LOGITS_INTO) or converted and copied; the same bits as the gathered, upcast logits either way
    from backend.model import kimi_linear
    from backend.model.loader import load_model

    monkeypatch.setenv("KIMI_GEMV", "1")
    model = load_model(tiny_fp32, DEV, torch.bfloat16)
    monkeypatch.setattr(kernels.gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(kimi_linear, "LOGITS_INTO", into)
    outs = []
    real = kernels.gemv.gemv_triton
    monkeypatch.setattr(kernels.gemv, "gemv_triton", lambda *a, **k: outs.append(k.get("out")) or real(*a, **k))
    hidden = torch.randn(3, model.config.hidden_size, device=DEV).to(torch.bfloat16)
    ref = model.compute_logits(hidden, torch.arange(3, device=DEV))
    buf = torch.full((4, ref.shape[1]), float("nan"), device=DEV)
    got = model.compute_logits(hidden, None, out=buf[:3])
    assert ref.dtype == torch.float32 and torch.equal(got, ref) and torch.equal(buf[:3], ref)
    assert buf[3].isnan().all()
    assert outs[0] is None and (outs[1] is not None) == into


@requires_triton
@pytest.mark.parametrize("M,I,K,cfg", [
    (1, 100, 64, GemvConfig(BN=32, BK=32, dot=True, ragged=True)),
    (3, 70, 96, GemvConfig(BN=16, BK=32, dot=True, split=3)),
    (1, 50, 40, GemvConfig(BN=16, BK=64, dot=False)),
    (2, 33, 64, GemvConfig(BN=16, BK=32, dot=True, tma=True)),
], ids=["ragged", "split-ignored", "fma-k-tail", "tma-ignored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_glu(monkeypatch, M, I, K, cfg, dtype):
    # glu=True: W = [gate | up] rows, y = silu(x gate^T) * (x up^T) (a dense MLP's gate_up_proj + act + mul)
    monkeypatch.setattr(kernels.gemv, "num_sms", lambda device: 7)
    x, w = _xw(M, 2 * I, K, dtype)
    real_empty = torch.empty
    monkeypatch.setattr(kernels.gemv.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    y = gemv_triton(x, w, cfg, glu=True)
    monkeypatch.undo()
    gu = gemv_ref(x, w).to(dtype).float()                           # the projections rounded as F.linear's output
    ref = (F.silu(gu[:, :I]).to(dtype).float() * gu[:, I:]).to(dtype)
    assert y.shape == (M, I) and y.dtype == dtype and not y.isnan().any()
    assert_close("glu", y, ref, TOL[dtype])
    with pytest.raises(AssertionError):
        gemv_triton(x, w[:-1], cfg, glu=True)                      # odd row count: no gate | up halves


@requires_triton
def test_model_mlp_glu_matches(tiny_fp32, monkeypatch):
    # MLP_GLU: the dense MLP's silu * up inside the gate|up gemv; decode logits as with the two elementwise ops
    from backend.model import kimi_linear
    from backend.model.loader import load_model

    monkeypatch.setenv("KIMI_GEMV", "1")
    model = load_model(tiny_fp32, DEV, torch.float32)
    assert any(isinstance(m, kimi_linear.KimiMLP) for m in model.modules())
    monkeypatch.setattr(kernels.gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(kimi_linear, "use_triton", lambda t: True)
    ref = _decode_logits(model)
    glu = []
    real = kernels.gemv.gemv_triton
    monkeypatch.setattr(kimi_linear, "gemv_triton", lambda *a, **k: glu.append(k.get("glu")) or real(*a, **k))
    monkeypatch.setattr(kimi_linear, "MLP_GLU", True)
    got = _decode_logits(model)
    assert glu and all(glu)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


@requires_triton
def test_skinny_linear_measured_only(monkeypatch):
    # KIMI_GEMV=auto: ours only for the shapes and row counts of GEMV_WINS, F.linear (bit-exact) elsewhere
    monkeypatch.setattr(kernels.gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels.gemv, "GEMV_WINS", {(1, 24, 64): 2})
    calls = []
    real = kernels.gemv.gemv_triton
    monkeypatch.setattr(kernels.gemv, "gemv_triton", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    x, w = _xw(3, 24, 64, torch.float32)
    assert_close("win", skinny_linear(x[:2], w, measured_only=True), gemv_ref(x[:2], w), TOL[torch.float32])
    assert torch.equal(skinny_linear(x, w, measured_only=True), F.linear(x, w))            # M = 3 > 2
    assert torch.equal(skinny_linear(x[:1, :32], w[:, :32], measured_only=True), F.linear(x[:1, :32], w[:, :32]))
    skinny_linear(x, w)                                                                   # not measured_only
    assert calls == [2, 3]


def test_model_auto_mode(tiny_fp32, monkeypatch):
    # KIMI_GEMV=auto builds _GemvLinear modules that only take GEMV_WINS shapes
    from backend.model import kimi_linear
    from backend.model.loader import load_model

    for env in ("auto", None):                           # unset: auto is the default
        if env:
            monkeypatch.setenv("KIMI_GEMV", env)
        else:
            monkeypatch.delenv("KIMI_GEMV", raising=False)
        model = load_model(tiny_fp32, "cpu", torch.float32)
        assert isinstance(model.lm_head, kimi_linear._GemvLinear) and model.lm_head.measured_only


def test_bench_smoke():
    # bench/gemv.py --smoke (CPU, interpreter, tiny shapes) runs the benchmark and the sweep end to end
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "gemv.py"), "--smoke", "--sweep", "--m", "1,3"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "best per shape" in r.stdout and "projections of one decode step" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "gemv.py"), "--smoke", "--tma", "--m", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert " tma" in r.stdout and "best per shape" in r.stdout


# last in the file: a TMA fault would poison the CUDA context for every later GPU test
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("N,K,what", KIMI[:3], ids=[k[2] for k in KIMI[:3]])
def test_gemv_tma_gpu(M, N, K, what):
    x, w = _xw(M, N, K, torch.bfloat16)
    for cfg in [GemvConfig(BN=64, BK=128, dot=True, tma=True), GemvConfig(BN=128, BK=128, dot=True, tma=True,
                                                                          num_stages=3, split=1)]:
        assert_close(what + " tma", gemv_triton(x, w, cfg), gemv_ref(x, w), bf16_tol())


def test_dot_stages_fit_shared_memory(monkeypatch):
    """SHAPE_CONFIGS' 6-stage dot configs (120 KB at BN 64 / BK 128 bf16) keep their stages with the H200's 227 KB per
    block and drop to what fits a GB10's 99 KB (4 stages = 80 KB); fp32 halves that again."""
    monkeypatch.setattr(kernels.gemv, "max_shared_mem", lambda dev: 232448)
    assert gemv_config(1, 2304, 4096, 1, "cpu")[0].num_stages == 6
    monkeypatch.setattr(kernels.gemv, "max_shared_mem", lambda dev: 101376)
    c = gemv_config(1, 2304, 4096, 1, "cpu")[0]
    assert c.num_stages == 4 and c.num_stages * (c.BN + 16) * c.BK * 2 <= 101376 - 8192
    assert gemv_config(1, 2304, 4096, 1, "cpu", es=4)[0].num_stages == 2
