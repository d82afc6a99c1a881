import json
import os
import subprocess
import sys

import torch

from backend.model.generate import greedy_generate
from backend.model.loader import load_model
from tests.reference_model import reference_logits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_greedy_matches_reference_argmax(fp32_model, fp32_dir):
    ids = [3, 141, 59, 26, 53, 58, 97]
    out = greedy_generate(fp32_model, ids, 8)
    ref = reference_logits(fp32_dir, ids + out[:-1])
    assert out == ref[len(ids) - 1:].argmax(-1).tolist()
    assert len(set(out)) > 2


def test_chunked_prefill_and_stop_ids(fp32_model):
    ids = list(range(40, 61))
    out = greedy_generate(fp32_model, ids, 10)
    assert greedy_generate(fp32_model, ids, 10, prefill_chunk=4) == out
    stop = out[3]
    assert greedy_generate(fp32_model, ids, 10, stop_ids={stop}) == out[:out.index(stop) + 1]
    assert greedy_generate(fp32_model, ids, 0) == []


def test_tool_checkpoint_layout(bf16_dir):
    files = set(os.listdir(bf16_dir))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tiktoken.model",
            "tokenizer_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= files
    assert not any(f.endswith(".safetensors") and "-of-" not in f for f in files)
    with open(os.path.join(bf16_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(bf16_dir, "tokenizer_config.json")) as f:
        specials = {t["content"]: int(i) for i, t in json.load(f)["added_tokens_decoder"].items()}
    assert cfg["model_type"] == "kimi_linear" and cfg["architectures"] == ["KimiLinearForCausalLM"]
    assert cfg["eos_token_id"] == specials["<|im_end|>"] and cfg["bos_token_id"] == specials["[BOS]"]
    assert cfg["vocab_size"] == max(specials.values()) + 1
    with open(os.path.join(bf16_dir, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert shards == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_tool_checkpoint_generates_deterministically(bf16_dir):
    model = load_model(bf16_dir, "cpu", torch.bfloat16)
    ids = [5, 77, 300, 12, 9]
    out = greedy_generate(model, ids, 8)
    assert len(set(out)) > 2
    assert greedy_generate(load_model(bf16_dir, "cpu", torch.bfloat16), ids, 8) == out


def test_cli(tmp_path):
    out = tmp_path / "cli"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tiny_checkpoint.py"), str(out), "--tokenizer",
                    "json", "--seed", "3", "--dtype", "float16", "--layers", "KMKM"], check=True, cwd=tmp_path,
                   capture_output=True)
    with open(out / "config.json") as f:
        cfg = json.load(f)
    assert cfg["linear_attn_config"]["full_attn_layers"] == [2, 4] and cfg["dtype"] == "float16"
    assert (out / "tokenizer.json").exists()
    model = load_model(str(out), "cpu", torch.float32)
    assert len(greedy_generate(model, [1, 2, 3], 3)) == 3
