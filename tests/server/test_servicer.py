"""BackendServicer over a real grpc.aio loopback server with a scripted fake engine: the server's own logic
(prompt building, detokenization, stop strings, tool-call deltas, counts, errors, cancellation, concurrency)."""

import json
import math
import threading
import time

import grpc
import pytest

from server_harness import FakeEngine, pb

RESPONSE = "Hello world. The quick brown fox jumps over the lazy dog."


def script_text(tok, text, eos=True):
    ids = tok.encode(text)
    return (lambda prompt, params: ids + ([tok.eos_token_ids[0]] if eos else []))


def stream_all(stub, req, timeout=30):
    return list(stub.PredictStream(req, timeout=timeout))


def code_of(fn):
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details()


def test_health_status_before_load(aio):
    assert aio.stub.Health(pb.HealthMessage()).message == b"OK"
    st = aio.stub.Status(pb.HealthMessage())
    assert st.state == pb.StatusResponse.UNINITIALIZED
    assert st.memory.total > 0 and "rss" in st.memory.breakdown


@pytest.mark.parametrize("rpc", ["Predict", "TokenizeString"])
def test_before_load_is_failed_precondition(aio, rpc):
    code, details = code_of(lambda: getattr(aio.stub, rpc)(pb.PredictOptions(Prompt="hi")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "LoadModel" in details
    code, _ = code_of(lambda: stream_all(aio.stub, pb.PredictOptions(Prompt="hi")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_unimplemented_rpcs_have_a_message(aio):
    code, details = code_of(lambda: aio.stub.Embedding(pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "Embedding" in details
    code, details = code_of(lambda: list(aio.stub.TTSStream(pb.TTSRequest(text="x"))))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "TTSStream" in details
    code, _ = code_of(lambda: aio.stub.GenerateImage(pb.GenerateImageRequest()))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_predict_and_stream_agree(aio, tok):
    eng = FakeEngine(script_text(tok, RESPONSE))
    aio.install(eng, tok)
    req = pb.PredictOptions(Prompt="Say hello", Temperature=0, Tokens=0)
    r = aio.stub.Predict(req)
    assert r.message.decode() == RESPONSE
    assert r.tokens == len(tok.encode(RESPONSE)) + 1  # + EOS
    assert r.prompt_tokens == len(tok.encode("Say hello"))
    assert r.timing_prompt_processing == pytest.approx(10.0)
    assert r.timing_token_generation >= 0
    assert r.chat_deltas[0].content == RESPONSE and not r.chat_deltas[0].tool_calls
    chunks = stream_all(aio.stub, req)
    pieces = chunks[:-1]
    assert all(c.message for c in pieces)
    assert all(c.chat_deltas[0].content == c.message.decode() for c in pieces)
    assert b"".join(c.message for c in chunks).decode() == RESPONSE
    assert len(pieces) > 3  # one Reply per detokenized piece
    final = chunks[-1]
    assert final.tokens == r.tokens and final.prompt_tokens == r.prompt_tokens
    assert final.timing_prompt_processing > 0 and final.message == b""
    # the prompt reached the engine as the tokenizer's ids, with greedy params
    rid, prompt, params = eng.requests[0]
    assert prompt == tok.encode("Say hello") and params.temperature == 0.0
    assert params.stop_token_ids == tuple(tok.eos_token_ids)


def test_utf8_split_across_tokens_is_never_cut(aio, tok):
    text = "人工智能🎉 fine"
    aio.install(FakeEngine(script_text(tok, text)), tok)
    chunks = stream_all(aio.stub, pb.PredictOptions(Prompt="x"))
    for c in chunks:
        c.message.decode("utf-8")  # each piece is whole UTF-8
    assert b"".join(c.message for c in chunks).decode() == text


@pytest.mark.parametrize("stop", ["quick brown", "o w", ". T", "dog."])
def test_stop_strings_cut_and_abort(aio, tok, stop):
    eng = FakeEngine(script_text(tok, RESPONSE), chunk=1)
    aio.install(eng, tok)
    r = aio.stub.Predict(pb.PredictOptions(Prompt="x", StopPrompts=["never-there", stop]))
    assert r.message.decode() == RESPONSE[:RESPONSE.index(stop)]
    chunks = stream_all(aio.stub, pb.PredictOptions(Prompt="x", StopPrompts=[stop]))
    assert b"".join(c.message for c in chunks).decode() == RESPONSE[:RESPONSE.index(stop)]
    assert chunks[-1].tokens < len(tok.encode(RESPONSE)) + 1 or stop == "dog."
    # generation stopped early -> the engine request was aborted (state freed)
    if stop != "dog.":
        assert {rid for rid, _, _ in eng.requests} <= eng.aborted


def test_tokens_limit_and_ignore_eos(aio, tok):
    eng = FakeEngine(script_text(tok, RESPONSE))
    aio.install(eng, tok, max_model_len=64)
    r = aio.stub.Predict(pb.PredictOptions(Prompt="x", Tokens=3))
    assert r.tokens == 3 and r.message.decode() == tok.decode(tok.encode(RESPONSE)[:3])
    # max_tokens beyond the context (LocalAI configs often set max_tokens == context_size) is capped
    prompt = tok.encode("Say something")
    aio.stub.Predict(pb.PredictOptions(Prompt="Say something", Tokens=4096))
    assert eng.requests[-1][2].max_tokens == 64 - len(prompt)
    aio.stub.Predict(pb.PredictOptions(Prompt="x", IgnoreEOS=True))
    assert eng.requests[-1][2].ignore_eos and eng.requests[-1][2].stop_token_ids == ()


TOOL_TEXT = ("Let me check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             "<|tool_call_argument_begin|>{\"city\": \"Paris\", \"unit\": \"c\"}<|tool_call_end|>"
             "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"CET\"}<|tool_call_end|>"
             "<|tool_calls_section_end|>")


def test_tool_call_deltas_stream_and_predict(aio, tok):
    aio.install(FakeEngine(script_text(tok, TOOL_TEXT)), tok)
    tools = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
    req = pb.PredictOptions(UseTokenizerTemplate=True, Tools=tools,
                            Messages=[pb.Message(role="user", content="weather in Paris?")])
    chunks = stream_all(aio.stub, req)
    text = b"".join(c.message for c in chunks).decode()
    assert "<|tool" not in text and text.strip() == "Let me check."
    calls = {}
    for c in chunks:
        for d in c.chat_deltas:
            for t in d.tool_calls:
                e = calls.setdefault(t.index, {"name": "", "id": "", "args": ""})
                e["name"] = t.name or e["name"]
                e["id"] = t.id or e["id"]
                e["args"] += t.arguments
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["args"]) == {"city": "Paris", "unit": "c"}
    assert calls[1]["name"] == "get_time" and json.loads(calls[1]["args"]) == {"tz": "CET"}
    assert calls[0]["id"] == "functions.get_weather:0"
    r = aio.stub.Predict(req)
    assert r.message.decode().strip() == "Let me check."
    full = r.chat_deltas[0].tool_calls
    assert [t.name for t in full] == ["get_weather", "get_time"]
    assert json.loads(full[0].arguments) == {"city": "Paris", "unit": "c"}


def test_tool_parser_none_passes_markup_through(aio, tok):
    aio.install(FakeEngine(script_text(tok, TOOL_TEXT)), tok, tool_parser="none")
    r = aio.stub.Predict(pb.PredictOptions(Prompt="x"))
    assert r.message.decode() == TOOL_TEXT and not r.chat_deltas[0].tool_calls


def test_chat_template_prompt_and_tokenize(aio, tok):
    eng = FakeEngine(script_text(tok, "ok"))
    aio.install(eng, tok)
    msgs = [pb.Message(role="system", content="You are Kimi."), pb.Message(role="user", content="hi there")]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    req = pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs, Tools=json.dumps(tools),
                            Metadata={"enable_thinking": "false"})
    expected = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "hi there"}], tools=tools,
        add_generation_prompt=True))
    aio.stub.Predict(req)
    assert eng.requests[-1][1] == expected
    t = aio.stub.TokenizeString(req)
    assert list(t.tokens) == expected and t.length == len(expected)
    t = aio.stub.TokenizeString(pb.PredictOptions(Prompt="Hello world, 你好"))
    assert list(t.tokens) == tok.encode("Hello world, 你好")
    # ToolChoice "none" drops the tools from the prompt
    aio.stub.Predict(pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs, Tools=json.dumps(tools),
                                       ToolChoice='"none"'))
    assert eng.requests[-1][1] == tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "hi there"}],
        add_generation_prompt=True))
    d = aio.stub.Detokenize(pb.DetokenizeRequest(tokens=tok.encode("round trip")))
    assert d.content == "round trip"


def test_logprobs_openai_shape(aio, tok):
    aio.install(FakeEngine(script_text(tok, "Hello world")), tok)
    for call in (lambda r: aio.stub.Predict(r), lambda r: stream_all(aio.stub, r)[-1]):
        r = call(pb.PredictOptions(Prompt="x", Logprobs=2, TopLogprobs=2))
        lp = json.loads(r.logprobs)
        ids = tok.encode("Hello world") + [tok.eos_token_ids[0]]
        assert [e["id"] for e in lp["content"]] == ids
        e = lp["content"][0]
        assert e["token"] == tok.decode([ids[0]]) and bytes(e["bytes"]) == tok.id_to_bytes(ids[0])
        assert e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2
        assert set(e["top_logprobs"][0]) == {"id", "token", "bytes", "logprob"}
    r = aio.stub.Predict(pb.PredictOptions(Prompt="x"))
    assert r.logprobs == b""


DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJ = {}
for _ in range(900):
    DEEP_OBJ = {"a": DEEP_OBJ}
BAD = [
    (dict(Temperature=math.nan), "Temperature"),
    (dict(Temperature=-0.5), "Temperature"),
    (dict(TopP=1.5), "TopP"),
    (dict(MinP=-0.1), "MinP"),
    (dict(Penalty=-1.0), "Penalty"),
    (dict(PresencePenalty=math.inf), "PresencePenalty"),
    (dict(LogitBias="{not json"), "LogitBias"),
    (dict(LogitBias='{"abc": 1}'), "LogitBias"),
    (dict(LogitBias='{"999999999": 1}'), "logit_bias"),
    (dict(Tools="[{bad"), "Tools"),
    (dict(TopLogprobs=50), "TopLogprobs"),
    (dict(Grammar='root ::= ( "a" '), "grammar"),
    (dict(Grammar='{"type": 3}'), "grammar"),
    (dict(Prompt=""), "empty prompt"),
    (dict(Prompt="word " * 400), "context"),
    (dict(UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content="x")],
          Metadata={"chat_template_kwargs": "{nope"}), "chat_template_kwargs"),
    # nested deeper than the JSON parser recurses (RecursionError): named as bad input, never UNKNOWN
    (dict(Tools=DEEP), "Tools"),
    (dict(LogitBias=DEEP), "LogitBias"),
    (dict(UseTokenizerTemplate=True, Messages=[pb.Message(role="assistant", content="x", tool_calls=DEEP)]),
     "tool_calls"),
    (dict(UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content="x")],
          Metadata={"chat_template_kwargs": DEEP}), "chat_template_kwargs"),
    # parseable, but deeper than the template's tojson can render
    (dict(UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content="x")], Tools=json.dumps(
        [{"type": "function", "function": {"name": "f", "parameters": DEEP_OBJ}}])), "nested too deeply"),
]


@pytest.mark.parametrize("fields,needle", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_are_invalid_argument_and_server_survives(aio, tok, fields, needle):
    aio.install(FakeEngine(script_text(tok, "fine")), tok, max_model_len=256)
    kw = {"Prompt": "hello"}
    kw.update(fields)
    req = pb.PredictOptions(**kw)
    for fn in (lambda: aio.stub.Predict(req), lambda: stream_all(aio.stub, req)):
        code, details = code_of(fn)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert needle.lower() in details.lower()
    assert aio.stub.Health(pb.HealthMessage()).message == b"OK"
    assert aio.stub.Predict(pb.PredictOptions(Prompt="hello")).message == b"fine"


def test_engine_failures_are_internal(aio, tok):
    eng = FakeEngine(script_text(tok, RESPONSE))
    aio.install(eng, tok)
    eng.fail_after = 2
    code, details = code_of(lambda: aio.stub.Predict(pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.INTERNAL and "boom" in details
    code, _ = code_of(lambda: stream_all(aio.stub, pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.INTERNAL
    eng.fail_after = None
    eng.raise_on_add = RuntimeError("engine thread died")
    code, details = code_of(lambda: aio.stub.Predict(pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.INTERNAL and "engine thread died" in details
    eng.raise_on_add = ValueError("prompt too long for the pool")
    code, _ = code_of(lambda: aio.stub.Predict(pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    eng.raise_on_add = None
    assert aio.stub.Health(pb.HealthMessage()).message == b"OK"
    assert aio.stub.Predict(pb.PredictOptions(Prompt="x")).message.decode() == RESPONSE


def test_model_identity_mismatch(aio, tok):
    aio.install(FakeEngine(script_text(tok, "ok")), tok, model_name="kimi-linear")
    code, details = code_of(lambda: aio.stub.Predict(pb.PredictOptions(Prompt="x", ModelIdentity="other")))
    assert code == grpc.StatusCode.NOT_FOUND and "model identity mismatch" in details
    assert aio.stub.Predict(pb.PredictOptions(Prompt="x", ModelIdentity="kimi-linear")).message == b"ok"


def test_client_cancel_aborts_engine_request(aio, tok):
    eng = FakeEngine(script_text(tok, RESPONSE * 20), delay=0.02)
    aio.install(eng, tok)
    it = aio.stub.PredictStream(pb.PredictOptions(Prompt="x"))
    next(it)
    it.cancel()
    deadline = time.monotonic() + 5
    while "fake-0" not in eng.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "fake-0" in eng.aborted
    assert aio.servicer._active == 0
    # unary call with a deadline: the engine request is aborted too
    with pytest.raises(grpc.RpcError):
        aio.stub.Predict(pb.PredictOptions(Prompt="x"), timeout=0.2)
    deadline = time.monotonic() + 5
    while "fake-1" not in eng.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "fake-1" in eng.aborted


def test_status_busy_while_generating_and_free(aio, tok):
    eng = FakeEngine(script_text(tok, RESPONSE * 3), delay=0.01)
    aio.install(eng, tok)
    assert aio.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
    states = []
    it = aio.stub.PredictStream(pb.PredictOptions(Prompt="x"))
    next(it)
    states.append(aio.stub.Status(pb.HealthMessage()).state)
    t0 = time.monotonic()
    assert aio.stub.Health(pb.HealthMessage()).message == b"OK"
    assert time.monotonic() - t0 < 1.0
    list(it)
    assert states == [pb.StatusResponse.BUSY]
    assert aio.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
    m = aio.stub.GetMetrics(pb.MetricsRequest())
    assert m.tokens_generated > 0 and m.prompt_tokens_processed > 0
    assert "queue_depth" in json.loads(m.prompt_json_for_slot)
    r = aio.stub.Free(pb.HealthMessage())
    assert r.success and eng.shut
    assert aio.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.UNINITIALIZED
    code, _ = code_of(lambda: aio.stub.Predict(pb.PredictOptions(Prompt="x")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_concurrent_streams_all_complete(aio, tok):
    texts = [f"answer number {i}: " + "abc " * i for i in range(8)]
    by_prompt = {tuple(tok.encode(f"q{i}")): tok.encode(t) + [tok.eos_token_ids[0]] for i, t in enumerate(texts)}
    aio.install(FakeEngine(lambda prompt, params: by_prompt[tuple(prompt)], delay=0.005), tok)
    results = [None] * 8

    def run(i):
        chunks = stream_all(aio.stub, pb.PredictOptions(Prompt=f"q{i}"))
        results[i] = b"".join(c.message for c in chunks).decode()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == texts


def slow_load(aio, tok, seconds, engines):
    """servicer._load_sync -> a FakeEngine after `seconds` (a load the client's deadline cuts short)."""
    from backend.server import _Loaded

    def load(spec):
        time.sleep(seconds)
        eng = FakeEngine(script_text(tok, RESPONSE))
        engines.append(eng)
        return _Loaded(eng, tok, spec, 256, tok.vocab_size, "cpu", "float32")
    aio.servicer._load_sync = load
    aio.servicer._precheck = lambda spec: None


def wait_state(aio, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while aio.stub.Status(pb.HealthMessage()).state != state:
        assert time.monotonic() < deadline, aio.stub.Status(pb.HealthMessage()).state
        time.sleep(0.02)


def test_load_model_cancelled_by_client_still_finishes(aio, tok, tmp_path):
    """A LoadModel whose client goes away (deadline, disconnect) mid-load: the load runs to its end and installs
    the model (Status READY, requests served, the same LoadModel again keeps it), never Status BUSY for good with
    the loaded model left in memory. The same for a reload cut short while it drains the old model's requests."""
    engines = []
    slow_load(aio, tok, 0.5, engines)
    opts = pb.ModelOptions(Model=str(tmp_path))
    code, _ = code_of(lambda: aio.stub.LoadModel(opts, timeout=0.1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_state(aio, pb.StatusResponse.READY)
    assert len(engines) == 1 and aio.servicer._loaded.engine is engines[0]
    assert aio.stub.Predict(pb.PredictOptions(Prompt="x")).message.decode() == RESPONSE
    r = aio.stub.LoadModel(opts, timeout=10)
    assert r.success and "kept" in r.message and len(engines) == 1
    # a reload with other settings, cut short while a stream of the old model still runs (the drain)
    engines[0].delay = 0.05
    it = aio.stub.PredictStream(pb.PredictOptions(Prompt="x"), timeout=30)
    next(it)
    other = pb.ModelOptions(Model=str(tmp_path), ContextSize=128)
    code, _ = code_of(lambda: aio.stub.LoadModel(other, timeout=0.1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    list(it)
    wait_state(aio, pb.StatusResponse.READY)
    assert len(engines) == 2 and engines[0].shut and aio.servicer._loaded.engine is engines[1]
    assert aio.servicer._loaded.spec.engine.get("max_model_len") == 128


def test_free_cancelled_by_client_still_releases(aio, tok, tmp_path):
    """A Free whose client goes away mid-release keeps the load lock until the old model is released: a LoadModel
    right after it loads only then (on a GPU the new model's KV cache is sized from the memory left free)."""
    eng = FakeEngine(script_text(tok, RESPONSE))
    aio.install(eng, tok)
    release = aio.servicer._release
    aio.servicer._release = lambda loaded: (time.sleep(0.5), release(loaded))
    code, _ = code_of(lambda: aio.stub.Free(pb.HealthMessage(), timeout=0.1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert aio.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.UNINITIALIZED
    engines = []
    slow_load(aio, tok, 0.0, engines)
    assert aio.stub.LoadModel(pb.ModelOptions(Model=str(tmp_path)), timeout=10).success
    assert eng.shut and len(engines) == 1


def test_sampled_id_outside_the_tokenizer_has_no_text(aio, tok):
    """A checkpoint whose vocab_size pads the tokenizer's lets the model sample ids the tokenizer lacks: they count
    as tokens and add no text (the call does not fail), in Predict and PredictStream alike."""
    a, b = tok.encode("Hello"), tok.encode(" world")
    aio.install(FakeEngine(lambda prompt, params: a + [tok.vocab_size + 5] + b + [tok.eos_token_ids[0]]), tok)
    r = aio.stub.Predict(pb.PredictOptions(Prompt="x"))
    assert r.message.decode() == "Hello world" and r.tokens == len(a) + len(b) + 2   # + the EOS
    assert "".join(c.message.decode() for c in stream_all(aio.stub, pb.PredictOptions(Prompt="x"))) == "Hello world"


def test_score_refused_mid_group_aborts_the_candidates_added(aio, tok):
    """A Score whose second candidate the engine refuses: INVALID_ARGUMENT, and the first candidate's request, already
    in the engine, is aborted (not left running for nobody)."""
    from types import SimpleNamespace

    eng = FakeEngine(script_text(tok, "x"), delay=0.05)
    eng.cfg = SimpleNamespace(prefix_cache_slots=0)
    add = eng.add_request

    def add_then_refuse(*a, **kw):
        if eng.requests:
            raise ValueError("no room for the candidate")
        return add(*a, **kw)
    eng.add_request = add_then_refuse
    aio.install(eng, tok)
    code, details = code_of(lambda: aio.stub.Score(pb.ScoreRequest(prompt="Once upon a", candidates=[" time", " day"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no room" in details
    deadline = time.monotonic() + 10   # the handler's `finally` may run just after the client has its status
    while not eng.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(eng.requests) == 1 and eng.aborted == {eng.requests[0][0]}
