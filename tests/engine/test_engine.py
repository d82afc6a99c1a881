"""End-to-end engine tests on CPU with a tiny float32 checkpoint: continuous batching gives exactly the greedy tokens
of each request alone (backend/model/generate.py), under chunking, preemption, aborts and injected failures."""

import asyncio
import random
import threading
import time

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.model.generate import greedy_generate
from tests.eager_graph import EagerGraph

EOS = 252
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(tiny_dir, **kw):
    opts = dict(block_size=16, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128, device="cpu")
    opts.update(kw)
    return LLMEngine.from_config(tiny_dir, EngineConfig(**opts))


def with_graphs(eng, sizes=(1, 2, 4, 8)):
    """CPU stand-ins for the decode graphs: decode-only steps take the graph path, pipelined (runner.launch);
    runner.fed counts the steps launched with the previous step's tokens fed on the device."""
    r = eng.runner
    r.graph_vars = r._make_graph_vars(max(sizes))
    r.graphs = {b: EagerGraph(r, b) for b in sizes}
    return count_fed(eng)


@pytest.fixture(scope="module", params=["eager", "graphs"])
def engine(tiny_dir, request):
    eng = make_engine(tiny_dir)
    if request.param == "graphs":
        with_graphs(eng)
    yield eng
    eng.shutdown()


def workload(n=16, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(250) for _ in range(rng.randint(1, 60))], rng.randint(1, 8)) for _ in range(n)]


def staggered(engine, requests, every=4, pause=0.05):
    """Adds (prompt ids, SamplingParams) requests, pausing after each `every`-th so that later ones join while
    earlier ones decode -> their streams."""
    streams = []
    for i, (p, sp) in enumerate(requests):
        streams.append(engine.add_request(p, sp))
        if i % every == every - 1:
            time.sleep(pause)
    return streams


def alone(engine, work):
    return [greedy_generate(engine.runner.model, p, m) for p, m in work]


def collect(stream):
    toks, last = [], None
    for out in stream:
        toks += out.token_ids
        last = out
    return toks, last


def wait_idle(engine, timeout=30.0):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def assert_pools_full(engine):
    s = wait_idle(engine)
    assert s["free_blocks"] == s["num_blocks"] and s["free_slots"] == s["num_slots"], s


def test_continuous_batching_matches_alone(engine):
    work = workload(16)
    ref = alone(engine, work)
    streams = staggered(engine, [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work])
    results = [collect(s) for s in streams]
    for (toks, last), r, (p, m) in zip(results, ref, work):
        assert toks == r
        assert last.finished and last.finish_reason == "length" and last.num_prompt_tokens == len(p)
        assert last.num_output_tokens == m
    assert_pools_full(engine)
    assert engine.stats()["steps"] > 0
    assert getattr(engine.runner, "fed", 1) > 0  # graphs: steps were pipelined


def count_fed(eng):
    """runner.fed counts the steps launched with the previous step's tokens fed on the device (pipelined)."""
    r = eng.runner
    real, r.fed = r.forward, 0

    def forward(out, feed=None):  # launch's forward, or the first half of a step whose sampling reads the tokens
        r.fed += feed is not None
        return real(out, feed)

    r.forward = forward
    return eng


def check_pipelined(eager, eng):
    """Pipelined decode (eng, graphs) against the step-by-step engine (eager): a request stopped by the token of
    step N was already in step N+1; that token is dropped, the others go on; seeded sampling gives the same tokens."""
    work = workload(6, seed=7)
    seeded = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(3)]
    ref_seeded = [collect(s)[0] for s in [eager.add_request(p, sp) for (p, _), sp in zip(work, seeded)]]
    ref = [greedy_generate(eng.runner.model, p, 12) for p, _ in work]
    # request i stops at its (i + 2)-th token, unless that token came earlier
    stops = [r[i + 1] for i, r in enumerate(ref)]
    streams = [eng.add_request(p, SamplingParams(max_tokens=12, stop_token_ids=(t,), **GREEDY))
               for (p, _), t in zip(work, stops)]
    total = 0
    for s, r, t in zip(streams, ref, stops):
        toks, last = collect(s)
        assert toks == r[:r.index(t) + 1] and last.finish_reason == "stop"
        total += len(toks)
    assert_pools_full(eng)
    assert eng.stats()["output_tokens"] == total  # the dropped tokens are not counted
    fed = eng.runner.fed
    assert fed > 0
    got = [eng.add_request(p, sp) for (p, _), sp in zip(work, seeded)]
    assert [collect(s)[0] for s in got] == ref_seeded
    assert eng.runner.fed > fed


def test_stop_token_while_the_next_step_is_in_flight(tiny_dir):
    eager, eng = make_engine(tiny_dir), with_graphs(make_engine(tiny_dir))
    try:
        check_pipelined(eager, eng)
    finally:
        eager.shutdown()
        eng.shutdown()


@pytest.mark.gpu
def test_gpu_pipelined_decode(tiny_dir):
    """The CUDA-graph engine pipelines decode steps (device-fed tokens, async copy back) with the tokens of the
    eager engine."""
    kw = dict(max_num_seqs=8, num_blocks=128, device="cuda", dtype="float32")
    eager = make_engine(tiny_dir, enforce_eager=True, **kw)
    eng = count_fed(make_engine(tiny_dir, **kw))
    try:
        assert eng.runner.graphs and not eager.runner.graphs
        check_pipelined(eager, eng)
    finally:
        eager.shutdown()
        eng.shutdown()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_under_tiny_memory_gives_same_tokens(tiny_dir, graphs):
    # 7 usable pages of 16 tokens; 6 requests each grow to ~40-60 tokens (3-4 pages)
    eng = make_engine(tiny_dir, num_blocks=8, max_model_len=112, max_num_batched_tokens=64)
    if graphs:
        with_graphs(eng)
    try:
        rng = random.Random(1)
        work = [([rng.randrange(250) for _ in range(rng.randint(20, 40))], 20) for _ in range(6)]
        ref = alone(eng, work)
        streams = [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work]
        assert [collect(s)[0] for s in streams] == ref
        assert eng.stats()["preemptions"] > 0
        assert_pools_full(eng)
    finally:
        eng.shutdown()


def test_abort_mid_stream_returns_pages_and_slot(engine):
    stream = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=90, **GREEDY))
    toks = []
    for out in stream:
        toks += out.token_ids
        if len(toks) >= 3 and not out.finished:
            stream.abort()
    assert out.finished and out.finish_reason == "abort" and 3 <= len(toks) < 90
    # abort of a waiting request and of an unknown id
    blockers = [engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=30, **GREEDY)) for _ in range(6)]
    waiting = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    engine.abort(waiting.request_id)
    engine.abort("no-such-request")
    toks, last = collect(waiting)
    assert last.finish_reason == "abort"
    for b in blockers:
        b.abort()
    assert all(collect(b)[1].finish_reason == "abort" for b in blockers)
    assert_pools_full(engine)


def test_exception_in_step_fails_only_that_step(engine, monkeypatch):
    work = workload(8, seed=2)
    ref = alone(engine, work)
    real, failed = engine.runner.execute, []

    def flaky(out):
        ids = {s.request.request_id for s in out.seqs}
        if "victim" in ids and not failed:
            failed.extend(ids)
            raise RuntimeError("injected failure")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    streams = [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work[:4]]
    time.sleep(0.05)
    streams.append(engine.add_request([9, 8, 7], SamplingParams(max_tokens=5, **GREEDY), request_id="victim"))
    streams += [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work[4:]]
    results = {s.request_id: collect(s) for s in streams}
    assert "victim" in failed
    v_toks, v_last = results["victim"]
    assert v_last.finish_reason == "error" and "injected failure" in v_last.error
    for s, r in zip([s for s in streams if s.request_id != "victim"], ref):
        toks, last = results[s.request_id]
        if s.request_id in failed:
            assert last.finish_reason == "error"
        else:
            assert last.finish_reason == "length" and toks == r
    assert len(failed) < len(streams)  # some requests were not in the failing step
    assert_pools_full(engine)
    # the engine keeps working
    p, m = work[0]
    assert collect(engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)))[0] == ref[0]


def test_async_stream(engine):
    p, m = [3, 1, 4, 1, 5, 9, 2, 6], 6
    ref = greedy_generate(engine.runner.model, p, m)

    async def main():
        streams = [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for _ in range(3)]

        async def one(s):
            toks = []
            async for out in s:
                toks += out.token_ids
            return toks, out

        return await asyncio.gather(*(one(s) for s in streams))

    for toks, last in asyncio.run(main()):
        assert toks == ref and last.finished and last.prompt_time_s >= 0 and last.gen_time_s >= 0


def test_seeded_sampling_independent_of_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=777, ignore_eos=True)
    p = [10, 20, 30, 40]
    solo = collect(engine.add_request(p, params))[0]
    others = [engine.add_request([i + 1] * (i + 3), SamplingParams(max_tokens=10, temperature=0.8, seed=i))
              for i in range(5)]
    again = collect(engine.add_request(p, params))[0]
    for o in others:
        collect(o)
    assert again == solo
    different = collect(engine.add_request(p, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=778,
                                                             ignore_eos=True)))[0]
    assert different != solo


def test_logprobs_and_eos_bias(engine):
    toks, last = [], None
    lps = []
    for out in engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                            logprobs=True, top_logprobs=3)):
        toks += out.token_ids
        lps += out.logprobs
        last = out
    assert len(lps) == len(toks) == 4
    for t, e in zip(toks, lps):
        assert e["token_id"] == t and e["logprob"] <= 0 and len(e["top"]) == 3 and e["top"][0][0] == t
    # a +100 bias on EOS makes it the first token: finish "stop"
    toks, last = collect(engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, logit_bias={EOS: 100.0})))
    assert toks == [EOS] and last.finish_reason == "stop" and last.logprobs is None
    # stop_token_ids end a request even with ignore_eos
    toks, last = collect(engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True,
                                                                      logit_bias={7: 100.0}, stop_token_ids=(7,))))
    assert toks == [7] and last.finish_reason == "stop"


def test_rejects_up_front(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(1, 129)), SamplingParams())
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=126))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], SamplingParams(temperature=float("nan")))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 256], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    # max_tokens 0: until the end of the context
    toks, last = collect(engine.add_request(list(range(1, 120)), SamplingParams(max_tokens=0, **GREEDY)))
    assert len(toks) == 9 and last.finish_reason == "length"
    assert_pools_full(engine)


def test_shutdown_aborts_pending(tiny_dir):
    eng = make_engine(tiny_dir)
    streams = [eng.add_request(list(range(1, 40)), SamplingParams(max_tokens=80, **GREEDY)) for _ in range(8)]
    time.sleep(0.05)
    eng.shutdown()
    ends = [collect(s) for s in streams]
    reasons = [last.finish_reason for _, last in ends]
    # 8 x 80 tokens take far longer than 0.05 s: shutdown aborts what is left (not drains it)
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons
    assert all(len(toks) < 80 for toks, last in ends if last.finish_reason == "abort")
    with pytest.raises(RuntimeError):
        eng.add_request([1], SamplingParams())


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_engine_matches_alone(tiny_dir, enforce_eager):
    eng = LLMEngine.from_config(tiny_dir, EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
                                                       max_model_len=128, num_blocks=128, device="cuda",
                                                       dtype="float32", enforce_eager=enforce_eager))
    try:
        assert bool(eng.runner.graphs) != enforce_eager
        work = workload(16)
        ref = alone(eng, work)
        streams = staggered(eng, [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work], pause=0.02)
        assert [collect(s)[0] for s in streams] == ref
        assert_pools_full(eng)
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def test_graph_replay_path_with_padding_lanes(tiny_dir):
    """The decode-graph path (static buffers, padded lanes on slot 0 / page 0) gives each request's tokens alone."""
    eng = make_engine(tiny_dir, max_num_seqs=7, max_num_batched_tokens=512)
    try:
        r = eng.runner
        r.graph_vars = r._make_graph_vars(8)
        r.graphs = {b: EagerGraph(r, b) for b in (1, 2, 4, 8)}
        replays = []
        real = r._replay
        r._replay = lambda out, *a: replays.append(len(out.seqs)) or real(out, *a)
        work = workload(10, seed=5)
        ref = alone(eng, work)
        streams = [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work]
        assert [collect(s)[0] for s in streams] == ref
        assert replays and any(n not in (1, 2, 4, 8) for n in replays)  # padded batches were replayed
        assert torch.count_nonzero(r.cache.latent[0][0]) == 0  # the null page is never written
        assert_pools_full(eng)
    finally:
        eng.shutdown()


def test_stream_from_another_thread(engine):
    out = {}

    def worker():
        out["toks"] = collect(engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, **GREEDY)))[0]

    t = threading.Thread(target=worker)
    t.start()
    t.join(30)
    assert out["toks"] == greedy_generate(engine.runner.model, [4, 5, 6], 3)
