"""LocalAI gRPC backend server for Kimi-Linear (grpc.aio).

    python -m backend.server --addr 127.0.0.1:50051          (run.sh does this; LocalAI passes --addr)

Nothing heavy is imported at module load: torch, the model and the engine are imported inside LoadModel, which
runs in a worker thread so Health/Status answer while a checkpoint loads. All Predict/PredictStream calls go to
the one engine, which batches them (continuous batching in its own thread); the event loop only detokenizes.
"""

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import backend_pb2  # noqa: E402  (generated into the repo root by `make protogen`)
import backend_pb2_grpc  # noqa: E402

from backend.options import OptionsError, build_load_spec, engine_config  # noqa: E402

log = logging.getLogger("kimi-linear")

MAX_WORKERS = int(os.environ.get("PYTHON_GRPC_MAX_WORKERS", "1"))
# RecursionError while building a request (template, schema, grammar compiler): bad input, INVALID_ARGUMENT
TOO_DEEP = "the request is nested too deeply to process (Tools, Messages, Grammar or Metadata)"
# LoadModel on a serving backend: running requests may finish for this long before they are aborted
RELOAD_DRAIN_S = float(os.environ.get("KIMI_RELOAD_DRAIN_S", "60"))
MAX_MESSAGE_BYTES = 50 * 1024 * 1024  # LocalAI's Python backends use 50 MB both ways
GRPC_OPTIONS = [
    ("grpc.max_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

UNINITIALIZED = backend_pb2.StatusResponse.UNINITIALIZED
BUSY = backend_pb2.StatusResponse.BUSY
READY = backend_pb2.StatusResponse.READY
ERROR = backend_pb2.StatusResponse.ERROR


class _Loaded:
    """What one successful LoadModel produced."""

    def __init__(self, engine, tok, spec, max_model_len, vocab_size, device, dtype):
        self.engine = engine
        self.tok = tok
        self.spec = spec
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self._grammars = None
        self._grammar_lock = threading.Lock()

    def grammar(self, text: str):
        """PredictOptions.Grammar -> a compiled Grammar (raises GrammarError, a ValueError). The llguidance
        tokenizer is built on the first grammar (about a second for Kimi's vocabulary), then shared."""
        from backend.engine.structured import Grammars

        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = Grammars.from_tokenizer(self.tok, self.vocab_size)
        return self._grammars.compile(text)


class _Throughput:
    """Tokens generated in the last `window` seconds -> tokens/s (for GetMetrics)."""

    def __init__(self, window=10.0):
        self.window = window
        self.events = deque()  # (t, n)
        self.total_generated = 0
        self.total_prompt = 0

    def add(self, n):
        now = time.monotonic()
        self.events.append((now, n))
        self.total_generated += n
        self._trim(now)

    def rate(self):
        now = time.monotonic()
        self._trim(now)
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1e-3)
        return sum(n for _, n in self.events) / span

    def _trim(self, now):
        while self.events and now - self.events[0][0] > self.window:
            self.events.popleft()


class _Pipeline:
    """Engine token ids -> text: detokenize, cut at stop strings, split Kimi tool-call markup from content."""

    def __init__(self, tok, stops, parse_tools):
        from backend.tokenizer import IncrementalDetokenizer, StopStringMatcher
        from backend.toolcalls import ToolCallStreamParser

        self.detok = IncrementalDetokenizer(tok, skip_ids=tok.eos_token_ids)
        self.stops = StopStringMatcher(stops)
        self.tools = ToolCallStreamParser() if parse_tools else None
        self.stopped = False

    def push(self, token_id):
        """-> (content delta, tool-call deltas); sets .stopped when a stop string completes."""
        text, stop = self.stops.feed(self.detok.push(token_id))
        if stop is not None:
            self.stopped = True
        return self._content(text, final=False)

    def finish(self):
        text = ""
        if not self.stopped:
            text, _ = self.stops.feed(self.detok.flush())
            text += self.stops.flush()
        return self._content(text, final=True)

    def _content(self, text, final):
        if self.tools is None:
            return text, []
        content, deltas = self.tools.feed(text)
        if final:
            c2, d2 = self.tools.finish()
            content, deltas = content + c2, deltas + d2
        return content, deltas


def _tool_deltas(deltas):
    return [backend_pb2.ToolCallDelta(index=d["index"], id=d.get("id", ""), name=d.get("name", ""),
                                      arguments=d.get("arguments", "")) for d in deltas]


def _merge_tool_deltas(deltas):
    """Streamed deltas -> one full delta per call (arguments concatenated), as a non-streamed reply carries."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"index": d["index"], "id": "", "name": "", "arguments": ""})
        c["id"] = d.get("id") or c["id"]
        c["name"] = d.get("name") or c["name"]
        c["arguments"] += d.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def _memory_usage():
    breakdown = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    breakdown["rss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    total = breakdown.get("rss", 0)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                breakdown["cuda_allocated"] = int(torch.cuda.memory_allocated())
                breakdown["cuda_reserved"] = int(torch.cuda.memory_reserved())
                total = breakdown["cuda_reserved"]
        except Exception:  # noqa: BLE001 - memory figures are best effort
            pass
    return backend_pb2.MemoryUsageData(total=total, breakdown=breakdown)


# load counters that Status adds to MemoryUsageData.breakdown next to the memory figures (bytes)
STATUS_COUNTERS = ("queue_depth", "running", "active_requests", "tokens_per_s")


def _check_vocab(tok, model_cfg):
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but config.json has vocab_size "
                         f"{model_cfg.vocab_size}: the tokenizer files do not belong to these weights")


class BackendServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self):
        self._loaded = None
        self._state = UNINITIALIZED
        self._last_error = ""
        self._load_lock = asyncio.Lock()
        self._active = 0
        self._draining = False  # a LoadModel waits for running requests before replacing the model
        self._throughput = _Throughput()
        self._background = set()  # LoadModel / Free tasks whose client went away (kept referenced until done)

    # ------------------------------------------------------------------------------------------ lifecycle

    async def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    async def Status(self, request, context):
        state = self._state
        if state == READY and self._active > 0:
            state = BUSY
        loaded = self._loaded
        if loaded is not None and loaded.engine.error:  # a tensor-parallel rank died
            state = ERROR
        memory = _memory_usage()
        stats = self._load_stats()
        for k in STATUS_COUNTERS:   # not bytes: load figures for LocalAI's backend monitor
            memory.breakdown[k] = max(0, int(round(float(stats.get(k, 0) or 0))))
        return backend_pb2.StatusResponse(state=state, memory=memory)

    def _load_stats(self):
        """Engine stats + server counters: tokens_per_s (last 10 s), queue_depth (waiting requests), running,
        active_requests (open Predict/PredictStream calls)."""
        stats = {}
        loaded = self._loaded
        if loaded is not None:
            try:
                stats = dict(loaded.engine.stats())
            except Exception:  # noqa: BLE001 - metrics are best effort
                stats = {}
        stats.setdefault("active_requests", self._active)
        for k in ("num_waiting", "waiting"):
            if k in stats:
                stats.setdefault("queue_depth", stats[k])
        stats.setdefault("queue_depth", 0)
        for k in ("num_running", "running"):
            if k in stats:
                stats.setdefault("running", stats[k])
        stats.setdefault("running", 0)
        stats.setdefault("tokens_per_s", self._throughput.rate())
        return stats

    async def _uncancelled(self, coro, what):
        """Runs coro (holding the load lock) as a task that a client's cancel (disconnect, deadline) does not stop.
        The load or release it runs in a worker thread cannot be interrupted, so the state it sets afterwards (the
        model installed or released, Status, the lock) must be set anyway: a LoadModel cancelled halfway otherwise
        left Status BUSY for good and the loaded model in memory with nothing referring to it."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            log.warning("%s: the client went away; it runs to its end in the background", what)
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or log.error("%s (client gone) failed: %r", what, t.exception()))
            raise

    async def LoadModel(self, request, context):
        return await self._uncancelled(self._load_model(request), "LoadModel")

    async def _load_model(self, request):
        async with self._load_lock:
            try:
                spec = build_load_spec(request, os.environ.get("KIMI_LAUNCH_CWD"))
            except OptionsError as e:
                log.error("LoadModel: %s", e)
                return backend_pb2.Result(success=False, message=str(e))
            if self._loaded is not None:
                if spec == self._loaded.spec and not self._loaded.engine.error:
                    # LocalAI (re)connecting to a running backend: same model, same settings -> nothing to do
                    msg = f"Kimi-Linear from {spec.model_dir} is already loaded with these settings; kept"
                    log.info("LoadModel: %s", msg)
                    return backend_pb2.Result(success=True, message=msg)
                try:  # a damaged checkpoint is refused while the current model keeps serving
                    await asyncio.to_thread(self._precheck, spec)
                except Exception as e:  # noqa: BLE001
                    msg = (f"could not load Kimi-Linear from {spec.model_dir}: {type(e).__name__}: {e} "
                           f"(the model already loaded keeps serving)")
                    log.error("LoadModel: %s", msg)
                    return backend_pb2.Result(success=False, message=msg)
                # another model or other settings: new requests are refused (UNAVAILABLE) while the running ones
                # get up to KIMI_RELOAD_DRAIN_S to finish; the rest are aborted, then the model is replaced
                self._state, self._draining = BUSY, True
                try:
                    await self._drain(RELOAD_DRAIN_S)
                    old, self._loaded = self._loaded, None
                    await asyncio.to_thread(self._release, old)
                finally:
                    self._draining = False
            self._state = BUSY
            t0 = time.monotonic()
            log.info("LoadModel: loading %s (%s)", spec.model_dir, spec.engine)
            try:
                loaded = await asyncio.to_thread(self._load_sync, spec)
            except Exception as e:  # noqa: BLE001 - any load failure becomes an actionable Result
                msg = f"could not load Kimi-Linear from {spec.model_dir}: {type(e).__name__}: {e}"
                log.exception("LoadModel failed")
                self._state, self._last_error = ERROR, msg
                return backend_pb2.Result(success=False, message=msg)
            self._loaded, self._state, self._last_error = loaded, READY, ""
            msg = (f"Kimi-Linear loaded from {spec.model_dir} in {time.monotonic() - t0:.1f}s "
                   f"(device={loaded.device}, dtype={loaded.dtype}, max_model_len={loaded.max_model_len})")
            if spec.ignored:
                msg += f"; ignored unknown options: {', '.join(spec.ignored)}"
            log.info("LoadModel: %s", msg)
            return backend_pb2.Result(success=True, message=msg)

    async def _drain(self, timeout):
        t0 = time.monotonic()
        if self._active:
            log.info("LoadModel: waiting up to %.0fs for %d running requests", timeout, self._active)
        while self._active and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.05)
        if self._active:
            log.warning("LoadModel: aborting %d requests still running after %.0fs", self._active, timeout)

    @staticmethod
    def _precheck(spec):
        """The cheap checks of a checkpoint, nothing large read or allocated: config.json, tokenizer (and its size
        against vocab_size), every safetensors header matched against the config."""
        from backend.config import ModelConfig
        from backend.tokenizer import load_tokenizer

        model_cfg = ModelConfig.from_dir(spec.model_dir)
        _check_vocab(load_tokenizer(spec.model_dir), model_cfg)
        if not spec.engine.get("random_weights"):
            from backend.model.loader import check_checkpoint, checkpoint_plan

            check_checkpoint(spec.model_dir, checkpoint_plan(model_cfg))

    def _load_sync(self, spec):
        from backend.config import ModelConfig
        from backend.engine import EngineConfig, LLMEngine
        from backend.tokenizer import load_tokenizer

        model_cfg = ModelConfig.from_dir(spec.model_dir)  # validated before anything large is read or allocated
        tok = load_tokenizer(spec.model_dir)
        _check_vocab(tok, model_cfg)
        engine = LLMEngine.from_config(spec.model_dir, engine_config(EngineConfig, spec.engine))
        cfg = engine.cfg  # the settings in effect, "auto" values resolved
        return _Loaded(engine, tok, spec, engine.max_model_len, engine.vocab_size, cfg.device, cfg.dtype)

    @staticmethod
    def _release(loaded):
        try:
            loaded.engine.shutdown()
        finally:
            import gc

            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                torch.cuda.empty_cache()

    async def Free(self, request, context):
        return await self._uncancelled(self._free(), "Free")

    async def _free(self):
        async with self._load_lock:
            if self._loaded is None:
                self._state = UNINITIALIZED
                return backend_pb2.Result(success=True, message="no model loaded")
            old, self._loaded = self._loaded, None
            self._state = UNINITIALIZED
            try:
                await asyncio.to_thread(self._release, old)
            except Exception as e:  # noqa: BLE001
                return backend_pb2.Result(success=False, message=f"free failed: {type(e).__name__}: {e}")
            return backend_pb2.Result(success=True, message="model freed")

    async def shutdown(self):
        if self._loaded is not None:
            old, self._loaded = self._loaded, None
            await asyncio.to_thread(self._release, old)

    # ------------------------------------------------------------------------------------------ helpers

    async def _require_model(self, request, context):
        loaded = self._loaded
        if loaded is None:
            if self._state == BUSY:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "a model is loading (LoadModel in progress): "
                                    "retry when Status is READY")
            detail = "no model loaded: call LoadModel first"
            if self._state == ERROR and self._last_error:
                detail += f" (last load failed: {self._last_error})"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, detail)
        ident = getattr(request, "ModelIdentity", "")
        if ident and loaded.spec.model_name and ident != loaded.spec.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model identity mismatch: request for '{ident}', "
                                f"this backend serves '{loaded.spec.model_name}'")
        return loaded

    async def _admit(self, request, context, build):
        """-> (the loaded model, build(loaded) run in a thread: a slow chat template or a long prompt never stalls
        the event loop). Aborts the call: INVALID_ARGUMENT when build raises a bad-request error, UNAVAILABLE while a
        LoadModel/Free replaces the model or after the engine failed. Nothing awaits after these checks, so the
        caller's `self._active += 1` is seen by any LoadModel/Free that starts later."""
        from backend.predict import BadRequest
        from backend.tokenizer import TokenizerError

        loaded = await self._require_model(request, context)
        error = None
        try:
            built = await asyncio.to_thread(build, loaded)
        except (BadRequest, TokenizerError, ValueError, TypeError) as e:
            error = str(e)
        except RecursionError:  # a structure nested too deeply for the template, a schema or the grammar compiler
            error = TOO_DEEP
        if error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        if self._draining or self._loaded is not loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is being replaced or was freed "
                                "(LoadModel/Free in progress): retry when Status is READY")
        if loaded.engine.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{loaded.engine.error}; LoadModel restarts the model")
        return loaded, built

    def _build(self, request, loaded):
        """-> (prompt ids, SamplingParams, stops, prefix cache points) or raises BadRequest/ValueError."""
        from backend.predict import BadRequest, cache_points, prompt_ids, sampling_params, tool_choice_grammar
        from backend.tokenizer import TemplateError, TokenizerError

        try:
            ids = prompt_ids(request, loaded.tok)
        except (TemplateError, TokenizerError) as e:
            raise BadRequest(str(e)) from None
        params, stops = sampling_params(request, loaded.tok.eos_token_ids, loaded.spec.default_max_tokens,
                                        loaded.spec.engine.get("seed"))
        if request.Grammar:  # GBNF (what LocalAI sends for response_format and grammar function calling), Lark, or
            params.grammar = loaded.grammar(request.Grammar)   # a JSON schema; invalid -> INVALID_ARGUMENT
        elif (forced := tool_choice_grammar(request, loaded.tok)) is not None:  # ToolChoice required / a function
            try:
                params.grammar = loaded.grammar(forced)
            except ValueError as e:
                raise BadRequest(f"ToolChoice cannot be enforced with these Tools: {e}") from None
        params.validate(loaded.vocab_size)
        if loaded.max_model_len and len(ids) >= loaded.max_model_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens but the context is {loaded.max_model_len} tokens "
                             "(context_size): shorten the prompt or raise context_size")
        if loaded.max_model_len and params.max_tokens > loaded.max_model_len - len(ids):
            # LocalAI configs often set max_tokens == context_size: generate until the context is full (as
            # llama.cpp does) instead of refusing the request
            params.max_tokens = loaded.max_model_len - len(ids)
        return ids, params, stops, cache_points(ids, loaded.tok)

    async def _generate(self, request, context):
        """Async generator of ("delta", content, tool_deltas) then one ("final", info)."""
        from backend.predict import logprob_entry

        loaded, (ids, params, stops, points) = await self._admit(
            request, context, lambda loaded: self._build(request, loaded))
        # no await from here to `self._active += 1`: a LoadModel/Free either sees this request or it sees them
        pipe = _Pipeline(loaded.tok, stops, loaded.spec.tool_parser != "none")
        error = None
        try:
            stream = loaded.engine.add_request(ids, params, cache_points=points)
        except ValueError as e:
            error = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            error = (grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        if error is not None:
            await context.abort(*error)

        request_id = stream.request_id
        finished = False
        self._active += 1
        self._throughput.total_prompt += len(ids)
        n_out, logprobs, last, failure, aborted = 0, [], None, None, None
        try:
            async for out in stream:
                last = out
                if out.logprobs:
                    logprobs.extend(out.logprobs)
                for tid in out.token_ids:
                    n_out += 1
                    content, deltas = pipe.push(tid)
                    if content or deltas:
                        yield "delta", content, deltas
                    if pipe.stopped:
                        break
                self._throughput.add(len(out.token_ids))
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        failure = out.error or "engine error"
                    elif out.finish_reason == "abort":  # only Free / LoadModel abort a request whose client is here
                        aborted = out.error or "aborted"
                    break
                if pipe.stopped:
                    break
            if failure is not None:
                await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {failure}")
            if aborted is not None:
                await context.abort(grpc.StatusCode.ABORTED, f"request aborted after {n_out} tokens: the model was "
                                    f"freed or replaced while it ran ({aborted})")
            content, deltas = pipe.finish()
            if content or deltas:
                yield "delta", content, deltas
            info = {
                "tokens": n_out,
                "prompt_tokens": len(ids),
                "prompt_ms": 1000.0 * (last.prompt_time_s if last is not None else 0.0),
                "gen_ms": 1000.0 * (last.gen_time_s if last is not None else 0.0),
                "finish_reason": "stop" if pipe.stopped else (last.finish_reason if last is not None else None),
                "logprobs": ([logprob_entry(loaded.tok, e) for e in logprobs[:n_out]]
                             if params.wants_logprobs else None),
            }
            yield "final", info
        finally:
            self._active -= 1
            if not finished and request_id is not None:
                try:
                    loaded.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - the request may already be gone
                    log.debug("abort(%s) failed", request_id, exc_info=True)

    # ------------------------------------------------------------------------------------------ inference

    async def Predict(self, request, context):
        from backend.predict import logprobs_json

        text, deltas, info = [], [], None
        gen = self._generate(request, context)
        try:
            async for kind, *rest in gen:
                if kind == "delta":
                    text.append(rest[0])
                    deltas.extend(rest[1])
                else:
                    info = rest[0]
        finally:
            await gen.aclose()
        content = "".join(text)
        reply = backend_pb2.Reply(
            message=content.encode("utf-8"), tokens=info["tokens"], prompt_tokens=info["prompt_tokens"],
            timing_prompt_processing=info["prompt_ms"], timing_token_generation=info["gen_ms"],
            chat_deltas=[backend_pb2.ChatDelta(content=content, tool_calls=_tool_deltas(_merge_tool_deltas(deltas)))])
        if info["logprobs"] is not None:
            reply.logprobs = logprobs_json(info["logprobs"])
        return reply

    async def PredictStream(self, request, context):
        from backend.predict import logprobs_json

        gen = self._generate(request, context)
        try:
            async for kind, *rest in gen:
                if kind == "delta":
                    content, deltas = rest
                    yield backend_pb2.Reply(
                        message=content.encode("utf-8"),
                        chat_deltas=[backend_pb2.ChatDelta(content=content, tool_calls=_tool_deltas(deltas))])
                else:
                    info = rest[0]
                    reply = backend_pb2.Reply(
                        message=b"", tokens=info["tokens"], prompt_tokens=info["prompt_tokens"],
                        timing_prompt_processing=info["prompt_ms"], timing_token_generation=info["gen_ms"])
                    if info["logprobs"] is not None:
                        reply.logprobs = logprobs_json(info["logprobs"])
                    yield reply
        finally:
            await gen.aclose()

    async def TokenizeString(self, request, context):
        from backend.predict import BadRequest, prompt_text
        from backend.tokenizer import TemplateError, TokenizerError

        loaded = await self._require_model(request, context)
        error = None
        try:
            tokens = await asyncio.to_thread(lambda: loaded.tok.encode(prompt_text(request, loaded.tok)))
        except (BadRequest, TemplateError, TokenizerError, ValueError, TypeError) as e:
            error = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RecursionError:
            error = (grpc.StatusCode.INVALID_ARGUMENT, TOO_DEEP)
        except Exception as e:  # noqa: BLE001
            error = (grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        if error is not None:
            await context.abort(*error)
        return backend_pb2.TokenizationResponse(length=len(tokens), tokens=tokens)

    async def Detokenize(self, request, context):
        loaded = await self._require_model(request, context)
        bad = [t for t in request.tokens if not 0 <= t < loaded.tok.vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token ids outside the vocabulary (size {loaded.tok.vocab_size}): {bad[:8]}")
        return backend_pb2.DetokenizeResponse(content=loaded.tok.decode(list(request.tokens)))

    async def Score(self, request, context):
        """log P(candidate | prompt) of each candidate (backend/predict.py score_inputs): scoring requests in the
        engine (SamplingParams.score_from), batched with whatever else runs. With the prefix cache on, the first
        candidate caches the prompt and the others start after it (the prompt is computed once); without it, each
        candidate computes the prompt."""
        from backend.predict import candidate_score, score_inputs

        loaded, work = await self._admit(
            request, context, lambda loaded: score_inputs(request, loaded.tok, loaded.max_model_len))
        self._active += 1  # no await since _admit's checks
        streams = []
        try:
            scores = await self._score_all(loaded, work, streams, context)
        finally:
            self._active -= 1
            for s in streams:  # a cancelled or failed call leaves nothing running
                if not s.done:
                    loaded.engine.abort(s.request_id)
        self._throughput.total_prompt += sum(len(ids) for ids, _, _ in work)
        return backend_pb2.ScoreResponse(candidates=[
            backend_pb2.CandidateScore(**candidate_score(loaded.tok, ids[sf:], s, request.length_normalize,
                                                         request.include_token_logprobs))
            for (ids, sf, _), s in zip(work, scores)])

    async def _score_all(self, loaded, work, streams, context) -> list:
        """-> each candidate's token log-probabilities ([] for one without tokens: nothing runs). The first candidate
        runs alone when the prefix cache can then hand the prompt to the others."""
        from backend.engine import SamplingParams

        engine, results = loaded.engine, [[] for _ in work]
        todo = [i for i, (ids, sf, _) in enumerate(work) if sf < len(ids)]
        first = 1 if engine.cfg.prefix_cache_slots and len(todo) > 1 else len(todo)
        for group in (todo[:first], todo[first:]):
            batch = []
            for i in group:
                ids, sf, points = work[i]
                try:
                    batch.append(engine.add_request(ids, SamplingParams(score_from=sf), cache_points=points))
                    streams.append(batch[-1])  # the caller aborts what is in `streams` if this call ends early
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception as e:  # noqa: BLE001 - a shut-down or failed engine
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}")
            for i, s in zip(group, batch):
                last = None
                async for out in s:
                    last = out
                if last is None or last.finish_reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        f"scoring failed: {last.error if last is not None else 'no output'}")
                if last.finish_reason != "stop":
                    await context.abort(grpc.StatusCode.ABORTED, f"scoring aborted: the model was freed or "
                                        f"replaced while it ran ({last.error or last.finish_reason})")
                results[i] = last.scores
        return results

    async def GetMetrics(self, request, context):
        import json

        stats = self._load_stats()
        memory = _memory_usage()
        stats["memory"] = {"total": memory.total, **dict(memory.breakdown)}
        return backend_pb2.MetricsResponse(
            slot_id=0, prompt_json_for_slot=json.dumps(stats, default=str),
            tokens_per_second=float(stats["tokens_per_s"]),
            tokens_generated=min(self._throughput.total_generated, 2**31 - 1),
            prompt_tokens_processed=min(self._throughput.total_prompt, 2**31 - 1))


def _unimplemented(name):
    async def handler(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{name} is not implemented by the kimi-linear backend (a text-generation backend)")
    return handler


def _unimplemented_stream(name):
    async def handler(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{name} is not implemented by the kimi-linear backend (a text-generation backend)")
        yield  # pragma: no cover - makes this an async generator
    return handler


def _fill_unimplemented():
    """Every RPC of the proto that BackendServicer does not serve answers UNIMPLEMENTED with a message."""
    service = backend_pb2.DESCRIPTOR.services_by_name["Backend"]
    for m in service.methods:
        if m.name in BackendServicer.__dict__:
            continue
        factory = _unimplemented_stream if m.server_streaming else _unimplemented
        setattr(BackendServicer, m.name, factory(m.name))


_fill_unimplemented()


class _Undecodable:
    """What the request deserializer hands a method instead of a message when the bytes do not parse."""

    __slots__ = ("detail",)

    def __init__(self, detail):
        self.detail = detail


def _varint(data: bytes, i: int) -> tuple:
    n = shift = 0
    while True:
        b = data[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return n, i


def _bad_utf8_field(desc, data: bytes, path: str = ""):
    """-> ("Messages[1].content", "byte 2: b'\\xff'") for the first string field of a serialized `desc` message that is
    not UTF-8, else None. Walks the wire format with the descriptor; raises on bytes that are not a message at all."""
    i, seen = 0, {}
    while i < len(data):
        key, i = _varint(data, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        elif wire == 2:
            n, i = _varint(data, i)
            chunk, i = data[i:i + n], i + n
            f = desc.fields_by_number.get(num)
            if f is None or f.type not in (f.TYPE_STRING, f.TYPE_MESSAGE):
                continue
            name = path + f.name
            if f.is_repeated:
                seen[num] = seen.get(num, -1) + 1
                name += f"[{seen[num]}]"
            if f.type == f.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    return name, f"byte {e.start}: {chunk[e.start:e.start + 4]!r}"
            else:
                inner = _bad_utf8_field(f.message_type, chunk, name + ".")
                if inner is not None:
                    return inner
        else:  # groups (3, 4) are not used by this proto: not a message we sent
            raise ValueError(f"wire type {wire}")
    return None


def _decode_error_detail(desc, data: bytes, error: DecodeError) -> str:
    try:
        field = _bad_utf8_field(desc, data)
    except (IndexError, ValueError):
        field = None
    if field is not None:
        return (f"the request is not a valid {desc.full_name}: string field {field[0]} is not valid UTF-8 "
                f"({field[1]}; protobuf string fields must hold UTF-8 text)")
    return f"the request is not a valid {desc.full_name} protobuf message ({error})"


def _request_deserializer(cls):
    """cls.FromString that never raises: bytes that do not parse (e.g. raw invalid UTF-8 in a string field, which
    grpc would answer with UNKNOWN before any backend code runs) become an _Undecodable marker."""
    def deserialize(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _Undecodable(_decode_error_detail(cls.DESCRIPTOR, data, e))
    return deserialize


def _refuse_undecodable(method, server_streaming: bool):
    """Wraps a servicer method: an _Undecodable request ends the call with INVALID_ARGUMENT naming the problem."""
    if server_streaming:
        async def stream_handler(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
            gen = method(request, context)
            try:
                async for reply in gen:
                    yield reply
            finally:
                await gen.aclose()
        return stream_handler

    async def handler(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        return await method(request, context)
    return handler


_HANDLERS = {  # (client streaming, server streaming) -> grpc handler constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(servicer, server):
    """backend_pb2_grpc.add_BackendServicer_to_server, except that a request that does not parse reaches the method
    as INVALID_ARGUMENT with a message instead of failing inside grpc (UNKNOWN). Streamed requests (methods this
    backend does not implement) keep the plain handler: they answer UNIMPLEMENTED without reading a message."""
    service = backend_pb2.DESCRIPTOR.services_by_name["Backend"]
    handlers = {}
    for m in service.methods:
        method = getattr(servicer, m.name)
        if not m.client_streaming:
            method = _refuse_undecodable(method, m.server_streaming)
        handlers[m.name] = _HANDLERS[m.client_streaming, m.server_streaming](
            method, request_deserializer=_request_deserializer(GetMessageClass(m.input_type)),
            response_serializer=GetMessageClass(m.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _interceptors():
    """LocalAI's shared interceptors (bearer auth, model identity, parent watch) when run inside its tree ->
    (interceptors, whether they are LocalAI's: those arm its own parent watcher)."""
    here = os.path.dirname(ROOT)
    for p in (os.path.join(ROOT, "common"), os.path.join(here, "common")):
        if os.path.isfile(os.path.join(p, "grpc_auth.py")) and p not in sys.path:
            sys.path.insert(0, p)
    try:
        from grpc_auth import get_auth_interceptors  # type: ignore
    except ImportError:
        token = os.environ.get("LOCALAI_GRPC_AUTH_TOKEN", "")
        return ([_TokenAuth(token)] if token else []), False
    return list(get_auth_interceptors(aio=True)), True


def _duration_s(raw: str, default: float) -> float:
    """A Go-style duration ("500ms", "2s", "1m") or a bare number of seconds -> seconds (default if unreadable)."""
    raw = raw.strip().lower()
    for unit, scale in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("", 1.0)):
        if raw.endswith(unit):
            try:
                v = float(raw[:len(raw) - len(unit)]) * scale
            except ValueError:
                return default
            return v if v > 0 else default
    return default


async def _watch_parent(stop: asyncio.Event):
    """Outside LocalAI's tree (no common/ watcher): stop like on SIGTERM once the process that started this backend
    is gone (this process reparented), so a LocalAI killed with SIGKILL leaves no backend holding GPU memory and its
    port. LocalAI's variables: LOCALAI_BACKEND_PARENT_WATCH (false / 0 / no / off: off),
    LOCALAI_BACKEND_PARENT_WATCH_INTERVAL (default 2s)."""
    if os.environ.get("LOCALAI_BACKEND_PARENT_WATCH", "").strip().lower() in ("false", "0", "no", "off"):
        return
    ppid = os.getppid()
    if ppid <= 1 or os.name == "nt":  # started under init: no parent to watch
        return
    interval = _duration_s(os.environ.get("LOCALAI_BACKEND_PARENT_WATCH_INTERVAL", ""), 2.0)
    while not stop.is_set():
        await asyncio.sleep(interval)
        if os.getppid() != ppid:
            log.error("the parent process (pid %d) exited without stopping this backend: stopping", ppid)
            stop.set()


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token check (LOCALAI_GRPC_AUTH_TOKEN) for standalone runs without LocalAI's common/."""

    def __init__(self, token):
        self._expected = "Bearer " + token

    async def intercept_service(self, continuation, details):
        import hmac

        auth = dict(details.invocation_metadata or ()).get("authorization", "")
        if not hmac.compare_digest(auth, self._expected):
            async def deny(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid token")
            return grpc.unary_unary_rpc_method_handler(deny)
        return await continuation(details)


async def _preload(servicer, model):
    """`--model DIR` (make run / make demo): load a model at start-up, as a LocalAI LoadModel call would."""
    result = await servicer.LoadModel(backend_pb2.ModelOptions(Model=model), None)
    if not result.success:
        log.error("--model %s: %s", model, result.message)


async def serve(addr, model=None):
    interceptors, localai_common = _interceptors()
    server = grpc.aio.server(migration_thread_pool=futures.ThreadPoolExecutor(max_workers=MAX_WORKERS),
                             options=GRPC_OPTIONS, interceptors=interceptors)
    servicer = BackendServicer()
    add_servicer(servicer, server)
    port = server.add_insecure_port(addr)
    if port == 0:
        raise SystemExit(f"kimi-linear: cannot listen on {addr}")
    await server.start()
    log.info("kimi-linear backend listening on %s (pid %d)", addr, os.getpid())
    print(f"Server started. Listening on: {addr}", file=sys.stderr, flush=True)
    background = []  # strong references to the tasks below: the event loop keeps only weak ones
    if model:
        background.append(asyncio.ensure_future(_preload(servicer, model)))

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if not localai_common:
        background.append(asyncio.ensure_future(_watch_parent(stop)))
    waiter = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.wait([waiter, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    log.info("kimi-linear backend stopping")
    await server.stop(5)
    try:
        await asyncio.wait_for(servicer.shutdown(), timeout=30)
    except Exception:  # noqa: BLE001
        log.exception("engine shutdown failed")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Kimi-Linear LocalAI gRPC backend")
    ap.add_argument("--addr", default="localhost:50051", help="HOST:PORT to listen on")
    ap.add_argument("--model", default=os.environ.get("KIMI_MODEL", ""),
                    help="checkpoint directory to load at start-up (default: none, wait for LoadModel as LocalAI "
                         "does; `make run` passes the embedded models/kimi-linear-tiny)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("KIMI_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun: rank 0 serves gRPC; the other ranks follow it through every LoadModel
        from backend.model import parallel

        group = parallel.init_from_env()
        if group.rank != 0:
            parallel.follow(group, init_group=False)
            return
    asyncio.run(serve(args.addr, args.model or None))
    if group is not None:
        parallel.release(group)


if __name__ == "__main__":
    main()
