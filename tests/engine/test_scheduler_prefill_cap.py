"""max_prefill_tokens_with_decode through the engine on the tiny CPU checkpoint: while requests decode, no step
carries more prefill tokens than the cap; with nothing decoding prefill gets the whole budget; every request's greedy
tokens are those of the request alone (backend/model/generate.py)."""

import random

import pytest

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.runner import ModelRunner
from backend.model.generate import greedy_generate

GREEDY = dict(temperature=0.0, ignore_eos=True)
BUDGET, CAP = 32, 5


@pytest.fixture(scope="module")
def engine(tiny_dir):
    cfg = EngineConfig(block_size=16, max_num_seqs=6, max_num_batched_tokens=BUDGET, max_model_len=128, device="cpu",
                       max_prefill_tokens_with_decode=CAP)
    eng = LLMEngine(ModelRunner(tiny_dir, cfg), cfg, start=False)  # steps driven here: a deterministic schedule
    yield eng
    eng.shutdown()


def test_engine_default_cap():
    assert EngineConfig(device="cpu").max_prefill_tokens_with_decode == 2048
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decode"):
        EngineConfig(device="cpu", max_prefill_tokens_with_decode=-1)


def test_cap_respected_and_tokens_unchanged(engine):
    rng = random.Random(7)
    work = [([rng.randrange(250) for _ in range(rng.randint(1, 60))], rng.randint(2, 10)) for _ in range(14)]
    ref = [greedy_generate(engine.runner.model, p, m) for p, m in work]
    steps = []  # (decodes, prefill tokens) of every step
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        d = sum(x.is_decode and x.sample for x in out.seqs)
        steps.append((d, out.num_tokens - d))
        return out

    engine.scheduler.schedule = recording
    try:
        streams = []
        for i, (p, m) in enumerate(work):  # arrivals every few steps: long prompts land while others decode
            streams.append(engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)))
            for _ in range(i % 3):
                engine.step()
        while engine.scheduler.has_unfinished:
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    assert [[t for out in s for t in out.token_ids] for s in streams] == ref
    assert all(p <= CAP for d, p in steps if d), steps
    assert any(d and p == CAP for d, p in steps), steps  # the cap was what limited some steps
    assert any(not d and p > CAP for d, p in steps), steps  # nothing decoding: more than the cap
    s = engine.stats()
    assert s["free_blocks"] == s["num_blocks"] and s["free_slots"] == s["num_slots"]
