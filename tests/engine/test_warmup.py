"""The load-time warm-up (backend/engine/warmup.py): the step kinds and sampler settings it runs, and that it leaves
no trace: pools full, counters zero, the prefix cache empty, and later requests (unseeded ones included) get exactly
the tokens of an engine that never warmed up."""
import pytest
import torch

import backend.engine.runner as runner_mod
from backend.engine import warmup as wu
from backend.engine.engine import FAIL_STEPS_ENV, EngineConfig, LLMEngine
from backend.engine.request import SamplingParams
from backend.engine.runner import ModelRunner

OPTS = dict(block_size=16, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128, device="cpu")


def _engine(tiny_dir, **kw):
    cfg = EngineConfig(**dict(OPTS, **kw))
    return LLMEngine(ModelRunner(tiny_dir, cfg), cfg, start=False)


def _drive(eng, prompts, params):
    streams = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng._inbox or eng.scheduler.has_unfinished or eng._inflight is not None:
        eng.step()
    return [[t for out in s for t in out.token_ids] for s in streams]


def _record(monkeypatch):
    """-> (steps, sampling): per executed step (decode rows, [(start, tokens)] of its prefill rows); per sampling
    call the filters present (all greedy, min-p, top-k, top-p, logprobs)."""
    steps, sampling = [], []
    real_execute, real_sample = runner_mod.ModelRunner.execute, runner_mod.sample

    def execute(self, out):
        steps.append((out.num_decodes, [(s.start, s.num_new_tokens) for s in out.seqs[out.num_decodes:]]))
        return real_execute(self, out)

    def sample(logits, md):
        sampling.append((md.all_greedy, md.min_p is not None, md.top_k is not None, md.top_p is not None,
                         md.num_top_logprobs >= 0))
        return real_sample(logits, md)

    monkeypatch.setattr(runner_mod.ModelRunner, "execute", execute)
    monkeypatch.setattr(runner_mod, "sample", sample)
    return steps, sampling


def test_warmup_covers_eager_steps_and_sampler_settings(tiny_dir, monkeypatch):
    steps, sampling = _record(monkeypatch)
    eng = _engine(tiny_dir)
    try:
        wu.warmup(eng)
    finally:
        eng.shutdown()
    # every common filter combination sampled in a step of its own (the filtered race compiles one kernel per
    # combination), and logprobs
    for combo in [(True, False, False, False, False), (False, True, False, True, False),
                  (False, False, True, True, False), (False, True, True, True, False),
                  (False, False, False, True, False), (True, False, False, False, True)]:
        assert combo in sampling, (combo, sorted(set(sampling)))
    # a fresh prefill of a whole token budget, a later chunk alone, and a later chunk beside decoding rows
    assert any(nd == 0 and sum(n for _, n in rows) == OPTS["max_num_batched_tokens"] for nd, rows in steps)
    assert any(nd == 0 and any(a > 0 for a, _ in rows) for nd, rows in steps), steps
    assert any(nd > 0 and any(a > 0 for a, _ in rows) for nd, rows in steps), steps


def test_warmup_leaves_no_trace(tiny_dir):
    prompts = [[5, 9, 77, 3], list(range(40, 90)), [200] * 20]
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9),
              SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05)]   # unseeded: engine-drawn seeds
    fresh = _engine(tiny_dir, prefix_cache_slots=2, prefix_cache_min_tokens=16)
    try:
        want = _drive(fresh, prompts, params)
    finally:
        fresh.shutdown()
    eng = _engine(tiny_dir, prefix_cache_slots=2, prefix_cache_min_tokens=16)
    try:
        rng = eng._rng.getstate()
        assert wu.warmup(eng) >= 0
        s = eng.scheduler
        assert s.blocks.num_free == s.blocks.capacity and s.states.num_free == s.states.capacity
        assert len(s.cache) == 0 and s.cache.hits == s.cache.evictions == 0
        st = eng.stats()
        assert st["steps"] == st["prompt_tokens"] == st["output_tokens"] == st["finished"] == 0, st
        assert eng._rng.getstate() == rng and eng._executed == 0
        assert _drive(eng, prompts, params) == want
    finally:
        eng.shutdown()


def test_warmup_failure_fails_the_load(tiny_dir, monkeypatch):
    """A warm-up request that errors raises (LoadModel then reports it), and only on CUDA does the engine warm up by
    itself (here: a runner whose device reads cuda)."""
    monkeypatch.setenv(FAIL_STEPS_ENV, "1")
    eng = _engine(tiny_dir)
    try:
        with pytest.raises(RuntimeError, match="warm-up request failed"):
            wu.warmup(eng)
    finally:
        eng.shutdown()
    monkeypatch.delenv(FAIL_STEPS_ENV)
    calls = []
    monkeypatch.setattr(wu, "warmup", lambda e: calls.append(e))
    cfg = EngineConfig(**OPTS)
    runner = ModelRunner(tiny_dir, cfg)
    LLMEngine(runner, cfg).shutdown()                     # CPU: no warm-up
    assert calls == []
    runner.device = torch.device("cuda")
    eng = LLMEngine(runner, cfg)
    runner.device = torch.device("cpu")
    eng.shutdown()
    assert calls == [eng]
    runner.device = torch.device("cuda")
    LLMEngine(runner, EngineConfig(**dict(OPTS, warmup=False))).shutdown()
    runner.device = torch.device("cpu")
    assert calls == [eng]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_warmup_at_load(tiny_dir):
    """On CUDA the engine warms up in its constructor (kernels, decode and prefill graphs) and then serves: pools
    full, counters zero, and the same tokens as an engine built without the warm-up (greedy and unseeded sampled)."""
    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=128,
              device="cuda", dtype="float32")
    prompts = [[5, 9, 77, 3], list(range(40, 90)), [200] * 20]
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9),
              SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05)]
    outs = []
    for warm in (False, True):
        eng = LLMEngine.from_config(tiny_dir, EngineConfig(warmup=warm, **kw))
        try:
            st = eng.stats()
            assert st["steps"] == 0 and st["free_blocks"] == st["num_blocks"] and st["free_slots"] == st["num_slots"]
            streams = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
            outs.append([[t for out in s for t in out.token_ids] for s in streams])
        finally:
            eng.shutdown()
            torch.cuda.empty_cache()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("max_model_len,budget", [(8, 32), (40, 32), (80, 32), (4096, 2048)])
def test_warmup_groups_fit(tiny_dir, max_model_len, budget):
    """Every warm-up prompt fits max_model_len with its new tokens and is not empty, whatever the limits."""
    eng = _engine(tiny_dir, max_model_len=max_model_len, max_num_batched_tokens=budget)
    try:
        gs = wu.groups(eng)
        assert len(gs) >= len(wu.SAMPLING)
        for g in gs:
            for prompt, sp in g:
                assert 1 <= len(prompt) and len(prompt) + sp.max_tokens <= max_model_len, (len(prompt), sp)
    finally:
        eng.shutdown()
