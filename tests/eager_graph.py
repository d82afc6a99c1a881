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
