"""Train the embedded default model: a tiny Kimi-Linear (KDA + MLA hybrid, MoE FFN) on the CPU, in minutes.

    python tools/train_tiny.py [--out models/kimi-linear-tiny] [--steps 600] [--threads 2]

Corpus: the English prose of the Python documentation's help topics (`pydoc_data/topics.py`, shipped with
CPython, PSF License 2.0 -- permissive), code blocks and grammar lines dropped (`corpus_text`). A byte-level BPE
(tools/tiny_tokenizer.py with a corpus) is learned on it, then the model is trained with a differentiable forward
written here from the torch references in kernels/ over whole sequences:

    KDA:  kernels/conv.py semantics (depthwise causal conv + SiLU, as F.conv1d), kernels/kda/ref.py kda_gate_ref,
          l2norm_ref, kda_chunk_ref (batched, autograd through it), kernels/norm.py gated_rmsnorm_ref
    MLA:  the expanded (decompressed) form, NoPE, causal softmax attention (= backend/model KimiMLA._attend_expanded)
    MoE:  kernels/moe/ref.py moe_router_ref + fused_moe_ref, plus the shared expert; the selection-only
          e_score_correction_bias is trained the aux-loss-free way (nudged towards balanced expert load)

The parameters live under the official checkpoint names, so the result is written in the official layout by the
project's own writers (tools/tiny_checkpoint.py: config.json, generation_config.json, two safetensors shards +
index; tools/tiny_tokenizer.py: tiktoken.model, tokenizer_config.json with the Kimi chat template, ...).
Afterwards the served model (backend/model, loaded from the written files) must reproduce the training forward's
logits (`check_served_model`), and a greedy sample is printed.
"""
import argparse
import hashlib
import json
import math
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.kda.ref import kda_chunk_ref, kda_gate_ref, l2norm_ref  # noqa: E402
from kernels.moe.ref import fused_moe_ref, moe_router_ref  # noqa: E402
from kernels.norm import gated_rmsnorm_ref, rmsnorm_ref  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "models", "kimi-linear-tiny")
LAYERS = "KKMK"          # 3:1 KDA:MLA like Kimi-Linear; layer 0 dense MLP, the rest MoE
NUM_MERGES = 1024
DIMS = dict(hidden_size=128, intermediate_size=256, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=64, num_experts=8,
            num_experts_per_token=2, head_dim=32, model_max_length=4096)
KDA_HEADS, KDA_HEAD_DIM = 4, 32


# ------------------------------------------------------------------------------------------------------ corpus

def corpus_text():
    """English prose paragraphs of CPython's pydoc help topics (PSF License 2.0), deterministic order."""
    import pydoc_data.topics as topics

    paras = []
    for key in sorted(topics.topics):
        for para in re.split(r"\n\s*\n", topics.topics[key]):
            lines = para.split("\n")
            if any(line.startswith("   ") for line in lines):          # code / grammar / indented blocks
                continue
            if re.fullmatch(r"[*=\-~^]+", lines[-1].strip() or "x"):  # section titles
                continue
            p = " ".join(line.strip() for line in lines)
            p = re.sub(r"\s+", " ", p).strip()
            if "::=" in p or ">>>" in p or len(p) < 40:
                continue
            paras.append(p)
    return "\n\n".join(paras) + "\n"


# ------------------------------------------------------------------------------------------------------ config / init

def model_config(vocab):
    from tools.tiny_checkpoint import tiny_config

    cfg = tiny_config(LAYERS, vocab, "bfloat16", **DIMS)
    cfg["linear_attn_config"].update(num_heads=KDA_HEADS, head_dim=KDA_HEAD_DIM)
    return cfg


def init_params(cfg, seed=0):
    """Official-name fp32 tensors (tools/tiny_checkpoint.py's layout and init), trainable."""
    from tools.tiny_checkpoint import tiny_tensors

    c = dict(cfg, dtype="float32")
    params = {k: v.float().clone() for k, v in tiny_tensors(c, seed).items()}
    params["lm_head.weight"] = params["lm_head.weight"] / 4.0   # tiny_checkpoint's gain 4 is for random weights
    params["model.embed_tokens.weight"] *= 0.5
    for k, v in params.items():
        if k.endswith("e_score_correction_bias"):
            v.zero_()                                         # trained without gradients (load balancing)
        else:
            v.requires_grad_(True)
    return params


# ------------------------------------------------------------------------------------------------------ forward

def _causal_conv_silu(x, w):
    """x [B, T, C], w [C, 1, W] -> silu(depthwise causal conv) (kernels/conv.py short_conv_prefill_ref math)."""
    W = w.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w.float(), groups=x.shape[-1])
    return F.silu(y).transpose(1, 2)


def _kda(p, x, cfg):
    lin = cfg["linear_attn_config"]
    H, K = lin["num_heads"], lin["head_dim"]
    B, T, _ = x.shape
    q, k, v = (_causal_conv_silu(x @ p[f"{n}_proj.weight"].t(), p[f"{n}_conv1d.weight"]) for n in "qkv")
    q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))
    z = (x @ p["f_a_proj.weight"].t()) @ p["f_b_proj.weight"].t()                 # [B, T, HK]
    g = kda_gate_ref(z, p["A_log"], p["dt_bias"])                                 # [B, T, H, K]
    beta = torch.sigmoid(x @ p["b_proj.weight"].t())                              # [B, T, H]
    o, _ = kda_chunk_ref(l2norm_ref(q), l2norm_ref(k), v, g, beta, K ** -0.5, chunk_size=32,
                         output_final_state=False)
    r = ((x @ p["g_a_proj.weight"].t()) @ p["g_b_proj.weight"].t()).reshape(B, T, H, K)
    o = gated_rmsnorm_ref(o, r, p["o_norm.weight"], cfg["rms_norm_eps"])
    return o.reshape(B, T, H * K) @ p["o_proj.weight"].t()


def _mla(p, x, cfg):
    B, T, _ = x.shape
    H, L = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q = (x @ p["q_proj.weight"].t()).view(B, T, H, nope + rope)
    ckv = x @ p["kv_a_proj_with_mqa.weight"].t()                                  # [B, T, L + R]
    c = rmsnorm_ref(ckv[..., :L], p["kv_a_layernorm.weight"], 1e-6)
    kv = (c @ p["kv_b_proj.weight"].t()).view(B, T, H, nope + vd)
    k = torch.cat([kv[..., :nope], ckv[..., None, L:].expand(B, T, H, rope)], dim=-1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                         is_causal=True, scale=(nope + rope) ** -0.5)
    return out.transpose(1, 2).reshape(B, T, H * vd) @ p["o_proj.weight"].t()


def _mlp(p, x, prefix):
    return (F.silu(x @ p[prefix + "gate_proj.weight"].t()) * (x @ p[prefix + "up_proj.weight"].t())) \
        @ p[prefix + "down_proj.weight"].t()


def _moe(p, x, cfg, loads):
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    E = cfg["num_experts"]
    w, ids = moe_router_ref(flat, p["gate.weight"], p["gate.e_score_correction_bias"], cfg["num_experts_per_token"],
                            cfg["routed_scaling_factor"], cfg["moe_renormalize"])
    w13 = torch.stack([torch.cat([p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w3.weight"]]) for e in range(E)])
    w2 = torch.stack([p[f"experts.{e}.w2.weight"] for e in range(E)])
    y = fused_moe_ref(flat, w13, w2, w, ids) + _mlp(p, flat, "shared_experts.")
    if loads is not None:
        loads.append(torch.bincount(ids.reshape(-1).long(), minlength=E).float())
    return y.reshape(B, T, D)


def forward(params, cfg, ids, loads=None):
    """ids [B, T] -> logits [B, T, vocab] fp32 (whole sequences from position 0, differentiable)."""
    kda = set(cfg["linear_attn_config"]["kda_layers"])
    eps = cfg["rms_norm_eps"]
    h = params["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        sub = lambda name: {k[len(pre + name):]: v for k, v in params.items() if k.startswith(pre + name)}  # noqa
        x = rmsnorm_ref(h, params[pre + "input_layernorm.weight"], eps)
        attn = _kda if i + 1 in kda else _mla
        h = h + attn(sub("self_attn."), x, cfg)
        x = rmsnorm_ref(h, params[pre + "post_attention_layernorm.weight"], eps)
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            h = h + _moe(sub("block_sparse_moe."), x, cfg, loads)
        else:
            h = h + _mlp(params, x, pre + "mlp.")
    h = rmsnorm_ref(h, params["model.norm.weight"], eps)
    return (h @ params["lm_head.weight"].t()).float()


# ------------------------------------------------------------------------------------------------------ training

def batches(tokens, batch, seq, gen):
    n = len(tokens) - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        x = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


def train(params, cfg, tokens, steps, batch, seq, lr, log_every=25, seed=0):
    gen = torch.Generator().manual_seed(seed)
    trainable = [v for v in params.values() if v.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    biases = [k for k in params if k.endswith("e_score_correction_bias")]
    it = batches(tokens, batch, seq, gen)
    t0, ema = time.monotonic(), None
    for step in range(1, steps + 1):
        x, y = next(it)
        loads = []
        logits = forward(params, cfg, x, loads)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():   # aux-loss-free balancing: raise the bias of under-loaded experts
            for name, load in zip(biases, loads):
                params[name] += 1e-3 * torch.sign(load.mean() - load)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % log_every == 0 or step == steps:
            print(f"step {step}/{steps} loss {ema:.3f} ({time.monotonic() - t0:.0f}s)", flush=True)
    return ema


# ------------------------------------------------------------------------------------------------------ output

def write_checkpoint(out_dir, params, cfg):
    from tools.tiny_checkpoint import _write_json, _write_shards

    tensors = {k: (v.detach().float() if k.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias"))
                   else v.detach().to(torch.bfloat16)).contiguous() for k, v in params.items()}
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "transformers_version": "4.57.0"})
    for f in os.listdir(out_dir):
        if f.startswith("model-") and f.endswith(".safetensors"):
            os.remove(os.path.join(out_dir, f))
    _write_shards(out_dir, tensors)


def load_checkpoint_params(model_dir):
    """The written checkpoint as official-name fp32 tensors (what `forward` takes)."""
    from safetensors.torch import load_file

    params = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            params.update({k: v.float() for k, v in load_file(os.path.join(model_dir, f)).items()})
    return params


def served_logits(model_dir, ids):
    """All-position logits of `ids` through the served model (backend/model, fp32 on the CPU, one prefill)."""
    from backend.model.batch import ForwardBatch
    from backend.model.loader import load_model

    model = load_model(model_dir, "cpu", torch.float32)
    bs = 16
    blocks = list(range(1, 1 + -(-len(ids) // bs)))
    cache = model.allocate_cache(num_slots=2, num_blocks=len(blocks) + 1, block_size=bs)
    batch = ForwardBatch.build([(list(ids), 0, 1, blocks)], 0, bs, "cpu", logits_positions=list(range(len(ids))))
    with torch.no_grad():
        return model.compute_logits(model(batch, cache), batch.logits_index)


def check_served_model(model_dir, ids, atol=2e-3):
    """The served model reproduces the training forward's logits on the written weights -> max abs diff."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    params = load_checkpoint_params(model_dir)
    with torch.no_grad():
        ref = forward(params, cfg, torch.tensor([ids]))[0]
    got = served_logits(model_dir, ids)
    diff = (got - ref).abs().max().item()
    if not diff <= atol:
        raise AssertionError(f"served logits differ from the training forward by {diff:.3g} (> {atol})")
    return diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.monotonic()

    from backend.tokenizer import load_tokenizer
    from tools.tiny_tokenizer import write_tokenizer_files

    text = corpus_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"corpus: {len(text)} chars, sha256 {digest[:16]} (Python {sys.version.split()[0]} pydoc_data.topics)")
    os.makedirs(args.out, exist_ok=True)
    vocab = write_tokenizer_files(args.out, "tiktoken", NUM_MERGES, corpus=text)
    tok = load_tokenizer(args.out)
    tokens = torch.tensor(tok.encode(text.replace("\n\n", "\n")), dtype=torch.long)
    print(f"tokenizer: vocab {vocab['vocab_size']}, corpus {len(tokens)} tokens ({time.monotonic() - t0:.0f}s)")

    cfg = model_config(vocab)
    params = init_params(cfg, args.seed)
    n = sum(v.numel() for v in params.values())
    print(f"model: {LAYERS} layers, {n / 1e6:.2f}M parameters")
    loss = train(params, cfg, tokens, args.steps, args.batch, args.seq, args.lr, seed=args.seed)
    write_checkpoint(args.out, params, cfg)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({"corpus": "CPython pydoc_data/topics.py (prose paragraphs), PSF License 2.0",
                   "python": sys.version.split()[0], "corpus_chars": len(text), "corpus_sha256": digest,
                   "corpus_tokens": len(tokens), "steps": args.steps, "batch": args.batch, "seq": args.seq,
                   "lr": args.lr, "seed": args.seed, "final_loss": round(loss, 4), "parameters": n,
                   "train_seconds": round(time.monotonic() - t0)}, f, indent=2)
        f.write("\n")

    probe = tok.encode("The built-in function returns the value of the object")
    print(f"served model vs training forward: max |logit diff| {check_served_model(args.out, probe):.2e}")
    from backend.model.generate import greedy_generate
    from backend.model.loader import load_model

    model = load_model(args.out, "cpu", torch.float32)
    for prompt in ("The function", "A class is"):
        with torch.no_grad():
            out = greedy_generate(model, tok.encode(prompt), 40, stop_ids=tuple(tok.eos_token_ids))
        print(repr(prompt + tok.decode(out)))
    print(f"done in {time.monotonic() - t0:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
