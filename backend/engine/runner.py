"""ModelRunner: owns every tensor (weights, KDA state slots, MLA pages, graph buffers); turns a SchedulerOutput into
a ForwardBatch, runs the model, samples on the device and syncs once per step.

Decode-only steps replay CUDA graphs captured for padded batch sizes; padding lanes point at the null slot 0 and the
null page 0 (slot_mapping -1: nothing is stored; seq_lens 1: they read the never-written, zeroed page 0, so their
activations stay finite). Mixed steps and CPU run eagerly.

Tensor parallel (cfg.tp_size > 1 or a torchrun world): rank 0's runner launches or joins the world
(backend/model/parallel.py) and broadcasts each step's ints before running it; the runners of the other ranks loop in
`follow()`, rebuild the same batch (or graph inputs) from the broadcast and run the same forward.
"""

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from backend.config import ModelConfig
from backend.engine.prefill_graphs import PrefillGraphs, graph_sizes
from backend.engine.sampler import SamplerOutput, SamplingMetadata, sample
from backend.engine.scheduler import MAX_SCORE_ROWS, SchedulerOutput
from backend.model import parallel
from backend.model.batch import ForwardBatch, cache_slots
from backend.model.loader import load_model
from backend.model.parallel import COPY, EAGER, PING, REPLAY, STOP, TP, RankFailure

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A step queued on the device (ModelRunner.launch), not yet synced."""
    sampled: SamplerOutput
    md: SamplingMetadata
    copy: tuple  # SamplerOutput.copy_to_host(): queued right after the sampling, before any later step

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_GIB = 1 << 30


def graph_batch_sizes(max_bs: int) -> list:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


# host lists -> tensors through numpy: ~3x faster than torch.tensor(list) (~170 vs ~50 us for 1280 ints)
_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def _pinned(data, dtype, device) -> torch.Tensor:
    t = torch.from_numpy(np.array(data, dtype=_NP[dtype]))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


_UNKNOWN = object()  # a graph lane whose block-table row is not known (after a failed replay)


def _logits_rows(out: SchedulerOutput) -> list:
    """Rows of the packed batch whose logits a step needs: each sampling sequence's last token (in order), then
    every scoring row (ScheduledSeq.score_lo/hi), which execute splits off after the sampled ones."""
    sampled, scored, t = [], [], 0
    for s in out.seqs:
        if s.score_hi > s.score_lo:
            scored += range(t + s.score_lo - s.start, t + s.score_hi - s.start)
        t += s.num_new_tokens
        if s.sample:
            sampled.append(t - 1)
    return sampled + scored


class ModelRunner:
    def __init__(self, model_dir: str, cfg, model=None, group: parallel.Group = None):
        """cfg: an EngineConfig (backend/engine/engine.py); model: an already built model (benchmarks);
        group: a follower's tensor-parallel group (backend/model/parallel.py follow())."""
        if group is None and model is None and (cfg.tp_size > 1 or parallel.launched()):
            parallel.check_divisible(ModelConfig.from_dir(model_dir), cfg.tp_size if cfg.tp_size > 1 else
                                     torch.distributed.get_world_size())
            group = parallel.start(model_dir, cfg)
        self.group = group
        try:
            self._init(model_dir, cfg, model)
        except BaseException:
            if group is not None and group.rank == 0:
                group.close()
            raise

    def _init(self, model_dir: str, cfg, model):
        group = self.group
        tp = group.tp if group is not None else TP()
        self.device = parallel.local_device(cfg.device, group.local_rank) if group else torch.device(cfg.device)
        if group is not None:
            group.bind(self.device)
        self.block_size = cfg.block_size
        if model is None:
            dtype = cfg.dtype
            if dtype == "auto":
                dtype = ModelConfig.from_dir(model_dir).dtype if self.device.type == "cuda" else "float32"
            t0 = time.monotonic()
            if getattr(cfg, "random_weights", False):
                from backend.model.random_weights import random_model

                model = random_model(ModelConfig.from_dir(model_dir, router_biased_weights=cfg.router_biased_weights),
                                     self.device, _DTYPES[dtype], tp=tp)
            else:
                model = load_model(model_dir, self.device, _DTYPES[dtype], tp,
                                   router_biased_weights=cfg.router_biased_weights)
            log.info("loaded %s in %.1f s (%s, %s)", model_dir, time.monotonic() - t0, self.device, dtype)
        self.model = model
        self.dtype = model.dtype
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        # prefix cache snapshots take state slots of their own, on top of the sequences'
        self.prefix_cache_slots = cfg.prefix_cache_slots
        self.num_slots = (cfg.num_slots or cfg.max_num_seqs + 1) + self.prefix_cache_slots
        self.max_num_seqs = min(cfg.max_num_seqs, self.num_slots - 1 - self.prefix_cache_slots)
        self.num_blocks = cfg.num_blocks or self._auto_num_blocks(cfg)
        if group is not None:
            # rank 0's scheduler hands out pages that every rank must have
            n = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(n, torch.distributed.ReduceOp.MIN)
            self.num_blocks = int(n.item())
        capacity = (self.num_blocks - 1) * self.block_size
        self.max_model_len = cfg.max_model_len or min(self.config.model_max_length, capacity)
        if self.max_model_len > capacity:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the MLA page pool ({self.num_blocks - 1} "
                             f"pages of {self.block_size} = {capacity} tokens): lower it or give more memory")
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        from backend.model.random_weights import check_fits

        check_fits(self.num_slots * self.slot_bytes() + self.num_blocks * self.page_bytes(), self.device,
                   f"the state/KV cache ({self.num_slots} KDA slots, {self.num_blocks} MLA pages of {self.block_size})"
                   " [lower num_blocks, num_slots, max_num_seqs or max_model_len]")
        self.cache = self.model.allocate_cache(self.num_slots, self.num_blocks, self.block_size)
        log.info("KV capacity: %d tokens in %d pages of %d; %d KDA state slots (%d sequences); max_model_len %d",
                 capacity, self.num_blocks - 1, self.block_size, self.num_slots - 1, self.max_num_seqs,
                 self.max_model_len)
        self.graphs, self.graph_vars = {}, {}
        self._sizes = (None, [])  # (graphs, smallest graph batch size >= n for each n)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self._capture_graphs(min(cfg.max_graph_batch_size or self.max_num_seqs, self.max_num_seqs))
        self.prefill_graphs = None
        pg_tokens = self._prefill_graph_tokens(cfg)
        if pg_tokens:
            pg = PrefillGraphs(self, pg_tokens)
            if pg.sizes:
                pg.capture()
                self.prefill_graphs = pg
            else:
                log.info("prefill_graph_tokens: no bucket fits max_model_len %d; prefill graphs off",
                         self.max_model_len)

    def _prefill_graph_tokens(self, cfg) -> int:
        """Largest prefill graph bucket wanted: cfg.prefill_graph_tokens on one CUDA device with graphs, else 0."""
        ok = self.device.type == "cuda" and not cfg.enforce_eager and self.group is None
        t = min(getattr(cfg, "prefill_graph_tokens", 0), cfg.max_num_batched_tokens) if ok else 0
        return t if graph_sizes(t) else 0

    # memory sizing
    def slot_bytes(self) -> int:
        c, h = self.config, self.config.kda_num_heads // self.model.tp.world
        conv = (c.conv_size - 1) * 3 * h * c.kda_head_dim * self.dtype.itemsize
        rec = h * c.kda_head_dim * c.kda_head_dim * 4
        return len(c.kda_layers) * (conv + rec)

    def page_bytes(self) -> int:
        c = self.config
        return len(c.mla_layers) * self.block_size * (c.kv_lora_rank + c.qk_rope_head_dim) * self.dtype.itemsize

    def _auto_num_blocks(self, cfg) -> int:
        if self.device.type != "cuda":
            # enough for every sequence at full length
            want_len = cfg.max_model_len or self.config.model_max_length
            return 1 + self.max_num_seqs * -(-want_len // self.block_size)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_activations(cfg)
        pg_tokens = self._prefill_graph_tokens(cfg)
        if pg_tokens:   # the prefill graphs' pool (largest bucket) stays allocated beside an eager step's peak
            peak += self._forward_peak(graph_sizes(pg_tokens)[-1])
        budget = total * cfg.gpu_memory_utilization - (total - free) - peak - self.num_slots * self.slot_bytes()
        num_blocks = int(budget // self.page_bytes())
        log.info("memory: %.1f GiB total, %.1f GiB free after weights, activation peak %.2f GiB, %d KDA slots "
                 "%.2f GiB -> %d pages (%.2f GiB)", total / _GIB, free / _GIB, peak / _GIB, self.num_slots,
                 self.num_slots * self.slot_bytes() / _GIB, num_blocks, num_blocks * self.page_bytes() / _GIB)
        if num_blocks < 2:
            raise ValueError(f"no GPU memory left for the MLA cache ({budget / _GIB:.2f} GiB): lower max_num_seqs "
                             f"or max_num_batched_tokens, or raise gpu_memory_utilization")
        return num_blocks

    def _profile_activations(self, cfg) -> int:
        """Peak activation memory of a max_num_batched_tokens prefill (nano-vllm's warmup) and of the sampling."""
        n = cfg.max_num_batched_tokens
        if cfg.max_model_len:
            n = min(n, cfg.max_model_len)
        # sampling on max_num_seqs rows: logits, sort and noise buffers; scoring rows: logits in the lm_head's dtype
        # and fp32, and the log-softmax temporaries
        return self._forward_peak(n) + (8 * self.max_num_seqs + 3 * MAX_SCORE_ROWS) * self.vocab_size * 4

    def _forward_peak(self, n: int) -> int:
        """Peak activation memory of an n-token prefill forward."""
        pages = -(-n // self.block_size)
        cache = self.model.allocate_cache(2, pages + 1, self.block_size)
        batch = ForwardBatch.build([([0] * n, 0, 1, list(range(1, pages + 1)))], 0, self.block_size, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.model.compute_logits(self.model(batch, cache), batch.logits_index)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del cache, batch
        torch.cuda.empty_cache()
        return peak

    # batch building
    def prepare(self, out: SchedulerOutput, width: int = 0) -> ForwardBatch:
        """Host lists -> one int64 and one int32 transfer -> ForwardBatch views. width: block-table columns."""
        bs = self.block_size
        ids, slot_mapping = [], []
        cu, seq_lens, slots, has_init, table = [0], [], [], [], []
        width = width or max(len(s.request.block_ids) for s in out.seqs)
        for s in out.seqs:
            r, a, n = s.request, s.start, s.num_new_tokens
            ids += r.tokens(a, n)
            blocks = r.block_ids
            slot_mapping += cache_slots(blocks, a, n, bs)
            cu.append(cu[-1] + n)
            seq_lens.append(a + n)
            slots.append(r.state_slot)
            has_init.append(int(a > 0))
            table += blocks + [0] * (width - len(blocks))
        nd, N, T = out.num_decodes, len(out.seqs), len(ids)
        pcu = [c - cu[nd] for c in cu[nd:]]
        l64, l32 = ids + slot_mapping + _logits_rows(out), cu + pcu + seq_lens + slots + has_init + table
        meta = (nd, N, T, width, max(s.num_new_tokens for s in out.seqs), len(l64), sum(seq_lens[nd:]))
        if self.group is None:
            return self._batch(_pinned(l64, torch.int64, self.device), _pinned(l32, torch.int32, self.device), *meta)
        return self._batch_from(self.group.send(EAGER, meta, l64 + l32), meta)

    def _batch_from(self, payload: torch.Tensor, meta) -> ForwardBatch:
        """Tensor parallel: one broadcast int64 payload -> ForwardBatch."""
        n64 = meta[5]
        return self._batch(payload[:n64], payload[n64:].to(torch.int32), *meta[:7])

    @staticmethod
    def _batch(i64, i32, nd, N, T, width, max_query_len, n64=0, prefill_keys=-1) -> ForwardBatch:
        o = [0]
        for k in (N + 1, N - nd + 1, N, N, N, N * width):
            o.append(o[-1] + k)
        return ForwardBatch(
            input_ids=i64[:T], num_decodes=nd, cu_seqlens=i32[o[0]:o[1]], prefill_cu_seqlens=i32[o[1]:o[2]],
            seq_lens=i32[o[2]:o[3]], state_slots=i32[o[3]:o[4]], has_initial_state=i32[o[4]:o[5]] != 0,
            block_table=i32[o[5]:o[6]].view(N, width), slot_mapping=i64[T:2 * T], logits_index=i64[2 * T:],
            max_query_len=max_query_len, prefill_keys=prefill_keys)

    # execution
    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> tuple:
        """-> (token ids, logprob entries, scores): the first two for the scheduled sequences that sample, in order;
        scores: the log-probabilities of the scoring rows (ScheduledSeq.score_lo/hi), seq by seq. One host sync."""
        reqs = [s.request for s in out.seqs if s.sample]
        n = len(out.seqs)
        if self.can_launch(out):
            return self.collect(self.launch(out))
        try:
            self._copy(out.copies)
            if out.is_decode_only and self.graphs and n <= max(self.graphs):
                # a decode-shaped lane's logits are its one position's: a scoring row if it has one
                rows = ([i for i, s in enumerate(out.seqs) if s.sample]
                        + [i for i, s in enumerate(out.seqs) if s.score_hi > s.score_lo])
                logits = self._replay(out)[_pinned(rows, torch.int64, self.device)]
            elif self.prefill_graphs is not None and self.prefill_graphs.can_run(out):
                hidden = self.prefill_graphs.run(out)
                logits = self.model.compute_logits(hidden, _pinned(_logits_rows(out), torch.int64, self.device))
            else:
                batch = self.prepare(out)
                hidden = self.model(batch, self.cache)
                logits = self.model.compute_logits(hidden, batch.logits_index)
            self._copy(self._snapshot_copies(out))
            scores = self._score(out, logits[len(reqs):])
        except Exception as e:
            raise self._step_error(e) from e
        if not reqs:
            return [], [], scores.tolist()
        md = SamplingMetadata.build(reqs, self.vocab_size, self.device)
        ids, logprobs = sample(logits[:len(reqs)], md).to_host(md)
        return ids, logprobs, scores.tolist()

    def _score(self, out: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] fp32 of the scoring rows (at most MAX_SCORE_ROWS) -> [R] fp32 log P(next prompt token),
        on the device; row blocks bound the log-softmax temporaries."""
        if not logits.shape[0]:
            return logits.new_empty(0)
        targets = []
        for s in out.seqs:
            if s.score_hi > s.score_lo:
                targets += s.request.tokens(s.score_lo + 1, s.score_hi - s.score_lo)
        targets = _pinned(targets, torch.int64, self.device)
        res = torch.empty(logits.shape[0], dtype=torch.float32, device=self.device)
        for i in range(0, logits.shape[0], 64):
            x = logits[i:i + 64]
            res[i:i + 64] = x.gather(1, targets[i:i + 64, None])[:, 0] - torch.logsumexp(x, dim=-1)
        return res

    def _step_error(self, e: Exception) -> Exception:
        # tensor parallel: the ranks are out of step after a failed forward; nothing can run any more
        if self.group is None or isinstance(e, RankFailure):
            return e
        return self.group.fail(f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}")

    def can_launch(self, out: SchedulerOutput) -> bool:
        """A decode-only step that a graph replays and whose every sequence samples (and no prefix-cache copies):
        `launch` runs it."""
        return (out.is_decode_only and bool(self.graphs) and len(out.seqs) <= max(self.graphs)
                and all(s.sample for s in out.seqs) and not out.copies and not out.snapshots)

    # prefix cache (backend/engine/prefix_cache.py): state slots and MLA pages copied on the device
    def _snapshot_copies(self, out: SchedulerOutput) -> list:
        """A snapshot of each prompt (or prompt prefix) `out` completes: its KDA state and its last, partial page."""
        copies = []
        for req, slot, page, end in out.snapshots:
            copies.append(("slot", req.state_slot, slot))
            if page:
                copies.append(("page", req.block_ids[end // self.block_size], page))
        return copies

    def _copy(self, copies: list) -> None:
        """("slot", src, dst): every KDA layer's conv and recurrent state; ("page", src, dst): every MLA layer's
        latent page. Tensor parallel: the followers get the same list first (their shards of the same slots/pages)."""
        if not copies:
            return
        flat, counts = [], []
        for kind in ("slot", "page"):  # [slot srcs | slot dsts | page srcs | page dsts]
            pairs = [(a, b) for k, a, b in copies if k == kind]
            flat += [a for a, _ in pairs] + [b for _, b in pairs]
            counts.append(len(pairs))
        if self.group is not None:
            self._apply_copies(self.group.send(COPY, counts, flat), *counts)
        else:
            self._apply_copies(_pinned(flat, torch.int64, self.device), *counts)  # no host sync

    def _apply_copies(self, flat: torch.Tensor, n_slot: int, n_page: int) -> None:
        """flat: [2 n_slot + 2 n_page] i64 on the device (see _copy). One index_copy_ per tensor."""
        o = 0
        for n, tensors in ((n_slot, self.cache.conv_state + self.cache.rec_state), (n_page, self.cache.latent)):
            if n:
                src, dst = flat[o:o + n], flat[o + n:o + 2 * n]
                for t in tensors:
                    t.index_copy_(0, dst, t.index_select(0, src))
            o += 2 * n

    @torch.no_grad()
    def launch(self, out: SchedulerOutput, feed: "Launched" = None) -> "Launched":
        """Queues a `can_launch` step (graph replay + sampling) without waiting for it; `collect` syncs.

        feed: the launched step just before, not collected yet, over the same sequences in the same order (this
        step's input token of each is the token that one samples: it is copied on the device, never via the host).
        Its sampling takes each request's output index as one past the known tokens."""
        return self.sample_launch(out, self.forward(out, feed), pending=int(feed is not None))

    @torch.no_grad()
    def forward(self, out: SchedulerOutput, feed: "Launched" = None) -> torch.Tensor:
        """Queues the graph replay of a `can_launch` step (feed: as in `launch`) -> its logits [n, V], a view of the
        graphs' static buffer: sample it (`sample_launch`) before the next replay is queued."""
        try:
            return self._replay(out, None if feed is None else feed.sampled.token_ids)
        except Exception as e:
            raise self._step_error(e) from e

    @torch.no_grad()
    def sample_launch(self, out: SchedulerOutput, logits: torch.Tensor, pending: int = 0) -> "Launched":
        """Queues the sampling of `forward`'s logits and the copy of its tokens to the host. pending: as in
        SamplingMetadata.build (penalties and grammars need 0: every earlier token applied to the requests)."""
        md = SamplingMetadata.build([s.request for s in out.seqs], self.vocab_size, self.device, pending=pending)
        sampled = sample(logits, md)
        return Launched(sampled, md, sampled.copy_to_host())

    @staticmethod
    def collect(launched: "Launched") -> tuple:
        """-> (token ids, logprob entries, scores: none) of a launched step; waits for its device->host copy only (a
        step launched after it may still run)."""
        return (*launched.sampled.to_host(launched.md, launched.copy), [])

    # CUDA graphs
    def _capture_graphs(self, max_bs: int):
        t0 = time.monotonic()
        self.graph_vars = self._make_graph_vars(max_bs)
        logits, pool = self.graph_vars["logits"], torch.cuda.graph_pool_handle()
        # largest first, so that smaller graphs reuse the pool
        for bs in reversed(graph_batch_sizes(max_bs)):
            batch = self.static_batch(bs)
            # warmup outside the capture: Triton compiles and autotunes here
            # decode: every row is sampled (no logits gather); the logits land in the static buffer
            self.model.compute_logits(self.model(batch, self.cache), None, out=logits[:bs])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.model.compute_logits(self.model(batch, self.cache), None, out=logits[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                 sorted(self.graphs), time.monotonic() - t0)

    def _make_graph_vars(self, max_bs: int) -> dict:
        """Static decode inputs; at rest every lane is a padding lane (null slot, null page, nothing stored).

        The per-lane inputs live in one device byte buffer, `stage`: [input_ids i64 | slot_mapping i64 | seq_lens i32
        | state_slots i32] x max_bs, then room for a step's block-table edits (flat index i64 x k | page i32 x k,
        k <= max_bs * max_blocks). A replay fills one of two pinned host copies (alternating: the previous step's
        copy may still be in flight) and moves it with one H2D copy; the block table changes by edits (`lanes`
        remembers what each lane's row holds), scattered on the device only when some row changed."""
        dev, mb = self.device, self.max_blocks_per_seq
        small = 24 * max_bs
        size = small + 12 * max_bs * mb
        stage = torch.empty(size, dtype=torch.uint8, device=dev)
        pin = dev.type == "cuda"
        hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

        def lanes_of(buf, typed):
            i64 = buf[:16 * max_bs].view(torch.int64)
            i32 = buf[16 * max_bs:small].view(torch.int32)
            parts = (i64[:max_bs], i64[max_bs:], i32[:max_bs], i32[max_bs:])
            return tuple(t.numpy() for t in parts) if typed else parts

        ids, slot_mapping, seq_lens, state_slots = lanes_of(stage, False)
        for h in hosts:  # the padding values: id 0, nothing stored, 1 key, null slot
            for a, pad in zip(lanes_of(h, True), (0, -1, 1, 0)):
                a[:] = pad
        stage[:small].copy_(hosts[0][:small])
        return dict(
            input_ids=ids, slot_mapping=slot_mapping, seq_lens=seq_lens, state_slots=state_slots,
            block_table=torch.zeros(max_bs, mb, dtype=torch.int32, device=dev),
            cu_seqlens=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=dev),
            has_initial_state=torch.ones(max_bs, dtype=torch.bool, device=dev),
            logits_index=torch.arange(max_bs, dtype=torch.int64, device=dev),
            logits=torch.zeros(max_bs, self.vocab_size, dtype=torch.float32, device=dev),
            stage=stage, hosts=[(h, h.numpy(), lanes_of(h, True)) for h in hosts], flip=[0],
            # per lane: the block_ids list whose first `lens[i]` pages row i holds; None = col 0 is the null page
            lanes=[None] * max_bs, lens=[0] * max_bs,
        )

    def static_batch(self, bs: int) -> ForwardBatch:
        v = self.graph_vars
        return ForwardBatch(
            input_ids=v["input_ids"][:bs], num_decodes=bs, cu_seqlens=v["cu_seqlens"][:bs + 1],
            prefill_cu_seqlens=v["prefill_cu_seqlens"], seq_lens=v["seq_lens"][:bs],
            state_slots=v["state_slots"][:bs], has_initial_state=v["has_initial_state"][:bs],
            block_table=v["block_table"][:bs], slot_mapping=v["slot_mapping"][:bs],
            logits_index=v["logits_index"][:bs], max_query_len=1)

    def _replay(self, out: SchedulerOutput, feed: torch.Tensor = None) -> torch.Tensor:
        """Fills the graph inputs of a decode-only step and replays -> logits [n, V] (a view of the static buffer).
        feed: [n] i64 device tensor of input ids (the previous step's samples), instead of the host's."""
        n = len(out.seqs)
        bs = self._graph_size(n)
        if self.group is not None:
            return self._replay_tp(out, bs)
        try:
            return self._fill_and_replay(out, n, bs, feed)
        except BaseException:
            self.graph_vars["lanes"][:] = [_UNKNOWN] * len(self.graph_vars["lanes"])  # rewrite every row next time
            raise

    def _fill_and_replay(self, out: SchedulerOutput, n: int, bs: int, feed) -> torch.Tensor:
        B, v = self.block_size, self.graph_vars
        mb, lanes, lens = self.max_blocks_per_seq, v["lanes"], v["lens"]
        flip = v["flip"][0] = 1 - v["flip"][0]
        host, raw, (h_ids, h_slot, h_len, h_state) = v["hosts"][flip]
        reqs, starts = [s.request for s in out.seqs], [s.start for s in out.seqs]
        e_idx, e_val = [], []
        for i, r in enumerate(reqs):
            # block_ids only grows in place (Scheduler._take) or is replaced (_release): a row takes the new pages
            blocks = r.block_ids
            k, m = lens[i], len(blocks)
            if lanes[i] is not blocks or k > m:
                lanes[i], k = blocks, 0
            if k < m:
                e_idx += range(i * mb + k, i * mb + m)
                e_val += blocks[k:]
                lens[i] = m
        for i in range(n, bs):  # padding lanes read column 0 only: the null page
            if lanes[i] is not None:
                lanes[i], lens[i] = None, 0
                e_idx.append(i * mb)
                e_val.append(0)
        if feed is None:
            h_ids[:n] = [r.token_id(p) for r, p in zip(reqs, starts)]
        h_slot[:n] = [r.block_ids[p // B] * B + p % B for r, p in zip(reqs, starts)]
        h_len[:n] = [p + 1 for p in starts]
        h_state[:n] = [r.state_slot for r in reqs]
        h_ids[n:bs], h_slot[n:bs], h_len[n:bs], h_state[n:bs] = 0, -1, 1, 0
        small, k = 24 * len(lanes), len(e_idx)
        if k:
            raw[small:small + 8 * k].view(np.int64)[:] = e_idx
            raw[small + 8 * k:small + 12 * k].view(np.int32)[:] = e_val
        stage = v["stage"]
        stage[:small + 12 * k].copy_(host[:small + 12 * k], non_blocking=True)  # the one H2D copy
        if k:
            v["block_table"].view(-1).index_copy_(0, stage[small:small + 8 * k].view(torch.int64),
                                                  stage[small + 8 * k:small + 12 * k].view(torch.int32))
        if feed is not None:
            v["input_ids"][:n].copy_(feed)
        self.graphs[bs].replay()
        return v["logits"][:n]

    def _graph_size(self, n: int) -> int:
        """The smallest captured batch size >= n (a lookup table, rebuilt when `graphs` is replaced)."""
        if self._sizes[0] is not self.graphs:
            top = max(self.graphs)
            self._sizes = (self.graphs, [min(b for b in self.graphs if b >= i) for i in range(top + 1)])
        return self._sizes[1][n]

    def _replay_tp(self, out: SchedulerOutput, bs: int) -> torch.Tensor:
        """Tensor parallel: rank 0 broadcasts the lanes' ints (ids, slot mapping, seq lens, slots, used block-table
        columns) and every rank fills its graph inputs from the payload."""
        n, B, v = len(out.seqs), self.block_size, self.graph_vars
        # only the used columns are refreshed: the kernel never reads pages past ceil(seq_len / block_size)
        w = max(len(s.request.block_ids) for s in out.seqs)
        ids, slot_mapping, seq_lens, slots, table = [], [], [], [], []
        for s in out.seqs:
            r, p = s.request, s.start
            ids.append(r.token_id(p))
            slot_mapping.append(r.block_ids[p // B] * B + p % B)
            seq_lens.append(p + 1)
            slots.append(r.state_slot)
            table += r.block_ids + [0] * (w - len(r.block_ids))
        pad = bs - n
        l64 = ids + [0] * pad + slot_mapping + [-1] * pad
        l32 = seq_lens + [1] * pad + slots + [0] * pad + table + [0] * (pad * w)
        payload = self.group.send(REPLAY, (bs, w), l64 + l32)
        self._fill_graph(bs, w, payload[:2 * bs], payload[2 * bs:])
        self.graphs[bs].replay()
        return v["logits"][:n]

    def _fill_graph(self, bs: int, w: int, i64: torch.Tensor, i32: torch.Tensor):
        """i32 may be int64 (copy_ casts)."""
        v = self.graph_vars
        v["input_ids"][:bs].copy_(i64[:bs])
        v["slot_mapping"][:bs].copy_(i64[bs:])
        v["seq_lens"][:bs].copy_(i32[:bs])
        v["state_slots"][:bs].copy_(i32[bs:2 * bs])
        v["block_table"][:bs, :w].copy_(i32[2 * bs:].view(bs, w))

    # tensor parallel
    @torch.no_grad()
    def follow(self):
        """Ranks > 0: run the forward of every step rank 0 broadcasts, until it says STOP."""
        g = self.group
        while True:
            kind, meta, payload = g.recv()
            if kind == STOP:
                return
            if kind == EAGER:
                batch = self._batch_from(payload, meta)
                self.model.compute_logits(self.model(batch, self.cache), batch.logits_index)
            elif kind == COPY:
                self._apply_copies(payload, *meta[:2])
            elif kind == REPLAY:
                bs, w = meta[:2]
                self._fill_graph(bs, w, payload[:2 * bs], payload[2 * bs:].to(torch.int32))
                self.graphs[bs].replay()
            else:
                assert kind == PING, f"unknown tensor-parallel message kind {kind}"

    def ping(self):
        """Rank 0, idle: keeps the followers' pending broadcast inside its timeout; raises RankFailure."""
        self.group.send(PING)

    def close(self):
        """Rank 0: releases the followers (no-op without tensor parallelism)."""
        if self.group is not None and self.group.rank == 0:
            self.group.close()
