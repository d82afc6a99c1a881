"""The embedded default model (models/kimi-linear-tiny) and the demo path.

`make demo` (tools/demo.py) starts a fresh backend, loads the embedded model and streams an answer that reads as
text; `make run` serves the embedded model when no model is given (run.sh --model, preloaded at start-up); the
served model reproduces tools/train_tiny.py's training forward; Tools and a tool-result turn render into the
prompt through the real server (TokenizeString / Detokenize).
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))
MODEL = os.path.join(ROOT, "models", "kimi-linear-tiny")
LAYOUT = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tiktoken.model",
          "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md"]


def reads_as_text(text):
    """Mostly ASCII letters and spaces, and made of word-like pieces."""
    if not text.strip():
        return False
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    words = re.findall(r"[A-Za-z]{2,}", text)
    return letters / len(text) >= 0.75 and len(words) >= 5


def test_embedded_checkpoint_layout():
    for name in LAYOUT:
        assert os.path.isfile(os.path.join(MODEL, name)), name
    size = sum(os.path.getsize(os.path.join(MODEL, f)) for f in os.listdir(MODEL))
    assert size < 8 << 20, f"embedded model is {size / 2**20:.1f} MB"
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "kimi_linear" and cfg["architectures"] == ["KimiLinearForCausalLM"]
    lin = cfg["linear_attn_config"]
    assert lin["kda_layers"] and lin["full_attn_layers"] and cfg["num_experts"] > 1   # KDA + MLA + MoE
    readme = open(os.path.join(MODEL, "README.md")).read()
    assert "PSF" in readme and "pydoc_data" in readme and "train_tiny.py" in readme


def test_served_model_reproduces_training_forward():
    from backend.tokenizer import load_tokenizer
    from tools.train_tiny import check_served_model

    ids = load_tokenizer(MODEL).encode("A class definition is an executable statement that creates objects.")
    assert check_served_model(MODEL, ids) < 2e-3


def test_make_demo_streams_text():
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"tools/demo.py --model {MODEL}" in out
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--tokens", "32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("The function"), r.stdout
    answer = r.stdout[len("The function"):]
    assert reads_as_text(answer), repr(answer)
    assert "tokens/s" in r.stderr and "loaded from" in r.stderr
    print(f"demo ({time.monotonic() - t0:.0f}s): {r.stdout.strip()!r}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`run.sh --addr ... --model models/kimi-linear-tiny` (what `make run` does), READY without a LoadModel."""
    from server_harness import BackendProcess, pb

    out = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"run.sh --addr 127.0.0.1:50051 --model {MODEL}" in out
    p = BackendProcess(str(tmp_path_factory.mktemp("log") / "backend.log"), env={"KIMI_MODEL": MODEL})
    t0 = time.monotonic()
    while p.stub.Status(pb.HealthMessage()).state != pb.StatusResponse.READY:
        assert time.monotonic() - t0 < 180, p.read_log()
        assert p.proc.poll() is None, p.read_log()
        time.sleep(0.3)
    yield p
    p.close()


def test_run_serves_default_model(served):
    import torch

    from backend.model.generate import greedy_generate
    from backend.model.loader import load_model
    from backend.tokenizer import load_tokenizer
    from server_harness import pb

    tok = load_tokenizer(MODEL)
    prompt = "The value of the"
    r = served.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=16, Temperature=0), timeout=120)
    with torch.no_grad():
        ids = greedy_generate(load_model(MODEL, "cpu", torch.float32), tok.encode(prompt), 16,
                              stop_ids=tuple(tok.eos_token_ids))
    assert r.message.decode() == tok.decode([i for i in ids if i not in tok.eos_token_ids])
    assert "loading" in served.read_log() and "loaded shard" in served.read_log()   # load progress in the log
    m = served.stub.GetMetrics(pb.MetricsRequest())
    stats = json.loads(m.prompt_json_for_slot)
    assert m.tokens_generated >= 16 and m.prompt_tokens_processed == len(tok.encode(prompt))
    assert stats["queue_depth"] == 0 and stats["memory"]["total"] > 0 and "tokens_per_s" in stats
    s = served.stub.Status(pb.HealthMessage())
    assert s.state == pb.StatusResponse.READY and s.memory.total > 0 and "queue_depth" in s.memory.breakdown


def test_tools_render_through_server(served):
    from backend.tokenizer import load_tokenizer
    from server_harness import pb

    tok = load_tokenizer(MODEL)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    msgs = [pb.Message(role="user", content="Weather in Paris?"),
            pb.Message(role="assistant", content="", tool_calls=json.dumps(calls)),
            pb.Message(role="tool", content="22 C", tool_call_id="functions.get_weather:0")]
    req = pb.PredictOptions(UseTokenizerTemplate=True, Messages=msgs, Tools=json.dumps(tools), Tokens=4)
    t = served.stub.TokenizeString(req)
    text = served.stub.Detokenize(pb.DetokenizeRequest(tokens=list(t.tokens))).content
    want = tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [dict(calls[0], function={
             "name": "get_weather", "arguments": {"city": "Paris"}})]},
         {"role": "tool", "content": "22 C", "tool_call_id": "functions.get_weather:0"}], tools=tools)
    assert text == want
    assert '"name":"get_weather"' in text and "## Return of functions.get_weather:0\n22 C" in text
    r = served.stub.Predict(req, timeout=120)
    assert r.prompt_tokens == t.length
