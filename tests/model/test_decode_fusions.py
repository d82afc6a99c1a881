"""The decode fusions of the Triton path, end to end through the tiny checkpoint (interpreter on CPU, kernels on
CUDA): a prefill fills the KDA slots and MLA pages, then one decode-only step of two sequences runs with every fusion
on (PendingMoE: router + post-attention norm; the fused MLA chain; their caps lifted here) and with each switched
off. Logits and the caches the step wrote must agree."""
import copy

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory):
    """-> (model, cache after a prefill of two sequences, logits of the next decode step with every fusion on, the
    caches that step wrote): built once, each test switches one fusion off on a copy of the prefilled cache."""
    import kernels._dispatch as d
    from backend.model.batch import ForwardBatch
    from backend.model.loader import load_model
    from tools.tiny_checkpoint import write_tiny_checkpoint

    import backend.model.kimi_linear as km
    import kernels.moe.router as router

    mp = pytest.MonkeyPatch()
    mp.setattr(d, "_FORCE", "triton")
    # every fusion on (the caps lifted)
    mp.setattr(router, "ROUTER_NORM_MAX_T", 16)
    mp.setattr(km, "MLA_FUSED_MAX_T", 64)
    tmp = str(tmp_path_factory.mktemp("tiny_dec_fuse"))
    model = load_model(write_tiny_checkpoint(tmp, tokenizer=None, seed=5), DEV, torch.bfloat16)
    assert any(getattr(layer, "pending_moe", False) for layer in model.model.layers)
    cache = model.allocate_cache(3, 8, 4)
    prefill = ForwardBatch.build([(list(range(30, 35)), 0, 1, [1, 2]), (list(range(40, 43)), 0, 2, [3])], 0, 4,
                                 model.device)
    model(prefill, cache)
    on_cache = copy.deepcopy(cache)
    on = _decode_step(model, on_cache)
    yield model, cache, on, on_cache
    mp.undo()


def _switch(monkeypatch, model, name):
    import backend.model.kimi_linear as km
    import kernels.moe.router as router

    if name in ("pending", "all"):
        for layer in model.model.layers:
            monkeypatch.setattr(layer, "pending_moe", False)
    if name in ("router_norm", "all"):
        monkeypatch.setattr(router, "ROUTER_NORM", False)
    if name in ("mla", "all"):
        monkeypatch.setattr(km, "MLA_FUSED_MAX_T", 0)


def _decode_step(model, cache):
    from backend.model.batch import ForwardBatch

    # two decodes after 5 / 3 prompt tokens (block size 4: the first crosses into its second page)
    seqs = [([11], 5, 1, [1, 2]), ([12], 3, 2, [3])]
    batch = ForwardBatch.build(seqs, 2, 4, model.device)
    return model.compute_logits(model(batch, cache), batch.logits_index)


@pytest.mark.parametrize("off", ["pending", "router_norm", "mla", "all"])
def test_decode_fusions_match_unfused(tiny_step, monkeypatch, off):
    model, cache, on, on_cache = tiny_step
    cache_off = copy.deepcopy(cache)
    _switch(monkeypatch, model, off)
    ref = _decode_step(model, cache_off)
    assert torch.isfinite(ref).all()
    # bf16 roundings in another order (router's sum of squares, W_UK / W_UV products) move single elements by 1 ulp;
    # the random tiny model amplifies that (a 1-ulp change of one input embedding row moves these logits by ~0.18 of
    # a max ~11): within 2% of the logit scale, and the greedy token is the same
    assert (on - ref).abs().max() <= 0.02 * ref.abs().max()
    assert torch.equal(on.argmax(-1), ref.argmax(-1))
    for a, b in zip(on_cache.latent + on_cache.rec_state + on_cache.conv_state,
                    cache_off.latent + cache_off.rec_state + cache_off.conv_state):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_router_l2_hint_same_bits(tiny_step, monkeypatch):
    """ROUTER_L2_HINT_MB: the router hints the first MB of the folded shared expert (w13[E], then w2[E]) into L2 (a
    PDL launch only; dropped under the interpreter): the step's logits are bit for bit those without it."""
    import backend.model.kimi_linear as km

    model, cache, on, _ = tiny_step
    moe = next(layer.block_sparse_moe for layer in model.model.layers if getattr(layer, "pending_moe", False))
    w13, w2 = moe.w13[moe.num_local_experts], moe.w2[moe.num_local_experts]
    mb = lambda n: n * w13.element_size() / (1 << 20)  # noqa: E731
    assert moe.shared_l2_hint(0.0) == ()
    half = moe.shared_l2_hint(mb(w13.numel() // 2))
    assert len(half) == 1 and half[0].numel() == w13.numel() // 2 and half[0].data_ptr() == w13.data_ptr()
    both = moe.shared_l2_hint(mb(w13.numel() + w2.numel()) + 1)
    assert [t.numel() for t in both] == [w13.numel(), w2.numel()] and both[1].data_ptr() == w2.data_ptr()
    assert km.ROUTER_L2_HINT_MB > 0 and moe.shared_l2_hint(km.ROUTER_L2_HINT_MB)  # `on` ran with the hint
    monkeypatch.setattr(km, "ROUTER_L2_HINT_MB", 0.0)                                # and this step without it
    assert torch.equal(_decode_step(model, copy.deepcopy(cache)), on)
