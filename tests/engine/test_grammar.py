"""Grammar-constrained decoding in the engine (backend/engine/structured.py) on the tiny CPU checkpoint.

The tiny checkpoint has no tokenizer, so the tests give its 256 ids a byte vocabulary: id b < 250 is the byte b,
250..255 are special (252 is EOS). The exactness reference is independent of llguidance and of the engine: for a
finite language it allows token t after text s iff s + t is a prefix of a word (EOS iff s is a word), and decodes
greedily straight through the model API."""

import json
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.engine import SamplingParams
from backend.engine.structured import GrammarError, Grammars, advance, apply_masks, masks
from backend.model.generate import _step
from tests.engine.test_engine import EOS, alone, assert_pools_full, collect, make_engine, staggered, workload
from tests.engine import test_engine
from tools.synthetic_vocab import synthetic_grammars

VOCAB = 256
SPECIAL = list(range(250, 256))
WORDS = ["yes", "no", "maybe", "yesterday", "nope"]
GBNF = 'root ::= "yes" | "no" | "maybe" | "yesterday" | "nope"'
GREEDY = dict(temperature=0.0, ignore_eos=True)
engine = test_engine.engine  # the engine fixture: eager, and with CPU stand-ins for the decode graphs


@pytest.fixture(scope="module")
def grammars():
    token_bytes = [bytes([i]) for i in range(250)] + [f"<s{i}>".encode() for i in SPECIAL]
    return Grammars(token_bytes, SPECIAL, [EOS], None, lambda text: [b for b in text.encode() if b < 250])


def text_of(ids):
    return bytes(t for t in ids if t < 250).decode("latin-1")


def allowed_ref(text, words, ignore_eos=False):
    """Token ids that may follow `text` in the finite language `words` (EOS iff text is a word; with ignore_eos
    only where nothing else may follow)."""
    ok = [t for t in range(250) if any(w.startswith(text + chr(t)) for w in words)]
    return ok + [EOS] * (text in words and not (ignore_eos and ok))


def constrained_greedy_ref(model, prompt, words, max_tokens, ignore_eos=True):
    """Greedy decoding restricted to `words`, straight through the model (no engine, no llguidance). ignore_eos:
    EOS is not taken while the word can go on (llama.cpp's ignore_eos: the grammar ends only where it must)."""
    blocks = list(range(1, 1 + -(-(len(prompt) + max_tokens) // 16)))
    cache = model.allocate_cache(num_slots=2, num_blocks=len(blocks) + 1, block_size=16)
    logits = _step(model, cache, prompt, 0, blocks, num_decodes=0)
    out = []
    while len(out) < max_tokens:
        ok = allowed_ref(text_of(out), words, ignore_eos)
        masked = torch.full_like(logits[0], float("-inf"))
        masked[ok] = logits[0, ok]
        token = int(masked.argmax())
        out.append(token)
        if token == EOS or not [t for t in allowed_ref(text_of(out), words) if t != EOS]:
            break  # EOS, or the word cannot go on: the grammar is complete
        logits = _step(model, cache, [token], len(prompt) + len(out) - 1, blocks, num_decodes=1)
    return out


def test_compile_formats_and_errors(grammars):
    assert grammars.compile(GBNF) is grammars.compile(GBNF)  # cached
    grammars.compile('start: "a"+ "."')  # Lark
    grammars.compile('{"type": "object", "properties": {"a": {"type": "integer"}}}')  # JSON schema
    for bad in ['root ::= ( "a" ', 'root ::= undefined-rule', '{"type": 3}', "", "   "]:
        with pytest.raises(GrammarError):
            grammars.compile(bad)
    with pytest.raises(ValueError, match="compiled Grammar"):
        SamplingParams(grammar="root ::= x").validate(VOCAB)
    with pytest.raises(ValueError, match="compiled for 256"):
        SamplingParams(grammar=grammars.compile(GBNF)).validate(VOCAB + 1)


# LocalAI's grammars: response_format json_object (functions.JSONBNF) and the shape of its json_schema converter
JSONBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]*)) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws

ws ::= ([ \t\n] ws)?"""
SCHEMA_GBNF = r"""space ::= " "?
string ::= "\"" (
      [^"\\] |
      "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
    )* "\"" space
integer ::= ("-"? ([0-9] | [1-9] [0-9]*)) space
root-name-kv ::= "\"name\"" space ":" space string
root-age-kv ::= "\"age\"" space ":" space integer
root-tags ::= "[" space (string ("," space string)*)? "]" space
root-tags-kv ::= "\"tags\"" space ":" space root-tags
root ::= "{" space root-name-kv "," space root-age-kv "," space root-tags-kv "}" space"""
DOC = '{"name": "Ann \\"B\\" \\u00e9", "age": -42, "tags": ["x", "hello world", ""]}'


def accepts(grammars, spec, text):
    import llguidance as llg

    m = llg.LLMatcher(grammars.tokenizer(), spec, log_level=0)
    return not m.is_error() and m.consume_tokens(list(text.encode("latin-1"))) and m.is_accepting()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.one_of(st.text(alphabet='{}[]":, \n\tabu0123456789-.eE\\', max_size=24),
                      st.sampled_from([DOC, DOC[:-1], DOC.replace("-42", "042"), '{"a": [1, 2.5e-3, true, null]}',
                                       '{ }', '{"a" :1}', '[1]', '{"a": "\\x"}'])))
def test_lexeme_lifting_keeps_the_language(grammars, text):
    """_to_lark (runs of terminal items made lexemes) accepts exactly what llguidance's own conversion accepts."""
    import llguidance as llg

    from backend.engine.structured import _to_lark

    for gbnf in (JSONBNF, SCHEMA_GBNF, 'root ::= [a-z]* "ab" [0-9]? x\nx ::= "." x | "!"'):
        plain = llg.grammar_from("gbnf", gbnf)
        lifted = llg.LLMatcher.grammar_from_lark(_to_lark(gbnf))
        assert accepts(grammars, plain, text) == accepts(grammars, lifted, text), (gbnf[:20], text)


def test_localai_grammars_on_a_large_vocabulary():
    """On a 163,840-token vocabulary (Kimi's size; random multi-byte tokens) LocalAI's JSON grammars keep valid
    masks all along a document: without the lifting, JSONBNF's string body is parsed per character and llguidance
    gives up after '{"' (too many Earley items)."""
    big = synthetic_grammars(163840)
    for gbnf in (JSONBNF, SCHEMA_GBNF):
        m = big.compile(gbnf).matcher()
        ids = big.tokenizer().tokenize_str(DOC)
        for t in ids:
            w = masks([m], big.vocab_size)
            assert not m.is_error() and (int(w[0, t // 32]) >> (t % 32)) & 1, (gbnf[:20], m.get_error())
            assert advance(m, t) is None
        assert m.is_accepting()


@pytest.mark.parametrize("pool", [False, True])
def test_masks_against_the_reference_language(grammars, pool, monkeypatch):
    import backend.engine.structured as structured

    if pool:  # llguidance's thread pool instead of the loop
        monkeypatch.setattr(structured, "PARALLEL_MASKS", 1)
    g = grammars.compile(GBNF)
    ms = [g.matcher() for _ in range(3)]
    assert ms[1].consume_token(ord("y")) and ms[2].consume_token(ord("n")) and ms[2].consume_token(ord("o"))
    words = masks(ms, VOCAB)  # several matchers at once (llguidance's executor)
    assert words.shape == (3, VOCAB // 32) and words.dtype == torch.int32
    for i, (m, text) in enumerate(zip(ms, ["", "y", "no"])):
        assert torch.equal(masks([m], VOCAB)[0], words[i])
        bits = [t for t in range(VOCAB) if (int(words[i, t // 32]) >> (t % 32)) & 1]
        assert bits == allowed_ref(text, WORDS)
    # ignore_eos rows: EOS cleared where the word can go on ("no" -> "nope"), kept where it cannot ("nope")
    assert ms[2].consume_token(ord("p")) and ms[2].consume_token(ord("e"))
    for i, row in enumerate(masks(ms, VOCAB, [(EOS,), (), (EOS, 31)])):
        text = ["", "y", "nope"][i]
        bits = [t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1]
        assert bits == allowed_ref(text, WORDS, ignore_eos=i != 1), (text, bits)


@pytest.mark.parametrize("V", [1, 31, 70, 256])
def test_apply_masks_against_naive(V):
    gen = torch.Generator().manual_seed(V)
    W = -(-V // 32) + (V == 256)  # a mask may be wider than the logits
    words = torch.randint(-2**31, 2**31 - 1, (3, W), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, V, generator=gen)
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    for r, row in enumerate(rows.tolist()):
        for v in range(V):
            if not (int(words[r, v // 32]) >> (v % 32)) & 1:
                want[row, v] = float("-inf")
    apply_masks(logits, rows, words)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_matches_independent_reference(engine, grammars, ignore_eos):
    """ignore_eos: "yes" and "no" go on to "yesterday" and "nope" (EOS is masked while the grammar allows more);
    without it the model's EOS may end them."""
    g = grammars.compile(GBNF)
    work = workload(8, seed=11)
    ref = [constrained_greedy_ref(engine.runner.model, p, WORDS, 16, ignore_eos) for p, _ in work]
    streams = [engine.add_request(p, SamplingParams(max_tokens=16, grammar=g, temperature=0.0,
                                                    ignore_eos=ignore_eos)) for p, _ in work]
    for s, r in zip(streams, ref):
        toks, last = collect(s)
        assert toks == r
        assert last.finish_reason == "stop" and text_of(toks) in WORDS
        if ignore_eos:
            assert text_of(toks) not in ("yes", "no")
    assert_pools_full(engine)


def test_mixed_batch_is_invariant(engine, grammars):
    """Constrained and free requests arriving at different times: each gives exactly its tokens alone."""
    check_mixed(engine, grammars)


def test_steps_that_read_the_tokens_are_pipelined(tiny_dir, grammars):
    """With decode graphs, a step whose sampling reads the tokens (a grammar, penalties) queues its forward before
    the previous step's tokens are collected (fed on the device) and samples after they are applied: the tokens
    equal the reference's and the step-by-step engine's, also for requests that finish while the next step is in
    flight (words of different lengths; their dropped rows are sampled without asking the stopped matcher)."""
    eager, eng = make_engine(tiny_dir), test_engine.with_graphs(make_engine(tiny_dir))
    try:
        g = grammars.compile(GBNF)
        work = workload(6, seed=13)
        ref = [constrained_greedy_ref(eng.runner.model, p, WORDS, 16) for p, _ in work]
        streams = [eng.add_request(p, SamplingParams(max_tokens=16, grammar=g, **GREEDY)) for p, _ in work]
        assert [collect(s)[0] for s in streams] == ref
        fed = eng.runner.fed
        assert fed > 0
        params = [SamplingParams(max_tokens=12, temperature=1.2, seed=i, repetition_penalty=1.3,
                                 presence_penalty=0.5, frequency_penalty=0.2, ignore_eos=True,
                                 grammar=g if i % 2 else None) for i in range(len(work))]
        want = [collect(s)[0] for s in [eager.add_request(p, sp) for (p, _), sp in zip(work, params)]]
        got = [collect(s)[0] for s in [eng.add_request(p, sp) for (p, _), sp in zip(work, params)]]
        assert got == want and eng.runner.fed > fed
        assert_pools_full(eng)
    finally:
        eager.shutdown()
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True])
def test_gpu_grammar_engine(tiny_dir, grammars, eager):
    """On CUDA (decode graphs and pipelined steps; or eager): the same exactness."""
    eng = make_engine(tiny_dir, max_num_seqs=8, num_blocks=128, device="cuda", dtype="float32", enforce_eager=eager)
    try:
        assert bool(eng.runner.graphs) != eager
        check_mixed(eng, grammars)
        g = grammars.compile(GBNF)
        for i, (p, _) in enumerate(workload(6, seed=4)):
            sp = SamplingParams(max_tokens=16, temperature=1.5, top_k=8, seed=i, grammar=g, ignore_eos=True)
            toks, last = collect(eng.add_request(p, sp))
            assert last.finish_reason == "stop" and text_of(toks) in WORDS
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def check_mixed(engine, grammars):
    g = grammars.compile(GBNF)
    work = workload(12, seed=3)
    free_ref = alone(engine, work)
    con_ref = [constrained_greedy_ref(engine.runner.model, p, WORDS, 16) for p, _ in work]
    con = [i % 3 == 0 for i in range(len(work))]
    streams = staggered(engine, [(p, SamplingParams(max_tokens=16 if c else m, grammar=g if c else None, **GREEDY))
                                 for (p, m), c in zip(work, con)], pause=0.03)
    for c, s, fr, cr in zip(con, streams, free_ref, con_ref):
        assert collect(s)[0] == (cr if c else fr)
    assert_pools_full(engine)


@pytest.mark.parametrize("kind", ["torch", "fast", "logprobs"])
def test_sampled_outputs_are_in_the_language(engine, grammars, kind):
    g = grammars.compile(GBNF)
    extra = {"torch": dict(top_p=0.9), "fast": dict(top_k=8), "logprobs": dict(logprobs=True, top_logprobs=3)}[kind]
    work = workload(6, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=1.5, seed=i, grammar=g, ignore_eos=True, **extra)
              for i in range(len(work))]
    outs = [collect(engine.add_request(p, sp)) for (p, _), sp in zip(work, params)]
    for toks, last in outs:
        assert last.finish_reason == "stop" and text_of(toks) in WORDS, toks
    # seeded: the same tokens when the same requests run together
    together = [engine.add_request(p, sp) for (p, _), sp in zip(work, params)]
    assert [collect(s)[0] for s in together] == [t for t, _ in outs]
    if kind == "logprobs":
        toks, entries = [], []
        for out in engine.add_request(work[0][0], params[0]):
            toks += out.token_ids
            entries += out.logprobs
        assert [e["token_id"] for e in entries] == toks
        for i, e in enumerate(entries):
            ok = allowed_ref(text_of(toks[:i]), WORDS, ignore_eos=True)
            assert e["logprob"] > -1e4
            for tid, lp in e["top"]:  # tokens outside the grammar have probability 0 (the -9999 floor)
                assert lp == -9999.0 or tid in ok, (i, tid, lp)
            assert sum(lp > -9999.0 for _, lp in e["top"]) == min(len(ok), 3)
    assert_pools_full(engine)


def test_eos_ends_an_accepting_grammar(engine, grammars):
    """Without ignore_eos the EOS stop applies as usual; a complete word ends the request with or without it."""
    g = grammars.compile(GBNF)
    for p, _ in workload(4, seed=9):
        toks, last = collect(engine.add_request(p, SamplingParams(max_tokens=16, temperature=0.0,
                                                                  stop_token_ids=(EOS,), grammar=g)))
        assert last.finish_reason == "stop" and text_of(toks) in WORDS
        assert all(t < 250 for t in toks[:-1])


def test_json_schema_output_parses(engine, grammars):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    g = grammars.compile(json.dumps(schema))
    for i, (p, _) in enumerate(workload(4, seed=2)):
        toks, last = collect(engine.add_request(p[:8], SamplingParams(max_tokens=110, temperature=1.0, seed=i,
                                                                      grammar=g, stop_token_ids=(EOS,))))
        assert last.finish_reason == "stop", (text_of(toks), last.finish_reason)
        text = text_of(toks)
        assert all(re.fullmatch(r" |\n[ \t]{0,20}", w) for w in re.findall(r"\s+", text)), text  # JSON_DEFAULTS
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)


def test_max_tokens_cuts_a_grammar(engine, grammars):
    g = grammars.compile('root ::= [a-z]{10,20} "."')
    toks, last = collect(engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, grammar=g, **GREEDY)))
    assert last.finish_reason == "length" and len(toks) == 5 and text_of(toks).isalpha()


def test_preemption_keeps_the_grammar_state(tiny_dir, grammars):
    g = grammars.compile('root ::= [a-z]{20,30} "."')
    eng = make_engine(tiny_dir, num_blocks=8, max_model_len=112, max_num_batched_tokens=64)
    try:
        rng = random.Random(1)
        work = [[rng.randrange(250) for _ in range(rng.randint(20, 40))] for _ in range(6)]
        params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=g, ignore_eos=True)
                  for i in range(len(work))]
        ref = [collect(eng.add_request(p, sp))[0] for p, sp in zip(work, params)]  # one at a time: no preemption
        assert eng.stats()["preemptions"] == 0
        got = [collect(s)[0] for s in [eng.add_request(p, sp) for p, sp in zip(work, params)]]
        assert got == ref and eng.stats()["preemptions"] > 0
        for t in got:
            s = text_of(t)
            assert s.endswith(".") and 20 <= len(s) - 1 <= 30 and s[:-1].isalpha() and s[:-1].islower()
        assert_pools_full(eng)
    finally:
        eng.shutdown()


def test_a_rejected_token_fails_only_its_request(engine, grammars, monkeypatch):
    """If a mask were ever not applied, the matcher rejects the token: that request ends with an error, the others
    go on, and the pools come back full."""
    import backend.engine.sampler as sampler

    monkeypatch.setattr(sampler, "apply_masks", lambda *a: None)
    g = grammars.compile('root ::= "\\x01"+')  # a byte the tiny model's argmax essentially never picks
    bad = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, grammar=g, **GREEDY))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    toks, last = collect(bad)
    assert last.finish_reason == "error" and "grammar: token" in last.error
    gt, glast = collect(good)
    assert glast.finish_reason == "length" and len(gt) == 8
    assert_pools_full(engine)
