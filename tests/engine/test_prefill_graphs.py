"""Prefill CUDA graphs (backend/engine/prefill_graphs.py) with CPU stand-ins: a stand-in replay runs the model
eagerly on the static padded batch (the bucket's padding sequence included) and writes the graph's hidden buffer,
so the padding, the static buffers and the runner's logits gather are exercised as on the GPU; and once through the
Triton kernels under the interpreter (the padding sequence in the KDA / MLA / MoE kernels)."""
import pytest
import torch

from backend.engine import SamplingParams
from backend.engine.prefill_graphs import PrefillGraphs
from tests.engine.test_engine import GREEDY, alone, assert_pools_full, collect, make_engine, staggered, workload
from tools.launches import LaunchCounter


class EagerPrefillGraph:
    """replay() runs the model on the static batch, counting the host syncs a capture would have failed on."""

    def __init__(self, pg, tb, n, hidden):
        self.pg, self.tb, self.n, self.hidden = pg, tb, n, hidden

    def replay(self):
        r = self.pg.runner
        self.pg.replays += 1
        with LaunchCounter() as c:
            hidden = r.model(self.pg.batch(self.tb, self.n), r.cache)
        self.pg.syncs += sum(c.syncs.values())
        self.hidden.copy_(hidden)


def with_logprobs(stream) -> tuple:
    """A request's (token ids, logprob entries) over all its outputs."""
    toks, entries = [], []
    for out in stream:
        toks += out.token_ids
        entries += out.logprobs or []
    return toks, entries


def record_fills(pg) -> list:
    """(bucket, real tokens) of every step pg fills from now on."""
    fills, fill = [], pg._fill
    pg._fill = lambda tb, seqs: fills.append((tb, sum(len(x[0]) for x in seqs))) or fill(tb, seqs)
    return fills


def with_prefill_graphs(eng, max_tokens=512, max_seqs=3):
    r = eng.runner
    pg = PrefillGraphs(r, max_tokens, max_seqs)
    pg.replays = pg.syncs = 0
    d = r.config.hidden_size
    for tb in pg.sizes:
        for n in range(1, max_seqs + 1):
            g = EagerPrefillGraph(pg, tb, n, torch.zeros(tb, d, dtype=r.dtype))
            pg.graphs[(tb, n)] = (g, g.hidden)
    r.prefill_graphs = pg
    return eng


@pytest.fixture(scope="module")
def engines(tiny_dir):
    kw = dict(max_num_batched_tokens=300, max_model_len=600, num_blocks=200)
    eager, eng = make_engine(tiny_dir, **kw), with_prefill_graphs(make_engine(tiny_dir, **kw))
    yield eager, eng
    eager.shutdown()
    eng.shutdown()


def test_graphed_prefill_matches_alone(engines):
    """Staggered greedy requests: the prompts' steps replay the padded graphs (up to 3 prompts and < 512 tokens a
    step); each request's tokens equal the model's alone; the pools come back full."""
    _, eng = engines
    work = workload(12, seed=21)
    ref = alone(eng, work)
    before = eng.runner.prefill_graphs.replays
    streams = staggered(eng, [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work], every=3)
    assert [collect(s)[0] for s in streams] == ref
    assert eng.runner.prefill_graphs.replays > before
    assert_pools_full(eng)


def test_graphed_prefill_equals_eager_engine(engines):
    """Seeded sampling, logprobs and Score requests (scoring rows gathered from the graph's hidden states) give what
    the eager engine gives; long prompts included (chunked at 300 tokens: the first chunk is >= the 256 bucket, so
    the next one, 512; the chunk after it continues on cached state and runs eagerly)."""
    eager, eng = engines
    prompts = [list(range(3, 40)), [7] * 250, list(range(1, 250)) * 1 + [5] * 60, [9, 8, 7]]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i, logprobs=True, top_logprobs=2)
              for i in range(len(prompts))]
    want = [with_logprobs(eager.add_request(p, sp)) for p, sp in zip(prompts, params)]
    got = [with_logprobs(s) for s in [eng.add_request(p, sp) for p, sp in zip(prompts, params)]]
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt and len(gl) == len(wl) == len(gt)
        for g, w in zip(gl, wl):  # the sampled token's log-probability and the top 2, ids equal and values close
            assert g["token_id"] == w["token_id"] and abs(g["logprob"] - w["logprob"]) < 1e-4, (g, w)
            assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]], (g, w)
            assert max(abs(a - b) for (_, a), (_, b) in zip(g["top"], w["top"])) < 1e-4, (g, w)
    score = SamplingParams(score_from=2)
    ws = list(eager.add_request(prompts[0], score))[-1].scores
    gs = list(eng.add_request(prompts[0], score))[-1].scores
    assert len(gs) == len(ws) and max(abs(a - b) for a, b in zip(gs, ws)) < 1e-4
    assert_pools_full(eng)


def test_only_fresh_steps_are_graphed(engines):
    """A chunk after cached tokens (its keys outnumber its bucket: the expanded MLA's gather could not be a constant
    of the graph) runs eagerly: a 450-token prompt at a 300-token budget replays one graph, for its first chunk."""
    _, eng = engines
    pg = eng.runner.prefill_graphs
    before = pg.replays
    toks, _ = collect(eng.add_request(list(range(1, 226)) * 2, SamplingParams(max_tokens=2, **GREEDY)))
    assert len(toks) == 2 and pg.replays == before + 1
    assert_pools_full(eng)


def test_bucket_rule(engines):
    """A step takes the smallest bucket at or above its token count (an exact fit runs with an empty padding
    sequence); buckets whose padding could exceed one block-table row (max_model_len) are not made."""
    _, eng = engines
    pg = eng.runner.prefill_graphs
    assert pg.sizes == [256, 512]
    assert pg.bucket(1) == 256 and pg.bucket(256) == 256 and pg.bucket(257) == 512 and pg.bucket(512) == 512
    assert pg.bucket(513) == 0
    r = eng.runner   # max_model_len 600, pages of 16: a row covers 608 keys
    assert r.max_blocks_per_seq * r.block_size == 608
    assert PrefillGraphs(r, 4096).sizes == [256, 512] and PrefillGraphs(r, 200).sizes == []


def test_padded_step_through_the_triton_kernels(tiny_dir, monkeypatch):
    """The same under the Triton interpreter (kernels._dispatch forced to Triton on CPU tensors), with buckets of 64
    and 128 tokens (the interpreter's time; the real ones start at 256): two prompts in one graphed step, padded to
    the 128 bucket (the padding sequence, a partial KDA chunk, runs the KDA chunk, conv, MLA and MoE kernels on the
    null slot and page), then a prompt of exactly 64 tokens (the bucket with an EMPTY padding sequence), give the
    eager engine's tokens. The MLA runs the expanded form, as CUDA does for every bucket (its key gather sized by the
    bucket: ForwardBatch.prefill_keys). The graphed steps never sync (a capture would fail on it)."""
    import backend.engine.prefill_graphs as pgm
    import kernels._dispatch as d
    from backend.model import kimi_linear

    monkeypatch.setattr(d, "_FORCE", "triton")
    monkeypatch.setattr(pgm, "SIZES", (64, 128))
    monkeypatch.setitem(kimi_linear.MLA_EXPANDED_MIN_TOKENS, "cpu", 1)
    kw = dict(max_num_batched_tokens=300, max_model_len=300, num_blocks=40)
    eager, eng = make_engine(tiny_dir, **kw), with_prefill_graphs(make_engine(tiny_dir, **kw), 128, 2)
    try:
        pg = eng.runner.prefill_graphs
        assert pg.sizes == [64, 128]
        fills = record_fills(pg)
        prompts = [list(range(3, 70)), [11, 12, 13] * 9]
        sp = SamplingParams(max_tokens=3, **GREEDY)
        want = [collect(s)[0] for s in [eager.add_request(p, sp) for p in prompts]]
        got = [collect(s)[0] for s in [eng.add_request(p, sp) for p in prompts]]
        exact = [(i * 7) % 97 + 3 for i in range(64)]
        want.append(collect(eager.add_request(exact, sp))[0])
        got.append(collect(eng.add_request(exact, sp))[0])
        assert got == want and pg.replays >= 2
        assert (64, 64) in fills and (128, 94) in fills, fills   # the exact fit, and the padded step
        assert eng.runner.prefill_graphs.syncs == 0
        assert_pools_full(eng)
    finally:
        eager.shutdown()
        eng.shutdown()


def test_capture_code_runs(tiny_dir, monkeypatch):
    """PrefillGraphs.capture itself (the stand-ins above replace it) with torch.cuda's graph primitives stood in on
    the CPU: one warm-up and one captured forward per (bucket, sequences) graph, largest first, each graph keeping
    the hidden states its forward returned; the pool is handed on from graph to graph."""
    from tests.eager_graph import fake_cuda_graphs

    calls = []
    fake_cuda_graphs(monkeypatch, calls)
    eng = make_engine(tiny_dir, max_num_batched_tokens=300, max_model_len=600, num_blocks=200)
    try:
        r = eng.runner
        forward = r.model.forward
        monkeypatch.setattr(r.model, "forward", lambda b, c: calls.append(("forward", b.input_ids.shape[0],
                                                                           b.prefill_keys)) or forward(b, c))
        pg = PrefillGraphs(r, 512, 2)
        pg.capture()
        assert list(pg.graphs) == [(512, 2), (512, 1), (256, 2), (256, 1)]
        fwd = [c for c in calls if c[0] == "forward"]
        assert fwd == [("forward", tb, tb) for tb in (512, 512, 512, 512, 256, 256, 256, 256)]
        pools = [c[1] for c in calls if c[0] == "capture"]
        assert pools[0] == ("pool", 0) and all(p[1] != 0 for p in pools[1:])
        for (tb, _), (_, hidden) in pg.graphs.items():
            assert hidden.shape == (tb, r.config.hidden_size)
        assert_pools_full(eng)
    finally:
        eng.shutdown()


@pytest.mark.gpu
def test_gpu_prefill_graphs(tiny_dir, monkeypatch):
    """The captured graphs on CUDA (prefill_graph_tokens=512: buckets 256 and 512, 1-4 prompts) give the eager
    engine's tokens for staggered requests, exact fits (empty padding sequences) and Score; steps above the buckets
    stay eager. Every prefill part attends in the expanded MLA form here (on CUDA a bucket of >= 256 tokens always
    would, an eager step below 256 would not), so both engines run the same math."""
    import backend.model.kimi_linear as km

    monkeypatch.setitem(km.MLA_EXPANDED_MIN_TOKENS, "cuda", 1)
    kw = dict(max_num_seqs=8, num_blocks=256, max_num_batched_tokens=600, max_model_len=700, device="cuda",
              dtype="float32")
    eager = make_engine(tiny_dir, enforce_eager=True, **kw)
    eng = make_engine(tiny_dir, prefill_graph_tokens=512, **kw)
    try:
        pg = eng.runner.prefill_graphs
        assert pg is not None and sorted(pg.graphs) == [(t, n) for t in (256, 512) for n in (1, 2, 3, 4)]
        runs, run = [], pg.run
        monkeypatch.setattr(pg, "run", lambda out: runs.append(len(out.seqs)) or run(out))
        work = workload(12, seed=5) + [([3] * 450, 4), (list(range(1, 250)) * 2, 3)]
        want = [collect(s)[0] for s in [eager.add_request(p, SamplingParams(max_tokens=m, **GREEDY))
                                        for p, m in work]]
        got = [collect(s)[0] for s in staggered(eng, [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work])]
        assert got == want and runs, runs          # some steps replayed a graph
        fills = record_fills(pg)
        for n in (256, 512):                       # exact fits: the bucket itself, with an empty padding sequence
            p = [(i * 13) % 251 + 2 for i in range(n)]
            sp = SamplingParams(max_tokens=4, **GREEDY)
            assert collect(eng.add_request(p, sp))[0] == collect(eager.add_request(p, sp))[0]
        assert fills == [(256, 256), (512, 512)], fills
        ws = list(eager.add_request(list(range(3, 40)), SamplingParams(score_from=1)))[-1].scores
        gs = list(eng.add_request(list(range(3, 40)), SamplingParams(score_from=1)))[-1].scores
        assert max(abs(a - b) for a, b in zip(gs, ws)) < 1e-4
        assert_pools_full(eng)
    finally:
        eager.shutdown()
        eng.shutdown()
        torch.cuda.empty_cache()
