"""End to end: `run.sh --addr` subprocess (as LocalAI spawns it) serving a tiny fp32 checkpoint on the CPU with the
real engine and model. Greedy text must equal backend/model/generate.py's greedy_generate."""

import json
import math
import os
import shutil
import threading
import time

import grpc
import pytest

from backend.toolcalls import parse_tool_calls
from server_harness import BackendProcess, pb

N = 16


def load_opts(ckpt, **kw):
    o = dict(Model="tiny-kimi", ModelPath=str(ckpt), ContextSize=256, Options=["max_num_seqs:8", "dtype:float32"])
    o.update(kw)
    return pb.ModelOptions(**o)


@pytest.fixture
def loaded(srv, ckpt):
    if srv.stub.Status(pb.HealthMessage()).state != pb.StatusResponse.READY:
        r = srv.stub.LoadModel(load_opts(ckpt), timeout=300)
        assert r.success, r.message
    return srv


@pytest.fixture(scope="module")
def reference(ckpt):
    """(tokenizer, greedy(prompt, n) -> (ids, text)) straight through the model API."""
    import torch

    from backend.model.generate import greedy_generate
    from backend.model.loader import load_model
    from backend.tokenizer import load_tokenizer

    d = str(ckpt / "tiny-kimi")
    tok = load_tokenizer(d)
    model = load_model(d, "cpu", torch.float32)

    def greedy(prompt, n=N):
        with torch.no_grad():
            ids = greedy_generate(model, tok.encode(prompt), n, stop_ids=tuple(tok.eos_token_ids))
        # the server splits Kimi tool-call markup off the content (random weights rarely emit it)
        return ids, parse_tool_calls(tok.decode([i for i in ids if i not in tok.eos_token_ids]))[0]

    return tok, greedy


def text_of(chunks):
    return b"".join(c.message for c in chunks).decode()


def test_health_fast_and_uninitialized(srv):
    assert srv.startup_s < 30, f"Health took {srv.startup_s:.1f}s (LocalAI waits ~40s)"
    assert srv.stub.Health(pb.HealthMessage()).message == b"OK"


def test_load_failures_then_good_load(srv, ckpt, tmp_path):
    def fails(opts, needle):
        r = srv.stub.LoadModel(opts, timeout=300)
        assert not r.success and needle in r.message, r.message
        assert srv.stub.Health(pb.HealthMessage()).message == b"OK"

    fails(load_opts(ckpt, Model="does-not-exist"), "not found")
    fails(load_opts(ckpt, TensorParallelSize=3), "tensor_parallel_size 3 must divide")  # 4 heads
    fails(load_opts(ckpt, EngineArgs='{"max_num_seq": 4}'), "max_num_seqs")
    fails(load_opts(ckpt, EngineArgs="{bad json"), "JSON")
    bad = tmp_path / "truncated"
    shutil.copytree(ckpt / "tiny-kimi", bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".safetensors"))[-1]
    size = os.path.getsize(bad / shard)
    with open(bad / shard, "r+b") as f:
        f.truncate(size // 2)
    fails(load_opts(ckpt, Model=str(bad)), shard)
    assert srv.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.ERROR
    code = None
    try:
        srv.stub.Predict(pb.PredictOptions(Prompt="x"))
    except grpc.RpcError as e:
        code = e.code()
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # the next good request is served; Health answers while the model loads
    seen, done = [], threading.Event()
    result = {}

    def load():
        result["r"] = srv.stub.LoadModel(load_opts(ckpt, ModelFile=str(ckpt / "tiny-kimi"), Model="tiny-kimi"),
                                         timeout=300)
        done.set()

    t = threading.Thread(target=load)
    t.start()
    while not done.is_set():
        t0 = time.monotonic()
        assert srv.stub.Health(pb.HealthMessage(), timeout=5).message == b"OK"
        assert time.monotonic() - t0 < 2.0
        seen.append(srv.stub.Status(pb.HealthMessage(), timeout=5).state)
        time.sleep(0.1)
    t.join()
    assert result["r"].success, result["r"].message
    assert "max_model_len=256" in result["r"].message
    assert pb.StatusResponse.BUSY in seen
    assert srv.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hello", Tokens=4)).tokens >= 1


def test_greedy_matches_model_api(loaded, reference):
    tok, greedy = reference
    for prompt in ("Hello world", "人工智能是计算机科学的一个分支"):
        ids, text = greedy(prompt)
        r = loaded.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=N, Temperature=0, TopK=-1, TopP=0.95))
        assert r.message.decode() == text
        assert r.tokens == len(ids) and r.prompt_tokens == len(tok.encode(prompt))
        chunks = list(loaded.stub.PredictStream(pb.PredictOptions(Prompt=prompt, Tokens=N, Temperature=0)))
        assert text_of(chunks) == text
        final = chunks[-1]
        assert final.tokens == len(ids) and final.prompt_tokens == r.prompt_tokens
        assert final.timing_prompt_processing > 0 and final.timing_token_generation > 0


def test_tokenize_string_equals_tokenizer(loaded, reference):
    tok, _ = reference
    for text in ("Hello world", "def f(x):\n  return x", "你好 🎉"):
        r = loaded.stub.TokenizeString(pb.PredictOptions(Prompt=text))
        assert list(r.tokens) == tok.encode(text) and r.length == len(r.tokens)
    msgs = [pb.Message(role="user", content="hi")]
    r = loaded.stub.TokenizeString(pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs))
    assert list(r.tokens) == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))


def test_chat_request_through_template(loaded, reference):
    tok, greedy = reference
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is Kimi?"}], add_generation_prompt=True)
    _, text = greedy(prompt)
    r = loaded.stub.Predict(pb.PredictOptions(UseTokenizerTemplate=True, Tokens=N,
                                              Messages=[pb.Message(role="user", content="What is Kimi?")]))
    assert r.prompt_tokens == len(tok.encode(prompt))
    assert r.message.decode() == text


def req(prompt="Once upon a time", n=N, **kw):
    kw.setdefault("Temperature", 1.0)
    return pb.PredictOptions(Prompt=prompt, Tokens=n, **kw)


def run_all(stub, reqs):
    """Predict many requests at once (the engine batches them) -> texts, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as ex:
        return [r.message.decode() for r in ex.map(lambda q: stub.Predict(q, timeout=300), reqs)]


def test_seeded_sampling_reproducible(loaded, reference):
    _, greedy = reference
    a, a2, *others = run_all(loaded.stub, [req(Seed=1234), req(Seed=1234), req(Seed=1), req(Seed=2), req(Seed=3)])
    assert a2 == a
    assert len(set(others) | {a}) > 1, "different seeds never changed the sample"
    assert (set(others) | {a}) != {greedy("Once upon a time")[1]}, "temperature 1 looks greedy"


def test_sampling_parameters_have_effect(loaded, reference):
    tok, greedy = reference
    prompt = "Once upon a time"
    g = greedy(prompt)[1]
    hot = dict(Temperature=5.0)
    # filters that keep only the argmax make a hot sampler greedy, while the hot sampler alone is not
    filtered = [req(prompt, Seed=seed, **f, **hot) for seed in (11, 12)
                for f in (dict(TopK=1), dict(TopP=1e-6), dict(MinP=1.0))]
    plain = [req(prompt, Seed=s, **hot) for s in (11, 12, 13)]
    # penalties change greedy decoding somewhere over a few prompts
    prompts = ["Once upon a time", "the the the the the", "Hello, world! Hello, world!"]
    penal = [(field, value) for field, value in (("Penalty", 3.0), ("PresencePenalty", 2.0),
                                                 ("FrequencyPenalty", 2.0))]
    penal_reqs = [req(p, n=24, Temperature=0, **{f: v}) for f, v in penal for p in prompts]
    out = run_all(loaded.stub, filtered + plain + penal_reqs)
    assert out[:len(filtered)] == [g] * len(filtered)
    assert any(o != g for o in out[len(filtered):len(filtered) + len(plain)])
    base = [greedy(p, 24)[1] for p in prompts]
    pen_out = out[len(filtered) + len(plain):]
    for k, (field, value) in enumerate(penal):
        assert pen_out[k * 3:(k + 1) * 3] != base, f"{field}={value} had no effect"
    # logit bias forces a token
    tid = tok.encode(" the")[0]
    r = loaded.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=5, Temperature=0,
                                              LogitBias=json.dumps({str(tid): 100})))
    assert r.message.decode() == tok.decode([tid] * 5) and r.tokens == 5
    # Tokens caps the output; IgnoreEOS keeps going through EOS (biased to EOS to make sure it comes)
    eos = tok.eos_token_ids[0]
    r = loaded.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=6, Temperature=0,
                                              LogitBias=json.dumps({str(eos): 100})))
    assert r.tokens == 1 and r.message == b""
    r = loaded.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=6, Temperature=0, IgnoreEOS=True,
                                              LogitBias=json.dumps({str(eos): 100})))
    assert r.tokens == 6


def test_stop_prompts_and_logprobs(loaded, reference):
    tok, greedy = reference
    ids, text = greedy("Hello world", 24)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop:
        r = loaded.stub.Predict(pb.PredictOptions(Prompt="Hello world", Tokens=24, StopPrompts=[stop]))
        assert r.message.decode() == text[:text.index(stop)]
        chunks = list(loaded.stub.PredictStream(pb.PredictOptions(Prompt="Hello world", Tokens=24,
                                                                  StopPrompts=[stop])))
        assert text_of(chunks) == text[:text.index(stop)]
    r = loaded.stub.Predict(pb.PredictOptions(Prompt="Hello world", Tokens=8, Logprobs=3, TopLogprobs=3))
    lp = json.loads(r.logprobs)["content"]
    assert [e["id"] for e in lp] == ids[:8]
    for e in lp:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["id"] == e["id"]  # greedy: the chosen token is the most likely
        assert math.isclose(e["top_logprobs"][0]["logprob"], e["logprob"], abs_tol=1e-4)


def test_bad_inputs_invalid_argument_server_survives(loaded):
    bad = [dict(Temperature=math.nan), dict(Temperature=-1.0), dict(LogitBias="{"), dict(Tools="nope"),
           dict(Prompt="word " * 400)]
    for kw in bad:
        req = pb.PredictOptions(**{"Prompt": "hi", "Tokens": 2, **kw})
        with pytest.raises(grpc.RpcError) as ei:
            loaded.stub.Predict(req)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            list(loaded.stub.PredictStream(req))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert loaded.stub.Health(pb.HealthMessage()).message == b"OK"
    assert loaded.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=2)).tokens >= 1
    # max_tokens larger than the context is capped to what fits, not refused
    r = loaded.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=100000, Temperature=0,
                                              LogitBias=json.dumps({"0": 100})))
    assert r.tokens == 256 - r.prompt_tokens


# what LocalAI sends for response_format {"type": "json_schema", ...} (its json-schema-to-GBNF converter's shape)
SCHEMA_GBNF = r"""space ::= " "?
boolean ::= ("true" | "false") space
count ::= ("1" | "2" | "3") space
root-ok-kv ::= "\"ok\"" space ":" space boolean
root-n-kv ::= "\"n\"" space ":" space count
root ::= "{" space root-ok-kv "," space root-n-kv "}" space
"""


def test_grammar_constrains_output(loaded):
    """PredictOptions.Grammar (GBNF): Predict and PredictStream give text of the grammar's language, the same text
    with a fixed seed, and a free request beside constrained ones is unchanged; a bad grammar is INVALID_ARGUMENT."""
    free = pb.PredictOptions(Prompt="Give me JSON", Tokens=N, Temperature=0)
    free_text = loaded.stub.Predict(free).message.decode()
    outs = []
    for seed in range(1, 4):
        req = pb.PredictOptions(Prompt="Give me JSON", Tokens=64, Temperature=0.8, Seed=seed, Grammar=SCHEMA_GBNF)
        text = loaded.stub.Predict(req).message.decode()
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3), text
        assert text_of(list(loaded.stub.PredictStream(req))) == text
        outs.append(text)
    results = [None] * 4

    def run(i):
        req = free if i == 0 else pb.PredictOptions(Prompt="Give me JSON", Tokens=64, Temperature=0.8, Seed=i,
                                                    Grammar=SCHEMA_GBNF)
        results[i] = text_of(list(loaded.stub.PredictStream(req, timeout=120)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == [free_text] + outs
    yes_no = loaded.stub.Predict(pb.PredictOptions(Prompt="Answer:", Tokens=16, Temperature=0,
                                                   Grammar='root ::= "yes" | "no"'))
    assert yes_no.message.decode() in ("yes", "no")
    with pytest.raises(grpc.RpcError) as ei:
        loaded.stub.Predict(pb.PredictOptions(Prompt="hi", Grammar="root ::= missing-rule"))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in ei.value.details()
    assert loaded.stub.Health(pb.HealthMessage()).message == b"OK"


def test_tool_choice_forces_a_valid_call(srv, ckpt):
    """ToolChoice "required" / a named function: the tiny random model answers with tool calls (ChatDelta.tool_calls,
    no markup in the text) whose arguments satisfy the function's schema."""
    # the tiny tokenizer spends about a token per character of the tool declarations: a longer context
    r = srv.stub.LoadModel(load_opts(ckpt, ContextSize=1024), timeout=300)
    assert r.success, r.message
    weather = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"u": {"enum": ["c", "f"]}, "d": {"type": "integer", "maximum": 7}},
        "required": ["u", "d"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "t", "parameters": {
        "properties": {"z": {"type": "boolean"}}, "required": ["z"], "additionalProperties": False}}}
    for choice, names in (('"required"', {"w", "t"}), ('{"type": "function", "function": {"name": "t"}}', {"t"})):
        for seed in (1, 2):
            r = srv.stub.Predict(pb.PredictOptions(
                UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content="Weather?")],
                Tools=json.dumps([weather, clock]), ToolChoice=choice, Tokens=600, Temperature=1.0, Seed=seed))
            calls = r.chat_deltas[0].tool_calls
            assert r.tokens < 600  # the grammar ended the answer (after the call section), not the token limit
            assert calls and "<|tool" not in r.message.decode() and not r.message.decode().strip(), r
            for c in calls:
                assert c.name in names
                args = json.loads(c.arguments)
                if c.name == "w":
                    assert args["u"] in ("c", "f") and args["d"] <= 7 and set(args) == {"u", "d"}
                else:
                    assert set(args) == {"z"} and isinstance(args["z"], bool)
            if choice != '"required"':
                assert len(calls) == 1
    assert srv.stub.LoadModel(load_opts(ckpt), timeout=300).success  # back to the module's settings


def test_concurrent_streams_match_solo(loaded):
    prompts = [f"Request number {i}: tell me about item {i * 7}" for i in range(8)]
    solo = [loaded.stub.Predict(pb.PredictOptions(Prompt=p, Tokens=N, Temperature=0)).message.decode()
            for p in prompts]
    results, errors = [None] * 8, []

    def run(i):
        try:
            chunks = list(loaded.stub.PredictStream(pb.PredictOptions(Prompt=prompts[i], Tokens=N, Temperature=0),
                                                    timeout=120))
            results[i] = (text_of(chunks), chunks[-1].tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    assert loaded.stub.Health(pb.HealthMessage(), timeout=5).message == b"OK"
    assert time.monotonic() - t0 < 2.0
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert [r[0] for r in results] == solo
    assert all(r[1] >= 1 for r in results)


def test_cancel_frees_engine_request(loaded):
    """A client cancelling its stream after the first chunk aborts the engine request: it is counted as aborted,
    not finished, and far fewer than its 200 tokens are made (a server that let it run would make all 200)."""
    before = json.loads(loaded.stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)
    it = loaded.stub.PredictStream(pb.PredictOptions(Prompt="Tell me a long story", Tokens=200, IgnoreEOS=True))
    next(it)
    it.cancel()
    deadline = time.monotonic() + 20
    stats = {}
    while time.monotonic() < deadline:
        stats = json.loads(loaded.stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)
        if stats.get("running", 0) == 0 and stats.get("waiting", 0) == 0 and stats.get("active_requests") == 0:
            break
        time.sleep(0.1)
    assert stats.get("running") == 0 and stats.get("active_requests") == 0, stats
    assert stats.get("free_slots") == stats.get("num_slots") - 1 or stats.get("free_slots") == stats.get("num_slots")
    assert stats["aborted"] == before["aborted"] + 1 and stats["finished"] == before["finished"], (before, stats)
    assert stats["output_tokens"] - before["output_tokens"] < 150, (before, stats)
    assert loaded.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=2)).tokens >= 1


def test_prefix_cache_multi_turn(srv, ckpt, reference):
    """options prefix_cache_slots: the second turn of a chat starts after the first turn's cached prompt, a new
    conversation with the same system prompt after that system prompt (GetMetrics counts the hits); the texts are
    the from-scratch greedy texts."""
    tok, greedy = reference
    r = srv.stub.LoadModel(load_opts(ckpt, Options=["max_num_seqs:8", "dtype:float32", "prefix_cache_slots:8",
                                                    "prefix_cache_min_tokens:8"]), timeout=300)
    assert r.success, r.message
    system = {"role": "system", "content": "You are a weather assistant. Answer briefly and precisely."}
    turn1 = [system, {"role": "user", "content": "Tell me about the weather in Paris in spring."}]
    chat = lambda msgs: pb.PredictOptions(UseTokenizerTemplate=True, Tokens=N, Temperature=0,  # noqa: E731
                                          Messages=[pb.Message(**m) for m in msgs])
    metrics = lambda: json.loads(srv.stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)  # noqa: E731
    a1 = srv.stub.Predict(chat(turn1)).message.decode()
    assert metrics()["prefix_cache_entries"] == 2  # the prompt, and the system part before the first user message
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And in autumn?"}]
    a2 = srv.stub.Predict(chat(turn2)).message.decode()
    prompt1 = tok.encode(tok.apply_chat_template(turn1, add_generation_prompt=True))
    stats = metrics()
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_hit_tokens"] == len(prompt1), stats
    assert a2 == greedy(tok.apply_chat_template(turn2, add_generation_prompt=True))[1]
    other = [system, {"role": "user", "content": "Is it windy in Lyon?"}]  # a new conversation, same system prompt
    a3 = srv.stub.Predict(chat(other)).message.decode()
    assert a3 == greedy(tok.apply_chat_template(other, add_generation_prompt=True))[1]
    stats = metrics()
    sys_tokens = stats["prefix_cache_hit_tokens"] - len(prompt1)
    assert stats["prefix_cache_hits"] == 2 and 10 < sys_tokens < len(prompt1), stats
    assert prompt1[sys_tokens] == tok.token_to_id("<|im_user|>")  # it ended where the user message starts
    stats0 = stats
    turn3 = turn2 + [{"role": "assistant", "content": a2}, {"role": "user", "content": "Thanks."}]
    srv.stub.Predict(chat(turn3))
    stats = metrics()  # turn 3 starts after turn 2's prompt; the system part is cached already: one entry more
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_entries"] == stats0["prefix_cache_entries"] + 1
    assert srv.stub.Free(pb.HealthMessage()).success


def ref_logprobs(ckpt, ids, start):
    """log P(ids[i] | ids[:i]) for i >= start, from the independent reference model (tests/reference_model.py)."""
    import torch

    from tests.reference_model import reference_logits

    lp = torch.log_softmax(reference_logits(str(ckpt / "tiny-kimi"), ids), dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(start, len(ids))]


def joint(tok, prompt, cand):
    """The candidate's tokens as the Score RPC takes them: the prompt + candidate text tokenized together, from where
    they leave the prompt's tokens (BOS first for an empty prompt) -> (ids, start)."""
    p, ids = tok.encode(prompt) if prompt else [], tok.encode(prompt + cand)
    d = next((i for i, (a, b) in enumerate(zip(p, ids)) if a != b), min(len(p), len(ids)))
    return ([tok.bos_token_id] + ids, 1) if d == 0 else (ids, d)


def check_scores(tok, ckpt, prompt, cands, reply, normalize=True, per_token=True):
    assert len(reply.candidates) == len(cands)
    for c, row in zip(cands, reply.candidates):
        ids, d = joint(tok, prompt, c)
        ref = ref_logprobs(ckpt, ids, d) if d < len(ids) else []
        assert row.num_tokens == len(ids) - d
        assert row.log_prob == pytest.approx(sum(ref), abs=1e-3)
        if normalize:
            assert row.length_normalized_log_prob == pytest.approx(sum(ref) / len(ref) if ref else 0.0, abs=1e-3)
        if per_token:
            assert [t.log_prob for t in row.tokens] == pytest.approx(ref, abs=2e-4)
            assert "".join(t.token for t in row.tokens) == tok.decode(ids[d:])
        else:
            assert not row.tokens and row.length_normalized_log_prob == 0.0


def test_score_matches_reference(loaded, ckpt, reference):
    """Score: each candidate's log-probability given the prompt, token by token, against the reference model; an
    empty candidate scores 0; an empty prompt scores after BOS; bad input is INVALID_ARGUMENT."""
    tok, _ = reference
    prompt, cands = "The capital of France is", [" Paris", " Lyon, then Marseille.", "", " Paris"]
    r = loaded.stub.Score(pb.ScoreRequest(prompt=prompt, candidates=cands, include_token_logprobs=True,
                                          length_normalize=True), timeout=60)
    check_scores(tok, ckpt, prompt, cands, r)
    # the same candidate twice: the same score up to fp32 rounding, not bit for bit (on some CPUs the rows of one
    # fp32 GEMM, and GEMMs of other batch shapes, round differently: 4e-6 on one token on an AVX-512 EPYC)
    assert r.candidates[0].log_prob == pytest.approx(r.candidates[3].log_prob, abs=1e-4)
    # a candidate that merges with the prompt's last token is scored from where the joined tokens part
    r = loaded.stub.Score(pb.ScoreRequest(prompt="Once upon a ", candidates=["time", " time"],
                                          include_token_logprobs=True), timeout=60)
    check_scores(tok, ckpt, "Once upon a ", ["time", " time"], r, normalize=False)
    assert joint(tok, "Once upon a ", "time")[1] == len(tok.encode("Once upon a ")) - 1  # " " + "t" merge
    r = loaded.stub.Score(pb.ScoreRequest(prompt="", candidates=["Once upon a time"]), timeout=60)
    check_scores(tok, ckpt, "", ["Once upon a time"], r, normalize=False, per_token=False)
    assert not loaded.stub.Score(pb.ScoreRequest(prompt="x", candidates=[]), timeout=60).candidates
    with pytest.raises(grpc.RpcError) as ei:
        loaded.stub.Score(pb.ScoreRequest(prompt="x", candidates=["y" * 2000]), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        loaded.stub.Score(pb.ScoreRequest(prompt="x", candidates=["y"], ModelIdentity="other"), timeout=60)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert loaded.stub.Predict(req(), timeout=60).message  # the server still serves


def test_score_cancelled_frees_everything(loaded):
    """A Score call whose client gives up (deadline) aborts its candidates: the pools come back full."""
    metrics = lambda: json.loads(loaded.stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)  # noqa: E731
    with pytest.raises(grpc.RpcError) as ei:
        loaded.stub.Score(pb.ScoreRequest(prompt="Once upon a time", candidates=[" and then" * 25] * 8), timeout=0.05)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics()
        if m["running"] == m["waiting"] == 0 and m["free_blocks"] == m["num_blocks"]:
            break
        time.sleep(0.05)
    assert m["running"] == m["waiting"] == 0 and m["free_blocks"] == m["num_blocks"], m
    assert m["aborted"] > 0, m


def test_score_reuses_the_prompt_with_the_prefix_cache(srv, ckpt, reference):
    """With the prefix cache, the first candidate caches the prompt and the others start after it; the next call
    with the same stable prefix (stable_prefix_len) starts after that; the scores are the reference's."""
    tok, _ = reference
    r = srv.stub.LoadModel(load_opts(ckpt, Options=["max_num_seqs:8", "dtype:float32", "prefix_cache_slots:8",
                                                    "prefix_cache_min_tokens:4"]), timeout=300)
    assert r.success, r.message
    metrics = lambda: json.loads(srv.stub.GetMetrics(pb.MetricsRequest()).prompt_json_for_slot)  # noqa: E731
    stable = "Classify the ticket as billing, outage or other. Ticket: "
    cands = [" billing", " outage", " other"]
    prompts = [stable + "my invoice is wrong", stable + "the site is down again"]
    for i, prompt in enumerate(prompts):
        r = srv.stub.Score(pb.ScoreRequest(prompt=prompt, candidates=cands, include_token_logprobs=True,
                                           stable_prefix_len=len(stable.encode())), timeout=60)
        check_scores(tok, ckpt, prompt, cands, r, normalize=False)
        stats = metrics()
        ids = tok.encode(prompt)
        if i == 0:  # candidates 2 and 3 start after the prompt less its last token
            assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_hit_tokens"] == 2 * (len(ids) - 1)
    stable_ids = tok.encode(stable)
    k = next(i for i, (a, b) in enumerate(zip(stable_ids + [-1], ids)) if a != b)  # the stable tokens both share
    hit = stats["prefix_cache_hit_tokens"] - 2 * (len(tok.encode(prompts[0])) - 1)
    assert stats["prefix_cache_hits"] == 5 and hit == k + 2 * (len(ids) - 1), stats
    assert srv.stub.Free(pb.HealthMessage()).success


def test_free_then_predict_is_failed_precondition(loaded):
    r = loaded.stub.Free(pb.HealthMessage())
    assert r.success
    assert loaded.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.UNINITIALIZED
    with pytest.raises(grpc.RpcError) as ei:
        loaded.stub.Predict(pb.PredictOptions(Prompt="hi"))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert loaded.stub.Health(pb.HealthMessage()).message == b"OK"


def test_sigterm_stops_promptly(tmp_path):
    p = BackendProcess(str(tmp_path / "sigterm.log"))
    try:
        p.proc.terminate()
        assert p.proc.wait(15) == 0, p.read_log()
    finally:
        p.close()
