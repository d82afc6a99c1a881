import base64
import itertools
import json
import os

import pytest
import regex
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backend.tokenizer import (KIMI_PAT_STR, IncrementalDetokenizer, StopStringMatcher, TokenizerError,
                               load_tokenizer, split_long_runs)
from tools.tiny_tokenizer import SPECIAL_LAYOUT, write_tokenizer_files

SAMPLES = [
    "",
    "Hello, world! It's a test; we'll see.",
    "人工智能是计算机科学的一个分支。今天天气很好",
    "emoji 🎉🚀 and flags 🇨🇳 and ZWJ 👩‍👩‍👧 family",
    "def f(x):\n    return x ** 2  # square\n\n\tif a && b: pass\r\n",
    "mixed中文English混合123456数字 and Ünïcödé ÉCOLE école",
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
    "tool <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>",
    "   leading and trailing spaces   \n\n\n",
    "[BOS] text [EOS] <|reserved_token_999999|> <|im_end",
]

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tik")
    info = write_tokenizer_files(str(d), kind="tiktoken")
    return str(d), info


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir[0])


@pytest.fixture(scope="module")
def json_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_json")
    write_tokenizer_files(str(d), kind="json")
    assert not os.path.exists(d / "tiktoken.model")
    return load_tokenizer(str(d))


@pytest.fixture(scope="module")
def kimi_sized(tmp_path_factory):
    """A tiktoken.model with Kimi's real base size (163,584 ranks) and Kimi's special-id table."""
    d = tmp_path_factory.mktemp("kimi_sized")
    letters = "abcdefghijklmnopqrstuvwxyz"
    toks = [bytes([i]) for i in range(256)]
    for n in (2, 3, 4):
        toks += ["".join(p).encode() for p in itertools.product(letters, repeat=n)]
    toks = toks[:163_584]
    with open(d / "tiktoken.model", "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks))
    decoder = {str(163_584 + off): {"content": c, "special": s} for off, (c, s) in SPECIAL_LAYOUT.items()}
    cfg = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "unk_token": "[UNK]"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 163584, "eos_token_id": 163586}))
    return load_tokenizer(str(d))


# files and ids -------------------------------------------------------------------------------------------------

def test_tiny_tokenizer_files_and_ids(tiny_dir, tok):
    d, info = tiny_dir
    assert sorted(os.listdir(d)) == ["chat_template.jinja", "special_tokens_map.json", "tiktoken.model",
                                     "tokenizer_config.json"]
    n = info["n_base"]
    assert info["vocab_size"] == n + 256 == tok.vocab_size
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (n, n + 2, n + 254)
    assert tok.token_to_id("<|im_end|>") == n + 2 and tok.token_to_id("<|im_middle|>") == n + 17
    assert tok.token_to_id("<|tool_call_end|>") == n + 15 and tok.token_to_id("[UNK]") == n + 255
    assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5
    assert tok.bos_token_id == n and tok.pad_token_id == n + 254
    cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    assert cfg["chat_template"] == open(os.path.join(d, "chat_template.jinja")).read()


def test_tiny_tokenizer_is_deterministic(tmp_path, tiny_dir):
    write_tokenizer_files(str(tmp_path), kind="tiktoken")
    assert (tmp_path / "tiktoken.model").read_bytes() == open(os.path.join(tiny_dir[0], "tiktoken.model"), "rb").read()


def test_kimi_ids_on_a_kimi_sized_vocab(kimi_sized):
    tok = kimi_sized
    assert tok.vocab_size == 163_840
    want = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
            "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
            "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
            "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
            "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
            "<|media_start|>": 163602, "<|media_pad|>": 163605, "[PAD]": 163838, "[UNK]": 163839,
            "<|reserved_token_163589|>": 163589}
    assert {s: tok.token_to_id(s) for s in want} == want
    assert tok.eos_token_ids == [163585, 163586]
    assert tok.bos_token_id == 163584
    assert tok.encode("<|reserved_token_163840|>") != [163840]   # no phantom ids beyond the model vocab
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s


def test_eos_ids_from_argument_and_generation_config(tiny_dir, tmp_path):
    d, info = tiny_dir
    assert load_tokenizer(d).eos_token_ids == [info["tokenizer_eos_token_id"]]
    assert load_tokenizer(d, eos_token_ids=[info["eos_token_id"]]).eos_token_ids == [info["tokenizer_eos_token_id"],
                                                                                       info["eos_token_id"]]
    write_tokenizer_files(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [info["eos_token_id"]]}))
    assert load_tokenizer(str(tmp_path)).eos_token_ids == [info["tokenizer_eos_token_id"], info["eos_token_id"]]


# encode / decode -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_strings_become_single_ids(tok):
    n = tok.n_base
    assert tok.encode("<|im_end|>") == [n + 2]
    ids = tok.encode("a<|im_user|>b")
    assert ids[1:-1] == [n + 3] and tok.decode(ids) == "a<|im_user|>b"
    plain = tok.encode("a<|im_user|>b", allow_special=False)
    assert all(i < n for i in plain) and tok.decode(plain) == "a<|im_user|>b"


def test_merges_are_used(tok):
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")
    assert tok.id_to_bytes(tok.n_base + 2) == b"<|im_end|>"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.id_to_bytes(tok.vocab_size)


@pytest.mark.parametrize("text", SAMPLES)
def test_json_kind_equals_tiktoken_kind(tok, json_tok, text):
    assert json_tok.vocab_size == tok.vocab_size
    assert json_tok.encode(text) == tok.encode(text)
    assert json_tok.decode(tok.encode(text)) == text


TEXT = st.text(alphabet=st.sampled_from(list("aZé中文字 \n\t1234'sS.,<|>!🎉")) , max_size=60)


@FAST
@given(TEXT)
def test_json_kind_equals_tiktoken_kind_random(tok, json_tok, text):
    assert json_tok.encode(text) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


# pre-tokenizer -------------------------------------------------------------------------------------------------

def pieces(text):
    return regex.findall(KIMI_PAT_STR, text, flags=regex.V1)


def test_pretokenizer_han_latin_mixes():
    assert pieces("Hello世界foo中文Bar's") == ["Hello", "世界", "foo", "中文", "Bar's"]
    assert pieces("我爱Python编程！") == ["我爱", "Python", "编程", "！"]
    assert pieces("12345 CamelCase HTTPServer") == ["123", "45", " Camel", "Case", " HTTPServer"]
    assert pieces("x  \n\n  y") == ["x", "  \n\n", " ", " y"]
    assert pieces("こんにちは世界") == ["こんにちは", "世界"]   # kana is \p{Lo} but not Han
    assert pieces("ÉCOLE's") == ["ÉCOLE's"]


@FAST
@given(TEXT)
def test_bpe_never_crosses_a_pretoken_boundary(tok, text):
    # tiktoken's regex engine (with && intersections) must split exactly like the regex module (V1)
    assert tok.encode(text, allow_special=False) == [i for p in pieces(text) for i in tok.encode(p, False)]


def kimi_split_reference(s, max_len):
    """Kimi's _split_whitespaces_or_nonwhitespaces, verbatim logic."""
    cur_len, cur_space, start = 0, s[0].isspace() if s else False, 0
    for i in range(len(s)):
        now = s[i].isspace()
        if cur_space ^ now:
            cur_len, cur_space = 1, now
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start, cur_len = i, 1
    yield s[start:]


@FAST
@given(st.text(alphabet=" \na", max_size=60), st.integers(1, 6))
def test_split_long_runs_matches_kimi(text, max_run):
    got = list(split_long_runs(text, max_run))
    want = list(kimi_split_reference(text, max_run))
    assert "".join(got) == text
    assert [p for p in got if p] == [p for p in want if p]


def test_long_input_encodes(tok):
    text = "a" * 60_000 + " " * 30_000 + "中" * 30_000
    assert tok.decode(tok.encode(text)) == text


# load errors ---------------------------------------------------------------------------------------------------

def test_bad_tiktoken_model_names_the_file(tmp_path):
    write_tokenizer_files(str(tmp_path))
    (tmp_path / "tiktoken.model").write_text("not base64!! x\n")
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        load_tokenizer(str(tmp_path))


def test_bad_tokenizer_json_names_the_file(tmp_path):
    write_tokenizer_files(str(tmp_path), kind="json")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tiktoken.model or tokenizer.json"):
        load_tokenizer(str(tmp_path))


# streaming -----------------------------------------------------------------------------------------------------

@FAST
@given(st.lists(st.integers(0, 767), max_size=40))
def test_incremental_detokenizer_equals_decode(tok, ids):
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids)


@FAST
@given(TEXT)
def test_incremental_detokenizer_never_splits_characters(tok, text):
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(i) for i in tok.encode(text)]
    assert all("\ufffd" not in p for p in out)
    assert "".join(out) + detok.flush() == text


def test_incremental_detokenizer_holds_partial_utf8(tok):
    ids = tok.encode("🎉", allow_special=False)
    assert len(ids) > 1    # tiny vocab: the emoji is split into byte tokens
    detok = IncrementalDetokenizer(tok, skip_ids=[tok.n_base + 2])
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🎉"
    assert detok.push(tok.n_base + 2) == ""


def test_stop_string_split_across_pieces():
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.feed("hello ST") == ("hello ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("later") == ("", "STOP")


def test_stop_string_releases_false_prefix():
    m = StopStringMatcher(["abc"])
    assert m.feed("xab") == ("x", None)
    assert m.feed("d") == ("abd", None)
    assert m.feed("a") == ("", None)
    assert m.flush() == "a"


@FAST
@given(st.text(alphabet="abc\n", max_size=40), st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3),
                                                           min_size=1, max_size=3),
       st.lists(st.integers(0, 40), max_size=6))
@example("\naa", ["a", "\naa"], [2])  # 'a' completes (at 2) before '\naa' (at 3), which starts earlier
@example("\naa", ["a", "\naa"], [])
def test_stop_strings_random_splits(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces_ = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    m = StopStringMatcher(stops)
    out, stop, fed = "", None, ""
    for p in pieces_:
        got, stop = m.feed(p)
        out += got
        fed += p
        if stop is None:   # only a possible stop prefix is held back
            held = fed[len(out):]
            assert fed.startswith(out) and any(s.startswith(held) for s in stops) or held == ""
    if stop is None:
        out += m.flush()
    # the stop that completes first (smallest end, then the longer one), whatever the cuts
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    want = text[:min(hits)[1]] if hits else text
    assert out == want
    assert (stop is not None) == bool(hits)


def test_json_kind_takes_special_names_from_tokenizer_json(tmp_path, json_tok):
    write_tokenizer_files(str(tmp_path), kind="json")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["added_tokens_decoder"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.special_ids == json_tok.special_ids
    assert tok.encode(SAMPLES[6]) == json_tok.encode(SAMPLES[6])


def test_special_id_outside_the_special_range_is_refused(tmp_path):
    write_tokenizer_files(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["3"] = {"content": "<|bad|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="outside the special range"):
        load_tokenizer(str(tmp_path))


def test_eos_id_outside_the_vocabulary_is_refused(tiny_dir):
    with pytest.raises(TokenizerError, match="eos_token_id"):
        load_tokenizer(tiny_dir[0], eos_token_ids=[tiny_dir[1]["vocab_size"]])
