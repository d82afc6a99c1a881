"""Tensor-parallel engine on CPU: rank 0 in this process (scheduler, sampler), rank 1 a follower subprocess started
by the runner (python -m backend.model.parallel_worker) and fed by broadcasts; gloo collectives."""
import time

import pytest
import torch.distributed as dist

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.engine import EngineFailed

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 2], list(range(40, 75)), [9]]


def make_engine(tp_dir, tp_size):
    return LLMEngine.from_config(tp_dir, EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                                                      max_model_len=96, device="cpu", tp_size=tp_size))


@pytest.fixture(scope="module")
def reference(tp_dir):
    eng = make_engine(tp_dir, 1)
    try:
        return eng.generate(PROMPTS, SamplingParams(max_tokens=16, **GREEDY))
    finally:
        eng.shutdown()


def test_greedy_tokens_match_one_process(tp_dir, reference):
    eng = make_engine(tp_dir, 2)
    try:
        assert eng.runner.group is not None and eng.runner.group.tp.world == 2
        # chunked prefill (16-token budget) and decodes share steps: the broadcast carries mixed batches
        got = eng.generate(PROMPTS, SamplingParams(max_tokens=16, **GREEDY))
    finally:
        eng.shutdown()
    assert not dist.is_initialized()
    assert got == reference
    assert all(len(t) == 16 for t in got) and len({tuple(t) for t in got}) > 1


def test_killed_follower_fails_engine(tp_dir):
    eng = make_engine(tp_dir, 2)
    try:
        stream = eng.add_request(list(range(30, 40)), SamplingParams(max_tokens=80, **GREEDY))
        next(iter(stream))  # generating
        (rank, proc), = eng.runner.group.procs
        t0 = time.monotonic()
        proc.kill()
        last = None
        for out in stream:
            last = out
        assert time.monotonic() - t0 < 20
        assert last.finished and last.finish_reason == "error", last
        assert "rank 1" in last.error or "tensor-parallel" in last.error, last.error
        deadline = time.monotonic() + 10
        while eng.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.error and "engine failed" in eng.error
        with pytest.raises(EngineFailed, match="engine failed"):
            eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    finally:
        t0 = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - t0 < 40
    assert not dist.is_initialized()


def test_idle_follower_death_is_reported(tp_dir):
    """No request in flight: the liveness watch alone notices the dead follower."""
    eng = make_engine(tp_dir, 2)
    try:
        (rank, proc), = eng.runner.group.procs
        proc.kill()
        deadline = time.monotonic() + 10
        while eng.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.error and f"rank 1 (pid {proc.pid}) exited" in eng.error
    finally:
        eng.shutdown()


def test_indivisible_world_is_refused_before_launch(tp_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide KDA heads"):
        make_engine(tp_dir, 3)
    assert not dist.is_initialized()


def test_prefix_cache_copies_reach_the_follower(tp_dir):
    """Prefix caching with tensor parallel: the snapshot / restore copies go to the follower (COPY messages) before
    and after the forward that needs them; a next turn that starts after a cached prompt gives the one-process
    tokens."""
    def engine(tp_size):
        return LLMEngine.from_config(tp_dir, EngineConfig(
            block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, device="cpu", tp_size=tp_size,
            prefix_cache_slots=2, prefix_cache_min_tokens=4))

    turn1 = list(range(40, 75))
    results = []
    for tp_size in (1, 2):
        eng = engine(tp_size)
        try:
            out1 = eng.generate([turn1], SamplingParams(max_tokens=6, **GREEDY))[0]
            turn2 = turn1 + out1 + [5, 6, 7]
            out2 = eng.generate([turn2], SamplingParams(max_tokens=12, **GREEDY))[0]
            assert eng.stats()["prefix_cache_hits"] == 1
            results.append((out1, out2))
        finally:
            eng.shutdown()
    assert results[0] == results[1]


def test_scoring_rows_reach_the_follower(tp_dir, reference):
    """Scoring requests (the Score RPC) beside generating ones with tensor parallel: the scoring rows ride in the
    broadcast logits index, so both ranks run the same vocab-parallel lm_head; scores equal one process's."""
    texts = [list(range(40, 75)), [3, 17, 42, 99, 7]]
    scores = []
    for tp_size in (1, 2):
        eng = make_engine(tp_dir, tp_size)
        try:
            streams = [eng.add_request(t, SamplingParams(score_from=2)) for t in texts]
            gen = eng.generate(PROMPTS, SamplingParams(max_tokens=16, **GREEDY))
            scores.append([[o for o in s][-1].scores for s in streams])
        finally:
            eng.shutdown()
        assert gen == reference
    assert all(len(s) == len(t) - 2 for s, t in zip(scores[0], texts))
    for one, two in zip(*scores):
        assert two == pytest.approx(one, abs=1e-4)
