"""Request fuzzing against one real `run.sh` server (tiny checkpoint): random PredictOptions (and LoadModel
EngineArgs) must get a result or INVALID_ARGUMENT, never a crash, a hang (deadline per call) or INTERNAL.

KIMI_FUZZ_EXAMPLES=500 runs more examples; KIMI_FUZZ_RANDOM=1 draws new examples each run (CI is derandomized)."""

import json
import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_harness import BackendProcess, pb, raw_field

CONTEXT = 96
CALL_TIMEOUT = 60  # seconds per call: a hang fails the test
EXAMPLES = int(os.environ.get("KIMI_FUZZ_EXAMPLES", "60"))
SETTINGS = dict(deadline=None, database=None, derandomize=not os.environ.get("KIMI_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
OK = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


def load_opts(ckpt, **kw):
    o = dict(Model="tiny-kimi", ModelPath=str(ckpt), ContextSize=CONTEXT, Options=["max_num_seqs:4", "dtype:float32"])
    o.update(kw)
    return pb.ModelOptions(**o)


@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory):
    p = BackendProcess(str(tmp_path_factory.mktemp("log") / "backend.log"))
    r = p.stub.LoadModel(load_opts(ckpt), timeout=300)
    assert r.success, r.message
    yield p
    p.close()


def alive(srv):
    assert srv.proc.poll() is None, srv.read_log()
    assert srv.stub.Health(pb.HealthMessage(), timeout=10).message == b"OK"


# ------------------------------------------------------------------------------------------------ strategies

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling_float = st.one_of(f32, st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e30, -1e30, math.nan, math.inf,
                                                 -math.inf, 1e-45]))
i32 = st.one_of(st.integers(-2 ** 31, 2 ** 31 - 1), st.sampled_from([0, 1, -1, 5, 20, 21, 2 ** 31 - 1, -2 ** 31]))
specials = ["<|im_end|>", "<|im_user|>", "[EOS]", "[BOS]", "<|tool_calls_section_begin|>", "<|reserved_token_9|>"]
text = st.one_of(st.text(max_size=60), st.sampled_from(specials + ["", " ", "\n\n", "\ufffd", "é", "🎉", "\x00"]))
prompt = st.one_of(
    text,
    st.builds(lambda w, n: w * n, st.sampled_from(["word ", "🎉", "a", " ", "人工"]), st.integers(0, 3000)),
    st.lists(st.sampled_from(specials + ["hi ", "é", "\ud7ff"]), max_size=20).map("".join),
)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                          lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                          max_leaves=10)
json_text = st.one_of(st.text(max_size=40), json_value.map(lambda v: json.dumps(v)),
                      st.sampled_from(["{", "[", "null", "{}", "[]", '{"a":', "NaN", '"none"', '"auto"']))
VALID_TOOLS = json.dumps([{"type": "function", "function": {
    "name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}])
tools = st.one_of(json_text, st.just(VALID_TOOLS))
logit_bias = st.one_of(json_text, st.dictionaries(
    st.one_of(st.integers(-10, 10 ** 7).map(str), st.text(max_size=5)),
    st.one_of(st.floats(), st.integers(-10 ** 20, 10 ** 20), st.text(max_size=3), st.none(), st.booleans()),
    max_size=4).map(lambda d: json.dumps(d)))
role = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "", "developer", "function"]),
                 st.text(max_size=12))
message = st.builds(lambda r, c, tc, name, tid, rc: pb.Message(role=r, content=c, tool_calls=tc, name=name,
                                                               tool_call_id=tid, reasoning_content=rc),
                    role, text, st.one_of(st.just(""), st.just(""), st.just(""), json_text, st.just(json.dumps(
                        [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]))),
                    st.one_of(st.just(""), text),
                    st.one_of(st.just(""), text), st.one_of(st.just(""), text))
metadata = st.dictionaries(st.sampled_from(["enable_thinking", "thinking", "chat_template_kwargs", "reasoning_effort",
                                            "other"]), json_text, max_size=3)


GRAMMARS = ['root ::= "yes" | "no"', 'root ::= [a-z]+ "."', 'start: /[0-9]{1,4}/', '{"type": "object"}', "root ::= ",
            'root ::= "\\x00" | "x"', '{"enum": ["a", 1, null]}', 'root ::= ( "a" ']


@st.composite
def predict_options(draw):
    kw = dict(
        Prompt=draw(prompt), Tokens=draw(i32), Temperature=draw(sampling_float), TopP=draw(sampling_float),
        TopK=draw(i32), MinP=draw(sampling_float), Penalty=draw(sampling_float),
        PresencePenalty=draw(sampling_float), FrequencyPenalty=draw(sampling_float), Seed=draw(i32),
        IgnoreEOS=draw(st.booleans()), StopPrompts=draw(st.lists(text, max_size=4)),
        LogitBias=draw(st.one_of(st.just(""), logit_bias)), Logprobs=draw(i32), TopLogprobs=draw(i32),
        UseTokenizerTemplate=draw(st.booleans()), Messages=draw(st.lists(message, max_size=4)),
        Tools=draw(st.one_of(st.just(""), st.just(""), tools)), ToolChoice=draw(st.one_of(st.just(""), json_text)),
        Metadata=draw(metadata), Grammar=draw(st.one_of(st.just(""), st.just(""), st.text(max_size=10),
                                                        st.sampled_from(GRAMMARS))),
    )
    if draw(st.booleans()):  # half the requests have sane sampling values, so that they reach the engine
        kw.update(Temperature=draw(st.floats(0, 2)), TopP=draw(st.floats(0, 1)), MinP=draw(st.floats(0, 1)),
                  Penalty=draw(st.floats(0, 3)), PresencePenalty=draw(st.floats(-2, 2)),
                  FrequencyPenalty=draw(st.floats(-2, 2)), TopK=draw(st.integers(-1, 100)),
                  Logprobs=draw(st.integers(0, 3)), TopLogprobs=draw(st.integers(0, 20)),
                  LogitBias=draw(st.one_of(st.just(""), st.dictionaries(st.integers(0, 300).map(str),
                                                                        st.floats(-200, 200), max_size=3)
                                           .map(json.dumps))),
                  Tools=draw(st.sampled_from(["", "[]", VALID_TOOLS])))
        if draw(st.booleans()):
            kw["Messages"] = [pb.Message(role=m.role, content=m.content) for m in kw["Messages"]]
    # the server must cope with these, but keep most requests short so that many examples fit in CI time
    if draw(st.integers(0, 3)):
        kw["Tokens"] = draw(st.integers(-3, 8))
    return pb.PredictOptions(**kw)


def call(srv, req, stream):
    """-> (status code, details, replies)"""
    try:
        if stream:
            replies = list(srv.stub.PredictStream(req, timeout=CALL_TIMEOUT))
        else:
            replies = [srv.stub.Predict(req, timeout=CALL_TIMEOUT)]
        return grpc.StatusCode.OK, "", replies
    except grpc.RpcError as e:
        return e.code(), e.details(), []


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(req=predict_options(), stream=st.booleans())
def test_fuzz_predict(srv, req, stream):
    code, details, replies = call(srv, req, stream)
    event(code.name if code != grpc.StatusCode.INVALID_ARGUMENT else "INVALID_ARGUMENT: " + details[:20])
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"hang: {req}"
    assert code in OK, f"{code}: {details}\nrequest: {req}\nlog: {srv.read_log()[-2000:]}"
    if code == grpc.StatusCode.OK:
        last = replies[-1]
        assert last.tokens <= CONTEXT and last.prompt_tokens < CONTEXT
        if req.Tokens > 0:
            assert last.tokens <= req.Tokens
        if last.logprobs:
            json.loads(last.logprobs)
    else:
        assert details, "INVALID_ARGUMENT without a message"


@settings(max_examples=max(EXAMPLES // 3, 10), **SETTINGS)
@given(req=predict_options())
def test_fuzz_tokenize(srv, req):
    try:
        srv.stub.TokenizeString(req, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{e.code()}: {e.details()}\n{req}"


@settings(max_examples=max(EXAMPLES // 4, 10), **SETTINGS)
@given(tokens=st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=50))
def test_fuzz_detokenize(srv, tokens):
    try:
        srv.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens), timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{e.code()}: {e.details()}"


@pytest.mark.parametrize("field, payload", [
    (13, b"\xff\xfe"),           # StopPrompts: not UTF-8
    (13, b"ab\xe2\x82"),         # StopPrompts: a truncated 3-byte character
    (1, b"hello \xc3("),          # Prompt: invalid continuation byte
    (23, b'{"1": \xff}'),        # LogitBias
])
def test_invalid_utf8_strings(srv, field, payload):
    """Clients that bypass protobuf's UTF-8 check: INVALID_ARGUMENT before the request is built; the server lives."""
    raw = pb.PredictOptions(Prompt="hi", Tokens=2).SerializeToString() + raw_field(field, payload)
    for method in ("Predict", "PredictStream"):
        path = f"/backend.Backend/{method}"
        if method == "Predict":
            fn = srv.channel.unary_unary(path, request_serializer=lambda b: b,
                                         response_deserializer=pb.Reply.FromString)
            try:
                fn(raw, timeout=CALL_TIMEOUT)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
        else:
            fn = srv.channel.unary_stream(path, request_serializer=lambda b: b,
                                          response_deserializer=pb.Reply.FromString)
            try:
                list(fn(raw, timeout=CALL_TIMEOUT))
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
        # our request deserializer (backend/server.py add_servicer) turns protobuf's DecodeError into
        # INVALID_ARGUMENT naming the field, where grpc's own would answer UNKNOWN
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code
        assert "is not valid UTF-8" in details, details
        alive(srv)
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=2), timeout=CALL_TIMEOUT).tokens >= 1


engine_value = st.one_of(st.integers(-5, 10), st.sampled_from([0, 1, 2, 2 ** 31, 2 ** 62, -2 ** 62, 10 ** 30]),
                         st.floats(), st.text(max_size=6), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))
engine_args = st.one_of(
    json_text,
    st.dictionaries(st.sampled_from(["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                     "num_blocks", "num_slots", "gpu_memory_utilization", "enforce_eager", "dtype",
                                     "device", "seed", "tool_parser", "default_max_tokens", "max_graph_batch_size",
                                     "max-num-seqs", "bogus_key", "random_weights"]),
                    engine_value, min_size=1, max_size=3).map(json.dumps))


@settings(max_examples=max(EXAMPLES // 3, 10), **SETTINGS)
@given(args=engine_args, options=st.lists(st.one_of(st.text(max_size=20), st.sampled_from(
    ["max_num_seqs:0", "block_size:-1", "num_blocks:99999999999", "dtype:int8", "device:tpu", "seed:abc",
     "max_model_len:1e400", "gpu_memory_utilization:nan"])), max_size=3))
def test_fuzz_load_model(srv, ckpt, args, options):
    """Malformed or absurd EngineArgs/Options: LoadModel answers a Result (success or a message), never crashes the
    server or grabs absurd memory; the good model loads again afterwards."""
    r = srv.stub.LoadModel(load_opts(ckpt, EngineArgs=args, Options=["dtype:float32"] + options), timeout=300)
    event("loaded" if r.success else "refused: " + r.message.split(":")[0][:40])
    assert r.success or r.message, r
    alive(srv)


def test_good_model_after_fuzz(srv, ckpt):
    r = srv.stub.LoadModel(load_opts(ckpt), timeout=300)
    assert r.success, r.message
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hello", Tokens=3), timeout=CALL_TIMEOUT).tokens >= 1
    assert srv.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.READY
