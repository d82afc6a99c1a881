"""Independent naive Kimi-Linear forward, written from the spec (kimi-linear.md §3) for testing.

Shares no code with backend/ or kernels/: reads config.json and the safetensors shards itself, runs one whole
sequence in fp64 with the token-by-token KDA recurrence, expanded MLA with a full causal softmax, and a per-token
MoE loop.
"""
import json
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """-> (config dict, {name: fp64 tensor})."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).double()
    return cfg, weights


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _l2(x):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _conv_silu(x, w):
    """x [T, C], w [C, 1, W]: y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c], zero history, then SiLU."""
    width = w.shape[-1]
    xp = torch.cat([x.new_zeros(width - 1, x.shape[1]), x])
    y = sum(w[:, 0, j] * xp[j:j + x.shape[0]] for j in range(width))
    return F.silu(y)


def kda(x, p, cfg):
    lin = cfg["linear_attn_config"]
    h, k = lin["num_heads"], lin["head_dim"]
    t = x.shape[0]
    q, kk, v = (_conv_silu(x @ p[f"{n}_proj.weight"].T, p[f"{n}_conv1d.weight"]).view(t, h, k) for n in "qkv")
    z = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"]).view(t, h, k)
    g = -torch.exp(p["A_log"].view(h))[:, None] * F.softplus(z)     # [T, H, K]
    beta = torch.sigmoid(x @ p["b_proj.weight"].T)                  # [T, H]
    q, kk = _l2(q) * k ** -0.5, _l2(kk)
    s = x.new_zeros(h, k, k)                                        # S[h, key, value]
    out = []
    for i in range(t):
        s = s * torch.exp(g[i])[:, :, None]
        u = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", s, kk[i]))
        s = s + kk[i][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[i]))
    o = torch.stack(out)                                            # [T, H, V]
    r = (x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).view(t, h, k)
    o = _rms(o, p["o_norm.weight"], cfg["rms_norm_eps"]) * torch.sigmoid(r)
    return o.flatten(1) @ p["o_proj.weight"].T


def mla(x, p, cfg, kv_eps):
    h, nope, rope, vd, lat = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                              cfg["v_head_dim"], cfg["kv_lora_rank"])
    t = x.shape[0]
    q = (x @ p["q_proj.weight"].T).view(t, h, nope + rope)
    ckv = x @ p["kv_a_proj_with_mqa.weight"].T
    c, k_pe = _rms(ckv[:, :lat], p["kv_a_layernorm.weight"], kv_eps), ckv[:, lat:]
    kv = (c @ p["kv_b_proj.weight"].T).view(t, h, nope + vd)
    key = torch.cat([kv[..., :nope], k_pe[:, None].expand(t, h, rope)], -1)
    scores = torch.einsum("qhd,khd->hqk", q, key) * (nope + rope) ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khv->qhv", scores.softmax(-1), kv[..., nope:])
    return attn.flatten(1) @ p["o_proj.weight"].T


def mlp(x, p):
    return (F.silu(x @ p["gate_proj.weight"].T) * (x @ p["up_proj.weight"].T)) @ p["down_proj.weight"].T


def moe(x, p, cfg, biased):
    bias = p["gate.e_score_correction_bias"]
    out = []
    for xt in x:
        s = torch.sigmoid(p["gate.weight"] @ xt)
        # HF remote code takes a view here, so its in-place += also biases the scores that weight the experts
        choice = s.view(-1) if biased else s.clone()
        choice += bias
        idx = torch.topk(choice, cfg["num_experts_per_token"]).indices
        w = s[idx]
        if cfg["moe_renormalize"]:
            w = w / (w.sum() + 1e-20)
        w = w * cfg["routed_scaling_factor"]
        y = sum(wi * mlp(xt, {"gate_proj.weight": p[f"experts.{e}.w1.weight"],
                              "up_proj.weight": p[f"experts.{e}.w3.weight"],
                              "down_proj.weight": p[f"experts.{e}.w2.weight"]}) for wi, e in zip(w, idx.tolist()))
        out.append(y)
    shared = {n: p[f"shared_experts.{n}"] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
    return torch.stack(out) + mlp(x, shared)


def _sub(weights: dict, prefix: str) -> dict:
    return {n[len(prefix):]: w for n, w in weights.items() if n.startswith(prefix)}


def reference_logits(path: str, ids: list[int], biased_router=False, kv_eps=1e-6) -> torch.Tensor:
    """Full-sequence forward of one sequence -> fp64 logits [T, vocab]."""
    cfg, w = read_checkpoint(path)
    eps = cfg["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = _sub(w, f"model.layers.{i}.")
        a = _sub(p, "self_attn.")
        hn = _rms(x, p["input_layernorm.weight"], eps)
        is_kda = (i + 1) in cfg["linear_attn_config"]["kda_layers"]
        x = x + (kda(hn, a, cfg) if is_kda else mla(hn, a, cfg, kv_eps))
        hn = _rms(x, p["post_attention_layernorm.weight"], eps)
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            x = x + moe(hn, _sub(p, "block_sparse_moe."), cfg, biased_router)
        else:
            x = x + mlp(hn, _sub(p, "mlp."))
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T
