"""Continuous batching with chunked prefill and preemption by recompute (pure Python, no torch).

One rule (vLLM v1): a request needs `num_tokens - num_computed_tokens` more tokens; each step gives running requests
first (a decode needs 1), then admits waiting ones, within `max_num_batched_tokens` and `max_num_seqs`. There is no
prefill or decode phase: a long prompt is simply cut by the budget. Out of pages, the newest running request is
preempted: its pages and slot go back, and it is recomputed from scratch later (its output tokens so far are kept and
recomputed as part of its prompt).

Decode stalls are bounded: while any running request decodes, the prefill chunks of a step together get at most
`max_prefill_tokens_with_decode` tokens (0 = no cap), so a decode step never waits behind a full-budget prefill;
with nothing decoding, prefill gets the whole budget.

With a PrefixCache (backend/engine/prefix_cache.py), admission starts a request after the longest cached prompt its
tokens begin with (SchedulerOutput.copies: the snapshot's state slot and partial page, copied before the forward),
the step that completes a prompt also snapshots it (SchedulerOutput.snapshots, copied after the forward, registered
by update), and cache entries are evicted for pages or slots before any request is preempted.

Scoring requests (SamplingParams.score_from, the Score RPC) sample nothing: their chunks carry the positions whose
logits score the prompt's next token (ScheduledSeq.score_lo/hi; at most MAX_SCORE_ROWS such logits rows a step, which
bounds the step's logits memory), and they finish ("stop") once their prompt is computed.
"""

from collections import deque
from dataclasses import dataclass, field

from backend.engine.memory import BlockPool, StatePool
from backend.engine.prefix_cache import PrefixCache
from backend.engine.request import Request, RequestStatus
from backend.engine.structured import advance, finished

MAX_SCORE_ROWS = 128  # scoring logits rows [rows, vocab] fp32 per step: 84 MB for Kimi-Linear's 163,840 ids


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the caches (num_computed_tokens before this step)
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the known tokens: a new token is sampled
    # scoring requests: positions [score_lo, score_hi) of this chunk whose logits score the next prompt token
    score_lo: int = 0
    score_hi: int = 0

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list  # ScheduledSeq: the num_decodes decodes first, then prefill chunks
    num_decodes: int = 0
    num_tokens: int = 0
    preempted: list = field(default_factory=list)
    copies: list = field(default_factory=list)  # ("slot" | "page", src, dst): prefix cache hits, before the forward
    snapshots: list = field(default_factory=list)  # (request, slot, page, length): prompts to cache, after the forward

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode_only(self) -> bool:
        return bool(self.seqs) and self.num_decodes == len(self.seqs)


def _decodes(req: Request) -> bool:
    """req's next chunk is a decode: one token after cached ones, then a sample (ScheduledSeq.is_decode and .sample)."""
    return req.num_computed_tokens > 0 and req.num_tokens - req.num_computed_tokens == 1


class Scheduler:
    def __init__(self, block_pool: BlockPool, state_pool: StatePool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids=(), max_prefill_tokens_with_decode: int = 0,
                 prefix_cache: PrefixCache = None):
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_prefill_tokens_with_decode >= 0
        assert max_num_seqs <= state_pool.capacity, "more sequences than KDA state slots"
        assert max_model_len <= block_pool.capacity * block_pool.block_size, "max_model_len exceeds the page pool"
        self.blocks = block_pool
        self.states = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decode = max_prefill_tokens_with_decode
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache = prefix_cache
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0
        self._score_rows = MAX_SCORE_ROWS  # scoring rows the step being scheduled has left

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check(self, req: Request) -> None:
        """Rejects up front a request that could never run."""
        n, m = req.num_prompt_tokens, req.params.max_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if req.scores is not None:  # scoring: nothing is generated
            if req.params.score_from > n:
                raise ValueError(f"score_from ({req.params.score_from}) is past the prompt ({n} tokens)")
            if n > self.max_model_len:
                raise ValueError(f"the text to score has {n} tokens; max_model_len is {self.max_model_len}")
            return
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt + at least one new token must fit)")
        if n + m > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds max_model_len "
                             f"({self.max_model_len})")

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def find(self, request_id: str):
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        # prefill tokens this step may still take: capped while decodes run, so that they never wait behind a
        # full-budget prefill chunk
        prefill_budget = budget
        if self.max_prefill_tokens_with_decode and any(map(_decodes, self.running)):
            prefill_budget = self.max_prefill_tokens_with_decode
        decodes, prefills, preempted, copies, snapshots = [], [], [], [], []
        bs = self.blocks.block_size
        self._score_rows = MAX_SCORE_ROWS
        i = 0
        # running requests, oldest first
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            nc = req.num_computed_tokens
            if (nc and len(req.prompt_token_ids) + len(req.output_token_ids) == nc + 1 and nc < len(req.block_ids) * bs
                    and req.scores is None):
                # the common case, a decode with room in its last page: what the general path below gives
                decodes.append(ScheduledSeq(req, nc, 1, True))
                budget -= 1
                i += 1
                continue
            limit = budget if _decodes(req) else min(budget, prefill_budget)
            if limit == 0 or (req.scores is not None and self._score_cap(req, req.num_computed_tokens, 1) == 0):
                i += 1  # a prefill over the cap (or scoring rows over theirs) waits; the ones after it still run
                continue
            n = self._fit(req, self._cap(req, min(req.num_tokens - req.num_computed_tokens, limit)))
            while n == 0:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                n = self._fit(req, self._cap(req, min(req.num_tokens - req.num_computed_tokens, limit)))
            if n == 0:
                break
            s = self._take(req, n)
            (decodes if s.is_decode else prefills).append(s)
            self._maybe_snapshot(s, snapshots)
            budget -= n
            if not _decodes(req):
                prefill_budget -= n
            i += 1
        # admission, FCFS, only when nobody was preempted this step
        while (not preempted and self.waiting and min(budget, prefill_budget) > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            # the longest cached prompt this request begins with (at least one token must be left to compute)
            last = req.num_tokens - 1 if req.scores is None else req.params.score_from - 1  # scoring: from there
            hit = self.cache.lookup(req.all_token_ids, last) if self.cache is not None else None
            if req.scores is not None and self._score_cap(req, len(hit.tokens) if hit is not None else 0, 1) == 0:
                break  # no scoring rows left this step
            shared = hit.full_pages if hit is not None else []
            # the whole known sequence must fit in free pages, not just the first chunk: avoids admit-then-preempt
            need = self.blocks.blocks_for(req.num_tokens) - len(shared)
            if (not self.states.can_allocate() and (self.cache is None or len(self.cache) <= (hit is not None))) \
                    or not self._free_pages(need, hit, only_if_enough=True) or not self._free_slot(hit):
                break
            self.waiting.popleft()
            req.state_slot = self.states.allocate()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if hit is not None:
                copies += self._start_after(req, hit)
            n = self._fit(req, self._cap(req, min(req.num_tokens - req.num_computed_tokens, budget, prefill_budget)))
            s = self._take(req, n)
            (decodes if s.is_decode else prefills).append(s)
            self._maybe_snapshot(s, snapshots)
            budget -= n
            prefill_budget -= n
        return SchedulerOutput(decodes + prefills, len(decodes), self.max_num_batched_tokens - budget, preempted,
                               copies, snapshots)

    def schedule_next(self, prev: SchedulerOutput):
        """The step after `prev` while `prev` is still on the device (not `update`d): every running request decodes
        once more, in the same order, on the token `prev` samples for it. -> that SchedulerOutput (pages for the
        new positions allocated), or None where schedule() after update(prev) could give another step: a waiting
        request could be admitted, `prev` is not all the running requests' decodes, a request would finish by length
        at `prev`, or a new page is not free (schedule() would preempt). A request that `prev`'s token stops is only
        known later: update() then drops its token of this step (and a waiting request that its finish lets in is
        admitted one step later than step by step; each request's tokens do not depend on the batch)."""
        n = len(prev.seqs)
        if n != len(self.running) or prev.num_decodes != n:
            return None
        bs, last, need = self.blocks.block_size, self.max_model_len - 2, []
        for s, req in zip(prev.seqs, self.running):
            p, q, m = req.params, s.start, len(req.output_token_ids)
            # q + 1 == num_tokens: prev decodes the last token; no finish by length once its token is appended
            if (s.request is not req or not s.sample or q + 1 != len(req.prompt_token_ids) + m
                    or (p.max_tokens and m + 1 >= p.max_tokens) or q >= last):
                return None
            if q + 1 >= len(req.block_ids) * bs:  # position q + 1 opens a page
                need.append(req)
        free = self.blocks.num_free - len(need)
        if free < 0:
            return None
        # schedule() would admit the first waiting request (unless a request stops at prev: admitted a step later),
        # evicting cached prompts for it if need be
        cached = len(self.cache) if self.cache is not None else 0
        if (self.waiting and n < self.max_num_seqs and self.max_num_batched_tokens > n
                and (self.states.can_allocate() or cached)
                and self.blocks.blocks_for(self.waiting[0].num_tokens) <= free + (
                    self.cache.reclaimable() if cached else 0)):
            return None
        for req in need:
            req.block_ids += self.blocks.allocate(1)
        return SchedulerOutput([ScheduledSeq(s.request, s.start + 1, 1, True) for s in prev.seqs], n, n)

    def _fit(self, req: Request, n: int) -> int:
        """Largest m <= n whose pages can be allocated for `req` now (cached prompts are evicted for them first)."""
        bs = self.blocks.block_size
        self._free_pages(self.blocks.blocks_for(req.num_computed_tokens + n) - len(req.block_ids))
        room = (len(req.block_ids) + self.blocks.num_free) * bs - req.num_computed_tokens
        return max(0, min(n, room))

    def _take(self, req: Request, n: int) -> ScheduledSeq:
        a = req.num_computed_tokens
        need = self.blocks.blocks_for(a + n) - len(req.block_ids)
        if need > 0:
            req.block_ids += self.blocks.allocate(need)
        if req.scores is None:
            return ScheduledSeq(req, a, n, a + n == req.num_tokens)
        lo, hi = req.score_rows(a, n)
        self._score_rows -= hi - lo
        return ScheduledSeq(req, a, n, False, lo, hi)

    def _score_cap(self, req: Request, a: int, n: int) -> int:
        """A scoring request's chunk [a, a + n) cut to the scoring rows this step has left (0: none left for it)."""
        lo, hi = req.score_rows(a, n)
        return min(n, lo + self._score_rows - a) if hi - lo > self._score_rows else n

    # prefix cache
    def _free_pages(self, n: int, keep=None, only_if_enough: bool = False) -> bool:
        """Evicts cached prompts (never `keep`) until n pages are free -> whether they are. only_if_enough: evict
        nothing when even every entry would not free enough (a waiting request that cannot be admitted anyway)."""
        if only_if_enough and not self.blocks.can_allocate(n) and (
                self.cache is None or self.blocks.num_free + self.cache.reclaimable(keep) < n):
            return False
        while not self.blocks.can_allocate(n):
            if self.cache is None or not self.cache.evict(keep):
                return False
        return True

    def _free_slot(self, keep=None) -> bool:
        while not self.states.can_allocate():
            if self.cache is None or not self.cache.evict(keep):
                return False
        return True

    def _start_after(self, req: Request, hit) -> list:
        """req (just given its slot) starts after the cached prompt `hit` -> the copies that set it up."""
        req.block_ids = self.cache.take(hit)
        copies = [("slot", hit.slot, req.state_slot)]
        if hit.partial_page:  # copy-on-write: req writes its next tokens into this page
            page = self.blocks.allocate(1)[0]
            req.block_ids.append(page)
            copies.append(("page", hit.partial_page, page))
        req.num_computed_tokens = len(hit.tokens)
        return copies

    def _cap(self, req: Request, n: int) -> int:
        """A prefill chunk ends at the request's next cache point that the cache wants (so it can be snapshotted),
        and a scoring request's where this step's scoring rows run out."""
        if req.scores is not None:
            n = self._score_cap(req, req.num_computed_tokens, n)
        if self.cache is not None and req.cache_points:
            a = req.num_computed_tokens
            for p in req.cache_points:
                if a < p < a + n and self.cache.wants(req.prompt_token_ids[:p]):
                    return p - a
        return n

    def _maybe_snapshot(self, s: ScheduledSeq, snapshots: list) -> None:
        """s ends at its request's prompt end (the first time: before any output) or at one of its cache points:
        snapshot the prompt so far, if the cache wants it and has room."""
        req = s.request
        end, p = s.start + s.num_new_tokens, len(req.prompt_token_ids)
        if self.cache is None or end > p or not (end in req.cache_points or (
                end == p and s.sample and not req.output_token_ids)):
            return
        if not self.cache.wants(req.prompt_token_ids[:end]):
            return
        got = self.cache.reserve(partial=end % self.blocks.block_size != 0)
        if got is not None:
            snapshots.append((req, *got, end))

    def _register(self, out: SchedulerOutput) -> None:
        """update(): the snapshots of `out` are taken (the runner copied them after the forward): cache them."""
        for req, slot, page, end in out.snapshots:
            if req.status is RequestStatus.FINISHED or not req.block_ids:  # its pages went back meanwhile
                self.cache.unreserve(slot, page)
            else:
                self.cache.insert(req.prompt_token_ids[:end], slot, page, req.block_ids)
        out.snapshots = []

    def abandon(self, out: SchedulerOutput) -> None:
        """A failed step: the snapshots it reserved are not taken."""
        for _, slot, page, _ in out.snapshots:
            self.cache.unreserve(slot, page)
        out.snapshots = []

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        if req.state_slot:
            self.states.free(req.state_slot)
            req.state_slot = 0

    def update(self, out: SchedulerOutput, sampled: list, scores=()) -> list:
        """Advances the scheduled requests by one step; `sampled` holds one token per seq with `sample` set, `scores`
        the log-probabilities of the scoring rows (ScheduledSeq.score_lo/hi), seq by seq.

        Returns the requests that got a token or finished. A request that finished after `out` was scheduled (a
        step launched before the previous one was collected: the previous token was a stop token) is left as is."""
        if out.snapshots:  # before any request below finishes and gives back pages the cache shares
            self._register(out)
        touched, j, k = [], 0, 0
        for s in out.seqs:
            req = s.request
            if req.status is RequestStatus.FINISHED:  # finished while this step was in flight: its token is dropped
                j += s.sample
                k += s.score_hi - s.score_lo
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.scores is not None:
                k = self._scored(req, s, scores, k, touched)
                continue
            if not s.sample:
                continue
            token = sampled[j]
            j += 1
            req.output_token_ids.append(token)
            touched.append(req)
            error = advance(req.matcher, token) if req.matcher is not None else None
            if error is not None:
                self.finish(req, "error", error)
                continue
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
        assert j == len(sampled), f"{len(sampled)} sampled tokens for {j} sampling sequences"
        assert k == len(scores), f"{len(scores)} scores for {k} scoring rows"
        return touched

    def _scored(self, req: Request, s: ScheduledSeq, scores, k: int, touched: list) -> int:
        """A scoring request's step: its rows' values from scores[k:]; it finishes with its prompt. -> the next k."""
        m = s.score_hi - s.score_lo
        if m:
            i = s.score_lo + 1 - req.params.score_from
            req.scores[i:i + m] = scores[k:k + m]
        if req.num_computed_tokens == req.num_tokens:
            self.finish(req, "stop")
            touched.append(req)
        return k + m

    def _stop_reason(self, req: Request, token: int):
        p = req.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if req.matcher is not None and finished(req.matcher):  # the grammar is complete: nothing more may follow
            return "stop"
        if p.max_tokens and len(req.output_token_ids) >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str, error: str = None) -> None:
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def abort(self, request_id: str):
        req = self.find(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req
