"""End-to-end engine benchmark (H200): the full Kimi-Linear-48B-A3B shape with random bf16 weights made on the device
(nothing downloaded or written), driven through LLMEngine (scheduler, runner, CUDA graphs, device sampler).

    python bench/e2e.py                         # 27 layers, decode batch 1/8/64, prefill 1k/8k/32k
    python bench/e2e.py --layers 8 --prefill 1024,8192 --decode-batches 1,8
    python bench/e2e.py --profile               # + kernel/host breakdown of decode b1, b64 and one 8k prefill chunk
    python bench/e2e.py --multi-turn 8192,32768  # + next-turn TTFT with prefix caching vs from scratch
    python bench/e2e.py --grammar               # + decode under a JSON grammar (llguidance masks) vs unconstrained
    python bench/e2e.py --decode-batches 1,8 --prefill 1024,8192 --hf-dir .hf/kimi-linear
                                                # first HF transformers + fla (official remote code) on the same
                                                # weights (bench/hf_baseline.py), then ours; printed side by side

Each result is printed beside its speed of light. Decode: max(bytes / --bw, FLOPs / matmul peak), bytes = dense
weights + the experts the router actually picked (unique per MoE layer, counted on eager steps of the same batch)
+ KDA state read+write + MLA latents read. Prefill: matmul + attention FLOPs at the bf16 matmul peak measured here.
Ends with markdown rows for BENCHMARKS.md.

--profile (after the benchmarks): per case, host phases of engine.step (perf_counter wrappers), the forward graph
alone (CUDA events over back-to-back replays), torch.profiler over graph-replayed steps (kernel sum vs wall: the gap
is GPU idle time = host/launch overhead) and over eager steps (kernels by category and by module, top kernels);
the output says which path each table comes from.
"""

import argparse
import collections
import dataclasses
import gc
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backend.config import ModelConfig  # noqa: E402
from backend.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from backend.engine import structured  # noqa: E402
from backend.engine.request import SamplingParams  # noqa: E402
from backend.engine.runner import ModelRunner  # noqa: E402
from backend.model import kimi_linear  # noqa: E402
from backend.model.kimi_linear import KimiDeltaAttention, KimiLinearForCausalLM  # noqa: E402
from backend.model.random_weights import random_model  # noqa: E402
from tools.synthetic_vocab import synthetic_grammars  # noqa: E402

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


def smoke_config_dict() -> dict:
    """--smoke (CPU, no GPU): a tiny model to run every code path of this script."""
    from tools.tiny_checkpoint import tiny_config

    return tiny_config("KKKMKK", dtype="float32", vocab_size=1024)


class RouterTap:
    """Wraps the model's routers (moe_router, and moe_router_add_norm where the model has it): when `on`, counts the
    distinct experts each call picked (eager steps only: a replayed CUDA graph runs no Python; `on` stays off during
    capture, so the graphs are unchanged)."""

    def __init__(self):
        self.on = False
        self.counts = []
        for name in ("moe_router", "moe_router_add_norm"):
            if hasattr(kimi_linear, name):
                setattr(kimi_linear, name, self._tap(getattr(kimi_linear, name)))

    def _tap(self, real):
        def tap(*a, **kw):
            out = real(*a, **kw)
            if self.on:
                self.counts.append(int(torch.unique(out[-1]).numel()))   # ids come last
            return out

        return tap


class Roofline:
    """Bytes and FLOPs of one step, from the model's actual parameters."""

    def __init__(self, model: KimiLinearForCausalLM, runner: ModelRunner):
        c = self.cfg = model.config
        self.expert_bytes = self.expert_params = 0
        self.dense_bytes = self.dense_params = 0
        self.num_moe = sum(c.is_moe(i) for i in range(c.num_hidden_layers))
        self.folded = 0  # 1 when the shared expert is expert E of w13/w2 (fused_moe fold): the router tap counts it too
        for name, p in model.named_parameters():
            n, b = p.numel(), p.numel() * p.element_size()
            if "embed_tokens" in name:
                continue
            if name.endswith(".w13") or name.endswith(".w2"):
                self.folded = int(p.shape[0] > c.num_experts)
                self.expert_params += n // p.shape[0] // self.num_moe
                self.expert_bytes += b // p.shape[0] // self.num_moe
            else:
                self.dense_params += n
                self.dense_bytes += b
        self.slot_bytes = runner.slot_bytes()
        self.latent_bytes_per_token = len(c.mla_layers) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
        self.active_params = self.dense_params + self.num_moe * (c.num_experts_per_token + self.folded) * self.expert_params

    def expected_unique(self, batch: int) -> float:
        """Distinct experts per MoE layer that `batch` tokens hit under uniform independent routing."""
        k, e = self.cfg.num_experts_per_token, self.cfg.num_experts
        return e * (1.0 - (1.0 - k / e) ** batch) + self.folded

    def decode(self, batch: int, context: int, bw: float, peak: float, unique_total: float = None) -> dict:
        """Speed of light of one decode step of `batch` sequences at ~`context` keys. unique_total: distinct experts
        summed over the MoE layers, as measured (None: uniform routing). -> components, bytes, flops, times (s)."""
        c = self.cfg
        if unique_total is None:
            unique_total = self.num_moe * self.expected_unique(batch)
        comp = dict(dense=self.dense_bytes, experts=unique_total * self.expert_bytes,
                    kda_state=batch * 2 * self.slot_bytes, mla_cache=batch * context * self.latent_bytes_per_token)
        h, lat, r, hk, k = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.kda_num_heads, c.kda_head_dim
        flops = batch * (2.0 * self.active_params + len(c.mla_layers) * 2 * h * (2 * lat + r) * context
                         + len(c.kda_layers) * hk * 8 * k * k)
        nbytes = sum(comp.values())
        t_bytes, t_flops = nbytes / bw, flops / peak
        return dict(comp, bytes=nbytes, flops=flops, t_bytes=t_bytes, t_flops=t_flops, t=max(t_bytes, t_flops),
                    unique=unique_total / max(self.num_moe, 1), expected=self.expected_unique(batch))

    def describe(self, d: dict, bw: float, peak: float) -> str:
        g = 1e9
        return (f"dense {d['dense'] / g:.2f} GB + experts {d['experts'] / g:.2f} GB ({self.num_moe} layers x "
                f"{d['unique']:.1f} unique of {self.cfg.num_experts + self.folded}, shared included; uniform routing would hit {d['expected']:.1f})"
                f" + KDA state r+w {d['kda_state'] / g:.2f} GB + MLA cache {d['mla_cache'] / g:.2f} GB = "
                f"{d['bytes'] / g:.2f} GB -> {d['t_bytes'] * 1e3:.3f} ms at {bw / 1e12:.1f} TB/s; "
                f"{d['flops'] / 1e12:.3f} TFLOP -> {d['t_flops'] * 1e3:.3f} ms at {peak / 1e12:.0f} TFLOP/s; "
                f"SOL {d['t'] * 1e3:.3f} ms ({'bytes' if d['t_bytes'] >= d['t_flops'] else 'FLOPs'})")

    def pass_sol(self, tokens: int, flops: float, keys: int, seqs: int, bw: float, peak: float) -> float:
        """Seconds, at least, for one forward over `tokens` tokens of `seqs` sequences doing `flops`: the FLOPs, or
        the bytes (the dense weights, the experts those tokens hit under uniform routing (at a few hundred tokens:
        nearly all of them), `keys` cached latents read, the sequences' KDA states read and written)."""
        nbytes = (self.dense_bytes + self.num_moe * self.expected_unique(tokens) * self.expert_bytes
                  + keys * self.latent_bytes_per_token + seqs * 2 * self.slot_bytes)
        return max(flops / peak, nbytes / bw)

    def prefill_flops(self, n: int) -> float:
        c = self.cfg
        h, lat, r = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        # MLA prefill runs the expanded form (kernels/mla/prefill.py): per causal pair q.k over nope + rope dims and
        # p.v; plus expanding each key's latent once (kv_b: lat -> h x (nope + v)). The absorbed form would count
        # 2 * h * (2 * lat + r) per pair, ~3.4x more, which overstates what a prefill has to compute.
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        mla = len(c.mla_layers) * ((n * (n + 1) / 2) * 2 * h * (nope + r + v) + n * 2 * lat * h * (nope + v))
        hk, k, chunk = c.kda_num_heads, c.kda_head_dim, 64
        kda = len(c.kda_layers) * n * hk * (4 * chunk * k + 6 * k * k)  # chunked delta rule, roughly
        return 2.0 * self.active_params * n + mla + kda


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# datasheet HBM bandwidth by card name (the speed of light's bytes / s); others (and the CPU smoke run) get the H200's
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100", 3.35e12), ("GB10", 0.273e12))


def hbm_bandwidth(name: str) -> float:
    return next((bw for key, bw in HBM_BANDWIDTH if key in name), 4.8e12)


def matmul_peak(device) -> float:
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    sync()
    return 2 * m ** 3 * n / (time.perf_counter() - t)


def prompt(n: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 512 if vocab > 1024 else vocab // 2, (n,), generator=g).tolist()


def start_decode(engine: LLMEngine, batch: int, context: int, params, warmup: int = 5) -> list:
    """`batch` requests of `context` prompt tokens, prefilled and `warmup` decode steps in: -> their streams.
    params: SamplingParams, or a list of one per request."""
    vocab = engine.vocab_size
    plist = params if isinstance(params, list) else [params] * batch
    streams = [engine.add_request(prompt(context, vocab, i), plist[i]) for i in range(batch)]
    while len(running(engine)) < batch or any(not r.output_token_ids for r in running(engine)):
        engine.step()
    for _ in range(warmup):
        engine.step()
    assert len(running(engine)) == batch and not engine.scheduler.waiting
    return streams


def running(engine: LLMEngine) -> list:
    return list(engine.scheduler.running)


def stop_decode(engine: LLMEngine, streams: list):
    for s in streams:
        s.abort()
    engine.step()


def time_steps(engine: LLMEngine, steps: int) -> float:
    """-> seconds per engine.step() (decode-only steps; each syncs once, on the sampled ids)."""
    n = len(running(engine))
    engine.step()  # steady state: decode steps are pipelined (one in flight), so sync() would not drain it
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    assert len(running(engine)) == n, "a request finished during the measurement"
    return dt / steps


class Eager:
    """Runs decode steps without the CUDA graphs (the same math: the eager path the graphs were captured from)."""

    def __init__(self, engine: LLMEngine):
        self.runner = engine.runner

    def __enter__(self):
        self.graphs, self.runner.graphs = self.runner.graphs, {}

    def __exit__(self, *exc):
        self.runner.graphs = self.graphs


def count_unique_experts(engine: LLMEngine, tap: RouterTap, steps: int = 3) -> float:
    """Distinct experts picked per decode step, summed over the MoE layers (eager steps with the router tapped)."""
    tap.counts, tap.on = [], True
    try:
        with Eager(engine):
            for _ in range(steps):
                engine.step()
    finally:
        tap.on = False
    if len(tap.counts) != steps * sum(engine.runner.config.is_moe(i)
                                      for i in range(engine.runner.config.num_hidden_layers)):
        print(f"  (router tap saw {len(tap.counts)} router calls in {steps} steps, not one per MoE layer per step: "
              f"the model no longer calls kimi_linear.moe_router? SOL uses uniform routing)")
        return None
    return sum(tap.counts) / steps


def bench_decode(engine: LLMEngine, batch: int, context: int, steps: int, params, tap: RouterTap) -> tuple:
    """-> (decode steps per second at `batch` sequences of ~`context` tokens, distinct experts per step summed over
    the MoE layers)."""
    streams = start_decode(engine, batch, context, params)
    dt = time_steps(engine, steps)
    try:
        unique = count_unique_experts(engine, tap)
    except Exception:  # best effort: the SOL then assumes uniform routing
        traceback.print_exc()
        unique = None
    stop_decode(engine, streams)
    return 1.0 / dt, unique


def bench_prefill(engine: LLMEngine, n: int, seed: int) -> float:
    """-> seconds from submission to the first token of one n-token prompt (chunked by max_num_batched_tokens)."""
    return ttft(engine, prompt(n, engine.vocab_size, seed))


# LocalAI's JSON grammar (functions.JSONBNF) with an array of at least 500 values at the root: a decode of a few
# hundred steps never completes it (nor may it end with EOS)
OPEN_JSON = r"""root   ::= "[" ws value ("," ws value){499,} "]" ws
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]*)) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws ::= ([ \t\n] ws)?"""


def bench_turn(engine: LLMEngine, history: int, new: int, seed: int) -> tuple:
    """-> seconds to the first token of a (history + new)-token prompt (from scratch, then after the history-token
    prompt, the previous turn, was cached)."""
    hist, tail = prompt(history, engine.vocab_size, seed), prompt(new, engine.vocab_size, seed + 1)
    engine.scheduler.cache.clear()
    cold = ttft(engine, hist + tail)
    engine.scheduler.cache.clear()
    ttft(engine, hist)  # the previous turn: its prompt is cached
    hits = engine.stats()["prefix_cache_hits"]
    warm = ttft(engine, hist + tail)
    assert engine.stats()["prefix_cache_hits"] == hits + 1, "the next turn did not start after the cached prompt"
    engine.scheduler.cache.clear()
    return cold, warm


def bench_score(engine: LLMEngine, n: int, cands: int, length: int, seed: int) -> tuple:
    """The Score RPC's engine work: `cands` candidates of `length` tokens after one n-token prompt. -> seconds with
    the prompt shared (the server's order: the first candidate caches the prompt less its last token, the others
    start there) and with every candidate computing the prompt (no prefix cache)."""
    p = prompt(n, engine.vocab_size, seed)
    texts = [p + prompt(length, engine.vocab_size, seed + 1 + i) for i in range(cands)]
    params = SamplingParams(score_from=n)

    def run(groups, points):
        sync()
        t = time.perf_counter()
        for group in groups:
            streams = [engine.add_request(x, params, cache_points=points) for x in group]
            while engine.scheduler.has_unfinished or engine._inbox:
                engine.step()
            assert all(list(s)[-1].finish_reason == "stop" for s in streams)
        sync()
        return time.perf_counter() - t

    engine.scheduler.cache.clear()
    hits = engine.stats()["prefix_cache_hits"]
    shared = run([texts[:1], texts[1:]], (n - 1,))
    assert engine.stats()["prefix_cache_hits"] == hits + cands - 1, "the candidates did not share the prompt"
    engine.scheduler.cache.clear()
    alone = run([texts], ())
    engine.scheduler.cache.clear()
    return shared, alone


def ttft(engine: LLMEngine, ids: list) -> float:
    """-> seconds from submission to the first token of one prompt (chunked by max_num_batched_tokens)."""
    stream = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    sync()
    t = time.perf_counter()
    while engine.scheduler.has_unfinished or engine._inbox:
        engine.step()
    dt = time.perf_counter() - t
    out = list(stream)
    assert out[-1].finished and out[-1].finish_reason == "length", out[-1]
    return dt


# ----------------------------------------------------------------------------------------------------------------
# --profile

CATEGORIES = (  # first match on the lower-cased kernel name; "sampling" is decided by where the kernel was launched
    ("norms", ("_rmsnorm_kernel", "_gated_rmsnorm_kernel")),
    ("KDA", ("_kda_", "_conv_decode", "_conv_prefill")),
    ("MoE", ("_moe_", "_router_")),
    ("MLA", ("_mla_", "_store_latent", "flash", "fmha", "attention")),
    ("GEMM (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "cublas", "matmul", "sm90_", "sm80_")),
    ("copies", ("memcpy", "memset", "copy", "catarraybatched", "cat_", "fill", "index", "gather")),
)


def category(name: str, label) -> str:
    if label == "sampling":
        return "sampling"
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _label(e):
    """Innermost kimi:* range (record_function) above a CPU event, or None."""
    while e is not None:
        if e.name.startswith("kimi:"):
            return e.name[5:]
        e = e.cpu_parent
    return None


def kernel_instances(prof, cpu_fallback: bool = False) -> list:
    """-> [(kernel name, us, label)] of every device activity (kernels, memcpy, memset) in the profile. Kernels of a
    replayed CUDA graph have no launching op: label None. cpu_fallback (--smoke on CPU): leaf aten ops instead."""
    from torch.autograd import DeviceType

    evs = list(prof.events())
    inst, attached = [], collections.Counter()
    for e in evs:
        if e.device_type == DeviceType.CPU and e.kernels:
            lab = _label(e)
            for k in e.kernels:
                if k.name.startswith("kimi:"):  # the GPU-side span of a record_function range, not a kernel
                    continue
                inst.append((k.name, float(k.duration), lab))
                attached[k.name] += 1
    for e in evs:
        if (e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
                and not e.name.startswith("kimi:")):
            if attached[e.name] > 0:
                attached[e.name] -= 1
                continue
            inst.append((e.name, float(e.time_range.elapsed_us()), None))
    if not inst and cpu_fallback:
        inst = [(e.name, float(e.time_range.elapsed_us()), _label(e)) for e in evs
                if e.name.startswith("aten::") and not e.cpu_children]
    return inst


def print_kernels(title: str, inst: list, steps: int, wall_us: float = None, top: int = 25, modules: bool = False):
    total = sum(d for _, d, _ in inst) / steps
    n = len(inst) / steps
    print(f"\n  [{title}] {n:.0f} device activities/step, kernel sum {total:.0f} us/step"
          + (f", wall {wall_us:.0f} us/step -> GPU idle (host/launch gaps) {wall_us - total:.0f} us/step "
             f"({100 * (wall_us - total) / wall_us:.0f}% of the step)" if wall_us else ""))
    by_cat = collections.defaultdict(lambda: [0.0, 0])
    by_mod = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0, None])
    for name, d, lab in inst:
        c = category(name, lab)
        by_cat[c][0] += d
        by_cat[c][1] += 1
        by_mod[lab or "(no module: layer glue / graph)"][0] += d
        by_mod[lab or "(no module: layer glue / graph)"][1] += 1
        k = by_name[(name, c)]
        k[0] += d
        k[1] += 1
    print(f"    {'category':28s} {'us/step':>9s} {'%':>6s} {'kernels/step':>13s}")
    for c, (d, cnt) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
        print(f"    {c:28s} {d / steps:9.1f} {100 * d / steps / max(total, 1e-9):5.1f}% {cnt / steps:13.1f}")
    if modules:
        print(f"    {'module (eager hooks)':28s} {'us/step':>9s} {'%':>6s} {'kernels/step':>13s}")
        for m, (d, cnt) in sorted(by_mod.items(), key=lambda kv: -kv[1][0]):
            print(f"    {m[:28]:28s} {d / steps:9.1f} {100 * d / steps / max(total, 1e-9):5.1f}% {cnt / steps:13.1f}")
    print(f"    top {top} kernels: {'us/step':>9s} {'calls/step':>10s} {'us/call':>8s}  category       name")
    for (name, c), (d, cnt, _) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {'':11s} {d / steps:9.1f} {cnt / steps:10.1f} {d / cnt:8.1f}  {c[:14]:14s} {name[:90]}")
    if modules:  # eager: where the launch count goes (each launch costs host time whatever its length)
        print(f"    top {top} by launches: {'calls/step':>10s} {'us/step':>9s}  category       name")
        for (name, c), (d, cnt, _) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"    {'':16s} {cnt / steps:10.1f} {d / steps:9.1f}  {c[:14]:14s} {name[:90]}")


class Labels:
    """record_function ranges (kimi:<label>) around modules (eager only) and around the runner's sampling/inputs."""

    def __init__(self, engine: LLMEngine, modules: bool):
        import backend.engine.runner as runner_mod

        self.undo, self.handles = [], []
        self._wrap(runner_mod, "sample", "sampling")
        r = engine.runner
        self._wrap(r, "prepare", "inputs (prepare)", instance=True)
        self._wrap(r, "_replay", "inputs + graph replay", instance=True)
        if modules:
            m = r.model
            self._hook(m.model.embed_tokens, "embed")
            self._hook(m.model.norm, "norms")
            self._hook(m.lm_head, "lm_head")
            for layer in m.model.layers:
                kda = isinstance(layer.self_attn, KimiDeltaAttention)
                self._hook(layer.self_attn, "KDA mixer (proj+kernel)" if kda else "MLA mixer (proj+kernel)")
                self._hook(layer.input_layernorm, "norms")
                self._hook(layer.post_attention_layernorm, "norms")
                if layer.is_moe:
                    self._hook(layer.block_sparse_moe, "MoE FFN (router+experts+shared)")
                else:
                    self._hook(layer.mlp, "dense MLP")

    def _wrap(self, obj, attr, label, instance=False):
        real = getattr(obj, attr)

        def wrapped(*a, **kw):
            with torch.profiler.record_function("kimi:" + label):
                return real(*a, **kw)

        setattr(obj, attr, wrapped)
        self.undo.append((obj, attr, None if instance else real))

    def _hook(self, mod, label):
        stack = []

        def pre(m, args):
            rf = torch.profiler.record_function("kimi:" + label)
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out):
            stack.pop().__exit__(None, None, None)

        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def close(self):
        for obj, attr, real in self.undo:
            if real is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, real)
        for h in self.handles:
            h.remove()


class HostPhases:
    """perf_counter totals of the parts of engine.step() (instance/class attributes wrapped, then restored)."""

    def __init__(self, engine: LLMEngine):
        import backend.engine.runner as runner_mod
        from backend.engine.sampler import SamplingMetadata

        self.t = collections.defaultdict(float)
        self.undo = []
        r, sch = engine.runner, engine.scheduler
        self._wrap(engine, "step", "step", instance=True)
        self._wrap(sch, "schedule", "schedule", instance=True)
        self._wrap(sch, "schedule_next", "schedule", instance=True)  # pipelined decode: N+1 scheduled while N runs
        self._wrap(r, "launch", "launch", instance=True)
        self._wrap(r, "collect", "collect", instance=True)
        self._wrap(sch, "update", "update", instance=True)
        self._wrap(r, "execute", "execute", instance=True)
        self._wrap(r, "_replay", "replay", instance=True)
        self._wrap(r, "prepare", "prepare", instance=True)
        self._wrap(runner_mod, "sample", "sample")
        real_build, t = SamplingMetadata.build, self.t

        def build(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real_build(*a, **kw)
            finally:
                t["md_build"] += time.perf_counter() - t0

        SamplingMetadata.build = staticmethod(build)
        self.undo.append((SamplingMetadata, "build", staticmethod(real_build)))

    def _wrap(self, obj, attr, key, instance=False):
        real, t = getattr(obj, attr), self.t

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0

        setattr(obj, attr, wrapped)
        self.undo.append((obj, attr, None if instance else real))

    def close(self):
        for obj, attr, real in reversed(self.undo):
            if real is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, real)

    def report(self, steps: int) -> str:
        t = {k: v * 1e6 / steps for k, v in self.t.items()}
        g = t.get
        launch = g("replay", 0.0) + g("prepare", 0.0)
        # execute (step by step) or launch + collect (pipelined) hold prepare/replay, sampling and the wait
        run = g("execute", 0.0) + g("launch", 0.0) + g("collect", 0.0)
        wait = run - launch - g("md_build", 0.0) - g("sample", 0.0)
        rest = g("step", 0.0) - g("schedule", 0.0) - run - g("update", 0.0)
        return (f"step {g('step', 0):.0f} us = schedule {g('schedule', 0):.0f} + inputs & launch "
                f"{launch:.0f} ({'graph replay' if g('replay') else 'eager forward'}) + SamplingMetadata.build "
                f"{g('md_build', 0):.0f} + sample() launch {g('sample', 0):.0f} + wait for GPU & .tolist() "
                f"{wait:.0f} + scheduler.update {g('update', 0):.0f} + inbox/emit/other {rest:.0f}")


def profile_steps(engine: LLMEngine, steps: int, modules: bool, smoke: bool, lead: bool = True) -> list:
    """torch.profiler over `steps` engine steps -> kernel_instances. lead: one step first, unprofiled (decode: the
    step in flight launches before the profiler starts, else 6 steps' kernels / 5)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    labels = Labels(engine, modules)
    try:
        if lead:
            engine.step()
        sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                engine.step()
            sync()
    finally:
        labels.close()
    trace = os.environ.get("E2E_PROFILE_TRACE")   # also write the steps' chrome trace (bench/timeline.py reads it)
    if trace:
        prof.export_chrome_trace(trace)
    return kernel_instances(prof, cpu_fallback=smoke)


def decode_graph(runner: ModelRunner, batch: int):
    """The captured decode graph that serves `batch` sequences (the runner's own padded-size lookup)."""
    return runner.graphs[runner._graph_size(batch)]


def graph_forward_us(runner: ModelRunner, batch: int, n: int = 20) -> float:
    """The decode forward alone: back-to-back replays of the batch's graph (inputs as last filled), CUDA events."""
    g = decode_graph(runner, batch)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


PROFILE_MAX_TOKENS = 128  # > the ~62 steps profile_decode runs
# the decode rows' sampling: kind -> (SamplingParams fields, label); generic = LocalAI's defaults for a model not
# named *kimi* (top-k with top-p, no min-p)
SAMPLING_CASES = {"greedy": (dict(temperature=0.0), "greedy"),
                  "sampled": (dict(temperature=0.6, top_p=0.95, min_p=0.01), "T0.6 top_p0.95 min_p0.01"),
                  "generic": (dict(temperature=0.9, top_k=40, top_p=0.95), "T0.9 top_k40 top_p0.95")}


def sampling_case(kind: str, **kw) -> tuple:
    """-> (SamplingParams with ignore_eos and kw, label) of SAMPLING_CASES[kind]."""
    fields, label = SAMPLING_CASES[kind]
    return SamplingParams(**fields, ignore_eos=True, **kw), label


def profile_decode(engine: LLMEngine, batch: int, args, params: SamplingParams, name: str, roof, peak,
                   top: int = 25):
    steps_graph, steps_eager, steps_time = 5, 3, 20
    print(f"\n=== profile: decode {name} (batch {batch}, context {args.decode_context}) ===")
    params = dataclasses.replace(params, max_tokens=PROFILE_MAX_TOKENS)
    streams = start_decode(engine, batch, args.decode_context, params)
    graphs = bool(engine.runner.graphs)
    try:
        wall = time_steps(engine, steps_time) * 1e6
        hp = HostPhases(engine)
        try:
            time_steps(engine, steps_time)
        finally:
            hp.close()
        path = "graph replay" if graphs else "eager"
        print(f"  wall ({path}): {wall:.0f} us/step, {batch * 1e6 / wall:.0f} tok/s")
        print(f"  host phases ({path}, perf_counter): {hp.report(steps_time + 1)}")  # + time_steps' settling step
        fwd = None
        if graphs and torch.cuda.is_available():
            fwd = graph_forward_us(engine.runner, batch)
            print(f"  forward graph alone (back-to-back replays, CUDA events): {fwd:.0f} us -> everything else "
                  f"(sampling kernels + host work the GPU waits for) {wall - fwd:.0f} us/step")
        unique = count_unique_experts(engine, tap=args.tap)
        sol = roof.decode(batch, args.decode_context, args.bw, peak, unique)
        print(f"  speed of light: {roof.describe(sol, args.bw, peak)}")
        print(f"  -> wall is {wall / (sol['t'] * 1e6):.1f}x SOL")
        visible = False
        if graphs:
            inst = profile_steps(engine, steps_graph, modules=False, smoke=args.smoke)
            # graph kernels come with no launching op or attached to the replay range; ~10/step when not reported
            fwd_kernels = sum(1 for _, _, lab in inst if lab != "sampling") / steps_graph
            visible = fwd_kernels >= 50 or args.smoke
            print_kernels(f"graph path, torch.profiler, {steps_graph} steps", inst, steps_graph, wall,
                          top=top if visible else 8)
            if not visible:
                print("    (the replayed graph's kernels are not reported one by one by this torch/CUPTI: the "
                      "per-kernel breakdown below comes from the eager path)")
        with Eager(engine):
            eager = time_steps(engine, 5) * 1e6
            inst = profile_steps(engine, steps_eager, modules=True, smoke=args.smoke)
        print(f"  eager wall: {eager:.0f} us/step (no graphs: includes the per-kernel launch overhead)")
        print_kernels(f"eager path, torch.profiler, {steps_eager} steps, module hooks", inst, steps_eager, eager,
                      modules=True, top=top if not graphs or not visible else 15)
    finally:
        stop_decode(engine, streams)


def profile_prefill(engine: LLMEngine, args):
    n = min(args.profile_prefill, args.max_num_batched_tokens)
    print(f"\n=== profile: one {n}-token prefill chunk (always eager) ===")
    bench_prefill(engine, n, seed=123)  # warmup (compiles/autotunes if the benchmark did not run this size)
    wall = bench_prefill(engine, n, seed=124) * 1e6
    stream = engine.add_request(prompt(n, engine.vocab_size, 125), SamplingParams(max_tokens=1, temperature=0.0))
    inst = profile_steps(engine, 1, modules=True, smoke=args.smoke, lead=False)  # admission + the prompt: one step
    while engine.scheduler.has_unfinished:
        engine.step()
    assert list(stream)[-1].finished
    print_kernels(f"eager, torch.profiler, the {n}-token step", inst, 1, wall, modules=True)


def run_profile(engine: LLMEngine, args, roof, peak):
    (greedy, g), (sampled, s) = sampling_case("greedy"), sampling_case("sampled")
    lo, hi = min(args.decode_batches, default=0), max(args.decode_batches, default=0)
    cases = ((lo, greedy, f"b{lo} {g}"), (hi, greedy, f"b{hi} {g}"),
             (hi, sampled, f"b{hi} {s}")) if args.decode_batches and args.profile_decode else ()
    if cases and args.sampled_generic:  # LocalAI's generic rows at the smallest batch (where their sampler shows most)
        generic, label = sampling_case("generic")
        cases += ((lo, generic, f"b{lo} {label}"),)
    for batch, params, name in cases:
        try:
            profile_decode(engine, batch, args, params, name, roof, peak, top=25 if params is greedy else 12)
        except Exception:
            traceback.print_exc()
    try:
        profile_prefill(engine, args)
    except Exception:
        traceback.print_exc()


def run_hf(args, model, cfg_dict: dict, dev, dtype) -> list:
    """HF transformers + fla baseline (bench/hf_baseline.py) on `model`'s own weights, before our engine exists
    (its KV pool takes the rest of the memory). -> rows (name, tok/s); best effort: a failure is printed."""
    import hf_baseline

    rows = []
    try:
        print(f"\n=== HF transformers {args.hf_version} + fla baseline: official remote code from {args.hf_dir} ===\n"
              f"  source: {hf_baseline.source(args.hf_dir)}")
        t = time.perf_counter()
        hf = hf_baseline.build(args.hf_dir, cfg_dict, hf_baseline.hub_tensors(model), dtype)
        import fla

        ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shared = sum(p.untyped_storage().data_ptr() in ours for p in hf.parameters())
        print(f"  built in {time.perf_counter() - t:.0f} s (fla {fla.__version__}, MLA attention via "
              f"{hf.config._attn_implementation}); {shared} of {len(list(hf.parameters()))} HF parameters share our "
              f"model's storage, the rest are dtype casts of it")
        n = min(256, max(args.prefill))
        r = hf_baseline.compare(model, hf, prompt(n, cfg_dict["vocab_size"], 5), new=8)
        print(f"  same weights, ours vs HF ({'fp32' if dtype == torch.float32 else 'bf16'}): {n}-token prefill "
              f"logits max|diff| {r['prefill_max_diff']:.3g} (max|logit| {r['prefill_max_logit']:.3g}); 8 greedy "
              f"decode steps max|diff| {r['decode_max_diff']:.3g}; tokens ours {r['ours_tokens']} HF "
              f"{r['hf_tokens']}")
        rows = hf_baseline.bench(hf, prompt, cfg_dict["vocab_size"], [x for x in args.prefill if x <= 8192],
                                 args.hf_batches,
                                 args.decode_context, args.hf_decode_steps, dev)
    except Exception:  # best effort: our engine's benchmarks still run
        traceback.print_exc()
        print("HF transformers + fla baseline failed (traceback above)")
    hf = None
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def hf_comparison(rows: list, hf_rows: list):
    """Ours beside HF+fla, matched by case (decode bN, prefill N)."""
    def key(name):
        w = name.split()
        i = w.index("decode") if "decode" in w else w.index("prefill")
        return " ".join(w[i:i + 2])

    ours = {key(n): v for n, v, _, _ in rows if "T0.6" not in n}
    print(f"\n{'case':16s} {'ours tok/s':>12s} {'HF+fla tok/s':>14s} {'ours / HF':>10s}")
    for name, v in hf_rows:
        k = key(name)
        if k in ours:
            print(f"{k:16s} {ours[k]:12.0f} {v:14.1f} {ours[k] / v:9.1f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27, help="first N layers of the official 27 (memory)")
    ap.add_argument("--decode-batches", default="1,8,64")
    ap.add_argument("--decode-context", type=int, default=1024, help="prompt tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--sampled-batches", default="", help="batches of the sampled decode rows (T0.6 top_p 0.95 min_p "
                    "0.01; default: the largest decode batch only)")
    ap.add_argument("--sampled-generic", action="store_true", help="also the sampled batches with LocalAI's generic "
                    "sampling defaults (T0.9 top_k 40 top_p 0.95, no min_p)")
    ap.add_argument("--prefill", default="1024,8192,32768")
    ap.add_argument("--multi-turn", default="", help="history lengths H: time to first token of a next chat turn "
                    "(H history tokens + --turn-tokens new ones) from scratch and after the H-token prompt was cached "
                    "(prefix_cache_slots, backend/engine/prefix_cache.py)")
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--score", default="", help="prompt lengths: the Score RPC's engine work, --score-candidates "
                    "candidates of --score-tokens tokens after each prompt (shared through the prefix cache, and not)")
    ap.add_argument("--score-candidates", type=int, default=8)
    ap.add_argument("--score-tokens", type=int, default=8)
    ap.add_argument("--grammar", action="store_true", help="also decode (greedy, each batch) under a JSON grammar "
                    "that never completes, over a synthetic vocabulary of the model's size, and under a repetition "
                    "penalty: the cost of sampling that reads the tokens (host masks, the sampling queued after the "
                    "previous step's tokens), beside the unconstrained figure of the same batch")
    ap.add_argument("--grammar-threads", default="", help="--grammar: also the largest batch with these counts of "
                    "llguidance mask threads (default rule: backend.engine.structured.mask_threads())")
    ap.add_argument("--prefill-graph-tokens", type=int,
                    default={f.name: f.default for f in dataclasses.fields(EngineConfig)}["prefill_graph_tokens"],
                    help="EngineConfig.prefill_graph_tokens (CUDA graphs for prefill-only steps of up to it; default "
                    "the engine's, 0 = off); with graphs, each --prefill size is timed eager and graphed, "
                    "interleaved, in this process")
    ap.add_argument("--warmup", action="store_true", help="run the load-time warm-up twice and print its seconds "
                    "(the first compiles what the Triton cache lacks; the second is the warm cost)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--bw", type=float, default=None,
                    help="HBM bytes/s for the speed of light (default: the card's datasheet figure, hbm_bandwidth)")
    ap.add_argument("--hf-dir", default="", help="folder holding the official remote code (modeling_kimi.py, "
                    "configuration_kimi.py; e.g. .hf/kimi-linear): runs the HF transformers + fla baseline on the same "
                    "random weights first (bench/hf_baseline.py)")
    ap.add_argument("--hf-wheels", default=None, help="wheels for the baseline, installed into their own folder "
                    "(default: the folder 'whl' beside --hf-dir, if any; '' = use what is importable)")
    ap.add_argument("--hf-batches", default=None, help="HF decode batches (default: --decode-batches up to 8)")
    ap.add_argument("--hf-decode-steps", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="after the benchmarks: kernel and host breakdown of "
                    "decode at the smallest and largest batch (greedy, and sampled at the largest; with --sampled-generic "
                    "the generic rows at the smallest) and of one 8k prefill chunk")
    ap.add_argument("--no-profile-decode", dest="profile_decode", action="store_false", help="--profile: the "
                    "prefill chunk only")
    ap.add_argument("--profile-prefill", type=int, default=8192, help="--profile's prefill chunk size (tokens; "
                    "capped by --max-num-batched-tokens)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: runs every code path (testing this file)")
    args = ap.parse_args()
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    args.sampled_batches = [int(x) for x in args.sampled_batches.split(",") if x]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    args.grammar_threads = [int(x) for x in args.grammar_threads.split(",") if x]
    args.multi_turn = [int(x) for x in args.multi_turn.split(",") if x]
    args.score = [int(x) for x in args.score.split(",") if x]
    args.hf_batches = ([b for b in args.decode_batches if b <= 8] if args.hf_batches is None else
                       [int(x) for x in args.hf_batches.split(",") if x])
    if args.hf_dir:  # before anything imports transformers, tokenizers or fla: the baseline brings its own
        import hf_baseline

        wheels = args.hf_wheels
        if wheels is None:
            wheels = os.path.join(os.path.dirname(os.path.abspath(args.hf_dir)), "whl")
            wheels = wheels if os.path.isdir(wheels) else ""
        args.hf_version = hf_baseline.activate(wheels)
    if args.smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        cfg_dict = smoke_config_dict()
        args.layers = cfg_dict["num_hidden_layers"]
    else:
        assert torch.cuda.is_available(), "bench/e2e.py needs a CUDA device (or --smoke)"
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg_dict = config_dict(args.layers)
    # with the HF baseline: expert weights from the biased router scores, as the HF remote code computes them
    # (its in-place `scores_for_choice +=` aliases `scores`); the same experts are picked either way
    cfg = ModelConfig.from_dict(cfg_dict, router_biased_weights=bool(args.hf_dir))
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {card}, torch {torch.__version__}")

    peak = matmul_peak(dev)
    if args.bw is None:
        args.bw = hbm_bandwidth(card)
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s; HBM bandwidth assumed {args.bw / 1e12:.1f} TB/s")
    args.tap = RouterTap()  # before the graphs are captured; counts nothing until switched on
    t = time.perf_counter()
    model = random_model(cfg, dev, dtype)
    sync()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"random model: {args.layers} layers ({len(cfg.kda_layers)} KDA, {len(cfg.mla_layers)} MLA), "
          f"{n_params / 1e9:.1f} B parameters, built in {time.perf_counter() - t:.0f} s")
    hf_rows = run_hf(args, model, cfg_dict, dev, dtype) if args.hf_dir else []

    # Score's candidates run side by side: one sequence each
    max_bs = max(args.decode_batches + args.sampled_batches + ([args.score_candidates] if args.score else []),
                 default=1)
    max_len = max(args.prefill + [h + args.turn_tokens + 8 for h in args.multi_turn]
                  + [n + args.score_tokens for n in args.score] + [
                                  args.decode_context + args.decode_steps + 64,
                                  args.decode_context + PROFILE_MAX_TOKENS + 8]) + 64
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_bs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=64, gpu_memory_utilization=args.gpu_memory_utilization, device=dev.type,
                        dtype=str(dtype).removeprefix("torch."), enforce_eager=args.enforce_eager,
                        # no prefill cap while decoding: the decode figures time a full batch in steady decode, and
                        # with the cap the first of 64 prompts would reach max_tokens before the last is admitted
                        max_prefill_tokens_with_decode=0,
                        prefix_cache_slots=2 if args.multi_turn or args.score else 0,
                        prefill_graph_tokens=args.prefill_graph_tokens)
    t = time.perf_counter()
    runner = ModelRunner("", ecfg, model=model)
    engine = LLMEngine(runner, ecfg, start=False)
    st = engine.stats()
    print(f"engine ready in {time.perf_counter() - t:.0f} s: {st['kv_capacity_tokens']} KV tokens, "
          f"{st['num_slots']} KDA slots, graphs {sorted(runner.graphs) or 'off'}")
    if args.warmup:  # what LoadModel adds on CUDA (EngineConfig.warmup); cold: run with TRITON_CACHE_DIR empty
        from backend.engine.warmup import groups, warmup

        n = sum(len(g) for g in groups(engine))
        for i in range(2):
            print(f"warm-up ({n} requests, backend/engine/warmup.py) #{i + 1}: {warmup(engine):.2f} s", flush=True)
    roof = Roofline(model, runner)
    print(f"active parameters per token: {roof.active_params / 1e9:.2f} B; batch-1 weight bytes per token "
          f"{(roof.dense_bytes + roof.num_moe * (cfg.num_experts_per_token + roof.folded) * roof.expert_bytes) / 1e9:.2f} GB")

    rows = []  # (name, measured, unit, speed of light)
    ctx = args.decode_context + args.decode_steps // 2  # mean keys per sequence over the measured steps
    kinds = ["sampled", "generic"] if args.sampled_generic else ["sampled"]
    greedy, g = sampling_case("greedy", max_tokens=args.decode_steps + 32)
    runs = [(b, greedy, f"decode b{b} ctx{args.decode_context} {g}") for b in args.decode_batches]
    for kind in kinds:
        params, label = sampling_case(kind, max_tokens=args.decode_steps + 32)
        runs += [(b, params, f"decode b{b} ctx{args.decode_context} {label}")
                 for b in (args.sampled_batches or [max_bs])]
    for b, params, name in runs:
        sps, unique = bench_decode(engine, b, args.decode_context, args.decode_steps, params, args.tap)
        sol = roof.decode(b, ctx, args.bw, peak, unique)
        uni = roof.decode(b, ctx, args.bw, peak)  # uniform routing: what a trained router would roughly need
        rows.append((name, b * sps, "tok/s", b / sol["t"]))
        print(f"  {name}: {1e3 / sps:.3f} ms/step, {b * sps:.1f} tok/s; speed of light {sol['t'] * 1e3:.3f} ms "
              f"(routing as measured; {uni['t'] * 1e3:.2f} ms with uniform routing)\n"
              f"    SOL: {roof.describe(sol, args.bw, peak)}")

    if args.grammar:
        g = synthetic_grammars(engine.vocab_size).compile(OPEN_JSON)  # no tokenizer with random weights
        plain = {name: v for name, v, _, _ in rows}

        def against_free(b, params, label):  # decode b sequences with `params` (one or per row) vs unconstrained
            sps, _ = bench_decode(engine, b, args.decode_context, args.decode_steps, params, args.tap)
            base = plain.get(f"decode b{b} ctx{args.decode_context} greedy")
            name = f"decode b{b} ctx{args.decode_context} greedy, {label}"
            rows.append((name, b * sps, "tok/s", base))
            print(f"  {name}: {1e3 / sps:.3f} ms/step, {b * sps:.1f} tok/s"
                  + (f" ({100 * b * sps / base:.1f}% of the unconstrained {base:.1f} tok/s)" if base else ""))

        steps = args.decode_steps + 32
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps, grammar=g)
        for b in args.decode_batches:
            against_free(b, params, "JSON grammar")
        for b in args.decode_batches:  # penalties read the tokens too (no host masks)
            against_free(b, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps,
                                           repetition_penalty=1.1), "repetition_penalty 1.1")
        for n in args.grammar_threads:  # llguidance's mask pool at the largest batch
            structured.MASK_THREADS = n
            structured._EXEC.clear()
            against_free(max_bs, params, f"JSON grammar, {n} mask threads")
        if max_bs > 1:  # one constrained request among free ones: every row's sampling waits for its mask
            free = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps)
            against_free(max_bs, [params] + [free] * (max_bs - 1), "1 row with a JSON grammar")
    if args.prefill:
        bench_prefill(engine, min(args.prefill), seed=99)  # warmup: extend kernels compile
    graphs = runner.prefill_graphs
    for i, n in enumerate(args.prefill):
        sol = peak / roof.prefill_flops(n) * n
        for pg in ([None, graphs, None, graphs] if graphs is not None else [None]):  # eager / graphs interleaved
            runner.prefill_graphs = pg
            dt = bench_prefill(engine, n, seed=i)
            how = "" if graphs is None else (", prefill graphs" if pg is not None else ", eager")
            rows.append((f"prefill {n} (chunks of {args.max_num_batched_tokens}{how})", n / dt, "tok/s", sol))
            print(f"  prefill {n}{how}: {dt * 1e3:.1f} ms, {n / dt:.0f} tok/s")
    runner.prefill_graphs = graphs
    for i, h in enumerate(args.multi_turn):
        n = args.turn_tokens
        bench_turn(engine, h, n, seed=50 + i)  # warmup: the shapes' kernels compile (the first pass timed seconds)
        cold, warm = bench_turn(engine, h, n, seed=50 + i)
        # the new tokens' FLOPs after h cached, or the bytes of one pass over the weights their experts need
        sol = roof.pass_sol(n, roof.prefill_flops(h + n) - roof.prefill_flops(h), h, 1, args.bw, peak)
        name = f"next turn TTFT, {h} cached + {n} new"
        rows.append((name, 1.0 / warm, "turn/s", 1.0 / sol))
        print(f"  {name}: {warm * 1e3:.1f} ms with the prefix cache, {cold * 1e3:.1f} ms from scratch "
              f"({cold / warm:.1f}x); speed of light of the new tokens {sol * 1e3:.2f} ms (FLOPs or one weight pass)")
    for i, n in enumerate(args.score):
        c, m = args.score_candidates, args.score_tokens
        bench_score(engine, n, c, m, seed=70 + i)  # warmup, as for the turns
        shared, alone = bench_score(engine, n, c, m, seed=70 + i)
        # the prompt once and every candidate after it, in one pass over the weights at best
        flops = roof.prefill_flops(n) + c * (roof.prefill_flops(n + m) - roof.prefill_flops(n))
        sol = roof.pass_sol(n + c * m, flops, c * n, c, args.bw, peak)
        name = f"Score, {n}-token prompt, {c} candidates x {m} tokens"
        rows.append((name, 1.0 / shared, "call/s", 1.0 / sol))
        print(f"  {name}: {shared * 1e3:.1f} ms with the prompt shared, {alone * 1e3:.1f} ms with each candidate "
              f"computing it ({alone / shared:.1f}x); speed of light (prompt once, one weight pass) {sol * 1e3:.2f} ms")
    if args.profile:
        run_profile(engine, args, roof, peak)
    graphs = bool(runner.graphs)
    engine.shutdown()

    print(f"\n{'benchmark':58s} {'measured':>12s} {'speed of light':>15s} {'% SOL':>7s}")
    for name, v, unit, sol in rows:
        s = f"{sol:12.0f}" if sol else f"{'-':>12s}"
        pct = f"{100 * v / sol:7.2f}%" if sol else f"{'-':>8s}"   # 2 decimals: targets sit at whole percents
        print(f"{name:58s} {v:8.1f} {unit:5s} {s} {unit:5s}{pct}")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print("\n| benchmark | measured | speed of light | % SOL | setup |\n|---|---|---|---|---|")
    for name, v, unit, sol in rows:
        sol_s = f"{sol:.0f} {unit}" if sol else "-"
        pct = f"{100 * v / sol:.2f}%" if sol else "-"
        print(f"| {name} | {v:.1f} {unit} | {sol_s} | {pct} | {gpu}, {args.layers} layers, random "
              f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}, {'CUDA graphs' if graphs else 'eager'} |")
    for name, v in hf_rows:  # same weights, same process, before our engine was built
        print(f"| {name} | {v:.1f} tok/s | - | - | {gpu}, {args.layers} layers, same random weights; HF transformers "
              f"{args.hf_version}, official remote code ({args.hf_dir}), fla kernels, MLA via sdpa |")
    if hf_rows:
        hf_comparison(rows, hf_rows)


if __name__ == "__main__":
    main()
