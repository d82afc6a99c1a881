"""Tensor parallel model on CPU (gloo, spawned processes): the logits of W ranks equal those of one process.

Sharded matmuls and all-reduces sum in another order than one process, so fp32 logits (|logit| up to ~17 here) differ
by a few ulps: atol 1e-5 plus rtol 1e-5."""
import pytest
import torch
import torch.multiprocessing as mp

from backend.config import ModelConfig
from backend.model import parallel
from backend.model.loader import load_model
from backend.model.parallel import TP, check_divisible, free_port
from tp_harness import rank_main, run_workload


def test_two_ranks_match_one(tp_dir, tmp_path):
    ref = run_workload(load_model(tp_dir, "cpu", torch.float32))
    out = str(tmp_path / "logits.pt")
    mp.spawn(rank_main, args=(2, free_port(), tp_dir, out), nprocs=2, join=True)
    got = torch.load(out)
    assert [t.shape for t in got] == [t.shape for t in ref]
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    assert not torch.equal(ref[0][:1], ref[0][1:2])  # the workload is not degenerate


def test_shard_shapes(tp_dir):
    """Rank 1 of 2 holds half of every sharded tensor, and exactly the right rows of it."""
    full = load_model(tp_dir, "cpu", torch.float32)
    half = load_model(tp_dir, "cpu", torch.float32, TP(1, 2))
    f, h = dict(full.named_parameters()), dict(half.named_parameters())
    # unsharded, the shared expert is stacked as expert E of w13 / w2; sharded it is 1/W of a separate MLP
    # (moe_intermediate_size 32: rank 1 holds its rows / columns 16:32)
    assert set(f) == {n for n in h if ".shared_experts." not in n}
    torch.testing.assert_close(h["model.embed_tokens.weight"], f["model.embed_tokens.weight"][128:], rtol=0, atol=0)
    torch.testing.assert_close(h["lm_head.weight"], f["lm_head.weight"][128:], rtol=0, atol=0)
    moe = "model.layers.1.block_sparse_moe."
    torch.testing.assert_close(h[moe + "w13"], f[moe + "w13"][4:8], rtol=0, atol=0)
    # shared gate_up_proj rows: gate 16:32 | up 16:32 of the stacked expert 8's [gate 0:32 | up 32:64]
    torch.testing.assert_close(h[moe + "shared_experts.gate_up_proj.weight"],
                               torch.cat([f[moe + "w13"][8, 16:32], f[moe + "w13"][8, 32 + 16:]]), rtol=0, atol=0)
    torch.testing.assert_close(h[moe + "shared_experts.down_proj.weight"], f[moe + "w2"][8][:, 16:], rtol=0, atol=0)
    torch.testing.assert_close(h[moe + "gate.weight"], f[moe + "gate.weight"], rtol=0, atol=0)
    kda = "model.layers.0.self_attn."
    hk, k_dim = 4 * 16, 16
    # in_proj rows: q | k | v (this rank's heads) | f_a | g_a (replicated) | b (this rank's heads)
    fi, hi = f[kda + "in_proj.weight"], h[kda + "in_proj.weight"]
    assert hi.shape[0] == 3 * hk // 2 + 2 * k_dim + 2
    torch.testing.assert_close(hi[:hk // 2], fi[hk // 2:hk], rtol=0, atol=0)                       # q
    torch.testing.assert_close(hi[hk // 2:hk], fi[hk + hk // 2:2 * hk], rtol=0, atol=0)            # k
    torch.testing.assert_close(hi[3 * hk // 2:3 * hk // 2 + 2 * k_dim], fi[3 * hk:3 * hk + 2 * k_dim], rtol=0, atol=0)
    torch.testing.assert_close(hi[-2:], fi[-2:], rtol=0, atol=0)                                    # b heads 2:4
    torch.testing.assert_close(h[kda + "fg_b_proj"], f[kda + "fg_b_proj"][:, hk // 2:], rtol=0, atol=0)
    mla = "model.layers.1.self_attn."
    fm, hm = f[mla + "in_proj.weight"], h[mla + "in_proj.weight"]
    q_rows = fm.shape[0] - (32 + 8)
    torch.testing.assert_close(hm[:q_rows // 2], fm[q_rows // 2:q_rows], rtol=0, atol=0)             # q heads 2:4
    torch.testing.assert_close(hm[q_rows // 2:], fm[q_rows:], rtol=0, atol=0)                       # kv_a replicated
    fg, hg = f["model.layers.0.mlp.gate_up_proj.weight"], h["model.layers.0.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(hg, torch.cat([fg[64:128], fg[192:]]), rtol=0, atol=0)  # gate, up rows 64:128 of 128
    torch.testing.assert_close(h[kda + "A_log"], f[kda + "A_log"][2:], rtol=0, atol=0)
    torch.testing.assert_close(h[kda + "o_proj.weight"], f[kda + "o_proj.weight"][:, hk // 2:], rtol=0, atol=0)
    cache = half.allocate_cache(3, 2, 4)
    assert cache.rec_state[0].shape == (3, 2, 16, 16) and cache.conv_state[0].shape == (3, 3, 3 * hk // 2)
    assert cache.latent[0].shape == (2, 4, 32 + 8)  # the latent is replicated


def test_heads_not_divisible(tp_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide KDA heads .* = 4.*MLA heads .* = 4"):
        check_divisible(ModelConfig.from_dir(tp_dir), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        load_model(tp_dir, "cpu", torch.float32, TP(0, 3))
    check_divisible(ModelConfig.from_dir(tp_dir), 4)


def test_graph_replay_and_long_messages(tp_dir, tmp_path):
    """REPLAY messages (decode graphs, padded lanes) and steps larger than the first broadcast buffer."""
    from backend.engine import EngineConfig, LLMEngine, SamplingParams
    from tp_harness import engine_rank_main

    prompts = [[3, 17, 42, 99, 7], list(range(40, 75)), [9]]
    eng = LLMEngine.from_config(tp_dir, EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                                                     max_model_len=96, device="cpu"))
    try:
        want = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    finally:
        eng.shutdown()
    out = str(tmp_path / "tokens.pt")
    mp.spawn(engine_rank_main, args=(2, free_port(), tp_dir, prompts, 10, 40, out), nprocs=2, join=True)
    tokens, sends = torch.load(out)
    assert tokens == want
    long = 40 - parallel.HEADER
    assert {(kind, n > long) for kind, n in sends} >= {(parallel.EAGER, True), (parallel.REPLAY, False),
                                                       (parallel.REPLAY, True)}, sends
