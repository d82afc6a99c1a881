"""Kimi tool calls the way LocalAI uses them: the server's reply pipeline (backend/server.py _Pipeline, which runs
backend/toolcalls.py's ToolCallStreamParser) fed a token stream of Kimi tool-call markup; Tools and a tool-result
turn (role "tool" + tool_call_id, assistant tool_calls as LocalAI's JSON) rendered into the prompt; streamed and
unary replies carrying the calls only in chat_deltas."""

import json

import pytest

from backend.server import _merge_tool_deltas, _Pipeline, _tool_deltas
from backend.toolcalls import ToolCallStreamParser, parse_tool_calls
from server_harness import FakeEngine, pb

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
CALL_TEXT = ("I will look it up.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
             '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
TEXTS = [
    "No tools needed, just text.",
    CALL_TEXT,
    CALL_TEXT + " Anything else?",
    'Partial:<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1',
]


def run_pipeline(tok, ids, stops=()):
    pipe = _Pipeline(tok, list(stops), True)
    content, deltas = [], []
    for t in ids:
        c, d = pipe.push(t)
        content.append(c)
        deltas += d
        if pipe.stopped:
            break
    c, d = pipe.finish()
    return "".join(content) + c, deltas


def test_markup_is_single_special_tokens(tok):
    # the server's pipeline runs the parser tests/test_toolcalls.py checks at every split point
    assert isinstance(_Pipeline(tok, [], True).tools, ToolCallStreamParser)
    assert _Pipeline(tok, [], False).tools is None     # tool_parser:none
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>"):
        (tid,) = tok.encode(marker)
        assert tok.decode([tid]) == marker


@pytest.mark.parametrize("text", TEXTS)
def test_pipeline_token_stream_equals_whole_text_parse(tok, text):
    """Token by token through the server's pipeline == parse_tool_calls on the whole text."""
    want_content, want_calls = parse_tool_calls(text)
    content, deltas = run_pipeline(tok, tok.encode(text) + [tok.eos_token_ids[0]])
    assert content == want_content and "<|" not in content
    merged = _merge_tool_deltas(deltas)
    assert [(c["index"], c["id"], c["name"], c["arguments"]) for c in merged] == \
        [(c["index"], c["id"], c["name"], c["arguments"]) for c in want_calls]
    # each call announces id + name exactly once (LocalAI concatenates repeated fields)
    assert sum(1 for d in deltas if d["name"]) == len(want_calls)
    proto = _tool_deltas(merged)
    assert all(isinstance(p, pb.ToolCallDelta) for p in proto)
    if want_calls and not text.startswith("Partial"):   # an unterminated call keeps its partial arguments
        assert json.loads(proto[0].arguments) == json.loads(want_calls[0]["arguments"])


def test_pipeline_stop_string_before_tools(tok):
    content, deltas = run_pipeline(tok, tok.encode(CALL_TEXT), stops=["look"])
    assert content == "I will " and deltas == []


def localai_tool_turn():
    """A second turn as LocalAI sends it: assistant tool_calls JSON (arguments a JSON string) + a tool result."""
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    return [pb.Message(role="user", content="Weather in Paris?"),
            pb.Message(role="assistant", content="", tool_calls=json.dumps(calls)),
            pb.Message(role="tool", content="22 C and sunny", tool_call_id="functions.get_weather:0",
                       name="get_weather")]


def test_tools_and_tool_results_reach_the_template(aio, tok):
    eng = FakeEngine(lambda prompt, params: tok.encode("It is 22 C and sunny in Paris.") + [tok.eos_token_ids[0]])
    aio.install(eng, tok)
    req = pb.PredictOptions(UseTokenizerTemplate=True, Messages=localai_tool_turn(), Tools=json.dumps([WEATHER]),
                            ToolChoice='"auto"')
    r = aio.stub.Predict(req)
    assert r.message.decode() == "It is 22 C and sunny in Paris." and not r.chat_deltas[0].tool_calls
    prompt = tok.decode(eng.requests[-1][1])
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"description\":")
    assert ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>') in prompt
    assert "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n22 C and sunny<|im_end|>" \
        in prompt
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    # TokenizeString renders the same prompt
    assert list(aio.stub.TokenizeString(req).tokens) == eng.requests[-1][1]


@pytest.mark.parametrize("chunk", [1, 4])
def test_streamed_and_unary_replies_carry_calls_in_chat_deltas(aio, tok, chunk):
    aio.install(FakeEngine(lambda p, s: tok.encode(CALL_TEXT) + [tok.eos_token_ids[0]], chunk=chunk), tok)
    req = pb.PredictOptions(UseTokenizerTemplate=True, Tools=json.dumps([WEATHER]),
                            Messages=[pb.Message(role="user", content="Paris and Rome?")])
    chunks = list(aio.stub.PredictStream(req, timeout=30))
    assert b"".join(c.message for c in chunks).decode() == "I will look it up."
    calls = {}
    for c in chunks:
        for d in c.chat_deltas:
            assert "<|" not in d.content
            for t in d.tool_calls:
                assert c.message == b""   # a tool-call delta never comes with content bytes
                e = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
                e["id"] += t.id
                e["name"] += t.name
                e["arguments"] += t.arguments
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"id": "functions.get_weather:1", "name": "get_weather", "arguments": '{"city": "Rome"}'}}
    last = chunks[-1]
    assert not last.chat_deltas and last.tokens == len(tok.encode(CALL_TEXT)) + 1 and last.prompt_tokens > 0
    r = aio.stub.Predict(req)
    assert r.message.decode() == "I will look it up."
    assert [(t.index, t.id, t.name, t.arguments) for t in r.chat_deltas[0].tool_calls] == [
        (i, c["id"], c["name"], c["arguments"]) for i, c in sorted(calls.items())]


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"], "additionalProperties": False}}}


def _accepts(grammar, tok, text):
    m = grammar.matcher()
    return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()


def test_tool_choice_grammar(tok):
    """ToolChoice "required" / a named function -> a grammar of Kimi's tool-call section whose calls are declared
    functions with schema-valid arguments; nothing forced for auto / none / no tools / a raw prompt."""
    from backend.engine.structured import Grammars
    from backend.predict import BadRequest, tool_choice_grammar

    msgs = [pb.Message(role="user", content="time?")]
    req = lambda choice, tools=(WEATHER, TIME), **kw: pb.PredictOptions(  # noqa: E731
        UseTokenizerTemplate=True, Messages=msgs, Tools=json.dumps(list(tools)), ToolChoice=choice, **kw)
    for choice in ("", '"auto"', '"none"', "auto", "none"):
        assert tool_choice_grammar(req(choice), tok) is None
    assert tool_choice_grammar(req('"required"', tools=()), tok) is None
    assert tool_choice_grammar(pb.PredictOptions(Prompt="x", Tools=json.dumps([WEATHER]), ToolChoice='"required"'),
                               tok) is None
    grammars = Grammars.from_tokenizer(tok, tok.vocab_size)
    any_call = grammars.compile(tool_choice_grammar(req('"required"'), tok))
    named = grammars.compile(tool_choice_grammar(req('{"type": "function", "function": {"name": "get_time"}}'), tok))
    sec = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
    call = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
    weather, cet = call.format("get_weather", 0, '{"city": "Paris"}'), call.format("get_time", 1, '{"tz": "CET"}')
    assert _accepts(any_call, tok, sec.format(weather)) and _accepts(any_call, tok, sec.format(weather + cet))
    assert _accepts(named, tok, sec.format(cet))
    assert not _accepts(named, tok, sec.format(weather))                          # another function
    assert not _accepts(named, tok, sec.format(cet + cet))                        # one call only
    assert not _accepts(named, tok, sec.format(call.format("get_time", 0, '{"tz": "PST"}')))  # not in the enum
    assert not _accepts(any_call, tok, "Let me check." + sec.format(weather))     # no text before the calls
    assert not _accepts(any_call, tok, sec.format(call.format("get_weather", 0, '{"town": "Paris"}')))  # required
    flat = grammars.compile(tool_choice_grammar(req('{"type": "function", "name": "get_time"}'), tok))  # responses
    assert _accepts(flat, tok, sec.format(cet)) and not _accepts(flat, tok, sec.format(weather))
    for unknown in ('{"type": "function"}', '"sometimes"', '{"type": "allowed_tools"}'):  # not enforced
        assert tool_choice_grammar(req(unknown), tok) is None
    with pytest.raises(BadRequest, match="not in Tools"):
        tool_choice_grammar(req('{"type": "function", "function": {"name": "nope"}}'), tok)


def test_tool_choice_reaches_the_engine_as_a_grammar(aio, tok):
    eng = FakeEngine(lambda prompt, params: tok.encode(CALL_TEXT) + [tok.eos_token_ids[0]])
    aio.install(eng, tok)
    base = dict(UseTokenizerTemplate=True, Tools=json.dumps([WEATHER]), Messages=[pb.Message(role="user", content="?")])
    aio.stub.Predict(pb.PredictOptions(ToolChoice='"required"', **base))
    assert eng.requests[-1][2].grammar is not None
    aio.stub.Predict(pb.PredictOptions(ToolChoice='"auto"', **base))
    assert eng.requests[-1][2].grammar is None
    import grpc
    with pytest.raises(grpc.RpcError) as ei:
        aio.stub.Predict(pb.PredictOptions(ToolChoice='{"type": "function", "function": {"name": "x"}}', **base))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not in Tools" in ei.value.details()
