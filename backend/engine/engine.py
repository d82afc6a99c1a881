"""LLMEngine: a dedicated thread loops schedule -> execute -> update; requests come in through an inbox and their
outputs go out through RequestStreams (async or blocking iterators)."""

import asyncio
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from backend.engine.memory import BlockPool, StatePool
from backend.engine.prefix_cache import PrefixCache
from backend.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from backend.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


FAIL_STEPS_ENV = "KIMI_TEST_FAIL_STEPS"


def _test_fail_steps() -> frozenset:
    """TESTING ONLY: KIMI_TEST_FAIL_STEPS="3,10" makes the 3rd and 10th model steps of every engine raise inside
    step() (after scheduling, where runner.execute runs), to test that a failing step fails only its requests."""
    raw = os.environ.get(FAIL_STEPS_ENV, "").strip()
    if not raw:
        return frozenset()
    steps = frozenset(int(x) for x in raw.split(",") if x.strip())
    log.warning("%s=%s: engine steps %s will raise (fault injection for tests)", FAIL_STEPS_ENV, raw, sorted(steps))
    return steps


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int = 0  # 0 = min(model_max_length, what the page pool holds)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    # while requests decode, the step's prefill chunks get at most this many tokens (bounds the inter-token stall);
    # 0 = no cap. With nothing decoding, prefill uses the whole max_num_batched_tokens.
    max_prefill_tokens_with_decode: int = 2048
    block_size: int = 64
    num_blocks: int = 0  # MLA pages incl. the null page; 0 = from gpu_memory_utilization (CUDA) or max_num_seqs
    num_slots: int = 0  # KDA slots incl. the null slot; 0 = max_num_seqs + 1
    # prefix caching (backend/engine/prefix_cache.py): prompts of >= prefix_cache_min_tokens tokens are snapshotted
    # into up to prefix_cache_slots extra KDA state slots (each one layer-set of states: ~42 MB for Kimi-Linear in
    # bf16) and their MLA pages kept, so a later prompt that extends one (multi-turn chat) starts after it; 0 = off
    prefix_cache_slots: int = 0
    prefix_cache_min_tokens: int = 64
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"  # auto (or None) = the checkpoint's on CUDA, float32 on CPU
    device: str = "auto"  # auto (or None) = cuda if available
    enforce_eager: bool = False
    max_graph_batch_size: int = 0  # 0 = max_num_seqs
    # CUDA graphs for prefill-only steps of <= this many tokens and <= 4 fresh sequences (backend/engine/
    # prefill_graphs.py; buckets 256..4096, single GPU); 0 = off. H200 (BENCHMARKS.md, twenty-fourth round): TTFT of
    # a 256 / 512 / 1,024-token prompt 14.5 / 19 / 23.5 ms against 27-44 / 29-40 / 27-53 eagerly
    prefill_graph_tokens: int = 4096
    # at load on CUDA: a few short requests (the common sampling settings) and long prompts through the engine before
    # it serves, so that the Triton kernels of eager steps and of the sampler compile then, not on the first user
    # requests (backend/engine/warmup.py)
    warmup: bool = True
    seed: int = 0  # seeds of requests that bring none
    eos_token_ids: tuple = ()  # () = config.json's
    router_biased_weights: bool = False  # ModelConfig option (HF remote-code router aliasing)
    random_weights: bool = False  # random weights from config.json alone (benchmarks; no safetensors read)
    # tensor parallel (backend/model/parallel.py): world size, rank 0's control-store address/port (0 = any free port,
    # single node only), number of nodes, this node's index (the serving process is node 0)
    tp_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self):
        import torch

        if self.device in ("auto", None):
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype is None:
            self.dtype = "auto"
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "prefix_cache_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_blocks", "num_slots", "max_graph_batch_size",
                     "max_prefill_tokens_with_decode", "prefix_cache_slots", "prefill_graph_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token each step")
        if self.num_blocks == 1 or self.num_slots == 1:
            raise ValueError("num_blocks and num_slots count the null page/slot: use 0 (auto) or >= 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) must be >= 1 and a multiple of nnodes "
                             f"({self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node world needs master_port (and master_addr: node 0's address)")


class EngineFailed(RuntimeError):
    """The engine cannot serve any more (a tensor-parallel rank died); the message says why."""


class RequestStream:
    """Outputs of one request: `async for out in stream` (on the loop that added it) or `for out in stream`."""

    def __init__(self, request_id: str, engine: "LLMEngine", loop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._q = queue.SimpleQueue()
        self._event = asyncio.Event() if loop is not None else None
        self._done = False

    def put(self, out: RequestOutput, wake: dict = None) -> None:
        """Engine thread. wake: {loop: [events]} collects this stream's wake-up for `wake_all` (one cross-thread
        call per event loop and step instead of one per stream); None wakes it now."""
        self._q.put(out)
        if self._loop is not None:
            if wake is not None:
                wake.setdefault(self._loop, []).append(self._event)
            else:
                wake_all({self._loop: [self._event]})

    def _take(self, out: RequestOutput) -> RequestOutput:
        if out.finished:
            self._done = True
        return out

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        assert self._event is not None, "this stream was created outside an event loop: iterate it with `for`"
        while True:
            try:
                return self._take(self._q.get_nowait())
            except queue.Empty:
                if self._done:
                    raise StopAsyncIteration
            self._event.clear()
            if self._q.empty():
                await self._event.wait()

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._done and self._q.empty():
            raise StopIteration
        return self._take(self._q.get())

    @property
    def done(self) -> bool:
        """The final output was taken."""
        return self._done

    def abort(self) -> None:
        self._engine.abort(self.request_id)


def _set_all(events: list) -> None:
    for e in events:
        e.set()


def wake_all(wake: dict) -> None:
    """Sets the collected asyncio events, with one call_soon_threadsafe per loop."""
    for loop, events in wake.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


@dataclass(slots=True)
class _InFlight:
    """A step on the device whose tokens are not collected yet (runner.launch)."""
    out: SchedulerOutput
    launched: object


class LLMEngine:
    def __init__(self, runner, cfg: EngineConfig, start: bool = True):
        """start=False: no engine thread; the caller drives `step()` (benchmarks, tests). start=True on CUDA with
        cfg.warmup: backend/engine/warmup.py runs first."""
        # the settings in effect, "auto" values resolved by the runner
        self.cfg = replace(cfg, dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device),
                           max_model_len=runner.max_model_len, max_num_seqs=runner.max_num_seqs,
                           num_blocks=runner.num_blocks, num_slots=runner.num_slots - runner.prefix_cache_slots,
                           prefix_cache_slots=runner.prefix_cache_slots)
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        eos = cfg.eos_token_ids or runner.config.eos_token_ids
        blocks, states = BlockPool(runner.num_blocks, runner.block_size), StatePool(runner.num_slots)
        cache = None
        if runner.prefix_cache_slots:
            cache = PrefixCache(blocks, states, runner.prefix_cache_slots, cfg.prefix_cache_min_tokens)
        self.scheduler = Scheduler(blocks, states, runner.max_num_seqs, cfg.max_num_batched_tokens,
                                   runner.max_model_len, eos, cfg.max_prefill_tokens_with_decode, cache)
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Condition()
        self._inbox: list = []
        self._streams: dict = {}
        self._stop = False
        self._totals = dict(steps=0, prompt_tokens=0, output_tokens=0, finished=0, errors=0, aborted=0)
        self._recent = deque()  # (time, tokens) of recent steps, for tokens/s
        self._executed = 0  # model steps attempted (the fault hook below counts them)
        self._fail_steps = _test_fail_steps()
        self.error = None  # set once by fail(): every request then fails with it
        self._idle_s = None  # tensor parallel: idle wake-up that pings the followers
        self._inflight = None  # _InFlight: the launched step collected by the next step()
        if runner.group is not None:
            runner.group.on_failure = self.fail
            self._idle_s = runner.group.ping_s
        self._thread = threading.Thread(target=self._loop, name="kimi-engine", daemon=True)
        if start:
            if cfg.warmup and self.cfg.device.startswith("cuda"):
                from backend.engine.warmup import warmup

                try:
                    warmup(self)
                except BaseException:
                    runner.close()      # tensor parallel: release the followers
                    raise
            self._thread.start()

    @classmethod
    def from_config(cls, model_dir: str, cfg: EngineConfig = None) -> "LLMEngine":
        from backend.engine.runner import ModelRunner

        cfg = cfg or EngineConfig()
        return cls(ModelRunner(model_dir, cfg), cfg)

    # API (any thread)
    def add_request(self, prompt_ids, params: SamplingParams = None, request_id: str = None,
                    cache_points=()) -> RequestStream:
        """Raises ValueError for bad parameters or a request that can never fit. cache_points: prompt positions
        where the prefix cache (if on) also keeps the prompt so far (where a chat's first user message starts)."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        with self._lock:
            if self.error is not None:
                raise EngineFailed(self.error)
            req = Request(prompt_ids, params, request_id, seed=self._rng.getrandbits(63), cache_points=cache_points)
            if req.request_id in self._streams:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self.scheduler.check(req)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            stream = RequestStream(req.request_id, self, loop)
            if self._stop:
                raise RuntimeError("the engine is shut down")
            self._streams[req.request_id] = stream
            self._inbox.append(("add", req))
            self._lock.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancels a request (its final output has finish_reason "abort"); unknown or finished ids are ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    def generate(self, prompts: list, params: SamplingParams = None) -> list:
        """Blocking helper: -> the output token ids of each prompt."""
        streams = [self.add_request(p, params) for p in prompts]
        return [[t for out in s for t in out.token_ids] for s in streams]

    def stats(self) -> dict:
        s, now = self.scheduler, time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t < 10.0]
        span = now - recent[0][0] if recent else 0.0
        return dict(
            running=len(s.running), waiting=len(s.waiting) + sum(op == "add" for op, _ in list(self._inbox)),
            free_blocks=s.blocks.num_free, num_blocks=s.blocks.capacity, block_size=s.blocks.block_size,
            free_slots=s.states.num_free, num_slots=s.states.capacity, max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len, kv_capacity_tokens=s.blocks.capacity * s.blocks.block_size,
            preemptions=s.num_preemptions, tokens_per_s=sum(n for _, n in recent) / span if span > 0 else 0.0,
            prefix_cache_entries=len(s.cache) if s.cache is not None else 0,
            prefix_cache_hits=s.cache.hits if s.cache is not None else 0,
            prefix_cache_hit_tokens=s.cache.hit_tokens if s.cache is not None else 0,
            prefix_cache_evictions=s.cache.evictions if s.cache is not None else 0,
            **self._totals)

    def fail(self, msg: str) -> None:
        """Any thread: the engine is dead (a tensor-parallel rank failed): fail every request now and refuse new
        ones; the engine thread stops once the step it may be blocked in returns."""
        with self._lock:
            if self.error is not None:
                return
            self.error = msg = f"engine failed: {msg}"
            streams, self._streams = self._streams, {}
            self._lock.notify()
        log.error("%s", msg)
        for rid, stream in streams.items():
            stream.put(RequestOutput(request_id=rid, token_ids=[], finished=True, finish_reason="error", error=msg))

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread.is_alive():
            # after a rank failure the thread may sit in a collective until its timeout: do not wait for it
            self._thread.join(None if self.error is None else 5.0)
        elif self.error is None:
            self.step()
        self.runner.close()

    # engine thread
    def _loop(self):
        while True:
            idle = False
            with self._lock:
                while (not self._inbox and not self.scheduler.has_unfinished and not self._stop and not self.error
                       and self._inflight is None):
                    if not self._lock.wait(self._idle_s):
                        idle = True
                        break
                stop, error = self._stop, self.error
            if error:
                self._inflight = None
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._abort(req.request_id, "error", error)
                return
            if stop:
                self.step()  # collects a step in flight, then aborts everything
                return
            try:
                if idle:
                    self.runner.ping()
                else:
                    self.step()
            except Exception as e:  # a bug outside the guarded parts of step(): fail everyone, never hang streams
                log.exception("engine step crashed")
                self._inflight = None
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._abort(req.request_id, "error", f"engine error: {e!r}")

    def _drain_inbox(self) -> bool:
        """Applies pending adds and aborts; -> whether the engine is stopping (everything then aborted)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            stop = self._stop
        for op, arg in inbox:
            if op == "add":
                self.scheduler.add(arg)
                self._totals["prompt_tokens"] += arg.num_prompt_tokens
            else:
                self._abort(arg, "abort")
        if stop:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._abort(req.request_id, "abort", "the engine is shutting down")
        return stop

    def _abort(self, request_id: str, reason: str, error: str = None):
        req = self.scheduler.find(request_id)
        if req is None:
            return
        self.scheduler.finish(req, reason, error)
        self._totals["aborted" if reason == "abort" else "errors"] += 1
        self._emit(req)

    def step(self) -> None:
        """Applies the inbox, then runs one scheduling step; an exception fails the requests of this step only.

        Decode-only steps that a graph replays are pipelined (runner.launch): while step N runs on the device, step
        N+1 is scheduled and launched with N's tokens fed on the device (Scheduler.schedule_next), and only then are
        N's tokens collected, applied and emitted; N+1 is collected by the next call. The tokens are the same as
        step by step: a request's step N+1 depends only on its own token N, and update() drops N+1's token of a
        request that N's token stopped. Anything else (inbox, waiting requests, a request finishing by length, no
        free page, tensor parallel) first collects the step in flight. A step whose sampling reads the tokens
        (penalties, a grammar) is launched in two parts around that collection (_settle)."""
        p, self._inflight = self._inflight, None
        if p is not None and self._settle(p):
            return
        if self._drain_inbox() or not self.scheduler.has_unfinished:
            return
        try:
            out = self.scheduler.schedule()
        except Exception as e:  # a scheduler bug: fail everything rather than spin
            log.exception("schedule() failed")
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._abort(req.request_id, "error", f"scheduler error: {e!r}")
            return
        if out.is_empty:
            time.sleep(0.001)
            return
        pipelined = self.runner.group is None and self.runner.can_launch(out)
        try:
            self._count_step()
            if pipelined:
                p = _InFlight(out, self.runner.launch(out))
            else:
                ids, logprobs, scores = self.runner.execute(out)
        except Exception as e:
            # a tensor-parallel rank failure has already called fail() (runner.group.on_failure)
            log.exception("step failed for %d requests", len(out.seqs))
            self._fail(out, e)
            return
        if pipelined:
            self._settle(p)
        else:
            self._apply(out, ids, logprobs, scores)

    def _count_step(self):
        self._executed += 1
        if self._executed in self._fail_steps:
            raise RuntimeError(f"fault injected at engine step {self._executed} ({FAIL_STEPS_ENV}, testing only)")

    def _settle(self, p: _InFlight) -> bool:
        """Launches the step after `p` if nothing changes the batch (it stays in flight), then collects `p`.
        -> whether the next step was launched.

        When a request samples with its history (penalties, a grammar), the next step's sampling must see `p`'s
        tokens on the host: only its forward is queued before `p` is collected; its sampling (and the grammar masks,
        computed on the host while that forward runs) is queued after `p`'s tokens are applied."""
        nxt = failed = logits = None
        if not self._inbox and not self._stop and self.error is None and self.runner.can_launch(p.out):
            out = self.scheduler.schedule_next(p.out)
            if out is not None:
                history = any(s.request.params.needs_history for s in out.seqs)
                try:
                    self._count_step()
                    if history:
                        logits = self.runner.forward(out, feed=p.launched)
                    else:
                        nxt = _InFlight(out, self.runner.launch(out, feed=p.launched))
                except Exception as e:
                    log.exception("step failed for %d requests", len(out.seqs))
                    failed = (out, e)
        try:
            ids, logprobs, scores = self.runner.collect(p.launched)
        except Exception as e:
            log.exception("step failed for %d requests", len(p.out.seqs))
            self._fail(p.out, e)
        else:
            self._apply(p.out, ids, logprobs, scores)
        if logits is not None:
            try:
                nxt = _InFlight(out, self.runner.sample_launch(out, logits))
            except Exception as e:
                log.exception("step failed for %d requests", len(out.seqs))
                failed = (out, e)
        if failed is not None:
            self._fail(*failed)
        self._inflight = nxt
        return nxt is not None or failed is not None

    def _apply(self, out: SchedulerOutput, ids: list, logprobs: list, scores: list):
        """A step's sampled tokens (and scoring requests' log-probabilities) -> requests (update) -> streams."""
        try:
            self._attach_logprobs(out, logprobs)
            touched = self.scheduler.update(out, ids, scores)
        except Exception as e:
            log.exception("step failed for %d requests", len(out.seqs))
            self._fail(out, e)
            return
        self._totals["steps"] += 1
        made = sum(r.scores is None for r in touched)  # a scoring request's finish makes no token
        self._totals["output_tokens"] += made
        now = time.monotonic()
        self._recent.append((now, made))
        while len(self._recent) > 1000:
            self._recent.popleft()
        wake = {}
        for req in touched:
            if req.first_token_time is None:
                req.first_token_time = now
            self._emit(req, now, wake)
        self._totals["finished"] += sum(r.status is RequestStatus.FINISHED for r in touched)
        wake_all(wake)

    def _attach_logprobs(self, out: SchedulerOutput, logprobs: list):
        for s, lp in zip((s for s in out.seqs if s.sample), logprobs):
            if lp is not None and not s.request.is_finished:
                s.request.pending_logprobs.append(lp)

    def _fail(self, out: SchedulerOutput, e: Exception):
        if out.snapshots:
            self.scheduler.abandon(out)
        for s in out.seqs:
            req = s.request
            if not req.is_finished:
                self.scheduler.finish(req, "error", f"{type(e).__name__}: {e}")
                self._totals["errors"] += 1
            self._emit(req)

    def _emit(self, req: Request, now: float = None, wake: dict = None):
        toks, sent = req.output_token_ids, req.num_sent_tokens
        req.num_sent_tokens = m = len(toks)
        lps = None
        if req.pending_logprobs:
            lps, req.pending_logprobs = req.pending_logprobs, []
        elif req.params.logprobs or req.params.top_logprobs:
            lps = []
        if now is None:
            now = time.monotonic()
        first, finished = req.first_token_time, req.status is RequestStatus.FINISHED
        out = RequestOutput(
            req.request_id, toks[sent:], lps, finished, req.finish_reason, req.error, len(req.prompt_token_ids), m,
            (first if first is not None else now) - req.arrival_time, now - first if first is not None else 0.0,
            req.scores if finished and req.finish_reason == "stop" else None)
        if finished:
            stream = self._streams.pop(req.request_id, None)
        else:
            stream = self._streams.get(req.request_id)
        if stream is not None:
            stream.put(out, wake)
