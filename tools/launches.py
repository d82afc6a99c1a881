"""Kernel launches of one engine step, counted (no timing): which code launches what, per layer.

A small prefill step is bound by its launches on the H200 (BENCHMARKS.md, twentieth round: a 1,024-token step
launches 2,006 kernels, 25.0 ms of kernels in 46.8 ms). This counts them without a GPU: the tiny checkpoint in
Kimi-Linear's layer layout (20 KDA + 7 MLA layers, layer 0 dense) runs through the Triton kernels (the interpreter on
CPU), and every Triton launch and every torch op that launches a kernel is attributed to the line of backend/ or
kernels/ that issued it.

    python tools/launches.py                          # CPU: one 1-prompt prefill step, then a 4-sequence decode step
    python tools/launches.py --prompts 3 --tokens 200 --decode 0
    python tools/launches.py --device cuda            # the same launches for real (Triton JIT, CUDA ops)

Counted: Triton kernel launches (one each) and torch ops other than views and allocations (one each; a few torch ops
launch more than one kernel, e.g. sort, so this is a lower bound for them). Host syncs (`.item()`, nonzero) are listed
apart. Counts depend on the shapes only through a few thresholds (the skinny-GEMM and expanded-MLA token counts), so
the tiny model's counts are the full model's.
"""

import argparse
import collections
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KIMI_LAYERS = "KKKMKKKMKKKMKKKMKKKMKKKMKKM"   # (i + 1) in full_attn_layers [4, 8, ..., 24, 27] -> MLA

# torch ops that launch no kernel (allocations, metadata); views are found from the schema
NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
             "aten::resize_", "aten::set_", "aten::detach", "aten::lift_fresh", "aten::_reshape_alias", "aten::alias",
             "aten::record_stream", "aten::_has_compatible_shallow_copy_type", "aten::is_pinned", "aten::sym_size",
             "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset"}
SYNCS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal"}


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _site() -> str:
    """The innermost frame in backend/ or kernels/ -> 'path:function:line'."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(ROOT):
            rel = os.path.relpath(path, ROOT)
            if rel.startswith(("backend", "kernels")):
                return f"{rel}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "?"


class LaunchCounter:
    """Context manager: counts Triton launches and kernel-launching torch ops, by site and by decoder layer."""

    def __init__(self, model=None):
        self.sites = collections.Counter()     # (site, what) -> n
        self.layers = collections.Counter()    # (layer index or -1, 'triton' | 'torch') -> n
        self.syncs = collections.Counter()     # (site, op) -> n
        self.layer, self._in_triton, self._hooks, self._patched = -1, 0, [], []
        self.model = model

    # -- hooks
    def _enter_layer(self, i):
        def pre(_mod, _args):
            self.layer = i
        return pre

    def _triton_run(self, orig):
        counter = self

        def run(fn_self, *args, **kwargs):
            if counter._in_triton == 0:
                name = getattr(getattr(fn_self, "fn", None), "__name__", None) or getattr(fn_self, "__name__", "?")
                counter.record("triton", name)
            counter._in_triton += 1
            try:
                return orig(fn_self, *args, **kwargs)
            finally:
                counter._in_triton -= 1
        return run

    def record(self, kind: str, what: str):
        self.sites[(_site(), f"{kind} {what}")] += 1
        self.layers[(self.layer, kind)] += 1

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime import jit

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if counter._in_triton == 0:
                    name = func._schema.name
                    if name in SYNCS:
                        counter.syncs[(_site(), name)] += 1
                    elif name not in NO_KERNEL and not _is_view(func):
                        counter.record("torch", name.replace("aten::", ""))
                return out

        targets = [(jit.JITFunction, "run")]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            targets.append((InterpretedFunction, "run"))
        except ImportError:
            pass
        for cls, attr in targets:
            orig = getattr(cls, attr)
            self._patched.append((cls, attr, orig))
            setattr(cls, attr, self._triton_run(orig))
        if self.model is not None:
            for i, layer in enumerate(self.model.model.layers):
                self._hooks.append(layer.register_forward_pre_hook(self._enter_layer(i)))
            self._hooks.append(self.model.model.norm.register_forward_pre_hook(self._enter_layer(-1)))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, attr, orig in self._patched:
            setattr(cls, attr, orig)
        for h in self._hooks:
            h.remove()
        self.layer = -1
        return False

    # -- results
    def total(self, kind: str = None) -> int:
        return sum(n for (_, k), n in self.layers.items() if kind is None or k == kind)

    def per_layer(self, kinds: str) -> dict:
        """layer kind ('K' / 'M' for decoder layers, '-' for outside them) -> (layers, triton, torch)."""
        out = collections.defaultdict(lambda: [0, 0, 0])
        seen = set()
        for (i, k), n in self.layers.items():
            c = kinds[i] if i >= 0 else "-"
            if (i, c) not in seen:
                seen.add((i, c))
                out[c][0] += 1
            out[c][1 if k == "triton" else 2] += n
        return dict(out)

    def report(self, title: str, kinds: str, top: int = 40) -> str:
        lines = [f"== {title}: {self.total()} launches (Triton {self.total('triton')}, torch "
                 f"{self.total('torch')}), host syncs {sum(self.syncs.values())}"]
        for c, (n, tri, tor) in sorted(self.per_layer(kinds).items()):
            name = {"K": "KDA layer", "M": "MLA layer", "-": "outside the layers"}[c]
            lines.append(f"   {name:<20} x{n:<3} per layer: Triton {tri / n:5.1f}  torch {tor / n:5.1f}")
        lines.append(f"   by site (top {top}; n over the whole step):")
        for (site, what), n in self.sites.most_common(top):
            lines.append(f"   {n:5d}  {what:<34} {site}")
        for (site, what), n in self.syncs.most_common():
            lines.append(f"   SYNC {n:3d}  {what:<30} {site}")
        return "\n".join(lines)


def build_engine(device: str, layers: str, max_tokens: int):
    from backend.engine import EngineConfig, LLMEngine
    from tools.tiny_checkpoint import write_tiny_checkpoint

    d = write_tiny_checkpoint(tempfile.mkdtemp(prefix="launches_"), tokenizer=None, seed=1, layers=layers,
                              dtype="float32" if device == "cpu" else "bfloat16")   # CUDA: the served dtype
    cfg = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=max_tokens + 64,
                       max_model_len=max_tokens + 64, device=device, enforce_eager=True,
                       **({} if device == "cpu" else dict(num_blocks=256)))
    return LLMEngine.from_config(d, cfg)


def count_steps(eng, prompts, decode_rows: int, warmup: bool = True):
    """-> (prefill counter, decode counter or None): one step running `prompts` together (after the same step once
    uncounted with `warmup`, so Triton's first-call work is not counted), then, with `decode_rows` sequences
    decoding, one eager decode step."""
    from backend.engine import SamplingParams

    runner = eng.runner
    results, orig = [], runner.execute

    def execute(out):
        if not results:
            return orig(out)
        with LaunchCounter(runner.model) as c:
            r = orig(out)
        results[-1] = c
        return r

    def run(ps, max_tokens):
        streams = [eng.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
                   for p in ps]
        for s in streams:
            list(s)

    runner.execute = execute
    try:
        if warmup:
            run(prompts, 1)                  # JIT / first calls, not counted
        results.append(None)
        run([list(p) for p in prompts], 1)   # counted: the last step it runs is the prefill step
        prefill = results[-1]
        dec = None
        if decode_rows:
            results[-1] = None
            run([[5 + i, 6, 7] for i in range(decode_rows)], 2)   # the last counted step: decode of every row
            dec = results[-1]
    finally:
        runner.execute = orig
    return prefill, dec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default=KIMI_LAYERS, help="K = KDA, M = MLA per layer (default: Kimi-Linear's 27)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per prompt")
    ap.add_argument("--decode", type=int, default=4, help="sequences in the counted decode step (0: none)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-warmup", action="store_true", help="count the first step too (the interpreter compiles "
                    "nothing: this halves the CPU run)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["KIMI_KERNELS"] = "triton"
    import torch
    from backend.model import kimi_linear

    # the prefill part's MLA form on CUDA (expanded above a token count) on every device
    cuda_min = kimi_linear.MLA_EXPANDED_MIN_TOKENS.get("cuda")
    if cuda_min is not None:
        kimi_linear.MLA_EXPANDED_MIN_TOKENS[args.device] = cuda_min
    import kernels.moe.fused as fused

    if fused.ALIGN_CHUNKED is None:   # CUDA's MoE align for large steps (the CPU default keeps torch ops)
        fused.ALIGN_CHUNKED = True
    torch.manual_seed(0)
    eng = build_engine(args.device, args.layers, args.prompts * args.tokens)
    try:
        prompts = [[(7 * i + j) % 250 + 1 for j in range(args.tokens)] for i in range(args.prompts)]
        pre, dec = count_steps(eng, prompts, args.decode, warmup=not args.no_warmup)
        print(pre.report(f"prefill step: {args.prompts} x {args.tokens} tokens, {len(args.layers)} layers",
                         args.layers, args.top))
        if dec is not None:
            print(dec.report(f"eager decode step: {args.decode} sequences", args.layers, args.top))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
