"""Marginal cost of each kernel class in the decode CUDA graph (H200): where a fusion could still save time.

    python bench/ablate.py                       # batch 1, context 1024, every ablation below
    python bench/ablate.py --batch 8 --only post_norm,router
    python bench/ablate.py --ab                  # instead: the decode fusions' switches, each one off, then all off
    python bench/ablate.py --only none --set kernels.gemv.PDL_L2_MB=32 --set "kernels.gemv.PDL_L2_MB=8;kernels.gemv.PDL_MAX_LINES=16"
                                                 # instead: module constants set per case (each --set is one case)

Builds the full Kimi-Linear-48B-A3B shape with random bf16 weights (bench/e2e.py), then for each ablation replaces
one group of calls in backend.model.kimi_linear by a stand-in that launches nothing (it returns a zero buffer of
the right shape, or its input), recaptures the decode graph, runs `--batch` fresh requests of `--context` prompt
tokens and times steady decode steps (engine.step, graph replay) and the forward graph alone (back-to-back
replays). The difference to the unablated step is what those launches cost inside the graph, PDL overlap
included: an upper bound on what fusing them away can save. The ablated models compute garbage: timing only.
"""
import argparse
import ast
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import e2e  # noqa: E402
from backend.config import ModelConfig  # noqa: E402
from backend.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from backend.engine.request import SamplingParams  # noqa: E402
from backend.engine.runner import ModelRunner  # noqa: E402
from backend.model import kimi_linear as km  # noqa: E402
from backend.model.random_weights import random_model  # noqa: E402
from kernels.gemv import skinny_linear as _skinny_linear  # noqa: E402

_ZEROS = {}


def zeros(key: str, shape, dtype, device) -> torch.Tensor:
    """A zero buffer per (key, shape, dtype), made on first use (the eager warmup before each capture), then reused:
    no kernel runs for it inside the graph."""
    k = (key, tuple(shape), dtype)
    if k not in _ZEROS:
        _ZEROS[k] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[k]


class _TorchNoEinsum:
    """kimi_linear's `torch` with einsum replaced (the MLA absorb / un-absorb GEMMs)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def einsum(eq, a, b):
        out = {"thn,hnl->thl": (a.shape[0], a.shape[1], b.shape[2]),
               "thl,hvl->thv": (a.shape[0], a.shape[1], b.shape[1])}[eq]
        return zeros("einsum" + eq, out, a.dtype, a.device)


def _router(x, w, bias, top_k, scaling, renorm, biased, shared_id=None):
    """Fixed experts 0..top_k-1 (+ the shared one) for every token, zero weights."""
    T, k = x.shape[0], top_k + (shared_id is not None)
    key = ("router_ids", (T, k), torch.int32)
    if key not in _ZEROS:  # made in the eager warmup, so the graph holds no kernel for it
        ids = torch.arange(k, dtype=torch.int32, device=x.device).repeat(T, 1)
        if shared_id is not None:
            ids[:, -1] = shared_id
        _ZEROS[key] = ids
    return zeros("router_w", (T, k), torch.float32, x.device), _ZEROS[key]


# the decode step's projections by weight shape [N, K] (full-size config, one GPU): the gemv / cuBLAS groups
LINEAR_GROUPS = {
    "lin_kda_in": lambda n, k: (n, k) == (12576, 2304),                  # KDA q|k|v|f_a|g_a|b (x20)
    "lin_o": lambda n, k: (n, k) == (2304, 4096),                        # KDA + MLA o_proj (x27)
    "lin_mla_in": lambda n, k: (n, k) == (6720, 2304),                   # MLA q|kv_a (x7)
    "lin_lm_head": lambda n, k: n >= 100000,                             # lm_head
    "lin_dense_mlp": lambda n, k: (n, k) in ((18432, 2304), (2304, 9216)),  # layer 0's dense MLP
}


def _skip_linear(pred):
    """skinny_linear stand-in: the projections whose weight matches pred launch nothing (zeros), the rest run."""
    def linear(x, w, measured_only=False):
        if pred(w.shape[0], w.shape[1]):
            return zeros(("lin", w.shape), (x.shape[0], w.shape[0]), x.dtype, x.device)
        return _skinny_linear(x, w, measured_only)
    return linear


def linear_bytes(model, pred) -> int:
    """Weight bytes of the model's nn.Linear modules whose weight matches pred (read once per decode step)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and pred(m.weight.shape[0], m.weight.shape[1]))


def parse_set(spec: str) -> list:
    """--set "pkg.mod.ATTR=value;pkg.mod.ATTR2=value" -> [(module, ATTR, value)] (values: Python literals)."""
    out = []
    for item in filter(None, (t.strip() for t in spec.split(";"))):
        lhs, _, rhs = item.partition("=")
        mod, _, attr = lhs.strip().rpartition(".")
        module = importlib.import_module(mod)
        if not hasattr(module, attr):
            raise SystemExit(f"--set: {mod} has no attribute {attr}")
        out.append((module, attr, ast.literal_eval(rhs.strip())))
    return out


# name -> {kimi_linear attribute: stand-in}
ABLATIONS = {
    "post_norm": {"add_rmsnorm": lambda x, res, w, eps: (x, res)},
    "combine_norm": {"combine_add_rmsnorm": lambda y, tw, res, w, eps: (res, res)},
    "router": {"moe_router": _router},
    "fgb": {"skinny_bmm_nt": lambda a, b: zeros("fgb", (a.shape[0], a.shape[1], b.shape[1]), a.dtype, a.device)},
    "kda": {"kda_decode": lambda qkv, *a: zeros("kda", (qkv.shape[0], qkv.shape[1] // 3), qkv.dtype, qkv.device)},
    "mla_attn": {"mla_decode": lambda q, *a, w_uv=None: zeros(
        "mla", q.shape if w_uv is None else (*q.shape[:2], w_uv.shape[1]), q.dtype, q.device)},
    "mla_einsum": {"torch": _TorchNoEinsum()},
    "mla_norm_store": {"rmsnorm_head": lambda y, w, eps: y, "store_latent": lambda *a: None},
    "moe": {"fused_moe_uncombined_triton": lambda x, w13, w2, tw, ids:
            zeros("moe", (ids.numel(), x.shape[1]), x.dtype, x.device),
            # the PendingMoE path (kimi_linear.KimiMoE.forward_norms): GEMM1 + GEMM2 skipped, the combine + add +
            # norm launch kept
            "fused_moe_add_norm": lambda x, w13, w2, tw, ids, res, w, eps: km.combine_add_rmsnorm(
                zeros("moe", (ids.numel(), x.shape[1]), x.dtype, x.device), tw, res, w, eps)},
}
# the PendingMoE path's combine + add + norm launch skipped (GEMM1 + GEMM2 kept): what folding it away can save
ABLATIONS["combine_tail"] = {"fused_moe_add_norm": lambda x, w13, w2, tw, ids, res, w, eps: (
    km.fused_moe_uncombined_triton(x, w13, w2, tw, ids), (res, res))[1]}
ABLATIONS["router_norm"] = {"moe_router_add_norm": lambda attn, res, w, eps, gw, b, top_k, *a: (
    attn, res, *_router(attn, gw, b, top_k, *a))}
ABLATIONS["mla_prep"] = {"mla_decode_prep": lambda y, q_dim, w, eps, w_uk, *a: zeros(
    "mla_prep", (y.shape[0], w_uk.shape[0], w_uk.shape[2]), y.dtype, y.device)}
ABLATIONS["norms+router+fgb"] = {**ABLATIONS["post_norm"], **ABLATIONS["combine_norm"], **ABLATIONS["router"],
                                 **ABLATIONS["fgb"]}
ABLATIONS["mla_small"] = {**ABLATIONS["mla_einsum"], **ABLATIONS["mla_norm_store"]}
for _name, _pred in LINEAR_GROUPS.items():
    ABLATIONS[_name] = {"skinny_linear": _skip_linear(_pred)}


def _all_on() -> list:
    """--all-on: every decode fusion on for every decode batch (the opt-in ones and the caps lifted)."""
    import kernels.kda.recurrent as rec
    import kernels.moe.router as router

    return [(rec, "_EARLY_STATE", 1),
            (router, "ROUTER_NORM_MAX_T", router.GEMV_MAX_T), (km, "MLA_FUSED_MAX_T", 64)]


def _switches():
    """--ab: name -> [(object, attribute, value)] turning one decode fusion off (module switches read per call)."""
    import kernels.kda.recurrent as rec
    import kernels.moe.router as router

    off = {
        "KDA early state off": [(rec, "_EARLY_STATE", 0)],
        "router + post-norm off": [(router, "ROUTER_NORM", False)],
        "MLA fused chain off": [(km, "MLA_FUSED_MAX_T", 0)],
    }
    off["all off"] = [p for v in off.values() for p in v]
    off["(on) KDA early state 2"] = [(rec, "_EARLY_STATE", 2)]   # state tile in registers before the wait
    return off


class Switched:
    def __init__(self, patches: list):
        self.patches, self.saved = patches, []

    def __enter__(self):
        for obj, name, value in self.patches:
            self.saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


class Patched:
    def __init__(self, patches: dict):
        self.patches, self.saved = patches, {}

    def __enter__(self):
        for name, fn in self.patches.items():
            self.saved[name] = getattr(km, name)
            setattr(km, name, fn)

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(km, name, fn)


def measure(engine: LLMEngine, runner: ModelRunner, args, params) -> tuple:
    """Recapture the graphs, start fresh requests, -> (ms per engine step, ms per graph replay, ms to the first token
    of each --prefill-token prompt: the median of 3 after an untimed one, a list)."""
    if not args.smoke:
        torch.cuda.synchronize()
        runner._capture_graphs(args.batch)
    streams = e2e.start_decode(engine, args.batch, args.context, params)
    step = e2e.time_steps(engine, args.steps)
    fwd = 0.0 if args.smoke else e2e.graph_forward_us(runner, args.batch)
    e2e.stop_decode(engine, streams)
    pre = []
    for n in args.prefill:
        ids = e2e.prompt(n, engine.vocab_size, 7)
        pre.append(sorted([e2e.ttft(engine, ids) for _ in range(4)][1:])[1] * 1e3)
    return step * 1e3, fwd / 1e3, pre


def export_timeline(runner: ModelRunner, batch: int, path: str, reps: int = 3):
    """torch.profiler over `reps` back-to-back replays of the batch's decode graph -> chrome trace at `path` (each
    kernel's start, duration, grid and block: the in-graph timeline, PDL overlap visible; analysed off the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    g = e2e.decode_graph(runner, batch)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    print(f"timeline: {reps} graph replays -> {path}")


def _case_path(path: str, i: int) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}.set{i}{ext or '.json'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-model-len", type=int, default=0, help="the engine's (block-table width; default: "
                    "context + 64 * steps)")
    ap.add_argument("--only", default="", help="comma-separated ablation names (default: all)")
    ap.add_argument("--ab", action="store_true", help="time the decode fusions' switches (each off, all off) instead")
    ap.add_argument("--all-on", action="store_true", help="first switch every decode fusion on at every batch size "
                    "(opt-in ones included, caps lifted): the baseline of --ab")
    ap.add_argument("--set", action="append", default=[], metavar="MOD.ATTR=VALUE[;...]",
                    help="a case that sets module constants (read per call) instead of an ablation; repeatable")
    ap.add_argument("--timeline", default="", metavar="PATH", help="also export a chrome trace of the unablated "
                    "decode graph's replays (GPU), and one per --set case (PATH with .setN before the extension)")
    ap.add_argument("--prefill", default="", metavar="N[,N...]", help="also time, per case, the first token of an "
                    "N-token prompt for each N (ms; eager prefill; e.g. --set cases of prefill-path switches)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager: runs every stand-in (testing)")
    args = ap.parse_args()
    args.prefill = [int(n) for n in args.prefill.split(",") if n]
    names = [n for n in args.only.split(",") if n and n != "none"] if args.only else list(ABLATIONS)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise SystemExit(f"--only: unknown ablation(s) {unknown}; known: {sorted(ABLATIONS)}")
    sets = [(spec, Switched(parse_set(spec))) for spec in args.set]
    if args.smoke:
        dev, dtype, cfg = torch.device("cpu"), torch.float32, ModelConfig.from_dict(e2e.smoke_config_dict())
    else:
        dev, dtype, cfg = torch.device("cuda"), torch.bfloat16, ModelConfig.from_dict(e2e.config_dict(27))
    model = random_model(cfg, dev, dtype)
    ecfg = EngineConfig(max_model_len=args.max_model_len or max(args.context + 64 * args.steps,
                                                                 max(args.prefill, default=0) + 8),
                        max_num_seqs=args.batch,
                        max_num_batched_tokens=8192, block_size=64, gpu_memory_utilization=0.9, device=dev.type,
                        dtype=str(dtype).removeprefix("torch."), max_prefill_tokens_with_decode=0,
                        max_graph_batch_size=args.batch, enforce_eager=args.smoke)
    runner = ModelRunner("", ecfg, model=model)
    engine = LLMEngine(runner, ecfg, start=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10 * args.steps)
    print(f"{torch.cuda.get_device_name(dev) if not args.smoke else 'cpu'}, torch {torch.__version__}; decode batch {args.batch}, "
          f"context {args.context}, {args.steps} steps per figure; stand-ins launch nothing (garbage math)")
    if args.all_on:
        Switched(_all_on()).__enter__()
    base_step, base_fwd, base_pre = measure(engine, runner, args, params)
    pre_col = lambda ms: "".join(f" {m:10.2f}" for m in ms)  # noqa: E731
    if args.timeline and not args.smoke:
        streams = e2e.start_decode(engine, args.batch, args.context, params)   # inputs as in a real step
        export_timeline(runner, args.batch, args.timeline)
        e2e.stop_decode(engine, streams)
    print(f"{'ablation':26s} {'step ms':>8s} {'saved us':>9s} {'graph ms':>9s} {'saved us':>9s}"
          + "".join(f" {f'prefill {n}':>10s}" for n in args.prefill))
    print(f"{'(none)':26s} {base_step:8.3f} {'':9s} {base_fwd:9.3f} {'':9s}" + pre_col(base_pre))
    cases = [(name, Switched(p)) for name, p in _switches().items()] if args.ab else \
        [(name, Patched(ABLATIONS[name])) for name in names]
    for i, (name, ctx) in enumerate(cases + sets):
        with ctx:
            step, fwd, pre = measure(engine, runner, args, params)
            if args.timeline and i >= len(cases) and not args.smoke:   # --set case i: its own trace, PATH.setI.json
                streams = e2e.start_decode(engine, args.batch, args.context, params)
                export_timeline(runner, args.batch, _case_path(args.timeline, i - len(cases) + 1))
                e2e.stop_decode(engine, streams)
        line = (f"{name:26s} {step:8.3f} {1e3 * (base_step - step):9.1f} {fwd:9.3f} {1e3 * (base_fwd - fwd):9.1f}"
                + pre_col(pre))
        if name in LINEAR_GROUPS:   # the group's weight bytes over the time it costs in the graph
            nbytes = linear_bytes(model, LINEAR_GROUPS[name])
            saved = base_fwd - fwd
            line += f"   {nbytes / 1e6:8.1f} MB" + (f" {nbytes / (saved * 1e-3) / 1e12:5.2f} TB/s" if saved > 0 else "")
        print(line)
    step, fwd, pre = measure(engine, runner, args, params)
    print(f"{'(none, again)':26s} {step:8.3f} {'':9s} {fwd:9.3f} {'':9s}" + pre_col(pre))
    engine.shutdown()


if __name__ == "__main__":
    main()
