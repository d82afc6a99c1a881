import json

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.toolcalls import ToolCallStreamParser, has_tool_calls, parse_tool_calls, split_call_id

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

TWO_CALLS = (
    "Let me check the weather. "
    f"{SB}{CB}functions.get_weather:0{AB}{{\"city\": \"北京\", \"unit\": \"c\"}}{CE}"
    f"{CB} functions.search.web:1 {AB} {{\"q\": \"a < b && c\"}} \n{CE}{SE}"
)


def stream(pieces):
    p = ToolCallStreamParser()
    content, deltas = [], []
    for piece in pieces:
        c, d = p.feed(piece)
        content.append(c)
        deltas += d
    c, d = p.finish()
    return "".join(content) + c, deltas + d, p.calls


def merge_deltas(deltas):
    """What LocalAI does with ToolCallDelta: keep last non-empty id/name, append arguments."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"index": d["index"], "id": "", "name": "", "arguments": ""})
        c["id"] = d["id"] or c["id"]
        c["name"] = d["name"] or c["name"]
        c["arguments"] += d["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_parse_two_calls():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check the weather. "
    assert calls == [
        {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "北京", "unit": "c"}',
         "index": 0},
        {"id": "functions.search.web:1", "name": "search.web", "arguments": '{"q": "a < b && c"}', "index": 1},
    ]
    assert json.loads(calls[0]["arguments"]) == {"city": "北京", "unit": "c"}


def test_no_calls_is_all_content():
    text = "plain answer with <b>tags</b> and <|im_middle|> text"
    assert parse_tool_calls(text) == (text, [])
    assert not has_tool_calls(text)
    assert stream([text])[:2] == (text, [])


def test_split_call_id():
    assert split_call_id(" functions.get_weather:12 ") == ("functions.get_weather:12", "get_weather")
    assert split_call_id("lookup") == ("lookup", "lookup")
    assert split_call_id("functions.a:b") == ("functions.a:b", "a:b")


def test_content_after_section_and_singular_marker():
    text = f"A{SB}{CB}functions.f:0{AB}{{}}{CE}{SE}B<|tool_call_section_begin|>{CB}functions.g:1{AB}[1]{CE}"
    content, calls = parse_tool_calls(text)
    assert content == "AB"
    assert [(c["name"], c["arguments"], c["index"]) for c in calls] == [("f", "{}", 0), ("g", "[1]", 1)]


def test_stream_every_split_position():
    want_content, want_calls = parse_tool_calls(TWO_CALLS)
    for i in range(len(TWO_CALLS) + 1):
        content, deltas, calls = stream([TWO_CALLS[:i], TWO_CALLS[i:]])
        assert content == want_content, i
        assert calls == want_calls, i
        assert merge_deltas(deltas) == want_calls, i


def test_stream_one_char_at_a_time_keeps_markup_out_of_content():
    p = ToolCallStreamParser()
    out = []
    for ch in TWO_CALLS:
        c, _ = p.feed(ch)
        out.append(c)
        assert "<|tool" not in "".join(out)
    assert "".join(out) + p.finish()[0] == "Let me check the weather. "


def test_stream_first_delta_carries_id_and_name():
    _, deltas, _ = stream([TWO_CALLS])
    firsts = [d for d in deltas if d["id"]]
    assert [(d["index"], d["name"], d["arguments"]) for d in firsts] == [(0, "get_weather", ""), (1, "search.web", "")]


def test_unterminated_call_at_end_of_stream():
    text = f"x{SB}{CB}functions.f:0{AB} {{\"a\": 1"
    content, calls = parse_tool_calls(text)
    assert content == "x" and calls[0]["arguments"] == '{"a": 1'
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]])[::2] == (content, calls)


def test_partial_marker_prefix_that_is_not_a_marker_is_released():
    text = "a <|tool_ca and <|tool_calls_section_beg"
    assert stream([text[:5], text[5:]])[:2] == (text, [])


FRAGMENTS = [SB, SE, CB, AB, CE, "functions.f:0", "functions.g_h:1", '{"k": "v"}', " ", "\n", "text", "<", "|", "<|",
             "北京", "{}", "<|tool_call"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.lists(st.integers(0, 200), max_size=4))
def test_stream_equals_whole_parse_on_random_markup(parts, cuts):
    text = "".join(parts)
    want = parse_tool_calls(text)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    content, deltas, calls = stream(pieces)
    assert (content, calls) == want
    assert merge_deltas(deltas) == [dict(c) for c in want[1]]
