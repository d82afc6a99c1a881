"""Runs in spawned processes: one rank of a gloo world computing the logits of a fixed two-step workload."""
import datetime
import os

import torch
import torch.distributed as dist

from backend.model.batch import ForwardBatch
from backend.model.loader import load_model
from backend.model.parallel import TP
from tests.eager_graph import EagerGraph

BLOCK = 4


def workload():
    """Two steps over one cache: step 1 prefills A, B and D's first chunk; step 2 decodes A and B, continues D and
    starts C -> [(seqs, num_decodes)], seqs as ForwardBatch.build takes them."""
    a, b, c, d = [3, 17, 42, 99, 7, 8, 120], [5, 6, 200, 31, 2], [9, 250, 11, 64, 65, 66], list(range(30, 39))
    pages = {"a": [1, 2], "b": [3, 4], "c": [5, 6], "d": [7, 8, 9]}
    step1 = [(a, 0, 1, pages["a"]), (b, 0, 2, pages["b"]), (d[:4], 0, 3, pages["d"])]
    step2 = [([77], 7, 1, pages["a"]), ([78], 5, 2, pages["b"]), (d[4:], 4, 3, pages["d"]), (c, 0, 4, pages["c"])]
    return [(step1, 0), (step2, 2)]


def run_workload(model) -> list:
    cache = model.allocate_cache(6, 12, BLOCK)
    out = []
    for seqs, nd in workload():
        n = sum(len(s[0]) for s in seqs)
        batch = ForwardBatch.build(seqs, nd, BLOCK, model.device, logits_positions=list(range(n)))
        out.append(model.compute_logits(model(batch, cache), batch.logits_index))
    return out


def rank_main(rank: int, world: int, port: int, ckpt: str, out_path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = load_model(ckpt, "cpu", torch.float32, TP(rank, world))
        logits = run_workload(model)
        if rank == 0:
            torch.save(logits, out_path + ".tmp")
            os.replace(out_path + ".tmp", out_path)
        dist.barrier()   # tear down together: a rank closing its gloo pairs under a busy peer can abort the peer
    finally:
        dist.destroy_process_group()


def engine_rank_main(rank: int, world: int, port: int, ckpt: str, prompts: list, max_tokens: int, first: int,
                     out_path: str):
    """Rank 0 drives an LLMEngine step by step, rank 1 follows; decode steps go through (fake) graphs and the
    broadcast buffer holds only `first` ints, so larger steps take the second broadcast."""
    from backend.engine import EngineConfig, LLMEngine, SamplingParams
    from backend.engine.runner import ModelRunner
    from backend.model import parallel

    torch.set_num_threads(1)
    parallel.FIRST = first
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        group = parallel.Group(TP(rank, world), rank, store, owned=False)
        cfg = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, device="cpu")
        runner = ModelRunner(ckpt, cfg, group=group)
        runner.graph_vars = runner._make_graph_vars(4)
        runner.graphs = {b: EagerGraph(runner, b) for b in (1, 2, 4)}
        if rank:
            runner.follow()
            dist.barrier()
            return
        sends, real_send = [], group.send
        group.send = lambda kind, meta=(), ints=(): sends.append((kind, len(ints))) or real_send(kind, meta, ints)
        engine = LLMEngine(runner, cfg, start=False)
        streams = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                   for p in prompts]
        while engine.scheduler.has_unfinished or engine._inbox:
            engine.step()
        group.send(parallel.STOP)
        torch.save(([[t for out in s for t in out.token_ids] for s in streams], sends), out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
