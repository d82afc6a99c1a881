"""Kimi tokenizer: tiktoken.model (or HF tokenizer.json), sandboxed chat template, streaming helpers.

    tok = load_tokenizer(model_dir)
    ids = tok.encode(text); text = tok.decode(ids)
    prompt = tok.apply_chat_template(messages, tools=tools)      # add_generation_prompt=True by default
    detok = IncrementalDetokenizer(tok); piece = detok.push(token_id)
    stops = StopStringMatcher(["\\n\\n"]); text, stop = stops.feed(piece)
"""

import base64
import codecs
import functools
import itertools
import json
import os
import re
import threading
import time

import jinja2
import jinja2.exceptions
import jinja2.sandbox

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256
MAX_ENCODE_CHARS = 400_000   # tiktoken panics on larger inputs
MAX_RUN_CHARS = 25_000       # longest run of whitespace / non-whitespace handed to the BPE at once

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


class TokenizerError(Exception):
    pass


class TemplateError(Exception):
    pass


def default_chat_template():
    """Kimi-Linear-48B-A3B-Instruct's chat_template.jinja (stored once in backend/templates)."""
    with open(os.path.join(TEMPLATE_DIR, "kimi_linear.jinja"), encoding="utf-8") as f:
        return f.read()


def bytes_to_unicode():
    """GPT-2 byte-level mapping byte -> printable char, as used by HF ByteLevel tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---------------------------------------------------------------------------------------------------------------
# BPE backends: ordinary (special-free) encoding + bytes of every id

class _TiktokenBPE:
    def __init__(self, path):
        self.ranks = _read_tiktoken_model(path)
        import tiktoken

        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=KIMI_PAT_STR,
                                     mergeable_ranks=self.ranks, special_tokens={})
        self.n_base = len(self.ranks)
        self.added = {}
        self.token_bytes = [b""] * self.n_base
        for tok, rank in self.ranks.items():
            self.token_bytes[rank] = tok

    def encode_ordinary(self, text):
        return self.enc.encode_ordinary(text)


class _HFJsonBPE:
    def __init__(self, path):
        from tokenizers import Tokenizer

        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            self.added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
            spec["added_tokens"] = []
            self.tok = Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # tokenizers raises its own exception types
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from e
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        vocab = self.tok.get_vocab(with_added_tokens=False)
        self.n_base = len(vocab)
        self.token_bytes = [b""] * self.n_base
        for s, i in vocab.items():
            if i >= self.n_base or s[0] not in u2b:
                raise TokenizerError(f"{path}: base vocab is not dense byte-level BPE (token {s!r} id {i})")
            self.token_bytes[i] = bytes(u2b[c] for c in s)

    def encode_ordinary(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids


def _read_tiktoken_model(path):
    ranks = {}
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot parse tiktoken model ({e})") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not a dense 0..{len(ranks) - 1} range")
    return ranks


# ---------------------------------------------------------------------------------------------------------------
# KimiTokenizer

class KimiTokenizer:
    def __init__(self, bpe, specials, bos_token, eos_tokens, pad_token=None, unk_token=None, chat_template=None,
                 template_limits=None):
        self._bpe = bpe
        self.n_base = bpe.n_base
        self.special_ids = dict(specials)                      # content -> id
        self.special_tokens = {i: s for s, i in specials.items()}  # id -> content
        self.vocab_size = self.n_base + NUM_RESERVED_SPECIAL
        self.bos_token_id = self.special_ids.get(bos_token)
        self.eos_token_ids = sorted({self._id_of(t) for t in eos_tokens})
        self.pad_token_id = self.special_ids.get(pad_token) if pad_token else None
        self.unk_token_id = self.special_ids.get(unk_token) if unk_token else None
        self._named = {"bos_token": bos_token, "eos_token": eos_tokens[0] if eos_tokens else None,
                       "pad_token": pad_token, "unk_token": unk_token}
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
        self.chat_template = chat_template
        self._template = None
        self._template_limits = template_limits or TemplateLimits()

    def _id_of(self, token):
        if isinstance(token, int):
            return token
        if token not in self.special_ids:
            raise TokenizerError(f"unknown special token {token!r}")
        return self.special_ids[token]

    # encode / decode ---------------------------------------------------------------------------------------

    def encode(self, text, allow_special=True):
        """Kimi's encode: special-token strings become special ids (allowed_special="all") unless disabled."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        ids, pos = [], 0
        for m in self._special_re.finditer(text):
            ids += self._encode_ordinary(text[pos:m.start()])
            ids.append(self.special_ids[m.group()])
            pos = m.end()
        return ids + self._encode_ordinary(text[pos:])

    def _encode_ordinary(self, text):
        ids = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[i:i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids += self._bpe.encode_ordinary(piece)
        return ids

    def id_to_bytes(self, token_id):
        if 0 <= token_id < self.n_base:
            return self._bpe.token_bytes[token_id]
        if token_id in self.special_tokens:
            return self.special_tokens[token_id].encode("utf-8")
        raise TokenizerError(f"token id {token_id} outside the vocabulary (size {self.vocab_size})")

    def decode_bytes(self, ids):
        base, n = self._bpe.token_bytes, self.n_base
        return b"".join(base[i] if 0 <= i < n else self.id_to_bytes(i) for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token):
        """Id of a special token string, or None."""
        return self.special_ids.get(token)

    def is_special(self, token_id):
        return token_id in self.special_tokens

    # chat template -----------------------------------------------------------------------------------------

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **extra):
        if self.chat_template is None:
            raise TemplateError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template, self._template_limits)
        context = {k: v for k, v in self._named.items() if v is not None}
        context.update(extra)
        context.update(messages=list(messages), tools=deep_sort(tools) if tools else tools,
                       add_generation_prompt=add_generation_prompt)
        return render_chat_template(self._template, context, self._template_limits)


def split_long_runs(text, max_run):
    """Kimi's _split_whitespaces_or_nonwhitespaces: cut inside runs of > max_run whitespace / non-whitespace."""
    if len(text) <= max_run:
        yield text
        return
    start = 0
    for m in re.finditer(r"\s+|\S+", text):
        for cut in range(m.start() + max_run, m.end(), max_run):
            yield text[start:cut]
            start = cut
    yield text[start:]


def deep_sort(obj):
    """Recursively key-sort dicts (Kimi's deep_sort_dict applied to tools)."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------------------------
# loading

def load_tokenizer(model_dir, eos_token_ids=None, template_limits=None):
    """KimiTokenizer from a model directory (tiktoken.model, else tokenizer.json).

    eos_token_ids: extra stop ids (e.g. config.json's eos_token_id); when None, they are read from
    generation_config.json / config.json in the directory if present.
    """
    cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"), required=False) or {}
    bpe = _load_bpe(model_dir)
    specials = _special_tokens(cfg, bpe, model_dir)
    bos, eos, pad, unk = (_token_name(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token"))
    bos = bos or "[BOS]"
    eos = eos or "[EOS]"
    if eos_token_ids is None:
        eos_token_ids = _config_eos_ids(model_dir)
    for name in (bos, eos):
        if name not in specials:
            raise TokenizerError(f"{model_dir}: special token {name!r} is not in the vocabulary")
    eos_list = [eos] + [int(i) for i in eos_token_ids]
    bad = [i for i in eos_list[1:] if not 0 <= i < bpe.n_base + NUM_RESERVED_SPECIAL]
    if bad:
        raise TokenizerError(f"{model_dir}: eos_token_id {bad} outside the vocabulary")
    return KimiTokenizer(bpe, specials, bos, eos_list, pad if pad in specials else None,
                         unk if unk in specials else None, _chat_template(model_dir, cfg), template_limits)


def _load_bpe(model_dir):
    tik = os.path.join(model_dir, "tiktoken.model")
    hf = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tik):
        return _TiktokenBPE(tik)
    if os.path.isfile(hf):
        return _HFJsonBPE(hf)
    raise TokenizerError(f"{model_dir}: no tiktoken.model or tokenizer.json")


def _special_tokens(cfg, bpe, model_dir):
    """content -> id for the 256 special slots: tokenizer_config.json's added_tokens_decoder, else the
    tokenizer.json's added_tokens, else <|reserved_token_{id}|>."""
    named = dict(bpe.added)
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        named[int(key)] = entry["content"] if isinstance(entry, dict) else str(entry)
    n_base = bpe.n_base
    for tid, content in named.items():
        if not n_base <= tid < n_base + NUM_RESERVED_SPECIAL:
            raise TokenizerError(f"{model_dir}: special token {content!r} has id {tid}, outside the special range "
                                 f"[{n_base}, {n_base + NUM_RESERVED_SPECIAL})")
    ids = range(n_base, n_base + NUM_RESERVED_SPECIAL)
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}


def _token_name(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def _config_eos_ids(model_dir):
    ids = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(os.path.join(model_dir, name), required=False) or {}
        eos = cfg.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ids


def _chat_template(model_dir, cfg):
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
    return tmpl


def _read_json(path, required=True):
    if not os.path.isfile(path):
        if required:
            raise TokenizerError(f"{path}: missing")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e


# ---------------------------------------------------------------------------------------------------------------
# sandboxed chat template

class TemplateLimits:
    def __init__(self, max_seconds=5.0, max_output_chars=32_000_000, max_iterations=5_000_000,
                 max_range=100_000):
        self.max_seconds = max_seconds
        self.max_output_chars = max_output_chars
        self.max_iterations = max_iterations
        self.max_range = max_range


# a printf / str.format width or precision of 9+ digits
_HUGE_WIDTH = re.compile(r"%[-+ #0]*\d{9,}|%[-+ #0]*\d*\.\d{9,}|\{[^{}]*:[^{}]*\d{9,}[^{}]*\}")


def _check_format(fmt):
    if isinstance(fmt, str) and _HUGE_WIDTH.search(fmt):
        raise TemplateError("chat template format spec with a huge width")


class _Budget:
    def __init__(self, limits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.steps = 0

    def tick(self, n=1):
        self.steps += n
        if self.steps > self.limits.max_iterations:
            raise TemplateError(f"chat template exceeded {self.limits.max_iterations} steps")
        if time.monotonic() > self.deadline:
            raise TemplateError(f"chat template exceeded its {self.limits.max_seconds}s time limit")

    def check_size(self, value):
        if isinstance(value, (str, bytes, list, tuple)) and len(value) > self.limits.max_output_chars:
            raise TemplateError(f"chat template built a value of {len(value)} items "
                                f"(limit {self.limits.max_output_chars})")
        return value


class _KimiSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """HF-compatible environment (trim_blocks, lstrip_blocks, loopcontrols) with budgets on every step."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, limits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.limits = limits
        self._local = threading.local()
        self.budget = _Budget(limits)
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guard_filter("tojson", _tojson)
        self.globals.update(range=self._range, raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.globals.pop("lipsum", None)   # generates unbounded text outside the step budget

    def _guard_filter(self, name, f):
        skip = 1 if getattr(f, "jinja_pass_arg", None) is None else 2   # the filtered value is not checked

        @functools.wraps(f)
        def guarded(*args, **kwargs):
            self.budget.tick()
            self._check_args(args[skip:], kwargs.values())
            if name == "format" and args:
                _check_format(args[skip - 1])
            return self.budget.check_size(f(*args, **kwargs))
        return guarded

    def _check_args(self, *groups):
        """Refuse widths/counts that would build huge values before Python builds them."""
        for a in itertools.chain(*groups):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.max_output_chars:
                raise TemplateError(f"chat template argument {a} is too large")

    def _range(self, *args):
        r = range(*args)
        if len(r) > self.limits.max_range:
            raise TemplateError(f"chat template range() of {len(r)} items (limit {self.limits.max_range})")
        return _TickingRange(r, self)

    @property
    def budget(self):
        return self._local.budget

    @budget.setter
    def budget(self, value):
        self._local.budget = value

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj, attribute):
        self.budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.budget.tick()
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self.budget.tick()
        if isinstance(getattr(__obj, "__self__", None), str):   # str methods: 'a'.ljust(10**10)
            __self._check_args(args, kwargs.values())
        return __self.budget.check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapped)
        def checked(*args, **kwargs):   # '{:>9999999999}'.format(x), '{:>{}}'.format(x, 10**10)
            _check_format(fmt)
            self._check_args(args, kwargs.values())
            return wrapped(*args, **kwargs)
        return checked

    def call_binop(self, context, operator, left, right):
        self.budget.tick()
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and abs(left).bit_length() * abs(right) > 1_000_000:
                raise TemplateError(f"chat template power {left} ** {right} is too large")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
        if operator == "*":
            n = right if isinstance(right, int) else left if isinstance(left, int) else 0
            seq = left if isinstance(right, int) else right
            if isinstance(seq, (str, list, tuple)) and len(seq) * max(n, 0) > self.limits.max_output_chars:
                raise TemplateError(f"chat template repeats a sequence {n} times (result too large)")
        return self.budget.check_size(super().call_binop(context, operator, left, right))


class _TickingRange:
    """range() whose iteration spends the render budget, so nested loops cannot run unbounded."""

    def __init__(self, r, env):
        self._r, self._env = r, env

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]

    def __contains__(self, x):
        return x in self._r

    def __iter__(self):
        for i in self._r:
            self._env.budget.tick()
            yield i

    def __reversed__(self):
        return iter(_TickingRange(self._r[::-1], self._env))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(f"chat template raised: {message}")


def _strftime_now(fmt):
    return time.strftime(fmt)


def compile_chat_template(source, limits=None):
    env = _KimiSandbox(limits or TemplateLimits())
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def render_chat_template(template, context, limits=None):
    env = template.environment
    env.budget = _Budget(limits or env.limits)
    out, size = [], 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > env.limits.max_output_chars:
                raise TemplateError(f"chat template output exceeded {env.limits.max_output_chars} chars")
            out.append(chunk)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
    except RecursionError as e:
        raise TemplateError("chat template recursed too deeply") from e
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ZeroDivisionError, OverflowError, MemoryError) as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# streaming helpers

class IncrementalDetokenizer:
    """push(id) -> newly completed text; never splits a UTF-8 character. Concatenation == tok.decode(ids). Ids the
    model can sample but the tokenizer lacks (a checkpoint whose vocab_size pads the tokenizer's) have no text: ""."""

    def __init__(self, tok, skip_ids=()):
        self.tok = tok
        self.skip_ids = frozenset(skip_ids)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        if token_id in self.skip_ids:
            return ""
        try:
            raw = self.tok.id_to_bytes(token_id)
        except TokenizerError:
            return ""
        return self._dec.decode(raw)

    def flush(self):
        return self._dec.decode(b"", final=True)


class StopStringMatcher:
    """feed(text) -> (safe_text, stop): text before any stop string; holds back only a possible stop prefix.

    Once a stop string completes, stop is that string and every later feed returns ("", stop).
    """

    def __init__(self, stops):
        self.stops = [s for s in dict.fromkeys(stops or []) if s]
        self._held = ""
        self.stop = None

    def feed(self, text):
        if self.stop is not None:
            return "", self.stop
        buf = self._held + text
        hit = self._first_stop(buf)
        if hit is not None:
            idx, self.stop = hit
            self._held = ""
            return buf[:idx], self.stop
        keep = self._prefix_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self):
        """End of generation without a stop: release the held-back text."""
        out, self._held = self._held, ""
        return out if self.stop is None else ""

    def _first_stop(self, buf):
        """(start, stop) of the stop string that completes first in buf (smallest end; at equal ends the longer one):
        what a character-by-character stream would stop on, so the result does not depend on how the text was cut
        into feeds (earlier feeds held no complete stop)."""
        best = None
        for s in self.stops:
            i = buf.find(s)  # the first occurrence also ends first
            if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                best = (i, s)
        return best

    def _prefix_len(self, buf):
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest
