"""Scoring requests (SamplingParams.score_from, the Score RPC's engine side): the log-probability of each prompt token
from score_from on, against an independent full-sequence reference (tests/reference_model.py), while generating
requests share the batches; under chunking, the per-step scoring-row cap, preemption and the prefix cache."""

import random

import pytest
import torch

from backend.engine import SamplingParams
from backend.engine import scheduler as scheduler_mod
from backend.model.generate import greedy_generate
from tests.engine.test_engine import assert_pools_full, collect, make_engine, staggered, with_graphs
from tests.reference_model import reference_logits

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ref_scores(tiny_dir, ids, score_from):
    """log P(ids[i] | ids[:i]) for i >= score_from, from the reference model's fp64 logits."""
    lp = torch.log_softmax(reference_logits(tiny_dir, ids), dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(score_from, len(ids))]


def scored(engine, ids, score_from, **kw):
    toks, last = collect(engine.add_request(ids, SamplingParams(score_from=score_from), **kw))
    assert toks == [] and last.finished and last.finish_reason == "stop", last
    return last.scores


def mixed_work(seed):
    """(ids, score_from or None, max_tokens): scoring requests of all shapes among generating ones."""
    rng = random.Random(seed)
    work = []
    for i in range(12):
        ids = [rng.randrange(250) for _ in range(rng.randint(2, 70))]
        if i % 3 == 2:
            work.append((ids, None, rng.randint(1, 6)))
        else:  # from the first token with context to the last (nothing scored), and in between
            work.append((ids, rng.choice([1, len(ids), rng.randint(1, len(ids))]), 0))
    return work


def check_mixed(engine, tiny_dir, seed, tol=2e-4):
    work = mixed_work(seed)
    reqs = [(ids, SamplingParams(score_from=sf) if sf else SamplingParams(max_tokens=m, **GREEDY))
            for ids, sf, m in work]
    results = [collect(s) for s in staggered(engine, reqs, every=3, pause=0.02)]
    for (ids, sf, m), (toks, last) in zip(work, results):
        assert last.finished, last
        if sf is None:
            assert toks == greedy_generate(engine.runner.model, ids, m) and last.scores is None
        else:
            assert toks == [] and last.finish_reason == "stop" and last.num_output_tokens == 0
            assert last.scores == pytest.approx(ref_scores(tiny_dir, ids, sf), abs=tol)
    assert_pools_full(engine)


@pytest.fixture(scope="module", params=["eager", "graphs"])
def engine(tiny_dir, request):
    eng = make_engine(tiny_dir)  # 32-token steps: long prompts are chunked
    if request.param == "graphs":
        with_graphs(eng)
    yield eng
    eng.shutdown()


def test_scores_match_reference_among_generating_requests(engine, tiny_dir):
    check_mixed(engine, tiny_dir, seed=0)


@pytest.mark.parametrize("cap", [3, 1])
def test_scoring_rows_cap_cuts_chunks(engine, tiny_dir, monkeypatch, cap):
    """A few scoring rows a step: every scoring chunk is cut, values unchanged. At 1 row, scoring requests run
    1-token chunks that make decode-only steps (the graph path: a lane's logits are its scoring row)."""
    monkeypatch.setattr(scheduler_mod, "MAX_SCORE_ROWS", cap)
    rows, graph_rows = [], []
    real = engine.runner.execute

    def spy(out):
        n = sum(s.score_hi - s.score_lo for s in out.seqs)
        rows.append(n)
        if n and out.is_decode_only:
            graph_rows.append(n)
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", spy)
    check_mixed(engine, tiny_dir, seed=1)
    assert max(rows) == cap
    if cap == 1:
        assert graph_rows


def test_output_token_count_leaves_scoring_out(engine):
    before = engine.stats()["output_tokens"]
    scored(engine, [5, 6, 7, 8], 1)
    collect(engine.add_request([5, 6], SamplingParams(max_tokens=3, **GREEDY)))
    assert engine.stats()["output_tokens"] - before == 3


def test_preemption_recomputes_the_same_scores(tiny_dir, monkeypatch):
    """6 usable pages of 16 tokens: a generating request grows into the pages of a scoring one admitted after it
    (3 scoring rows a step keep that one running long enough), which is preempted and recomputed."""
    monkeypatch.setattr(scheduler_mod, "MAX_SCORE_ROWS", 3)
    eng = make_engine(tiny_dir, num_blocks=7, max_model_len=96)
    try:
        rng = random.Random(5)
        gen = [rng.randrange(250) for _ in range(14)]
        work = [[rng.randrange(250) for _ in range(60)] for _ in range(2)]
        streams = [eng.add_request(gen, SamplingParams(max_tokens=50, **GREEDY))]
        streams += [eng.add_request(ids, SamplingParams(score_from=3)) for ids in work]
        results = [collect(s) for s in streams]
        assert results[0][0] == greedy_generate(eng.runner.model, gen, 50)
        for ids, (_, last) in zip(work, results[1:]):
            assert last.scores == pytest.approx(ref_scores(tiny_dir, ids, 3), abs=2e-4)
        assert eng.stats()["preemptions"] > 0
        assert_pools_full(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("graphs", [False, True])
def test_candidates_share_the_cached_prompt(tiny_dir, graphs):
    """The Score RPC's pattern: the first candidate caches the prompt up to its last token (cache point
    score_from - 1), the others start there."""
    eng = make_engine(tiny_dir, prefix_cache_slots=2, prefix_cache_min_tokens=8)
    if graphs:
        with_graphs(eng)
    try:
        rng = random.Random(9)
        prompt = [rng.randrange(250) for _ in range(37)]
        cands = [[rng.randrange(250) for _ in range(k)] for k in (3, 1, 0, 12)]
        P = len(prompt)
        got = [scored(eng, prompt + cands[0], P, cache_points=(P - 1,))]
        streams = [eng.add_request(prompt + c, SamplingParams(score_from=P), cache_points=(P - 1,))
                   for c in cands[1:]]
        got += [collect(s)[1].scores for s in streams]
        s = eng.stats()
        assert s["prefix_cache_hits"] == 3 and s["prefix_cache_hit_tokens"] == 3 * (P - 1), s
        for c, g in zip(cands, got):
            assert g == pytest.approx(ref_scores(tiny_dir, prompt + c, P), abs=2e-4)
    finally:
        eng.shutdown()


def test_bad_score_from_is_refused(engine, tiny_dir):
    for sf in (0, -1, 1.5):
        with pytest.raises(ValueError, match="score_from"):
            engine.add_request([1, 2, 3], SamplingParams(score_from=sf))
    with pytest.raises(ValueError, match="past the prompt"):
        engine.add_request([1, 2, 3], SamplingParams(score_from=4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(129)), SamplingParams(score_from=1))
    # a full context is fine: nothing is generated
    ids = [i % 250 for i in range(128)]
    assert scored(engine, ids, 120) == pytest.approx(ref_scores(tiny_dir, ids, 120), abs=2e-4)
    assert_pools_full(engine)


@pytest.mark.gpu
def test_gpu_scores(tiny_dir, monkeypatch):
    """On CUDA with the Triton kernels and decode graphs: scoring requests among generating ones, also with one
    scoring row a step (1-token scoring chunks: decode-only steps replay a graph), against the fp64 reference."""
    eng = make_engine(tiny_dir, max_num_seqs=8, num_blocks=128, device="cuda", dtype="float32")
    try:
        assert eng.runner.graphs
        check_mixed(eng, tiny_dir, seed=0, tol=2e-3)
        monkeypatch.setattr(scheduler_mod, "MAX_SCORE_ROWS", 1)
        check_mixed(eng, tiny_dir, seed=1, tol=2e-3)
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()
