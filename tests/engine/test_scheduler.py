"""BlockPool, StatePool and Scheduler without torch or a model: the engine loop is simulated by hand."""

import random

import pytest

from backend.engine.memory import BlockPool, StatePool
from backend.engine.request import Request, RequestStatus, SamplingParams
from backend.engine.scheduler import Scheduler

EOS = 99


def make(num_blocks=64, block_size=4, num_slots=9, max_num_seqs=8, max_tokens_step=32, max_model_len=64,
         prefill_cap=0):
    return Scheduler(BlockPool(num_blocks, block_size), StatePool(num_slots), max_num_seqs, max_tokens_step,
                     max_model_len, eos_token_ids=(EOS,), max_prefill_tokens_with_decode=prefill_cap)


def decodes(out) -> list:
    """The step's real decodes (one token, then sample); a 1-token prompt chunk without sampling is prefill."""
    return [x for x in out.seqs if x.is_decode and x.sample]


def prefill_tokens(out) -> int:
    return out.num_tokens - len(decodes(out))


def req(n, max_tokens=4, **kw):
    return Request(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def check_invariants(s: Scheduler):
    held = [b for r in s.running for b in r.block_ids]
    assert len(held) == len(set(held)) and 0 not in held
    assert len(held) + s.blocks.num_free == s.blocks.capacity
    slots = [r.state_slot for r in s.running]
    assert 0 not in slots and len(set(slots)) == len(slots)
    assert len(slots) + s.states.num_free == s.states.capacity
    for r in s.waiting:
        assert r.block_ids == [] and r.state_slot == 0 and r.num_computed_tokens == 0
    for r in s.running:
        assert len(r.block_ids) * s.blocks.block_size >= r.num_computed_tokens


def run_to_end(s: Scheduler, token=7, max_steps=10_000):
    """Drives the scheduler as the engine would; every sampled token is `token`."""
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return steps
        out = s.schedule()
        check_invariants(s)
        assert out.num_tokens <= s.max_num_batched_tokens and len(out.seqs) <= s.max_num_seqs
        if s.max_prefill_tokens_with_decode and decodes(out):
            assert prefill_tokens(out) <= s.max_prefill_tokens_with_decode
        steps.append(out)
        s.update(out, [token] * sum(x.sample for x in out.seqs))
        check_invariants(s)
    raise AssertionError("did not finish")


def test_block_pool_allocate_free_full():
    p = BlockPool(8, 16)
    assert p.num_free == 7 and p.capacity == 7 and p.blocks_for(17) == 2 and p.blocks_for(0) == 0
    a = p.allocate(3)
    b = p.allocate(4)
    assert 0 not in a + b and len(set(a + b)) == 7 and p.num_free == 0 and not p.can_allocate(1)
    with pytest.raises(AssertionError):
        p.allocate(1)
    p.free(a)
    p.free(b)
    assert p.num_free == 7 and sorted(p.free_ids) == list(range(1, 8))
    with pytest.raises(AssertionError):
        p.free(a)


def test_state_pool_allocate_free_full():
    p = StatePool(4)
    slots = [p.allocate() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3] and not p.can_allocate()
    for sl in slots:
        p.free(sl)
    assert p.num_free == 3
    with pytest.raises(AssertionError):
        p.free(1)
    with pytest.raises(AssertionError):
        p.free(0)


def test_single_request_prefill_then_decode():
    s = make()
    r = req(10, max_tokens=3)
    s.add(r)
    out = s.schedule()
    assert out.num_decodes == 0 and len(out.seqs) == 1
    x = out.seqs[0]
    assert (x.start, x.num_new_tokens, x.sample) == (0, 10, True)
    assert len(r.block_ids) == 3 and r.state_slot != 0
    s.update(out, [5])
    out = s.schedule()
    assert out.is_decode_only and out.seqs[0].start == 10 and out.seqs[0].num_new_tokens == 1
    s.update(out, [6])
    out = s.schedule()
    s.update(out, [7])
    assert r.is_finished and r.finish_reason == "length" and r.output_token_ids == [5, 6, 7]
    assert s.blocks.num_free == s.blocks.capacity and s.states.num_free == s.states.capacity


def test_decodes_first_then_prefill_chunks():
    s = make(max_tokens_step=16)
    a = req(5, max_tokens=10)
    s.add(a)
    s.update(s.schedule(), [1])
    b = req(30, max_tokens=10)
    s.add(b)
    out = s.schedule()
    assert out.num_decodes == 1 and out.seqs[0].request is a
    assert out.seqs[1].request is b and out.seqs[1].num_new_tokens == 15 and not out.seqs[1].sample
    assert out.num_tokens == 16
    s.update(out, [2])
    out = s.schedule()  # a decodes, b continues its prompt (15 more)
    assert [x.request for x in out.seqs] == [a, b] and out.seqs[1].start == 15 and out.seqs[1].sample
    s.update(out, [3, 4])
    assert b.output_token_ids == [4]
    out = s.schedule()
    assert out.is_decode_only and out.num_decodes == 2


def test_chunked_prefill_respects_budget():
    s = make(max_tokens_step=8, max_model_len=64)
    r = req(30, max_tokens=2)
    s.add(r)
    chunks = []
    while not r.output_token_ids:
        out = s.schedule()
        chunks.append((out.seqs[0].start, out.seqs[0].num_new_tokens, out.seqs[0].sample))
        s.update(out, [1] if out.seqs[0].sample else [])
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]


def test_prefill_capped_while_decoding():
    s = make(max_tokens_step=16, max_model_len=64, prefill_cap=5)
    a = req(20, max_tokens=4)
    s.add(a)
    out = s.schedule()  # nothing decodes: the whole budget
    assert out.num_decodes == 0 and prefill_tokens(out) == 16
    s.update(out, [])
    s.update(s.schedule(), [1])
    b, c = req(30, max_tokens=2), req(3, max_tokens=2)
    s.add(b)
    s.add(c)
    steps = []
    for _ in range(5):
        out = s.schedule()
        steps.append(([x.request for x in decodes(out)], [(x.request, x.num_new_tokens) for x in out.seqs[1:]]))
        s.update(out, [1] * sum(x.sample for x in out.seqs))
    assert steps == [
        ([a], [(b, 5)]),  # a decodes: b's prompt gets 5 tokens a step and c waits (the cap is spent)
        ([a], [(b, 5)]),
        ([a], [(b, 5)]),  # a's 4th token: finished
        ([], [(c, 1)]),   # nothing decodes: b takes 15 of the 16 (it comes first), c is admitted with the last one
        ([b], [(c, 2)]),
    ]
    assert a.is_finished and b.output_token_ids == [1, 1] and c.output_token_ids == [1]
    run_to_end(s)


def place(s: Scheduler, r: Request, computed: int, outputs=()):
    """Puts r in s.running as if `computed` of its tokens were in the caches (a hand-made state)."""
    r.output_token_ids += list(outputs)
    r.state_slot, r.status = s.states.allocate(), RequestStatus.RUNNING
    r.block_ids = s.blocks.allocate(s.blocks.blocks_for(computed))
    r.num_computed_tokens = computed
    s.running.append(r)


@pytest.mark.parametrize("cap, steps", [
    (0, "p1:10 p2:6"),        # no cap: the prefills ahead of d spend the whole budget and d waits a step
    (4, "d:1 p1:4"),          # p2 is over the cap: it waits (not preempted), d behind it still runs
    (12, "d:1 p1:10 p2:2"),
])
def test_prefill_cap_skips_a_prefill_not_the_decodes_after_it(cap, steps):
    """Two prefills ahead of a decode in the running order (a hand-made state)."""
    s = make(max_tokens_step=16, prefill_cap=cap)
    p1, p2, d = req(20, max_tokens=2), req(20, max_tokens=2), req(2, max_tokens=3)
    place(s, p1, 10)
    place(s, p2, 6)
    place(s, d, 2, outputs=[1])
    out = s.schedule()
    check_invariants(s)
    names = {id(p1): "p1", id(p2): "p2", id(d): "d"}
    assert " ".join(f"{names[id(x.request)]}:{x.num_new_tokens}" for x in out.seqs) == steps
    assert not out.preempted and s.running == [p1, p2, d]
    s.update(out, [1] * sum(x.sample for x in out.seqs))
    run_to_end(s)
    assert [len(r.output_token_ids) for r in (p1, p2, d)] == [2, 2, 3]


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=3, max_tokens_step=100)
    rs = [req(4, max_tokens=2) for _ in range(5)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert len(out.seqs) == 3 and len(s.waiting) == 2
    steps = run_to_end(s)
    assert all(r.finish_reason == "length" for r in rs)
    assert max(len(o.seqs) for o in steps) == 3


def test_eos_stop_ids_ignore_eos():
    s = make()
    a, b, c = req(3, max_tokens=10), req(3, max_tokens=10, ignore_eos=True), req(3, max_tokens=10, stop_token_ids=(42,))
    for r in (a, b, c):
        s.add(r)
    s.update(s.schedule(), [EOS, EOS, 42])
    assert a.finish_reason == "stop" and not b.is_finished and c.finish_reason == "stop"
    assert a.output_token_ids == [EOS]


def test_end_of_context_is_length():
    s = make(max_model_len=12)
    r = req(8, max_tokens=0)
    s.add(r)
    run_to_end(s)
    assert r.finish_reason == "length" and r.num_tokens == 12


def test_reject_up_front():
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        s.add(Request([], SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req(16, max_tokens=0))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        s.add(req(10, max_tokens=7))
    s.add(req(10, max_tokens=6))
    assert len(s.waiting) == 1
    with pytest.raises(AssertionError):
        make(num_blocks=4, block_size=4, max_model_len=16)  # 3 usable pages = 12 tokens


def test_admission_waits_for_pages_and_slots():
    s = make(num_blocks=5, block_size=4, num_slots=9, max_model_len=16)  # 4 usable pages
    a, b = req(9, max_tokens=4), req(6, max_tokens=4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    # a takes 3 pages; b needs 2 for its 6 prompt tokens, only 1 free: it waits
    assert [x.request for x in out.seqs] == [a] and list(s.waiting) == [b]
    run_to_end(s)
    assert a.finish_reason == b.finish_reason == "length"
    s = make(num_slots=3, max_num_seqs=2)
    rs = [req(3) for _ in range(3)]
    for r in rs:
        s.add(r)
    assert len(s.schedule().seqs) == 2 and s.states.num_free == 0


def test_preemption_newest_first_and_recompute():
    # 6 usable pages of 4 tokens; three requests each grow to 12 tokens (3 pages): not all fit
    s = make(num_blocks=7, block_size=4, max_model_len=16, max_tokens_step=64)
    rs = [req(4, max_tokens=8) for _ in range(3)]
    for r in rs:
        s.add(r)
    first_preempted, known, chunks = None, 0, []
    for _ in range(200):
        if not s.has_unfinished:
            break
        out = s.schedule()
        check_invariants(s)
        if first_preempted is not None and (not chunks or not chunks[-1].sample):
            chunks += [x for x in out.seqs if x.request is first_preempted]
        if out.preempted and first_preempted is None:
            first_preempted = out.preempted[0]
            known = first_preempted.num_prompt_tokens + len(first_preempted.output_token_ids)
            running_before = [r for r in rs if r not in out.preempted and not r.is_finished]
            # the newest running request is the one preempted; it waits at the head of the queue
            assert first_preempted is rs[2] and s.waiting[0] is rs[2]
            assert first_preempted.num_computed_tokens == 0 and first_preempted.output_token_ids
            assert all(r.status == RequestStatus.RUNNING for r in running_before)
        s.update(out, [7] * sum(x.sample for x in out.seqs))
    assert first_preempted is not None and s.num_preemptions >= 1
    assert all(r.finish_reason == "length" and r.output_token_ids == [7] * 8 for r in rs)
    # the recompute prefilled prompt + the outputs kept so far, from position 0, in contiguous chunks, and sampled
    # only at their end
    assert chunks and chunks[0].start == 0 and [x.sample for x in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(a.start + a.num_new_tokens == b.start for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1].start + chunks[-1].num_new_tokens == known, (known, chunks)
    assert s.blocks.num_free == s.blocks.capacity and s.states.num_free == s.states.capacity


def test_preempt_self_when_alone_is_never_needed():
    # max_model_len <= capacity: a single request always fits, whatever its length
    s = make(num_blocks=5, block_size=4, max_model_len=16)
    r = req(3, max_tokens=13)
    s.add(r)
    run_to_end(s)
    assert r.num_preemptions == 0 and len(r.output_token_ids) == 13


def test_abort_frees_everything():
    s = make()
    a, b, c = req(10, max_tokens=20), req(10, max_tokens=20), req(10, max_tokens=20)
    for r in (a, b):
        s.add(r)
    s.update(s.schedule(), [1, 1])
    s.add(c)
    assert s.abort(a.request_id) is a and a.finish_reason == "abort"
    assert s.abort(c.request_id) is c and c.finish_reason == "abort"
    assert s.abort("nope") is None
    check_invariants(s)
    s.abort(b.request_id)
    assert not s.has_unfinished
    assert s.blocks.num_free == s.blocks.capacity and s.states.num_free == s.states.capacity


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_returns_pools_to_full(seed):
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(9, 20), block_size=4, num_slots=rng.randint(2, 6), max_num_seqs=1,
             max_tokens_step=rng.randint(1, 20), max_model_len=32, prefill_cap=rng.choice([0, 1, 3, 8]))
    s.max_num_seqs = s.states.capacity
    rs = []
    for step in range(400):
        if rng.random() < 0.2 and len(rs) < 30:
            r = req(rng.randint(1, 20), max_tokens=rng.randint(1, 12))
            s.add(r)
            rs.append(r)
        if rng.random() < 0.03 and rs:
            s.abort(rng.choice(rs).request_id)
        out = s.schedule()
        check_invariants(s)
        if s.max_prefill_tokens_with_decode and decodes(out):
            assert prefill_tokens(out) <= s.max_prefill_tokens_with_decode
        s.update(out, [rng.choice([7, 8, EOS]) for x in out.seqs if x.sample])
        check_invariants(s)
    run_to_end(s)
    assert all(r.is_finished for r in rs)
    for r in rs:
        if r.finish_reason == "length":
            assert len(r.output_token_ids) == r.params.max_tokens
    assert s.blocks.num_free == s.blocks.capacity and s.states.num_free == s.states.capacity


def seqs_of(out) -> list:
    return [(x.request.request_id, x.start, x.num_new_tokens, x.sample, list(x.request.block_ids)) for x in out.seqs]


@pytest.mark.parametrize("seed", range(4))
def test_schedule_next_is_schedule_after_update(seed):
    """schedule_next(prev) (before prev's tokens are known) gives what schedule() gives after update(prev), or None;
    random arrivals, lengths and page pressure; no stop tokens (those are dropped by update, engine tests)."""
    import copy

    rng = random.Random(seed)
    s = make(num_blocks=rng.choice([12, 24, 64]), max_num_seqs=rng.choice([2, 4, 8]), max_model_len=40)
    chained = refused = 0
    for step in range(300):
        if rng.random() < 0.15:
            s.add(req(rng.randint(1, 20), max_tokens=rng.randint(1, 15)))
        prev = s.schedule()
        toks = [rng.randrange(1, EOS) for x in prev.seqs if x.sample]
        if prev.is_decode_only:
            if rng.random() < 0.2:  # an arrival after prev was scheduled (or a victim of prev's preemption) waits
                s.add(req(rng.randint(1, 20), max_tokens=rng.randint(1, 15)))
            ref_s, ref_prev = copy.deepcopy((s, prev))
            ref_s.update(ref_prev, toks)
            ref = ref_s.schedule()
            nxt = s.schedule_next(prev)
            if nxt is None:
                refused += 1
            else:
                chained += 1
                assert seqs_of(nxt) == seqs_of(ref) and nxt.num_decodes == ref.num_decodes
                assert s.blocks.num_free == ref_s.blocks.num_free
                s.update(prev, toks)
                prev, toks = nxt, [rng.randrange(1, EOS) for _ in nxt.seqs]
        s.update(prev, toks)
        check_invariants(s)
    assert chained > 20 and refused > 5


def test_request_token_ranges():
    """Request.tokens(a, n): ranges inside the prompt, inside the output and across the boundary (a preempted
    request's recompute), equal to slices of prompt + output."""
    r = Request([1, 2, 3, 4], SamplingParams(max_tokens=8))
    r.output_token_ids += [5, 6, 7]
    whole = r.prompt_token_ids + r.output_token_ids
    for a in range(len(whole)):
        for n in range(len(whole) - a + 1):
            assert r.tokens(a, n) == whole[a:a + n], (a, n)
