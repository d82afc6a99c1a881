"""Host-only micro-benchmark of a decode step: engine.step() on the tiny checkpoint (CPU) with the decode-graph path
on a graph that does nothing, so that only the host work is timed (schedule, graph inputs, sampling metadata,
update, emit). On the CPU the "H2D copies" are memcpys: this measures the Python and torch-dispatch cost, not the
CUDA launch latency.

    python -m tests.engine.host_bench [--batches 1,64] [--steps 100] [--rounds 9] [--context 1024]

Prints the least over rounds of each phase's us per step.
"""

import argparse
import collections
import time

import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.request import RequestStatus
from tools.tiny_checkpoint import write_tiny_checkpoint


class NullGraph:
    """A captured graph stand-in that leaves the logits as they are (zeros: every step samples token 0)."""

    def replay(self):
        pass


def decode_engine(ckpt: str, batch: int, context: int, max_bs: int) -> LLMEngine:
    """An engine (no thread) whose `batch` requests sit mid-decode at `context` tokens, with null decode graphs."""
    cfg = EngineConfig(block_size=64, max_num_seqs=max_bs, max_num_batched_tokens=max(2048, max_bs),
                       max_model_len=context + 4096, device="cpu")
    from backend.engine.runner import ModelRunner

    runner = ModelRunner(ckpt, cfg)
    eng = LLMEngine(runner, cfg, start=False)
    runner.graph_vars = runner._make_graph_vars(max_bs)
    runner.graphs = {b: NullGraph() for b in (1, 2, 4, 8, 16, 32, 48, 64) if b <= max_bs}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4000)
    for i in range(batch):
        eng.add_request([(i * 7 + j) % 250 for j in range(context)], params)
    eng._drain_inbox()
    sch = eng.scheduler
    while sch.waiting:  # admitted as if their prompts had run: the next step is a decode for each
        r = sch.waiting.popleft()
        r.state_slot = sch.states.allocate()
        r.status = RequestStatus.RUNNING
        r.block_ids = sch.blocks.allocate(sch.blocks.blocks_for(context + 1))
        r.num_computed_tokens = context
        r.output_token_ids = [1]
        sch.running.append(r)
    return eng


class Phases:
    """perf_counter totals of wrapped callables (the same split as bench/e2e.py --profile)."""

    def __init__(self):
        self.t = collections.defaultdict(float)

    def wrap(self, obj, attr, key):
        real, t = getattr(obj, attr), self.t

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0

        setattr(obj, attr, wrapped)


def run(ckpt: str, batch: int, steps: int, context: int, max_bs: int, rounds: int) -> dict:
    """-> us per step of each phase, the least over `rounds` rounds of `steps` steps (the host is noisy)."""
    import backend.engine.runner as runner_mod
    from backend.engine.sampler import SamplingMetadata

    eng = decode_engine(ckpt, batch, context, max_bs)
    for _ in range(20):  # warmup
        eng.step()
    ph = Phases()
    ph.wrap(eng, "step", "step")
    ph.wrap(eng.scheduler, "schedule", "schedule")
    if hasattr(eng.scheduler, "schedule_next"):  # pipelined decode steps schedule with schedule_next
        ph.wrap(eng.scheduler, "schedule_next", "schedule")
    ph.wrap(eng.scheduler, "update", "update")
    ph.wrap(eng.runner, "_replay", "inputs")
    real_build, real_sample = SamplingMetadata.build, runner_mod.sample
    ph.wrap(runner_mod, "sample", "sample")
    holder = type("B", (), {"build": staticmethod(real_build)})
    ph.wrap(holder, "build", "md_build")
    SamplingMetadata.build = staticmethod(holder.build)
    per_round = []
    try:
        for _ in range(rounds):
            ph.t.clear()
            for _ in range(steps):
                eng.step()
            t = {k: v * 1e6 / steps for k, v in ph.t.items()}
            t["other"] = t["step"] - sum(t.get(k, 0.0) for k in ("schedule", "update", "inputs", "md_build", "sample"))
            per_round.append(t)
    finally:
        SamplingMetadata.build = staticmethod(real_build)
        runner_mod.sample = real_sample
    assert len(eng.scheduler.running) == batch, "a request finished during the measurement"
    eng.shutdown()
    return {k: min(t[k] for t in per_round) for k in per_round[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ckpt", default="", help="a tiny checkpoint directory (default: written to a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ckpt = args.ckpt
    if not ckpt:
        import tempfile

        ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="host_bench_"), tokenizer=None, seed=3,
                                     dtype="float32", layers="KMK")
    for b in (int(x) for x in args.batches.split(",")):
        t = run(ckpt, b, args.steps, args.context, max_bs=64, rounds=args.rounds)
        print(f"batch {b:3d}: step {t['step']:7.1f} us = schedule {t['schedule']:.1f} + inputs {t['inputs']:.1f} "
              f"+ SamplingMetadata.build {t['md_build']:.1f} + sample {t['sample']:.1f} + update "
              f"{t['update']:.1f} + other (to_host, inbox, emit) {t['other']:.1f}")


if __name__ == "__main__":
    main()
