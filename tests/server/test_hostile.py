"""Hostile checkpoints and chat templates through a real `run.sh` server (tiny checkpoint): LoadModel refuses each
damaged checkpoint with a message naming the problem before anything large is allocated, nothing from the model
directory is ever executed or unpickled, a template that reaches Python internals or does not end fails only that
request with INVALID_ARGUMENT, and the server keeps serving (the next good LoadModel works)."""

import json
import os
import pickle
import shutil
import struct
import threading
import time

import grpc
import pytest

from server_harness import pb

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def load_opts(path, **kw):
    o = dict(Model=str(path), ContextSize=128, Options=["max_num_seqs:4", "dtype:float32"])
    o.update(kw)
    return pb.ModelOptions(**o)


# ------------------------------------------------------------------------------------------ file surgery

def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_st(path, header, data, header_len=None):
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if header_len is None else header_len))
        f.write(blob)
        f.write(data)


def edit_header(d, edit, shard=SHARD2, header_len=None):
    header, data = read_st(d / shard)
    edit(header)
    write_st(d / shard, header, data, header_len)


def tensors(header):
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def past_eof(h):
    name, e = tensors(h)[-1]
    rows = e["shape"][0]
    b, end = e["data_offsets"]
    e["shape"][0] = rows * 4
    e["data_offsets"] = [b, b + (end - b) * 4]


def overlap(h):
    by_size = {}
    for name, e in tensors(h):
        by_size.setdefault((e["dtype"], e["data_offsets"][1] - e["data_offsets"][0]), []).append(e)
    a, b = next(v for v in by_size.values() if len(v) >= 2)[:2]
    b["data_offsets"] = list(a["data_offsets"])


def bad_dtype(h):
    tensors(h)[0][1]["dtype"] = "I32"  # same item size: only the dtype check can catch it


def edit_json(d, name, edit):
    with open(d / name) as f:
        obj = json.load(f)
    edit(obj)
    with open(d / name, "w") as f:
        json.dump(obj, f)


def tok_vocab(d):
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(str(d)).vocab_size


class Evil:
    """Unpickling this creates the marker file (a stand-in for arbitrary code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickle_only(d):
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f == INDEX:
            os.remove(d / f)
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": Evil(str(d / "PICKLE_RAN"))}, f)


def layers_not_covered(c):
    c["linear_attn_config"]["kda_layers"] = c["linear_attn_config"]["kda_layers"][1:]


# (case id, damage(dir), needle in the LoadModel message)
CASES = [
    ("offsets-past-eof", lambda d: edit_header(d, past_eof), "past the end of the file"),
    ("overlapping-tensors", lambda d: edit_header(d, overlap), "overlap"),
    ("huge-header-length", lambda d: edit_header(d, lambda h: None, header_len=1 << 40), "header length"),
    ("header-not-json", lambda d: (d / SHARD1).write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 64),
     "header is not valid JSON"),
    ("unsupported-dtype", lambda d: edit_header(d, bad_dtype), "dtype 'I32'"),
    ("truncated-shard", lambda d: os.truncate(d / SHARD1, os.path.getsize(d / SHARD1) // 2), SHARD1),
    ("index-names-missing-shard",
     lambda d: edit_json(d, INDEX, lambda i: i["weight_map"].update(
         {next(iter(i["weight_map"])): "model-00003-of-00003.safetensors"})),
     "missing shard file model-00003-of-00003.safetensors"),
    ("index-path-traversal",
     lambda d: edit_json(d, INDEX, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): "../../x"})),
     "bad shard name"),
    ("heads-not-dividing", lambda d: edit_json(d, "config.json", lambda c: c.update(num_key_value_heads=3)),
     "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    ("layer-lists-not-covering", lambda d: edit_json(d, "config.json", layers_not_covered),
     "are in neither kda_layers nor full_attn_layers"),
    ("absurd-hidden-size", lambda d: edit_json(d, "config.json", lambda c: c.update(hidden_size=1 << 30)),
     "hidden_size = 1073741824 is out of range"),
    ("huge-but-legal-dims", lambda d: edit_json(d, "config.json", lambda c: c.update(
        vocab_size=1 << 22, hidden_size=1 << 16)), "tensor model.embed_tokens.weight has shape"),
    ("vocab-smaller-than-tokenizer",
     lambda d: edit_json(d, "config.json", lambda c: c.update(vocab_size=tok_vocab(d) - 1)),
     "the tokenizer has"),
    ("config-not-json", lambda d: (d / "config.json").write_text("{\"vocab_size\": "), "config.json"),
    ("tiktoken-garbage", lambda d: (d / "tiktoken.model").write_bytes(b"!!! not base64 !!!\n\x00\xff 12\n"),
     "cannot parse tiktoken model"),
    ("tokenizer-config-not-json", lambda d: (d / "tokenizer_config.json").write_text("{'single': quotes}"),
     "tokenizer_config.json: not valid JSON"),
    ("pickle-weights-only", pickle_only, "no model.safetensors.index.json or model.safetensors"),
]


def alive(srv):
    assert srv.proc.poll() is None, srv.read_log()
    assert srv.stub.Health(pb.HealthMessage(), timeout=10).message == b"OK"


def rss(srv):
    return srv.stub.Status(pb.HealthMessage(), timeout=10).memory.breakdown["rss"]


@pytest.mark.parametrize("case, damage, needle", CASES, ids=[c[0] for c in CASES])
def test_hostile_checkpoint_refused(srv, ckpt, tmp_path, case, damage, needle):
    d = tmp_path / case
    shutil.copytree(ckpt / "tiny-kimi", d)
    damage(d)
    rss0 = rss(srv)
    r = srv.stub.LoadModel(load_opts(d), timeout=300)
    assert not r.success and needle in r.message, r.message
    alive(srv)
    assert rss(srv) - rss0 < 512 << 20, "a refused checkpoint allocated a lot of memory"
    assert srv.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.ERROR
    with pytest.raises(grpc.RpcError) as ei:
        srv.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=2), timeout=30)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and needle in ei.value.details()
    assert not (d / "PICKLE_RAN").exists()


REMOTE_CODE = """
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{name}.RAN"), "w").write("executed")
"""


def test_remote_code_never_runs(srv, ckpt, tmp_path):
    """A checkpoint shipping trust_remote_code files (auto_map points at them) loads and serves with our own model
    and tokenizer; none of its Python files is imported."""
    d = tmp_path / "remote-code"
    shutil.copytree(ckpt / "tiny-kimi", d)
    names = ("modeling_kimi", "configuration_kimi", "tokenization_kimi", "__init__")
    for name in names:
        (d / f"{name}.py").write_text(REMOTE_CODE.format(name=name))
    edit_json(d, "tokenizer_config.json", lambda c: c.update(
        auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}))
    with open(d / "extra.pkl", "wb") as f:
        pickle.dump(Evil(str(d / "PICKLE_RAN")), f)
    r = srv.stub.LoadModel(load_opts(d), timeout=300)
    assert r.success, r.message
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hi", Tokens=3), timeout=60).tokens >= 1
    msgs = [pb.Message(role="user", content="hello")]
    assert srv.stub.Predict(pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs, Tokens=3),
                            timeout=60).tokens >= 1
    srv.stub.TokenizeString(pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs), timeout=60)
    ran = [p for p in os.listdir(d) if p.endswith(".RAN")] + [p for p in os.listdir(d) if p == "PICKLE_RAN"]
    assert not ran, f"code from the model directory ran: {ran}"


HOSTILE_TEMPLATE = r"""{%- set m = messages[0].content -%}
{%- macro f(n) -%}{{ f(n + 1) }}{%- endmacro -%}
{%- if m == 'mro' -%}{{ messages.__class__.__mro__[1].__subclasses__() }}
{%- elif m == 'globals' -%}{{ raise_exception.__globals__['os'].system('touch TEMPLATE_RAN') }}
{%- elif m == 'loop' -%}{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}
{%- elif m == 'recurse' -%}{{ f(0) }}
{%- elif m == 'big' -%}{{ 'x' * 1000000000 }}
{%- elif m == 'format' -%}{{ '%999999999999d' % 1 }}
{%- elif m == 'raise' -%}{{ raise_exception('roles must alternate') }}
{%- else -%}{% for msg in messages %}<|im_user|>{{ msg.content }}<|im_end|>{% endfor %}<|im_assistant|>
{%- endif -%}"""


@pytest.mark.parametrize("trigger, needle", [
    ("mro", "blocked by the sandbox"), ("globals", "blocked by the sandbox"), ("loop", "exceeded"),
    ("recurse", "recursed too deeply"), ("big", "too large"), ("format", "huge width"),
    ("raise", "roles must alternate"),
])
def test_hostile_chat_template(srv, ckpt, tmp_path_factory, trigger, needle):
    """INVALID_ARGUMENT (not INTERNAL): the rendered prompt is part of the request, a template that refuses these
    messages is a refused request (HF's raise_exception for bad role order is the common case), and retrying
    the same request cannot succeed. The server answers Health meanwhile and serves the next request."""
    d = tmp_path_factory.getbasetemp() / "hostile-template"
    if not d.exists():
        shutil.copytree(ckpt / "tiny-kimi", d)
        (d / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    r = srv.stub.LoadModel(load_opts(d), timeout=300)
    assert r.success, r.message
    req = pb.PredictOptions(UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content=trigger)], Tokens=2)
    slowest = [0.0]
    stop = threading.Event()

    def probe():  # the event loop stays responsive while a template burns its budget (it renders in a thread)
        while not stop.is_set():
            t0 = time.monotonic()
            srv.stub.Health(pb.HealthMessage(), timeout=10)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            time.sleep(0.05)

    t = threading.Thread(target=probe)
    t.start()
    try:
        for call in (srv.stub.Predict, lambda q, timeout: list(srv.stub.PredictStream(q, timeout=timeout)),
                     srv.stub.TokenizeString):
            with pytest.raises(grpc.RpcError) as ei:
                call(req, timeout=60)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
            assert "chat template" in ei.value.details() and needle in ei.value.details(), ei.value.details()
    finally:
        stop.set()
        t.join()
    assert slowest[0] < 2.0, f"Health took {slowest[0]:.1f}s while a template rendered"
    alive(srv)
    ok = pb.PredictOptions(UseTokenizerTemplate=True, Messages=[pb.Message(role="user", content="hello")], Tokens=2)
    assert srv.stub.Predict(ok, timeout=60).tokens >= 1
    assert srv.stub.Predict(pb.PredictOptions(Prompt="plain", Tokens=2), timeout=60).tokens >= 1
    assert not (d / "TEMPLATE_RAN").exists() and not os.path.exists("TEMPLATE_RAN")


def test_good_load_after_hostile_inputs(srv, ckpt):
    r = srv.stub.LoadModel(load_opts(ckpt / "tiny-kimi"), timeout=300)
    assert r.success, r.message
    assert srv.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.READY
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hello", Tokens=3), timeout=60).tokens >= 1


@pytest.mark.parametrize("opts", [
    dict(Options=["dtype:float32", "num_blocks:99999999999"]),
    dict(Options=["dtype:float32"], EngineArgs='{"max_model_len": 1099511627776}'),
    dict(Options=["dtype:float32", "num_slots:2000000000", "max_num_seqs:4"]),
    dict(Options=["dtype:float32", "block_size:1000000000000", "num_blocks:4"]),
], ids=["num_blocks", "max_model_len", "num_slots", "block_size"])
def test_absurd_memory_settings_refused(srv, ckpt, opts):
    """Cache sizes beyond the free memory are refused with the numbers, before anything is allocated."""
    rss0 = rss(srv)
    r = srv.stub.LoadModel(pb.ModelOptions(Model=str(ckpt / "tiny-kimi"), **opts), timeout=300)
    assert not r.success and "GiB is free" in r.message, r.message
    alive(srv)
    assert rss(srv) - rss0 < 512 << 20


@pytest.mark.parametrize("case", ["overlapping-tensors", "vocab-smaller-than-tokenizer", "tiktoken-garbage",
                                  "layer-lists-not-covering"])
def test_hostile_checkpoint_keeps_serving_model(srv, ckpt, tmp_path, case):
    """With a model loaded, a damaged checkpoint is refused by the cheap checks before the serving model is touched:
    it keeps serving (Status READY), running requests are not disturbed."""
    r = srv.stub.LoadModel(load_opts(ckpt / "tiny-kimi"), timeout=300)
    assert r.success, r.message
    _, damage, needle = next(c for c in CASES if c[0] == case)
    d = tmp_path / case
    shutil.copytree(ckpt / "tiny-kimi", d)
    damage(d)
    it = srv.stub.PredictStream(pb.PredictOptions(Prompt="running", Tokens=40, IgnoreEOS=True), timeout=60)
    next(it)
    r = srv.stub.LoadModel(load_opts(d), timeout=300)
    assert not r.success and needle in r.message and "keeps serving" in r.message, r.message
    assert sum(1 for _ in it) >= 1  # the running stream finishes normally
    assert srv.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.READY
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hello", Tokens=3), timeout=60).tokens == 3
