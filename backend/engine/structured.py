"""Grammar-constrained decoding (LocalAI's PredictOptions.Grammar) with llguidance.

A request's grammar is compiled once (`Grammars.compile`, off the engine thread: building the lexer can take
~0.1-1 s for a large grammar) into a `Grammar`; the request then owns a matcher (`Grammar.matcher`, a copy of the
compiled one) that follows its output tokens. Each step the sampler asks the matchers for the next token's
allowed set as a bitmask ([R, cdiv(V, 32)] int32, bit v % 32 of word v // 32; filled on the host while the
forward runs on the device) and sets the other logits to -inf before any other processing; the scheduler feeds
every sampled token back (`advance`) and stops the request once its grammar can take nothing more.

Accepted text: a GBNF grammar (llama.cpp's format, which LocalAI sends for response_format json_object /
json_schema and for grammar-based function calling), a Lark grammar (llguidance's syntax), or a JSON schema (a
JSON object, as vLLM's backend takes it). A grammar that does not compile is a bad request, never a crash.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # torch only where masks are made (the scheduler imports advance / finished: no torch there)
    import torch

# Whitespace a JSON schema allows between tokens: llguidance's default (any run of whitespace) lets a model that
# likes newlines pad forever. This is llama.cpp's json-schema-to-grammar rule (`space ::= | " " | "\n" [ \t]{0,20}`),
# what LocalAI's llama.cpp users get. A schema may override it with "x-guidance": {"whitespace_pattern": ...}.
JSON_DEFAULTS = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}


class GrammarError(ValueError):
    """The grammar text does not compile (the message says why)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # installed by requirements.txt; a hand-made venv may lack it
        raise GrammarError("grammar-constrained decoding needs the llguidance package (pip install llguidance)") \
            from e
    return llguidance


class _TokenSource:
    """What llguidance's TokenizerWrapper reads: every id's bytes, the special ids and an encoder (bytes -> ids)."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Sequence[int], eos_ids: Sequence[int],
                 bos_id: Optional[int], encode):
        self.tokens = list(token_bytes)
        self.special_token_ids = list(special_ids)
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = bos_id
        self._encode = encode

    def __call__(self, text) -> list:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


class Grammars:
    """Compiles grammar text for one vocabulary. The llguidance tokenizer (a trie over every token's bytes; ~1 s
    for a 160k vocabulary) is built on first use and shared by every grammar.

    token_bytes[i]: the bytes of token i (b"" for an id the tokenizer does not define, which no grammar allows);
    len(token_bytes) is the model's vocabulary (the logits' width). encode: text -> ids without special tokens."""

    CACHE = 32

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Sequence[int], eos_ids: Sequence[int],
                 bos_id: Optional[int], encode):
        if not eos_ids:
            raise ValueError("grammar-constrained decoding needs at least one EOS token id")
        self._source = _TokenSource(token_bytes, special_ids, eos_ids, bos_id, encode)
        self.vocab_size = len(self._source.tokens)
        self.eos_ids = list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._cache = {}   # text -> Grammar, least recently used first

    @classmethod
    def from_tokenizer(cls, tok, vocab_size: int) -> "Grammars":
        """backend.tokenizer.KimiTokenizer -> Grammars over the model's vocab_size ids."""
        def bytes_of(i):
            if i < tok.n_base or i in tok.special_tokens:
                return tok.id_to_bytes(i)
            return b""
        return cls([bytes_of(i) for i in range(vocab_size)], sorted(i for i in tok.special_tokens if i < vocab_size),
                   tok.eos_token_ids, tok.bos_token_id, lambda text: tok.encode(text, allow_special=False))

    def tokenizer(self):
        with self._tok_lock:
            if self._tokenizer is None:
                llg = _llguidance()
                self._tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(self._source), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, text: str) -> "Grammar":
        """GBNF / Lark grammar or JSON schema text -> Grammar (the last CACHE distinct texts are kept: clients send
        the same grammar again and again). Raises GrammarError."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("the grammar is empty")
        with self._lock:
            hit = self._cache.pop(text, None)
            if hit is not None:
                self._cache[text] = hit  # most recent last
                return hit
        grammar = self._compile(text)
        with self._lock:
            self._cache[text] = grammar
            while len(self._cache) > self.CACHE:
                self._cache.pop(next(iter(self._cache)))
        return grammar

    def _compile(self, text: str) -> "Grammar":
        llg = _llguidance()
        schema = _json_object(text)
        try:
            if schema is not None:
                spec = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            else:
                spec = llg.LLMatcher.grammar_from_lark(_to_lark(text))
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        matcher = llg.LLMatcher(self.tokenizer(), spec, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size, self.eos_ids)


def _to_lark(text: str) -> str:
    """GBNF -> llguidance Lark (Lark passes through), with the character-level runs made lexemes.

    llguidance lexes a grammar's terminal rules (those reaching no recursion) as regular expressions and parses the
    rest with an Earley parser. A GBNF rule such as LocalAI's JSON string, `"\"" ( [^"\\] | ... )* "\"" ws`, is not
    terminal because it ends in `ws` (recursive), so its body would be parsed one character per Earley step; over a
    160k vocabulary the mask exceeds llguidance's item limit after `{"` ("Too many items"). Each maximal run of >= 2
    terminal items in a non-terminal rule (here `"\"" (...)* "\""`) becomes a rule of its own, hence one lexeme. One
    regular expression accepts exactly the run's strings, so the language is unchanged; lexeme boundaries only
    disappear (never appear), and a run that can match the empty string is left alone (lexemes cannot be empty)."""
    from llguidance import gbnf_to_lark as g2l

    if g2l.is_lark_syntax(text):
        return text
    try:
        rules = g2l.GrammarParser().parse(text)
        g2l.resolve(rules)
    except Exception as e:  # noqa: BLE001 - its parse errors are plain Exceptions
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {e}") from None
    new = []
    for r in list(rules.values()):
        if not r.rule_is_terminal:
            r.alternatives = _lift_runs(r.alternatives, g2l, new, rules)
    for r in new:
        rules[r.name] = r
    out = ["%llguidance {}", ""]
    for r in sorted(rules.values(), key=lambda r: r.order):
        out.append(str(r))
    return "\n".join(out) + "\n"


def _lift_runs(node, g2l, new: list, rules: dict):
    """node of a non-terminal rule -> the same node with runs of terminal items in its sequences made rules."""
    if isinstance(node, g2l.SequenceNode):
        items, run = [], []

        def flush():
            if len(run) >= 2 and not all(_nullable(n, g2l) for n in run):
                name = f"LEXEME_{len(new)}"
                while name in rules:
                    name += "_"
                rule = g2l.RuleNode(name, g2l.SequenceNode(list(run)), "", rule_is_terminal=True)
                rule.order = len(rules) + len(new)
                new.append(rule)
                items.append(g2l.RuleRefNode(name, rule))
            else:
                items.extend(_lift_runs(n, g2l, new, rules) for n in run)
            run.clear()

        for n in node.nodes:
            if n.is_terminal():
                run.append(n)
            else:
                flush()
                items.append(_lift_runs(n, g2l, new, rules))
        flush()
        node.nodes = items
    elif isinstance(node, g2l.AlternativeNode):
        node.alternatives = [_lift_runs(a, g2l, new, rules) for a in node.alternatives]
    elif isinstance(node, g2l.RepetitionNode) and not node.node.is_terminal():
        node.node = _lift_runs(node.node, g2l, new, rules)
    return node


def _nullable(node, g2l, seen=frozenset()) -> bool:
    """node can match the empty string."""
    if isinstance(node, g2l.LiteralNode):
        return node.value == ""
    if isinstance(node, g2l.RegexNode):
        return False
    if isinstance(node, g2l.RepetitionNode):
        return node.min_times == 0 or _nullable(node.node, g2l, seen)
    if isinstance(node, g2l.SequenceNode):
        return all(_nullable(n, g2l, seen) for n in node.nodes)
    if isinstance(node, g2l.AlternativeNode):
        return any(_nullable(a, g2l, seen) for a in node.alternatives)
    if isinstance(node, g2l.RuleRefNode):
        t = node.target
        return t is not None and t.name not in seen and _nullable(t.alternatives, g2l, seen | {t.name})
    return True


def _json_object(text: str) -> Optional[dict]:
    """The JSON schema in `text`, or None when it is not a JSON object (a GBNF / Lark grammar)."""
    s = text.lstrip()
    if not s.startswith("{"):
        return None
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class Grammar:
    """A compiled grammar; immutable (its matcher is only ever copied), so one may serve many requests."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int] = ()):
        self._template = matcher
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)  # what masks(drop_eos=...) clears for a request that ignores EOS

    def matcher(self):
        """A fresh matcher at the grammar's start (llguidance LLMatcher), for one request."""
        return self._template.deep_copy()


def advance(matcher, token: int) -> Optional[str]:
    """Feeds a sampled token to the request's matcher -> None, or why the grammar rejected it (a token outside the
    mask: only a bug or a mask that was not applied can cause that)."""
    if matcher.consume_token(int(token)):
        return None
    return f"grammar: token {token} rejected ({matcher.get_error() or 'not allowed here'})"


def finished(matcher) -> bool:
    """The grammar can take no more tokens (it is complete, or after an EOS)."""
    return matcher.is_stopped()


# Up to this many rows are filled one after the other on the calling thread (JSON over a synthetic 160k vocabulary:
# median 0.03 ms, p90 0.6 ms per row on the 2-core CI box); more go to llguidance's thread pool, which pays for
# itself only with many rows: on that box, busy, 8-20 rows took 3.5-4 ms through the pool against 0.06 ms in a loop.
PARALLEL_MASKS = 32


def masks(matchers: list, vocab_size: int, drop_eos: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """The next token's allowed set of each matcher -> [R, cdiv(vocab_size, 32)] int32 bitmask on the host (pinned
    when CUDA is there, for a non-blocking copy). drop_eos[i] (optional, per row): EOS ids row i may not take while
    its grammar allows anything else (a request with ignore_eos goes on where the grammar could end)."""
    import torch

    words = (vocab_size + 31) // 32
    out = torch.empty(len(matchers), words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    if len(matchers) <= PARALLEL_MASKS:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(out.data_ptr() + i * words * 4, words * 4)
    else:
        _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.data_ptr(), words * 4,
                                            len(matchers))
    for i, ids in enumerate(drop_eos):
        if ids:
            _drop_bits(out[i].numpy().view("uint32"), ids)
    return out


def _drop_bits(row, ids) -> None:
    """Clears the bits of ids in one bitmask row (uint32 view), unless nothing else would be left allowed."""
    kept = row.copy()
    for t in ids:
        if 0 <= t < 32 * len(row):
            row[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
    if not row.any():
        row[:] = kept


_EXEC = []
# llguidance's mask threads (more than PARALLEL_MASKS rows). 0: the rule below, a bounded pool, since the host also
# runs the engine loop, the gRPC server and the tokenizer. The masks of a step are computed while its forward runs
# (engine._settle); past the forward's time they make the step longer. KIMI_GRAMMAR_THREADS=N
MASK_THREADS = int(os.environ.get("KIMI_GRAMMAR_THREADS", "0"))


def mask_threads() -> int:
    return MASK_THREADS or max(2, min(8, (os.cpu_count() or 4) // 2))


def _executor():
    if not _EXEC:
        _EXEC.append(_llguidance().LLExecutor(num_threads=mask_threads()))
    return _EXEC[0]


_BITS = {}


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """logits [M, V] fp32 (in place): -inf on every token that the bitmask row of each constrained row does not
    allow. rows: [R] i64 indices into logits; words: [R, W] int32 on logits' device, W * 32 >= V."""
    import torch

    V = logits.shape[1]
    key = (logits.device, V)
    if key not in _BITS:  # [V] word index and bit shift of every token, made once per device and width
        v = torch.arange(V, device=logits.device, dtype=torch.int64)
        _BITS[key] = (v >> 5, (v & 31).to(torch.int32))
    word, shift = _BITS[key]
    allowed = torch.bitwise_right_shift(words[:, word], shift) & 1   # [R, V]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
