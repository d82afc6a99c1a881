"""ModelRunner.prepare against ForwardBatch.build (the model owner's reference builder), and memory sizing."""

import random

import pytest
import torch

from backend.engine.engine import EngineConfig
from backend.engine.request import Request, SamplingParams
from backend.engine.runner import ModelRunner, graph_batch_sizes
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.model.batch import ForwardBatch


def req(prompt, output, computed, slot, blocks):
    r = Request(prompt, SamplingParams())
    r.output_token_ids, r.num_computed_tokens, r.state_slot, r.block_ids = list(output), computed, slot, blocks
    return r


def test_prepare_matches_forward_batch_build(tiny_dir):
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=4, max_num_seqs=4, max_model_len=64, device="cpu"))
    bs = runner.block_size
    # a decode, a decode that is a 1-token chunk inside a recomputed output, a first chunk, a middle chunk
    a = req([1, 2, 3, 4, 5], [6, 7], 6, 1, [3, 5])
    b = req([9] * 10, [8, 7, 6], 11, 2, [1, 2, 6])
    c = req(list(range(10, 17)), [], 0, 3, [4, 7])
    d = req(list(range(20, 33)), [44], 4, 4, [8, 9, 10, 11])
    seqs = [ScheduledSeq(a, 6, 1, True), ScheduledSeq(b, 11, 1, False), ScheduledSeq(c, 0, 7, True),
            ScheduledSeq(d, 4, 10, True)]
    out = SchedulerOutput(seqs, num_decodes=2, num_tokens=19)
    got = runner.prepare(out)
    toks = [[7], [7], list(range(10, 17)), list(range(24, 33)) + [44]]
    ref = ForwardBatch.build([(t, s.start, s.request.state_slot, s.request.block_ids) for t, s in zip(toks, seqs)],
                             2, bs, torch.device("cpu"), logits_positions=[0, 8, 18])
    for name in ("input_ids", "cu_seqlens", "prefill_cu_seqlens", "seq_lens", "state_slots", "has_initial_state",
                 "block_table", "slot_mapping", "logits_index"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.num_decodes == 2 and got.max_query_len == 10


def test_sizes_and_graph_batch_sizes(tiny_dir):
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=16, max_num_seqs=3, max_model_len=100, device="cpu"))
    assert runner.num_slots == 4 and runner.num_blocks == 1 + 3 * 7 and runner.max_blocks_per_seq == 7
    assert runner.page_bytes() == 1 * 16 * (32 + 8) * 4
    assert runner.slot_bytes() == 2 * (3 * 3 * 4 * 16 * 4 + 4 * 16 * 16 * 4)
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="max_model_len 100 exceeds"):
        ModelRunner(tiny_dir, EngineConfig(block_size=16, num_blocks=4, max_model_len=100, device="cpu"))


class NullGraph:
    def replay(self):
        pass


def test_graph_inputs_after_replays(tiny_dir):
    """Decode-graph inputs (one staged copy per step, block-table rows changed by edits only) equal a full rewrite's
    after each step, as lanes change hands, pages are added in place and block lists are replaced (preemption)."""
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=4, max_num_seqs=8, max_model_len=64, device="cpu"))
    runner.graph_vars = runner._make_graph_vars(8)
    runner.graphs = {b: NullGraph() for b in (1, 2, 4, 8)}
    rng, B, pages = random.Random(0), runner.block_size, iter(range(1, 10 ** 6))
    reqs = []
    for i in range(10):
        n = rng.randint(1, 20)
        reqs.append(req([rng.randrange(250) for _ in range(n + 1)], [], n, i + 1, [next(pages) for _ in range(n // B + 1)]))
    for step in range(80):
        chosen = rng.sample(reqs, rng.randint(1, 8))
        for r in chosen:
            if rng.random() < 0.1:  # preempted and recomputed: a new list of pages
                r.block_ids = [next(pages) for _ in r.block_ids]
        out = SchedulerOutput([ScheduledSeq(r, r.num_computed_tokens, 1, True) for r in chosen], len(chosen),
                              len(chosen))
        feed = torch.tensor([1000 + i for i in range(len(chosen))]) if step % 3 == 0 else None
        runner._replay(out, feed)
        v, n = runner.graph_vars, len(chosen)
        bs = min(b for b in runner.graphs if b >= n)
        ids = feed.tolist() if feed is not None else [r.token_id(r.num_computed_tokens) for r in chosen]
        assert v["input_ids"][:bs].tolist() == ids + [0] * (bs - n)
        p = [r.num_computed_tokens for r in chosen]
        assert v["slot_mapping"][:bs].tolist() == [r.block_ids[q // B] * B + q % B for r, q in zip(chosen, p)] + \
            [-1] * (bs - n)
        assert v["seq_lens"][:bs].tolist() == [q + 1 for q in p] + [1] * (bs - n)
        assert v["state_slots"][:bs].tolist() == [r.state_slot for r in chosen] + [0] * (bs - n)
        for i, r in enumerate(chosen):
            assert v["block_table"][i, :len(r.block_ids)].tolist() == r.block_ids
        assert v["block_table"][n:bs, 0].tolist() == [0] * (bs - n)
        for r in chosen:  # the step's token: a new page every B positions, added in place
            r.output_token_ids.append(rng.randrange(250))
            r.num_computed_tokens += 1
            if r.num_computed_tokens >= len(r.block_ids) * B:
                r.block_ids += [next(pages)]


def test_decode_capture_code_runs(tiny_dir, monkeypatch):
    """runner._capture_graphs itself (the engine tests replace the graphs by stand-ins) with torch.cuda's graph
    primitives stood in on the CPU: for each padded batch size, largest first, one warm-up and one captured
    decode forward of that many lanes (every lane sampled: no logits gather), the logits written into the static
    buffer's first rows; the pool handed on from graph to graph; no host sync inside a capture (CUDA would fail),
    through the Triton kernels as on CUDA."""
    import kernels._dispatch as d
    from tests.eager_graph import fake_cuda_graphs

    monkeypatch.setattr(d, "_FORCE", "triton")  # the kernels CUDA captures (interpreter on CPU tensors)
    calls = []
    fake_cuda_graphs(monkeypatch, calls, count_syncs=True)
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=16, max_num_seqs=8, max_model_len=64, device="cpu"))
    forward, logits_fn = runner.model.forward, runner.model.compute_logits

    def fwd(batch, cache):
        calls.append(("forward", batch.input_ids.shape[0], batch.num_decodes))
        return forward(batch, cache)

    def logits(hidden, index, out=None):
        calls.append(("logits", index, out.shape[0], out.data_ptr()))
        return logits_fn(hidden, index, out=out)
    monkeypatch.setattr(runner.model, "forward", fwd)
    monkeypatch.setattr(runner.model, "compute_logits", logits)
    runner._capture_graphs(8)
    sizes = [8, 4, 2, 1]
    assert sorted(runner.graphs) == sorted(sizes) and sizes == list(reversed(graph_batch_sizes(8)))
    buf = runner.graph_vars["logits"]
    want = []
    for i, bs in enumerate(sizes):
        pool = ("pool", 0) if i == 0 else ("pool", id(runner.graphs[sizes[i - 1]]))
        step = [("forward", bs, bs), ("logits", None, bs, buf.data_ptr())]
        want += step + [("capture", pool)] + step + [("syncs", 0)]
    assert calls == want
    assert torch.isfinite(buf[:8]).all()
