"""End-to-end engine benchmark (H200): the full Kimi-Linear-48B-A3B shape with random bf16 weights made on the device
(nothing downloaded or written), driven through LLMEngine (scheduler, runner, CUDA graphs, device sampler).

    python bench/e2e.py                         # 27 layers, decode batch 1/8/64, prefill 1k/8k/32k
    python bench/e2e.py --layers 8 --prefill 1024,8192 --decode-batches 1,8

Each result is printed beside its speed of light: decode is bandwidth-bound (weights of the experts actually hit,
KDA state read+write, MLA latents read, at --bw bytes/s), prefill compute-bound (matmul + attention FLOPs at the
bf16 matmul peak measured here). Ends with markdown rows for BENCHMARKS.md.
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backend.config import ModelConfig  # noqa: E402
from backend.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from backend.engine.request import SamplingParams  # noqa: E402
from backend.engine.runner import ModelRunner  # noqa: E402
from backend.model.kimi_linear import KimiLinearForCausalLM  # noqa: E402

OFFICIAL = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586,
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
    "topk_group": 1, "transformers_version": "4.57.0", "use_cache": True, "use_grouped_topk": True,
    "v_head_dim": 128, "vocab_size": 163840,
}


def config_dict(layers: int) -> dict:
    """The official config cut to the first `layers` layers (at least one MLA layer: the last one if needed)."""
    d = dict(OFFICIAL, num_hidden_layers=layers, linear_attn_config=dict(OFFICIAL["linear_attn_config"]))
    lin = d["linear_attn_config"]
    full = [i for i in lin["full_attn_layers"] if i <= layers] or [layers]
    lin["full_attn_layers"] = full
    lin["kda_layers"] = [i for i in range(1, layers + 1) if i not in full]
    return d


@torch.no_grad()
def random_model(cfg: ModelConfig, device) -> KimiLinearForCausalLM:
    """Random bf16 weights with O(1) activations, made in place on the device."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.uniform_(1.0, 16.0).log_()
        elif leaf == "dt_bias":
            dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1)).exp_()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif leaf == "conv_weight":
            p.normal_(0.0, 0.5)
        elif leaf == "e_score_correction_bias":
            p.normal_(0.0, 0.1)
        elif p.ndim == 1:  # norm weights
            p.fill_(1.0)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        else:  # [.., out, in]
            gain = 2.0 if name.endswith("gate.weight") else 1.0
            p.normal_(0.0, gain / math.sqrt(p.shape[-1]))
    model.tie_weights()
    return model.eval().requires_grad_(False)


class Roofline:
    """Bytes and FLOPs of one step, from the model's actual parameters."""

    def __init__(self, model: KimiLinearForCausalLM, runner: ModelRunner):
        c = self.cfg = model.config
        self.expert_bytes = self.expert_params = 0
        self.dense_bytes = self.dense_params = 0
        self.num_moe = sum(c.is_moe(i) for i in range(c.num_hidden_layers))
        for name, p in model.named_parameters():
            n, b = p.numel(), p.numel() * p.element_size()
            if "embed_tokens" in name:
                continue
            if name.endswith(".w13") or name.endswith(".w2"):
                self.expert_params += n // c.num_experts // self.num_moe
                self.expert_bytes += b // c.num_experts // self.num_moe
            else:
                self.dense_params += n
                self.dense_bytes += b
        self.slot_bytes = runner.slot_bytes()
        self.latent_bytes_per_token = len(c.mla_layers) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
        self.active_params = self.dense_params + self.num_moe * c.num_experts_per_token * self.expert_params

    def decode_bytes(self, batch: int, context: int) -> float:
        c = self.cfg
        k, e = c.num_experts_per_token, c.num_experts
        unique = e * (1.0 - (1.0 - k / e) ** batch)  # expected distinct experts hit per layer
        weights = self.dense_bytes + self.num_moe * unique * self.expert_bytes
        return weights + batch * (2 * self.slot_bytes + context * self.latent_bytes_per_token)

    def prefill_flops(self, n: int) -> float:
        c = self.cfg
        h, lat, r = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        mla = len(c.mla_layers) * (n * (n + 1) / 2) * 2 * h * (2 * lat + r)  # absorbed: q.[c|k_pe], p.c
        hk, k, chunk = c.kda_num_heads, c.kda_head_dim, 64
        kda = len(c.kda_layers) * n * hk * (4 * chunk * k + 6 * k * k)  # chunked delta rule, roughly
        return 2.0 * self.active_params * n + mla + kda


def matmul_peak(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t)


def prompt(n: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 512, (n,), generator=g).tolist()


def bench_decode(engine: LLMEngine, batch: int, context: int, steps: int, params: SamplingParams) -> float:
    """-> decode steps per second at `batch` sequences of ~`context` tokens (all decode-only steps)."""
    vocab = engine.vocab_size
    streams = [engine.add_request(prompt(context, vocab, i), params) for i in range(batch)]
    reqs = lambda: list(engine.scheduler.running)  # noqa: E731
    while len(reqs()) < batch or any(not r.output_token_ids for r in reqs()):
        engine.step()
    for _ in range(5):  # warmup decode steps
        engine.step()
    assert len(reqs()) == batch and not engine.scheduler.waiting
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()  # syncs once (the sampled ids)
    dt = time.perf_counter() - t
    assert len(reqs()) == batch, "a request finished during the measurement"
    for s in streams:
        s.abort()
    engine.step()
    return steps / dt


def bench_prefill(engine: LLMEngine, n: int, seed: int) -> float:
    """-> seconds from submission to the first token of one n-token prompt (chunked by max_num_batched_tokens)."""
    stream = engine.add_request(prompt(n, engine.vocab_size, seed), SamplingParams(max_tokens=1, temperature=0.0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.scheduler.has_unfinished or engine._inbox:
        engine.step()
    dt = time.perf_counter() - t
    out = list(stream)
    assert out[-1].finished and out[-1].finish_reason == "length", out[-1]
    return dt


def hf_baseline(args, rows):
    try:
        import fla  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"HF transformers + fla baseline skipped: {e}")
        return
    if not args.hf_dir:
        print("HF transformers + fla baseline skipped: pass --hf-dir DIR holding the official config.json and "
              "remote code (configuration_kimi.py, modeling_kimi.py); nothing is downloaded here")
        return
    try:
        conf = transformers.AutoConfig.from_pretrained(args.hf_dir, trust_remote_code=True)
        conf.num_hidden_layers = args.layers
        lin = config_dict(args.layers)["linear_attn_config"]
        conf.linear_attn_config = dict(conf.linear_attn_config, **lin)
        with torch.device("cuda"):
            hf = transformers.AutoModelForCausalLM.from_config(conf, trust_remote_code=True,
                                                               torch_dtype=torch.bfloat16).eval()
        for n in [x for x in args.prefill if x <= 8192]:
            ids = torch.tensor([prompt(n, OFFICIAL["vocab_size"], 7)], device="cuda")
            with torch.no_grad():
                hf(ids)
                torch.cuda.synchronize()
                t = time.perf_counter()
                hf(ids)
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            rows.append((f"HF+fla prefill {n}", n / dt, "tok/s", None))
        ids = torch.tensor([prompt(args.decode_context, OFFICIAL["vocab_size"], 8)], device="cuda")
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=8, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.decode_steps + 1, do_sample=False, min_new_tokens=args.decode_steps)
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        rows.append(("HF+fla decode b1 (incl. prefill)", args.decode_steps / dt, "tok/s", None))
        del hf
        torch.cuda.empty_cache()
    except Exception as e:  # best effort: report and go on
        print(f"HF transformers + fla baseline failed: {type(e).__name__}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27, help="first N layers of the official 27 (memory)")
    ap.add_argument("--decode-batches", default="1,8,64")
    ap.add_argument("--decode-context", type=int, default=1024, help="prompt tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill", default="1024,8192,32768")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--bw", type=float, default=4.8e12, help="HBM bytes/s for the decode speed of light")
    ap.add_argument("--hf-dir", default="", help="official config + remote code, for the HF+fla baseline")
    args = ap.parse_args()
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    assert torch.cuda.is_available(), "bench/e2e.py needs a CUDA device"
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")

    peak = matmul_peak(dev)
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s; HBM bandwidth assumed {args.bw / 1e12:.1f} TB/s")
    cfg = ModelConfig.from_dict(config_dict(args.layers))
    t = time.perf_counter()
    model = random_model(cfg, dev)
    torch.cuda.synchronize()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"random model: {args.layers} layers ({len(cfg.kda_layers)} KDA, {len(cfg.mla_layers)} MLA), "
          f"{n_params / 1e9:.1f} B parameters, built in {time.perf_counter() - t:.0f} s")

    max_bs = max(args.decode_batches)
    max_len = max(args.prefill + [args.decode_context + args.decode_steps + 64]) + 64
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_bs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=64, gpu_memory_utilization=args.gpu_memory_utilization, device="cuda",
                        dtype="bfloat16", enforce_eager=args.enforce_eager)
    t = time.perf_counter()
    runner = ModelRunner("", ecfg, model=model)
    engine = LLMEngine(runner, ecfg, start=False)
    st = engine.stats()
    print(f"engine ready in {time.perf_counter() - t:.0f} s: {st['kv_capacity_tokens']} KV tokens, "
          f"{st['num_slots']} KDA slots, graphs {sorted(runner.graphs) or 'off'}")
    roof = Roofline(model, runner)
    print(f"active parameters per token: {roof.active_params / 1e9:.2f} B; batch-1 weight bytes per token "
          f"{roof.decode_bytes(1, 0) / 1e9:.2f} GB")

    rows = []  # (name, measured, unit, speed of light)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_steps + 32)
    for b in args.decode_batches:
        sps = bench_decode(engine, b, args.decode_context, args.decode_steps, greedy)
        sol = args.bw / roof.decode_bytes(b, args.decode_context + args.decode_steps // 2)
        rows.append((f"decode b{b} ctx{args.decode_context} greedy", b * sps, "tok/s", b * sol))
        print(f"  decode b{b}: {1e3 / sps:.2f} ms/step, {b * sps:.0f} tok/s (speed of light {1e3 / sol:.2f} ms)")
    sampled = SamplingParams(temperature=0.6, top_p=0.95, min_p=0.01, ignore_eos=True,
                             max_tokens=args.decode_steps + 32)
    sps = bench_decode(engine, max_bs, args.decode_context, args.decode_steps, sampled)
    sol = args.bw / roof.decode_bytes(max_bs, args.decode_context + args.decode_steps // 2)
    rows.append((f"decode b{max_bs} ctx{args.decode_context} T0.6 top_p0.95 min_p0.01", max_bs * sps, "tok/s",
                 max_bs * sol))

    bench_prefill(engine, min(args.prefill), seed=99)  # warmup: extend kernels compile
    for i, n in enumerate(args.prefill):
        dt = bench_prefill(engine, n, seed=i)
        sol = peak / roof.prefill_flops(n) * n
        rows.append((f"prefill {n} (chunks of {args.max_num_batched_tokens})", n / dt, "tok/s", sol))
        print(f"  prefill {n}: {dt * 1e3:.0f} ms, {n / dt:.0f} tok/s")
    hf_baseline(args, rows)
    engine.shutdown()

    print(f"\n{'benchmark':58s} {'measured':>12s} {'speed of light':>15s} {'% SOL':>7s}")
    for name, v, unit, sol in rows:
        s = f"{sol:12.0f}" if sol else f"{'-':>12s}"
        pct = f"{100 * v / sol:6.1f}%" if sol else f"{'-':>7s}"
        print(f"{name:58s} {v:8.0f} {unit:5s} {s} {unit:5s}{pct}")
    gpu = torch.cuda.get_device_name(dev)
    print("\n| benchmark | measured | speed of light | % SOL | setup |\n|---|---|---|---|---|")
    for name, v, unit, sol in rows:
        sol_s = f"{sol:.0f} {unit}" if sol else "-"
        pct = f"{100 * v / sol:.1f}%" if sol else "-"
        print(f"| {name} | {v:.0f} {unit} | {sol_s} | {pct} | {gpu}, {args.layers} layers, random bf16, "
              f"{'eager' if args.enforce_eager else 'CUDA graphs'} |")


if __name__ == "__main__":
    main()
