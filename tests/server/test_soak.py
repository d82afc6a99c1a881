"""Soak (CI variant of bench/soak.py): 64 concurrent streams of mixed prompt/output lengths for ~20 s against a
`run.sh` server with the tiny checkpoint: 0 errors, every request completes, pools back to full, Status READY, RSS
growth bounded. Also the `random_weights:true` LoadModel option and bench/soak.py's full-size model directory."""

import asyncio
import os
import shutil
import sys

import pytest

from server_harness import ROOT, pb

sys.path.insert(0, os.path.join(ROOT, "bench"))
import soak  # noqa: E402

DURATION = float(os.environ.get("KIMI_SOAK_S", "20"))


@pytest.fixture(scope="module")
def ckpt(ckpt):
    return ckpt / "tiny-kimi"


def test_random_weights_option(srv, ckpt, tmp_path):
    """A directory with config.json + tokenizer files only: refused without the option, served with it."""
    d = tmp_path / "no-weights"
    shutil.copytree(ckpt, d)
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(d / f)
    opts = dict(Model=str(d), ContextSize=128)
    r = srv.stub.LoadModel(pb.ModelOptions(Options=["dtype:float32"], **opts), timeout=300)
    assert not r.success and "no model.safetensors" in r.message, r.message
    r = srv.stub.LoadModel(pb.ModelOptions(Options=["dtype:float32", "random_weights:true"], **opts), timeout=300)
    assert r.success, r.message
    assert srv.stub.Predict(pb.PredictOptions(Prompt="hello", Tokens=4, IgnoreEOS=True), timeout=60).tokens == 4


def test_random_full_dir_matches_official_vocab(tmp_path):
    from backend.config import ModelConfig
    from backend.tokenizer import load_tokenizer

    d = soak.write_random_full_dir(str(tmp_path / "full"))
    cfg, tok = ModelConfig.from_dir(d), load_tokenizer(d)
    assert cfg.vocab_size == tok.vocab_size == 163840 and cfg.num_hidden_layers == 27
    assert tok.bos_token_id == 163584 and 163586 in tok.eos_token_ids
    text = "the engine streams tokens"
    assert tok.decode(tok.encode(text)) == text
    assert not any(f.endswith(".safetensors") for f in os.listdir(d))


def test_soak(srv, ckpt):
    r = srv.stub.LoadModel(pb.ModelOptions(Model=str(ckpt), ContextSize=512,
                                           Options=["max_num_seqs:64", "dtype:float32"]), timeout=300)
    assert r.success, r.message
    rep = asyncio.run(soak.soak(srv.addr, streams=64, duration=DURATION, prompt_lens=(8, 64, 256),
                                output_lens=(8, 32, 128), warmup=3.0, seed=1))
    soak.print_report(rep)
    assert rep["errors"] == 0, rep["error_samples"]
    assert rep["stuck"] == 0 and rep["completed"] == rep["started"] >= 64, rep
    assert rep["pools_full"] and rep["status_ready"], rep
    assert rep["ttft_p99_ms"] > 0 and rep["itl_p50_ms"] > 0
    assert rep["rss_end_mb"] - rep["rss_start_mb"] < 100, rep
    assert len(rep["rss_timeline"]) >= 6 and rep["requests_2nd_half"] > 0, rep["rss_timeline"]
    assert rep["rss_growth_2nd_half_mb"] < 50, rep["rss_timeline"]  # a leak grows with requests served
    assert srv.proc.poll() is None
