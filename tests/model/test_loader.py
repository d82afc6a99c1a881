import json
import math
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.model.batch import ForwardBatch
from backend.model.loader import CheckpointError, load_model, read_header
from tests.reference_model import reference_logits
from tools.tiny_checkpoint import write_tiny_checkpoint

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(fp32_dir, tmp_path):
    """A private copy of the fp32 tiny checkpoint to damage."""
    out = tmp_path / "ckpt"
    shutil.copytree(fp32_dir, out)
    return str(out)


def _index(path):
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)


def _rewrite(path, shard, edit):
    """Apply edit(tensors) to one shard and keep the index in step with it."""
    file = os.path.join(path, shard)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    index = _index(path)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard}
    index["weight_map"].update({n: shard for n in tensors})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f)


def _first_tensor(path, shard):
    return next(n for n, f in _index(path)["weight_map"].items() if f == shard)


def test_loads_and_packs(fp32_dir, fp32_model):
    params = dict(fp32_model.named_parameters())
    a = load_file(os.path.join(fp32_dir, SHARD1)) | load_file(os.path.join(fp32_dir, SHARD2))
    p = "model.layers.1."
    attn = p + "self_attn."
    assert params[attn + "A_log"].dtype == torch.float32 and params[attn + "A_log"].shape == (4,)
    assert torch.equal(params[attn + "A_log"], a[attn + "A_log"].flatten())
    conv = torch.cat([a[f"{attn}{x}_conv1d.weight"][:, 0] for x in "qkv"])
    assert params[attn + "conv_weight"].dtype == torch.float32 and torch.equal(params[attn + "conv_weight"], conv)
    in_proj = torch.cat([a[f"{attn}{x}_proj.weight"] for x in ("q", "k", "v", "f_a", "g_a", "b")])
    assert torch.equal(params[attn + "in_proj.weight"], in_proj)
    fg_b = torch.stack([a[f"{attn}{x}_proj.weight"] for x in ("f_b", "g_b")])
    assert torch.equal(params[attn + "fg_b_proj"], fg_b)
    cfg = fp32_model.config
    mla = f"model.layers.{cfg.mla_layers[0]}.self_attn."
    assert torch.equal(params[mla + "in_proj.weight"],
                       torch.cat([a[mla + "q_proj.weight"], a[mla + "kv_a_proj_with_mqa.weight"]]))
    mlp = next(f"model.layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if not cfg.is_moe(i))
    assert torch.equal(params[mlp + "gate_up_proj.weight"],
                       torch.cat([a[mlp + "gate_proj.weight"], a[mlp + "up_proj.weight"]]))
    moe = p + "block_sparse_moe."
    e = 5
    w13 = torch.cat([a[f"{moe}experts.{e}.w1.weight"], a[f"{moe}experts.{e}.w3.weight"]])
    assert torch.equal(params[moe + "w13"][e], w13)
    assert torch.equal(params[moe + "w2"][e], a[f"{moe}experts.{e}.w2.weight"])
    # unsharded: the shared expert is stacked as expert E (one fused_moe call), not a separate MLP
    E = fp32_model.config.num_experts
    assert params[moe + "w13"].shape[0] == params[moe + "w2"].shape[0] == E + 1
    shared = torch.cat([a[f"{moe}shared_experts.gate_proj.weight"], a[f"{moe}shared_experts.up_proj.weight"]])
    assert torch.equal(params[moe + "w13"][E], shared)
    assert torch.equal(params[moe + "w2"][E], a[f"{moe}shared_experts.down_proj.weight"])
    assert not any("shared_experts" in n for n in params)
    assert torch.equal(params["lm_head.weight"], a["lm_head.weight"])


def test_random_weights_same_layout(fp32_model):
    from backend.model.random_weights import random_model

    model = random_model(fp32_model.config, "cpu", torch.float32)
    assert [(n, p.shape) for n, p in model.named_parameters()] == \
        [(n, p.shape) for n, p in fp32_model.named_parameters()]


def test_single_file_checkpoint(fp32_dir, fp32_model, tmp_path):
    tensors = load_file(os.path.join(fp32_dir, SHARD1)) | load_file(os.path.join(fp32_dir, SHARD2))
    shutil.copy(os.path.join(fp32_dir, "config.json"), tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(str(tmp_path), "cpu", torch.float32)
    ref = dict(fp32_model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


def test_bf16_load_keeps_gate_params_fp32(fp32_dir):
    model = load_model(fp32_dir, "cpu", torch.bfloat16)
    for name, p in model.named_parameters():
        fp32 = name.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "conv_weight", "e_score_correction_bias")
        assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.dt_bias"
    shard = _index(ckpt)["weight_map"][name]
    _rewrite(ckpt, shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        load_model(ckpt, "cpu", torch.float32)


@pytest.mark.parametrize("proj", ["gate_proj", "up_proj", "down_proj"])
def test_shared_expert_missing_or_misshaped(ckpt, proj):
    """The folded shared expert (read into w13[E] / w2[E]) is still checked by its checkpoint name."""
    name = f"model.layers.1.block_sparse_moe.shared_experts.{proj}.weight"
    shard = _index(ckpt)["weight_map"][name]
    _rewrite(ckpt, shard, lambda t: t.update({name: torch.zeros(*t[name].shape[:-1], t[name].shape[-1] + 1)}))
    with pytest.raises(CheckpointError, match=f"tensor {name} has shape"):
        load_model(ckpt, "cpu", torch.float32)
    _rewrite(ckpt, shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        load_model(ckpt, "cpu", torch.float32)


def test_unexpected_tensor(ckpt):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite(ckpt, SHARD2, lambda t: t.update({name: torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor {name}"):
        load_model(ckpt, "cpu", torch.float32)


def test_wrong_shape(ckpt):
    name = _first_tensor(ckpt, SHARD2)
    _rewrite(ckpt, SHARD2, lambda t: t.update({name: torch.zeros(*t[name].shape[:-1], t[name].shape[-1] + 1)}))
    with pytest.raises(CheckpointError, match=f"tensor {name} has shape"):
        load_model(ckpt, "cpu", torch.float32)


def test_missing_shard(ckpt):
    os.remove(os.path.join(ckpt, SHARD2))
    with pytest.raises(CheckpointError, match=f"missing shard file {SHARD2}"):
        load_model(ckpt, "cpu", torch.float32)


def test_truncated_file(ckpt):
    file = os.path.join(ckpt, SHARD1)
    os.truncate(file, os.path.getsize(file) - 100)
    with pytest.raises(CheckpointError, match=f"{SHARD1}: tensor .* past the end of the file"):
        load_model(ckpt, "cpu", torch.float32)


def test_index_disagrees_with_shard(ckpt):
    index = _index(ckpt)
    name = _first_tensor(ckpt, SHARD1)
    index["weight_map"][name] = SHARD2
    with open(os.path.join(ckpt, INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(ckpt, "cpu", torch.float32)


def _raw_file(path, header: dict, data_size: int, header_len=None):
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if header_len is None else header_len))
        f.write(blob)
        f.write(b"\0" * data_size)
    return str(path)


def test_valid_raw_header(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}}
    assert read_header(_raw_file(tmp_path / "ok.safetensors", header, 24)) == {
        "a": ("F32", (2, 2)), "b": ("BF16", (4,))}


@pytest.mark.parametrize("header, data_size, header_len, message", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, None, "tensor a: data ends at 16, past"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16, None, "tensors a and b overlap"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, 1 << 40, "header length"),
    ({"a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, 16, None, "tensor a: dtype 'I64'"),
    ({"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, 20, None, "do not match shape"),
    ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, 16, None, "bad shape"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, 16, None, "do not match shape"),
    ({"a": [1, 2]}, 0, None, "malformed header entry"),
])
def test_hostile_headers_refused(tmp_path, header, data_size, header_len, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data_size, header_len)
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def test_garbage_header(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    with pytest.raises(CheckpointError, match="bad.safetensors: header is not valid JSON"):
        read_header(str(path))
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(str(path))


def test_tied_embeddings(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "tied"), tokenizer=None, seed=4, dtype="float32",
                                 tie_word_embeddings=True)
    assert "lm_head.weight" not in _index(path)["weight_map"]
    model = load_model(path, "cpu", torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = [7, 8, 9, 10]
    batch = ForwardBatch.build([(ids, 0, 1, [1])], 0, 16, "cpu", logits_positions=list(range(4)))
    logits = model.compute_logits(model(batch, model.allocate_cache(2, 2, 16)), batch.logits_index)
    torch.testing.assert_close(logits.double(), reference_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_plan_matches_official_inventory():
    from backend.config import ModelConfig
    from backend.model.loader import checkpoint_plan
    from tests.model.test_config import OFFICIAL

    plan = checkpoint_plan(ModelConfig.from_dict(OFFICIAL))
    # kimi-linear.md §2: 20,493 tensors, 49,122,681,728 parameters
    assert len(plan) == 20493
    assert sum(math.prod(t.shape) for t in plan.values()) == 49_122_681_728
    assert plan["model.layers.3.self_attn.kv_b_proj.weight"].shape == (8192, 512)
    assert plan["model.layers.0.self_attn.A_log"].shape == (1, 1, 32, 1)
    shared = plan["model.layers.5.block_sparse_moe.shared_experts.up_proj.weight"]
    assert shared.shape == (1024, 2304) and shared.param == "model.layers.5.block_sparse_moe.w13"
    assert shared.index == (256, slice(1024, 2048))
