"""Load-time warm-up: a few requests through the engine so that the first real requests do not wait for the JIT.

Why: the decode and prefill CUDA graphs are captured at load, but eager steps (prompts longer than the prefill
graphs, a prompt's later chunks, steps that mix decodes with a prefill chunk) and the sampler launch Triton kernels
whose specialisations compile on first use: seconds each on a machine whose Triton cache is cold (session 24 saw a
first eager 256-token prompt take 6.1 s), paid by whichever user request comes first. The sampler's one-launch
filtered race compiles one kernel per combination of min-p / top-k / top-p present in a step, so each common
combination runs in a step of its own here.

Groups run one after the other (requests of a group together); every request has a fixed seed and ignores EOS, so the
steps are the same on every load. Afterwards nothing of them is left: no request, every page and state slot free,
the prefix cache empty, the engine's counters, step count and seed stream as before (unseeded requests get the same
seeds as without the warm-up).
"""
import logging
import time

from backend.engine.request import SamplingParams

log = logging.getLogger(__name__)

# the sampling settings of the groups run alone (one prompt each): greedy (argmax), LocalAI's Kimi defaults
# (temperature + top-p + min-p: the filtered race), top-k + top-p, all three filters, top-p alone and temperature alone
# (the filtered race with the nucleus check, the sort path without: kernels.sampling.NUCLEUS), and logprobs (the
# log-softmax / top-k path). Each filter set is its own compiled variant of the sampling kernels.
SAMPLING = (
    dict(temperature=0.0),
    dict(temperature=0.6, top_p=0.95, min_p=0.01),
    dict(temperature=0.7, top_k=40, top_p=0.9),
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.8),
    dict(temperature=0.0, logprobs=True, top_logprobs=5),
)
SHORT = 37         # prompt tokens of the sampling groups (an odd length; inside the smallest prefill graph)
NEW_TOKENS = 3     # tokens each request generates (a prefill step, then decode steps)
SEED = 12345


def _prompt(n: int, vocab: int, salt: int) -> list:
    """n token ids spread over the vocabulary (deterministic)."""
    return [(salt * 7919 + i * 104729) % vocab for i in range(n)]


def groups(engine) -> list:
    """[[(prompt ids, SamplingParams), ...], ...]: the sampling groups, then one long prompt alone (an eager fresh
    chunk, then its later chunk) and one long prompt beside a decoding request (steps that mix decodes with a prefill
    chunk after cached tokens). Long = one token-budget chunk plus an odd remainder, within max_model_len."""
    vocab, limit = engine.vocab_size, engine.max_model_len - NEW_TOKENS
    budget = engine.cfg.max_num_batched_tokens

    def params(**kw):
        return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, seed=SEED, **kw)

    short = min(SHORT, limit)
    out = [[(_prompt(short, vocab, i), params(**s))] for i, s in enumerate(SAMPLING)]
    long = min(budget + 333, limit)
    if long > 2 * short:
        out.append([(_prompt(long, vocab, 100), params(temperature=0.0))])
        # the short prompt and the long one's first chunk fill the first step's budget; then the short one decodes
        # beside the long one's later chunk
        out.append([(_prompt(short, vocab, 101), params(temperature=0.0)),
                    (_prompt(long - short, vocab, 102), params(temperature=0.0))])
    return out


def _run_group(engine, group: list) -> None:
    streams = [engine.add_request(p, sp) for p, sp in group]
    while engine._inbox or engine.scheduler.has_unfinished or engine._inflight is not None:
        engine.step()
    for s in streams:
        for out in s:      # all queued already: the steps ran above
            if out.finished and out.finish_reason == "error":
                raise RuntimeError(f"warm-up request failed: {out.error}")


def warmup(engine) -> float:
    """Runs `groups(engine)` to completion on the calling thread, before the engine thread starts (LLMEngine calls it
    from its constructor on CUDA when EngineConfig.warmup), and restores the engine's state -> seconds taken. Raises
    RuntimeError if a warm-up request fails (a kernel that cannot run here should fail the load, not the first user
    request)."""
    assert not engine._thread.is_alive(), "warm up before the engine thread starts"
    t0 = time.monotonic()
    rng_state = engine._rng.getstate()
    todo = groups(engine)
    try:
        for group in todo:
            _run_group(engine, group)
    finally:
        engine._rng.setstate(rng_state)
    _reset(engine)
    dt = time.monotonic() - t0
    log.info("warm-up: %d requests in %.1f s", sum(len(g) for g in todo), dt)
    return dt


def _reset(engine) -> None:
    """The engine as after construction: counters, step count, prefix cache (entries and statistics)."""
    s = engine.scheduler
    assert not s.has_unfinished and engine._inflight is None and not engine._inbox, "warm-up left requests"
    if s.cache is not None:
        s.cache.clear()
        s.cache.hits = s.cache.hit_tokens = s.cache.evictions = 0
    s.num_preemptions = 0
    engine._totals = {k: 0 for k in engine._totals}
    engine._recent.clear()
    engine._executed = 0
