"""Prefix caching (backend/engine/prefix_cache.py): a request that extends a cached prompt starts after it and gives
exactly the tokens of a from-scratch greedy decode (backend/model/generate.py); pages and slots are accounted for
under eviction, preemption, aborts and failed steps."""

import random
import time

import pytest
import torch

from backend.engine import SamplingParams
from backend.engine.memory import BlockPool, StatePool
from backend.engine.prefix_cache import PrefixCache
from backend.model.generate import greedy_generate
from tests.engine.test_engine import collect, make_engine, staggered, wait_idle, with_graphs

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module", params=["eager", "graphs"])
def engine(tiny_dir, request):
    eng = make_engine(tiny_dir, prefix_cache_slots=4, prefix_cache_min_tokens=8, max_model_len=160)
    if request.param == "graphs":
        with_graphs(eng)
    yield eng
    eng.shutdown()


def clear_cache(engine):
    """Waits until idle, drops every cached prompt, and checks that the pools are full again."""
    wait_idle(engine)
    with engine._lock:
        engine.scheduler.cache.clear()
    s = engine.stats()
    assert s["free_blocks"] == s["num_blocks"] and s["free_slots"] == s["num_slots"], s
    assert s["prefix_cache_entries"] == 0


def held(engine):
    """Pages and slots the cache holds when idle = what the pools miss."""
    s = wait_idle(engine)
    return s["num_blocks"] - s["free_blocks"], s["num_slots"] - s["free_slots"]


def ref(engine, prompt, n):
    return greedy_generate(engine.runner.model, prompt, n)


def prompt_of(rng, n):
    return [rng.randrange(250) for _ in range(n)]


@pytest.mark.parametrize("first", [40, 48, 17])  # partial last page (40, 17) and page-aligned (48)
def test_multi_turn_starts_after_the_previous_prompt(engine, first):
    rng = random.Random(first)
    turn1 = prompt_of(rng, first)
    out1 = collect(engine.add_request(turn1, SamplingParams(max_tokens=6, **GREEDY)))[0]
    assert out1 == ref(engine, turn1, 6)
    s0 = engine.stats()
    assert s0["prefix_cache_entries"] == 1
    turn2 = turn1 + out1 + prompt_of(rng, 13)  # the next turn: the answer and a new message appended
    out2 = collect(engine.add_request(turn2, SamplingParams(max_tokens=8, **GREEDY)))[0]
    s1 = engine.stats()
    assert s1["prefix_cache_hits"] == s0["prefix_cache_hits"] + 1
    assert s1["prefix_cache_hit_tokens"] == s0["prefix_cache_hit_tokens"] + first
    assert out2 == ref(engine, turn2, 8)
    assert s1["prefix_cache_entries"] == 2  # turn 2's prompt is cached too
    turn3 = turn2 + out2 + prompt_of(rng, 5)
    assert collect(engine.add_request(turn3, SamplingParams(max_tokens=8, **GREEDY)))[0] == ref(engine, turn3, 8)
    assert engine.stats()["prefix_cache_hit_tokens"] == s1["prefix_cache_hit_tokens"] + len(turn2)
    pages, slots = held(engine)
    assert slots == 3 and pages >= 1
    clear_cache(engine)


def test_hit_with_one_token_left(engine, monkeypatch):
    """A prompt one token longer than a cached one: after the hit its chunk is decode-shaped (one token after cached
    ones), so with graphs the copies run around a graph replay."""
    rng = random.Random(8)
    p = prompt_of(rng, 26)
    collect(engine.add_request(p, SamplingParams(max_tokens=1, **GREEDY)))
    r = engine.runner
    replays, real = [], r._replay
    monkeypatch.setattr(r, "_replay", lambda out, *a: replays.append(bool(out.copies)) or real(out, *a))
    hits = engine.stats()["prefix_cache_hits"]
    got = collect(engine.add_request(p + [17], SamplingParams(max_tokens=6, **GREEDY)))[0]
    assert got == ref(engine, p + [17], 6) and engine.stats()["prefix_cache_hits"] == hits + 1
    assert any(replays) == bool(r.graphs)
    clear_cache(engine)


def test_cache_point_shares_a_system_prompt(engine):
    """cache_points: the prefill chunk ends where the last message starts and that prefix is kept too, so a new
    conversation with the same system prompt starts after it; without a point only whole prompts are kept."""
    rng = random.Random(12)
    system = prompt_of(rng, 29)
    first = system + prompt_of(rng, 11)
    hits = engine.stats()["prefix_cache_hits"]
    out = collect(engine.add_request(first, SamplingParams(max_tokens=4, **GREEDY), cache_points=(len(system),)))[0]
    assert out == ref(engine, first, 4) and engine.stats()["prefix_cache_entries"] == 2
    s0 = engine.stats()
    for i in range(3):
        other = system + prompt_of(rng, 7 + i)
        got = collect(engine.add_request(other, SamplingParams(max_tokens=5, **GREEDY), cache_points=(len(system),)))
        assert got[0] == ref(engine, other, 5)
    s1 = engine.stats()
    assert s1["prefix_cache_hits"] == s0["prefix_cache_hits"] + 3 == hits + 3
    assert s1["prefix_cache_hit_tokens"] == s0["prefix_cache_hit_tokens"] + 3 * len(system)
    clear_cache(engine)


def test_same_prompt_again_and_short_prompts(engine):
    rng = random.Random(5)
    p = prompt_of(rng, 30)
    hits = engine.stats()["prefix_cache_hits"]
    a = collect(engine.add_request(p, SamplingParams(max_tokens=5, **GREEDY)))[0]
    b = collect(engine.add_request(p, SamplingParams(max_tokens=5, **GREEDY)))[0]  # nothing left to compute after it
    assert a == b == ref(engine, p, 5)
    s = engine.stats()
    assert s["prefix_cache_entries"] == 1 and s["prefix_cache_hits"] == hits
    short = prompt_of(rng, 7)  # below prefix_cache_min_tokens
    collect(engine.add_request(short, SamplingParams(max_tokens=3, **GREEDY)))
    assert engine.stats()["prefix_cache_entries"] == 1
    clear_cache(engine)


def test_shared_system_prompt_concurrent_requests(engine):
    """A common system prompt cached once; 12 requests extending it (and some not) arrive at different times:
    each gives exactly its from-scratch tokens; more prompts than slots: the least recently used are evicted."""
    rng = random.Random(9)
    system = prompt_of(rng, 37)
    collect(engine.add_request(system, SamplingParams(max_tokens=1, **GREEDY)))
    work = [(system + prompt_of(rng, rng.randint(1, 30)) if i % 4 else prompt_of(rng, 20), rng.randint(1, 8))
            for i in range(12)]
    want = [ref(engine, p, m) for p, m in work]
    hits0 = engine.stats()["prefix_cache_hits"]
    streams = staggered(engine, [(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work], every=3, pause=0.03)
    assert [collect(s)[0] for s in streams] == want
    s = engine.stats()
    assert s["prefix_cache_hits"] - hits0 >= 6 and s["prefix_cache_entries"] == 4
    pages, slots = held(engine)
    assert slots == 4
    clear_cache(engine)


def test_seeded_sampling_same_with_a_hit(engine):
    rng = random.Random(3)
    base = prompt_of(rng, 33)
    p = base + prompt_of(rng, 9)
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    cold = collect(engine.add_request(p, sp))[0]
    clear_cache(engine)
    collect(engine.add_request(base, SamplingParams(max_tokens=1, **GREEDY)))
    hits = engine.stats()["prefix_cache_hits"]
    warm = collect(engine.add_request(p, sp))[0]
    assert engine.stats()["prefix_cache_hits"] == hits + 1 and warm == cold
    clear_cache(engine)


def test_abort_and_failed_step_keep_the_books(engine, monkeypatch):
    rng = random.Random(4)
    base = prompt_of(rng, 40)
    collect(engine.add_request(base, SamplingParams(max_tokens=1, **GREEDY)))
    stream = engine.add_request(base + [1, 2, 3], SamplingParams(max_tokens=60, **GREEDY))
    toks = []
    for out in stream:
        toks += out.token_ids
        if len(toks) >= 2 and not out.finished:
            stream.abort()
    assert out.finish_reason == "abort"
    # a step that fails while it snapshots a prompt: the reserved slot and page go back
    real, failed = engine.runner.execute, []

    def flaky(out):
        if out.snapshots and not failed:
            failed.append(True)
            raise RuntimeError("injected failure")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    last = collect(engine.add_request(prompt_of(rng, 25), SamplingParams(max_tokens=4, **GREEDY)))[1]
    assert failed and last.finish_reason == "error"
    clear_cache(engine)


@pytest.mark.parametrize("graphs", [False, True])
def test_memory_pressure_evicts_before_preempting(tiny_dir, graphs):
    """9 usable pages of 16 tokens: cached prompts give their pages back for new requests; outputs stay exact, also
    when requests are preempted."""
    eng = make_engine(tiny_dir, num_blocks=10, max_model_len=128, max_num_batched_tokens=64, prefix_cache_slots=3,
                      prefix_cache_min_tokens=8)
    if graphs:
        with_graphs(eng)
    try:
        rng = random.Random(11)
        base = prompt_of(rng, 35)
        work = [(base + prompt_of(rng, rng.randint(1, 20)) if i % 2 else prompt_of(rng, rng.randint(20, 40)), 20)
                for i in range(8)]
        want = [ref(eng, p, m) for p, m in work]
        for p in [prompt_of(rng, 70), prompt_of(rng, 60), base]:  # fill the cache one at a time
            collect(eng.add_request(p, SamplingParams(max_tokens=2, **GREEDY)))
        s0 = eng.stats()
        assert s0["prefix_cache_entries"] >= 1 and s0["prefix_cache_evictions"] >= 1  # 3 prompts do not all fit
        streams = [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in work]
        assert [collect(s)[0] for s in streams] == want
        s1 = eng.stats()
        assert s1["preemptions"] > 0 and s1["prefix_cache_evictions"] > s0["prefix_cache_evictions"]
        assert s1["prefix_cache_hits"] > 0
        clear_cache(eng)
    finally:
        eng.shutdown()


def test_cache_books_unit():
    """PrefixCache on its own: longest-prefix lookup, LRU eviction, reference counts, reclaimable pages."""
    blocks, states = BlockPool(12, 4), StatePool(6)
    cache = PrefixCache(blocks, states, max_entries=2, min_tokens=2)
    a = list(range(10))                      # 2 full pages + a partial one
    pages_a = blocks.allocate(3)
    slot, page = cache.reserve(partial=True)
    cache.insert(a, slot, page, pages_a)
    assert [blocks.ref_count[p] for p in pages_a] == [2, 2, 1]
    blocks.free(pages_a)                     # the request finishes: its full pages stay with the cache
    assert cache.reclaimable() == 3          # 2 shared-then-released pages + the partial copy
    assert cache.lookup(a + [7], 10).tokens == a and cache.lookup(a, 9) is None
    assert cache.lookup([0, 1, 2, 9] + a, 13) is None
    b = list(range(8))                       # page-aligned: no partial page
    slot, page = cache.reserve(partial=False)
    assert page == 0
    pages_b = blocks.allocate(2)
    cache.insert(b, slot, page, pages_b)
    assert cache.lookup(a + [1], 10).tokens == a  # the longest prefix wins
    assert cache.has(b) and not cache.wants(b) and cache.wants(b + [1]) and not cache.wants([1])
    # full: a third entry evicts the least recently used one (b was touched last by has())
    got = cache.reserve(partial=True)
    assert got is not None and len(cache) == 1 and cache.lookup(a + [1], 10).tokens == b  # a is gone
    cache.unreserve(*got)
    blocks.free(pages_b)
    cache.clear()
    assert blocks.num_free == blocks.capacity and states.num_free == states.capacity
    # reservations not yet inserted count against max_entries: three prompts ending in one step get two
    got = [cache.reserve(partial=False) for _ in range(3)]
    assert got[2] is None and None not in got[:2] and states.num_free == states.capacity - 2
    for r in got[:2]:
        cache.unreserve(*r)
    assert states.num_free == states.capacity and cache.reserve(partial=False) is not None


@pytest.mark.gpu
def test_gpu_prefix_cache(tiny_dir):
    """On CUDA with decode graphs: multi-turn and concurrent hits give the from-scratch tokens."""
    eng = make_engine(tiny_dir, max_num_seqs=8, num_blocks=128, device="cuda", dtype="float32", max_model_len=160,
                      prefix_cache_slots=4, prefix_cache_min_tokens=8)
    try:
        assert eng.runner.graphs
        test_multi_turn_starts_after_the_previous_prompt(eng, 40)
        test_shared_system_prompt_concurrent_requests(eng)
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_books_balance(tiny_dir, seed):
    """Random prompts that share prefixes (turns of a few conversations), random arrivals, aborts and a small page
    pool: the requests that ran to the end give their from-scratch tokens, and once the cache is cleared every page
    and slot is free again (no reference leaked or freed twice)."""
    rng = random.Random(seed)
    eng = make_engine(tiny_dir, num_blocks=14, max_model_len=128, max_num_batched_tokens=48, max_num_seqs=4,
                      prefix_cache_slots=3, prefix_cache_min_tokens=4)
    if seed % 2:
        with_graphs(eng)
    try:
        convs = [prompt_of(rng, rng.randint(5, 40)) for _ in range(3)]
        work = []
        for i in range(14):
            c = rng.randrange(3)
            p = convs[c] + prompt_of(rng, rng.randint(1, 12))
            if len(p) < 100 and rng.random() < 0.6:
                convs[c] = p  # the conversation goes on from here
            work.append((p, rng.randint(1, 10), rng.random() < 0.2))
        streams = []
        for p, m, abort in work:
            streams.append((eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)), p, m, abort))
            if rng.random() < 0.3:
                time.sleep(0.01)
        for s, p, m, abort in streams:
            if abort and rng.random() < 0.5:
                s.abort()
            toks, last = collect(s)
            if last.finish_reason != "abort":
                assert last.finish_reason == "length" and toks == ref(eng, p, m)
        clear_cache(eng)
    finally:
        eng.shutdown()
