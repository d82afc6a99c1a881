"""CUDA graphs for small prefill-only steps (EngineConfig.prefill_graph_tokens, default 4096; 0 = off).

Why: an eager 1,024-token prefill step launches ~2,000 kernels and the H200 idled 47% of it waiting for the host
(BENCHMARKS.md, twentieth round). Every prefill kernel's grid depends only on the token count T and the number of
sequences P (KDA chunk grids use the upper bound cdiv(T, 64) + P, MLA extend takes max_query_len = T, the MoE grids
follow T * k), so a step is replayable once T and P are fixed.

A graph is keyed by (T bucket, n): n real prefill sequences (1..max_seqs) plus one padding sequence that takes the
T bucket - T (>= 0) remaining tokens: token id 0, KDA state slot 0 (the null slot, no initial state), a block-table
row of the null page, slot mapping -1 (no latent stored). It writes only the null slot; its keys read the null page.
A step of exactly a bucket's tokens (a 1,024-token prompt, a first chunk of max_num_batched_tokens) takes that
bucket with an empty padding sequence (every kernel takes empty sequences) instead of the next bucket's twice the
work: H200 (BENCHMARKS.md, twenty-fourth round), a 1,024-token prompt in the 2,048 bucket took 37.7 ms, eagerly 27.6.
The graph runs the model to the hidden states; the logits of the sampled and scoring rows are gathered outside it.
Decode rows are not handled here (mixed steps stay eager).

Only steps of fresh sequences (nothing cached before the chunk: a prompt's first chunk) are graphed: then the step's
keys are exactly its T bucket tokens, which sizes the expanded MLA's key gather (kernels.mla.mla_prefill) as a
constant of the graph. A chunk after cached tokens (a long prompt's later chunks, a prefix-cache hit) has a
data-dependent key count and runs eagerly.

The inputs live in two static device buffers (int64 ids | slot mapping, int32 metadata) filled from pinned host
copies by two H2D copies per step; every graph reads views of them (and of a constant all-false initial-state flag:
every sequence is fresh).
"""
import logging
import time

import torch

from backend.model.batch import ForwardBatch, cache_slots

log = logging.getLogger("kimi-linear")

SIZES = (256, 512, 1024, 2048, 4096)  # T buckets; a step of T tokens takes the smallest bucket >= T
MAX_SEQS = 4                           # real prefill sequences a graphed step may hold


def graph_sizes(max_tokens: int) -> list:
    return [s for s in SIZES if s <= max_tokens]


class PrefillGraphs:
    """Owned by a ModelRunner (single GPU). `capture` records the graphs; `can_run` / `run` serve a step."""

    def __init__(self, runner, max_tokens: int, max_seqs: int = MAX_SEQS):
        mb = runner.max_blocks_per_seq
        # the padding sequence (up to a bucket - 1 tokens) reads its keys through one block-table row
        self.runner, self.sizes = runner, [s for s in graph_sizes(max_tokens) if s - 1 <= mb * runner.block_size]
        self.max_seqs = max_seqs
        self.graphs = {}  # (T bucket, n) -> (graph with replay(), hidden [T bucket, D] it writes)
        if not self.sizes:
            return
        dev, S, T = runner.device, max_seqs + 1, self.sizes[-1]
        self.mb = mb
        # int32 layout: cu [S + 1] | seq_lens [S] | slots [S] | table [S, mb]
        self.n32 = (S + 1) + 2 * S + S * mb
        self.i64 = torch.zeros(2 * T, dtype=torch.int64, device=dev)
        self.i32 = torch.zeros(self.n32, dtype=torch.int32, device=dev)
        self.fresh = torch.zeros(S, dtype=torch.bool, device=dev)   # has_initial_state: never
        pin = dev.type == "cuda"
        # two pinned host copies, alternating: the previous step's H2D copies may still be in flight
        self.hosts = [(torch.zeros(2 * T, dtype=torch.int64, pin_memory=pin),
                       torch.zeros(self.n32, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self.flip = 0

    # static inputs
    def batch(self, tb: int, n: int) -> ForwardBatch:
        """The static ForwardBatch of bucket tb with n real sequences (views of the device buffers)."""
        S, mb, p = self.max_seqs + 1, self.mb, n + 1
        o_len, o_slot, o_tab = S + 1, 2 * S + 1, 3 * S + 1
        cu = self.i32[:p + 1]
        return ForwardBatch(
            input_ids=self.i64[:tb], num_decodes=0, cu_seqlens=cu, prefill_cu_seqlens=cu,
            seq_lens=self.i32[o_len:o_len + p], state_slots=self.i32[o_slot:o_slot + p],
            has_initial_state=self.fresh[:p],
            block_table=self.i32[o_tab:o_tab + S * mb].view(S, mb)[:p],
            slot_mapping=self.i64[self.sizes[-1]:self.sizes[-1] + tb],
            logits_index=self.i64[:0], max_query_len=tb, prefill_keys=tb)

    def _fill(self, tb: int, seqs: list) -> None:
        """seqs: [(token ids, state slot, block ids)] of the real sequences (fresh: from position 0), in order (no
        block ids: nothing stored, the null page); the padding sequence takes the rest of the bucket. Two H2D
        copies."""
        h64, h32 = self.hosts[self.flip]
        self.flip ^= 1
        a64, a32 = h64.numpy(), h32.numpy()
        S, T, mb, bs = self.max_seqs + 1, self.sizes[-1], self.mb, self.runner.block_size
        o_len, o_slot, o_tab = S + 1, 2 * S + 1, 3 * S + 1
        ids, slot_map, t = a64[:T], a64[T:], 0
        a32[:] = 0
        for i, (toks, slot, blocks) in enumerate(seqs):
            n = len(toks)
            ids[t:t + n] = toks
            if blocks:
                slot_map[t:t + n] = cache_slots(blocks, 0, n, bs)
                a32[o_tab + i * mb:o_tab + i * mb + len(blocks)] = blocks
            else:  # capture's at-rest sequences: nothing stored, the null page
                slot_map[t:t + n] = -1
            t += n
            a32[i + 1] = t
            a32[o_len + i] = n
            a32[o_slot + i] = slot
        p = len(seqs)                       # the padding sequence: tokens t .. tb - 1
        ids[t:tb] = 0
        slot_map[t:tb] = -1
        a32[p + 1] = tb
        a32[o_len + p] = tb - t
        self.i64[:T + tb].copy_(h64[:T + tb], non_blocking=True)  # ids [0, tb) (and stale beyond) | slot mapping
        self.i32.copy_(h32, non_blocking=True)

    # capture and replay
    def capture(self) -> None:
        """Every (bucket, n) graph, largest first (the smaller ones reuse the pool). Warm-up run outside each capture
        (Triton compiles there); at rest every sequence is a one-token padding sequence."""
        r, t0 = self.runner, time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for tb in reversed(self.sizes):
            for n in range(self.max_seqs, 0, -1):
                self._fill(tb, [([0], 0, [])] * n)
                batch = self.batch(tb, n)
                r.model(batch, r.cache)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    hidden = r.model(batch, r.cache)
                pool = graph.pool()
                self.graphs[(tb, n)] = (graph, hidden)
        torch.cuda.synchronize(r.device)
        log.info("captured %d prefill CUDA graphs (buckets %s tokens, 1-%d sequences) in %.1f s", len(self.graphs),
                 self.sizes, self.max_seqs, time.monotonic() - t0)

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket >= num_tokens (the padding sequence may be empty), or 0."""
        return next((s for s in self.sizes if s >= num_tokens), 0)

    def can_run(self, out) -> bool:
        """A prefill-only step of 1..max_seqs fresh sequences and at most the largest bucket's tokens."""
        return (out.num_decodes == 0 and 1 <= len(out.seqs) <= self.max_seqs
                and all(s.start == 0 for s in out.seqs)
                and self.bucket(sum(s.num_new_tokens for s in out.seqs)) > 0)

    def run(self, out) -> torch.Tensor:
        """Fills the inputs of a `can_run` step and replays -> hidden [T bucket, D] (the real tokens first, packed in
        out.seqs order as the eager batch packs them)."""
        seqs = [(s.request.tokens(0, s.num_new_tokens), s.request.state_slot, s.request.block_ids) for s in out.seqs]
        tb = self.bucket(sum(len(x[0]) for x in seqs))
        self._fill(tb, seqs)
        graph, hidden = self.graphs[(tb, len(seqs))]
        graph.replay()
        return hidden
