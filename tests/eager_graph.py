"""A stand-in for a captured CUDA decode graph on CPU (tests/engine, tests/parallel)."""


class EagerGraph:
    """replay() runs the model eagerly on the runner's static buffers for batch size bs (collectives included under
    tensor parallelism), writing the logits where a replayed graph would."""

    def __init__(self, runner, bs):
        self.runner, self.bs = runner, bs

    def replay(self):
        r = self.runner
        batch = r.static_batch(self.bs)
        r.model.compute_logits(r.model(batch, r.cache), None, out=r.graph_vars["logits"][:self.bs])


def fake_cuda_graphs(monkeypatch, calls, count_syncs=False):
    """torch.cuda's graph primitives stood in on the CPU, so capture code runs: each capture appends ("capture",
    pool) to calls (and ("syncs", n) after it with count_syncs: host syncs inside, which a CUDA capture fails on);
    a graph's pool() is ("pool", id(graph)), graph_pool_handle() ("pool", 0)."""
    import contextlib

    import torch

    class FakeGraph:
        def pool(self):
            return ("pool", id(self))

    @contextlib.contextmanager
    def graph(g, pool):
        calls.append(("capture", pool))
        if not count_syncs:
            yield
            return
        from tools.launches import LaunchCounter

        with LaunchCounter() as c:
            yield
        calls.append(("syncs", sum(c.syncs.values())))

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", 0))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
