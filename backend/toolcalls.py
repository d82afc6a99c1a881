"""Kimi-K2 tool-call markup (used by Kimi-Linear), parsed whole or streamed.

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>   (repeated)
    <|tool_calls_section_end|>

A call is {"id": "functions.NAME:IDX", "name": NAME, "arguments": json string, "index": position}. The id is kept
as the model wrote it: the chat template renders it back (`<|tool_call_begin|>{id}`, `## Return of {id}`).
Content is all text outside the sections; anything inside a section but outside a call is dropped.
"""

import re

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

_SECTION_RE = re.compile(
    "(?:" + "|".join(map(re.escape, SECTION_BEGINS)) + ")(.*?)(?:" + "|".join(map(re.escape, SECTION_ENDS)) + r"|\Z)",
    re.DOTALL)
_CALL_RE = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARG_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END)
                      + r"|\Z)", re.DOTALL)


def split_call_id(raw_id):
    """'functions.get_weather:0' -> ('functions.get_weather:0', 'get_weather')."""
    call_id = raw_id.strip()
    name = call_id
    head, sep, tail = call_id.rpartition(":")
    if sep and tail.isdigit():
        name = head
    if name.startswith("functions."):
        name = name[len("functions."):]
    return call_id, name


def make_call(raw_id, arguments, index):
    call_id, name = split_call_id(raw_id)
    return {"id": call_id, "name": name, "arguments": arguments.strip(), "index": index}


def has_tool_calls(text):
    return any(m in text for m in SECTION_BEGINS)


def parse_tool_calls(text):
    """Whole-text parse: returns (content, calls). An unterminated final section/call is still parsed."""
    calls, content, pos = [], [], 0
    for section in _SECTION_RE.finditer(text):
        content.append(text[pos:section.start()])
        pos = section.end()
        for call in _CALL_RE.finditer(section.group(1)):
            calls.append(make_call(call.group(1), call.group(2), len(calls)))
    content.append(text[pos:])
    return "".join(content), calls


class ToolCallStreamParser:
    """feed(text) -> (content_delta, tool_call_deltas); finish() flushes what is held back.

    A delta is {"index", "id", "name", "arguments"}: the first delta of a call carries id and name with empty
    arguments, later ones carry argument text only (id/name empty), as LocalAI's ToolCallDelta expects.
    Markup never reaches content; text that might be the start of a marker is held back until it is decided.
    """

    def __init__(self):
        self._buf = ""
        self._state = "content"     # content | section | header | args
        self._pending_ws = ""       # trailing whitespace of the arguments, emitted only if more follows
        self._args_started = False
        self.calls = []

    def feed(self, text):
        self._buf += text
        content, deltas = [], []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self):
        content, deltas = [], []
        if self._state == "content":
            content.append(self._buf)
        elif self._state == "args":
            self._emit_args(self._buf.rstrip(), deltas)
        self._buf = ""
        return "".join(content), deltas

    # one transition per call; returns False when more input is needed
    def _step(self, content, deltas):
        return getattr(self, "_step_" + self._state)(content, deltas)

    def _step_content(self, content, deltas):
        i, marker = _find_first(self._buf, SECTION_BEGINS)
        if marker is None:
            keep = _partial_marker_len(self._buf, SECTION_BEGINS)
            content.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        content.append(self._buf[:i])
        self._buf = self._buf[i + len(marker):]
        self._state = "section"
        return True

    def _step_section(self, content, deltas):
        i, marker = _find_first(self._buf, SECTION_ENDS + (CALL_BEGIN,))
        if marker is None:
            keep = _partial_marker_len(self._buf, SECTION_ENDS + (CALL_BEGIN,))
            self._buf = self._buf[len(self._buf) - keep:]   # stray text inside a section is dropped
            return False
        self._buf = self._buf[i + len(marker):]
        self._state = "header" if marker == CALL_BEGIN else "content"
        return True

    def _step_header(self, content, deltas):
        i, marker = _find_first(self._buf, (ARG_BEGIN,) + SECTION_ENDS)
        if marker is None:
            return False
        if marker != ARG_BEGIN:     # a call without arguments marker: dropped with its section
            self._buf = self._buf[i + len(marker):]
            self._state = "content"
            return True
        call = make_call(self._buf[:i], "", len(self.calls))
        self.calls.append(call)
        deltas.append({"index": call["index"], "id": call["id"], "name": call["name"], "arguments": ""})
        self._buf = self._buf[i + len(ARG_BEGIN):]
        self._state, self._pending_ws, self._args_started = "args", "", False
        return True

    def _step_args(self, content, deltas):
        i, marker = _find_first(self._buf, (CALL_END,) + SECTION_ENDS)
        if marker is not None:
            self._emit_args(self._buf[:i].rstrip(), deltas)
            self._buf = self._buf[i + len(marker):]
            self._state = "section" if marker == CALL_END else "content"
            return True
        keep = _partial_marker_len(self._buf, (CALL_END,) + SECTION_ENDS)
        body = self._buf[:len(self._buf) - keep]
        stripped = body.rstrip()
        self._emit_args(stripped, deltas)
        self._pending_ws += body[len(stripped):]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit_args(self, text, deltas):
        if not self._args_started:
            text = text.lstrip()
            self._pending_ws = ""
        if not text:
            return
        piece = self._pending_ws + text
        self._pending_ws, self._args_started = "", True
        call = self.calls[-1]
        call["arguments"] += piece
        deltas.append({"index": call["index"], "id": "", "name": "", "arguments": piece})


def _find_first(buf, markers):
    best = (-1, None)
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best[1] is None or i < best[0]):
            best = (i, m)
    return best


def _partial_marker_len(buf, markers):
    """Length of the longest suffix of buf that is a proper prefix of one of the markers."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), longest, -1):
            if buf.endswith(m[:k]):
                longest = k
                break
    return longest
