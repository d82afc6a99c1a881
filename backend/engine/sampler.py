"""Device sampling with per-request parameters; no host sync until `SamplerOutput.to_host` (one `.tolist()`).

Order (vLLM v1): grammar mask (backend/engine/structured.py: tokens the request's grammar does not allow next get
-inf) -> logit_bias -> repetition penalty (HF: prompt + output tokens) -> presence/frequency penalties
(OpenAI: output tokens) -> greedy argmax for temperature-0 rows | temperature -> min-p -> top-k -> top-p -> sample.
Sampling is an exponential race, argmax(p / E) with E ~ Exp(1), where E for token v of request r at output step i
is a counter-based hash of (seed_r, i, v): the same seed gives the same tokens whatever else is in the batch, and
nothing stateful lives on the device. Logprobs are the log_softmax of the processed logits (the distribution that was
sampled from; the penalised logits for greedy rows), -inf clamped to -9999 (OpenAI's convention).
"""

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from backend.engine.structured import apply_masks, masks
from kernels._dispatch import use_triton
from kernels._tensors import cdiv, next_pow2
from kernels.argmax import argmax_rows
import kernels.sampling as _sampling
from kernels.sampling import KS, NUC_TOPP_MIN, SERIES_MAX, SERIES_TERMS, _race_kernel

_M32 = 0xFFFFFFFF
LOGPROB_FLOOR = -9999.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit integer mix (lowbias32 shape; multipliers < 2^31 so int64 products never overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


# E = -log(1 - w), w uniform. The race is decided by the smallest E / p, so E must be accurate *relative to E* where
# it is tiny (w near 0): a token of probability p wins with E ~ p (1e-5..1e-9 for most tokens of a 160k vocabulary).
# The old E = -log(u), u near 1, was wrong exactly there: u in fp32 is quantised at 2^-24 (E ~ 1e-7 was a 2-3 step grid, u == 1 gave E = -0), and
# an approximate GPU log (absolute error ~1e-7) is ~100 % off at E ~ 1e-7. Now: w < SERIES_MAX: E = sum_k w^k / k
# (Horner, SERIES_TERMS terms, within ~1 ulp; no log, no cancellation); else E = -log(1 - w) (1 - w exact by Sterbenz,
# E >= log 2, so even an approximate log is within ~2e-7 relative). w = (bits + 0.5) * 2^-32 keeps full relative
# resolution near 0 (smallest E ~ 1.2e-10); it rounds to 1 only for bits >= 2^32 - 128 (E = 32 log 2, a certain
# loser). Keys are p / E with IEEE division (div_rn in the kernel). The Triton kernels (kernels/sampling.py:
# _race_kernel, filtered_race; SERIES_MAX / SERIES_TERMS live there) compute the same formula, so CUDA and the
# reference agree up to float rounding (FMA contraction, log ulps).


def _exp1_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bits: uint32 values (int64 tensor) -> E ~ Exp(1) fp32, accurate to ~1 ulp for every value."""
    w = (bits.to(torch.float32) + 0.5) * (1.0 / 2**32)
    s = torch.full_like(w, 1.0 / SERIES_TERMS)
    for k in range(SERIES_TERMS - 1, 0, -1):
        s = s * w + 1.0 / k
    series = w * s
    big = -torch.log((1.0 - w).clamp_min(2.0**-32))
    return torch.where(w < SERIES_MAX, series, big)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E[m, v] ~ Exp(1), a pure function of (seeds[m], steps[m], v). seeds, steps: [M] int64 -> [M, V] fp32."""
    key = _mix32(_mix32(_mix32(steps & _M32) ^ (seeds & _M32)) ^ ((seeds >> 32) & _M32))
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ v[None, :]) ^ 0x2545F491)
    return _exp1_from_bits(bits)


def race_keys_ref(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The race keys probs / E ([M, V] fp32; the winner is the largest)."""
    return probs / exponential_noise(seeds, steps, probs.shape[-1])


def race_argmax_ref(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E) per row, E from exponential_noise. probs [M, V] fp32 -> [M] i64."""
    return race_keys_ref(probs, seeds, steps).argmax(dim=-1)


_RACE_BLOCK = 4096


def race_argmax(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """race_argmax_ref fused in one Triton pass (noise never materialised) on CUDA, the reference on CPU."""
    if not use_triton(probs):
        return race_argmax_ref(probs, seeds, steps)
    M, V = probs.shape
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    block = min(_RACE_BLOCK, max(128, next_pow2(V)))  # small vocabularies (tests): small tiles
    nb = cdiv(V, block)
    vals = torch.empty(M, nb, dtype=torch.float32, device=probs.device)
    idx = torch.empty(M, nb, dtype=torch.int64, device=probs.device)
    _race_kernel[(M, nb)](probs, probs.stride(0), seeds, steps, vals, idx, V, nb, BLOCK=block,
                          SERIES_TERMS=SERIES_TERMS, SERIES_MAX=SERIES_MAX)
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]


_NP = {torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def _to_device(data, dtype, device) -> torch.Tensor:
    t = torch.from_numpy(np.array(data, dtype=_NP[dtype]))  # ~3x faster than torch.tensor(list)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class SamplingMetadata:
    """Device tensors describing the M rows sampled this step (built by `build`, consumed by `sample`)."""
    greedy: Optional[torch.Tensor]  # [M] bool (None when all_greedy)
    temperature: Optional[torch.Tensor]  # [M] f32, 1 on greedy rows (None when all greedy without penalties)
    all_greedy: bool
    top_k: Optional[torch.Tensor]  # [M] i64, V where off
    top_p: Optional[torch.Tensor]  # [M] f32
    min_p: Optional[torch.Tensor]  # [M] f32
    seeds: Optional[torch.Tensor]  # [M] i64 (None when all_greedy)
    steps: Optional[torch.Tensor]  # [M] i64: index of the output token being sampled (None when all_greedy)
    rep_penalty: Optional[torch.Tensor]  # [M] f32
    rep_index: Optional[tuple]  # (rows, cols) of prompt + output tokens of rows with a repetition penalty
    presence: Optional[torch.Tensor]  # [M] f32
    frequency: Optional[torch.Tensor]  # [M] f32
    out_index: Optional[tuple]  # (rows, cols) of output tokens (with repeats) of rows with presence/frequency
    bias: Optional[tuple]  # (rows, cols, values)
    grammar: Optional[tuple]  # (rows [R] i64, allowed-token bitmask [R, cdiv(V, 32)] int32) of rows with a grammar
    num_top_logprobs: int  # -1 = no logprobs this step
    wants_logprobs: list  # [M] bool (host)
    top_counts: list  # [M] int (host): top_logprobs asked per row
    any_greedy: bool = True  # (host) some row is greedy: the plain argmax is needed
    fast_filters: bool = False  # (host) every sampled row is one the kernel path is faster on (_fast_ok)

    @property
    def changes_logits(self) -> bool:
        """A bias or penalty to apply (apply_penalties' inputs): the raw logits' argmax is not the greedy token."""
        return (self.bias is not None or self.rep_index is not None or self.out_index is not None
                or self.grammar is not None)

    @staticmethod
    def build(reqs: list, vocab_size: int, device: torch.device, pending: int = 0) -> "SamplingMetadata":
        """At most two host->device transfers (floats, ints); none for an all-greedy step without penalties/bias.

        pending: tokens sampled for each request but not yet in its output_token_ids (a step launched before the
        previous one was collected): the output index of this step's token is len(output_token_ids) + pending. The
        penalties read output_token_ids, so they need pending == 0."""
        ps = [r.params for r in reqs]
        greedy = [p.greedy for p in ps]
        all_greedy = all(greedy)
        sampled = [not g for g in greedy]
        use = lambda pred: any(s and pred(p) for s, p in zip(sampled, ps))  # noqa: E731
        assert not pending or not any(p.needs_history for p in ps), \
            "penalties and grammars need the previous tokens on the host"
        rep_rows, rep_cols, out_rows, out_cols, b_rows, b_cols, b_vals = [], [], [], [], [], [], []
        for m, (r, p) in enumerate(zip(reqs, ps)):
            if p.repetition_penalty != 1.0:  # prompt ids (deduplicated once per request) + output ids (repeats ok)
                seen = np.concatenate([r.prompt_ids_unique(), np.asarray(r.output_token_ids, dtype=np.int64)])
                rep_rows.append(np.full(len(seen), m, dtype=np.int64))
                rep_cols.append(seen)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                out_rows.append(np.full(len(r.output_token_ids), m, dtype=np.int64))
                out_cols.append(np.asarray(r.output_token_ids, dtype=np.int64))
            if p.logit_bias:
                b_rows += [m] * len(p.logit_bias)
                b_cols += p.logit_bias.keys()
                b_vals += p.logit_bias.values()
        rep_rows, rep_cols, out_rows, out_cols = (np.concatenate(x) if x else []
                                                  for x in (rep_rows, rep_cols, out_rows, out_cols))
        f = i = None
        rep, out = len(rep_rows) > 0, len(out_rows) > 0
        if not all_greedy or rep or out:
            f = _to_device([[1.0 if p.greedy else p.temperature for p in ps], [p.top_p for p in ps],
                            [p.min_p for p in ps], [p.repetition_penalty for p in ps],
                            [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]], torch.float32, device)
        if not all_greedy:  # the greedy mask rides with the ints
            i = _to_device([[p.top_k if p.top_k > 0 else vocab_size for p in ps], [r.seed % (1 << 63) for r in reqs],
                            [len(r.output_token_ids) + pending for r in reqs], [int(g) for g in greedy]], torch.int64, device)
        idx = lambda rows, cols: (_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device))  # noqa
        # a request that the previous token finished (its row of a step launched before that token was applied)
        # samples a token that is dropped: its stopped matcher is not asked
        g_rows = [m for m, r in enumerate(reqs) if r.matcher is not None and not r.is_finished]
        grammar = None
        if g_rows:  # host work (llguidance) while the step's forward runs on the device
            words = masks([reqs[m].matcher for m in g_rows], vocab_size,
                          [ps[m].grammar.eos_ids if ps[m].ignore_eos else () for m in g_rows])
            grammar = (_to_device(g_rows, torch.int64, device), words.to(device, non_blocking=True))
        wants = [p.wants_logprobs for p in ps]
        return SamplingMetadata(
            greedy=i[3] != 0 if i is not None else None, temperature=f[0] if f is not None else None,
            all_greedy=all_greedy,
            top_k=i[0] if use(lambda p: p.top_k > 0) else None, top_p=f[1] if use(lambda p: p.top_p < 1.0) else None,
            min_p=f[2] if use(lambda p: p.min_p > 0.0) else None, seeds=i[1] if i is not None else None,
            steps=i[2] if i is not None else None,
            rep_penalty=f[3] if rep else None, rep_index=idx(rep_rows, rep_cols) if rep else None,
            presence=f[4] if out else None, frequency=f[5] if out else None,
            out_index=idx(out_rows, out_cols) if out else None,
            bias=(*idx(b_rows, b_cols), _to_device(b_vals, torch.float32, device)) if b_rows else None,
            grammar=grammar,
            num_top_logprobs=max((p.top_logprobs for p in ps if p.wants_logprobs), default=-1),
            wants_logprobs=wants, top_counts=[p.top_logprobs for p in ps], any_greedy=any(greedy),
            fast_filters=all(g or _fast_ok(p) for g, p in zip(greedy, ps)))


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [M] i64
    logprobs: Optional[torch.Tensor]  # [M] f32, the sampled token's
    top_ids: Optional[torch.Tensor]  # [M, k] i64
    top_logprobs: Optional[torch.Tensor]  # [M, k] f32

    def copy_to_host(self) -> tuple:
        """Queues the device->host copy that to_host reads (pinned memory + an event on CUDA) -> its handle. A step
        launched after this one (runner.launch) does not delay it: the copy is ahead of that step on the stream."""
        if self.logprobs is None:
            t = self.token_ids
        else:  # ids travel as fp64 (exact) so that ids and logprobs come back in one transfer
            t = torch.cat([self.token_ids[:, None].double(), self.logprobs[:, None].double(),
                           self.top_ids.double(), self.top_logprobs.double()], dim=1)
        if t.device.type != "cuda":      # a copy: token_ids may view a graph's static buffer that the next step reuses
            return t.clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def to_host(self, md: SamplingMetadata, copy: tuple = None) -> tuple:
        """-> (token ids, per row None or {"token_id", "logprob", "top": [(id, logprob), ...]}); one host sync.
        copy: copy_to_host()'s handle (queued earlier), else the copy is queued now."""
        host, done = copy if copy is not None else self.copy_to_host()
        if done is not None:
            done.synchronize()
        if self.logprobs is None:
            return host.tolist(), [None] * len(md.wants_logprobs)
        packed = host.tolist()
        k = self.top_ids.shape[1]
        ids, entries = [], []
        for row, want, n in zip(packed, md.wants_logprobs, md.top_counts):
            tok = int(row[0])
            ids.append(tok)
            if not want:
                entries.append(None)
                continue
            top = [(int(row[2 + j]), row[2 + k + j]) for j in range(n)]
            entries.append({"token_id": tok, "logprob": row[1], "top": top})
        return ids, entries


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if not md.changes_logits:
        return logits
    if md.grammar is not None:
        apply_masks(logits, *md.grammar)
    if md.bias is not None:
        rows, cols, vals = md.bias
        logits.index_put_((rows, cols), vals, accumulate=True)
    if md.rep_index is not None:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        # a device value: `seen[idx] = True` copies the Python scalar from pageable memory, which syncs the stream (the
        # sampling queued behind a step's forward then waits for it). H200: with a penalty the b1 step was 0.7 ms
        # slower than without before this and the numpy lists above, 0.04 ms after
        seen.index_put_(md.rep_index, seen.new_ones(()))
        pen = md.rep_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    if md.out_index is not None:
        counts = torch.zeros_like(logits)
        counts.index_put_(md.out_index, torch.ones_like(md.out_index[0], dtype=logits.dtype), accumulate=True)
        logits = logits - md.frequency[:, None] * counts - md.presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_filters(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """min-p, top-k, top-p on temperature-scaled logits x [M, V]; removed tokens get -inf."""
    if md.min_p is not None:
        # p < min_p * p_max  <=>  x < x_max + log(min_p)  (min_p = 0: log = -inf, nothing removed)
        x = x.masked_fill(x < x.amax(dim=-1, keepdim=True) + torch.log(md.min_p)[:, None], float("-inf"))
    if md.top_k is None and md.top_p is None:
        return x
    xs, order = torch.sort(x, dim=-1, descending=True)
    drop = torch.zeros_like(xs, dtype=torch.bool)
    if md.top_k is not None:
        rank = torch.arange(x.shape[-1], device=x.device)
        drop |= rank[None, :] >= md.top_k[:, None]
        xs = xs.masked_fill(drop, float("-inf"))
    if md.top_p is not None:
        ps = torch.softmax(xs, dim=-1)
        before = torch.cumsum(ps, dim=-1) - ps  # mass of strictly better tokens; the best one always stays
        drop |= before >= md.top_p[:, None]
    xs = xs.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, xs)


# Greedy rows' argmax by kernels.argmax (one launch, the whole GPU) instead of torch.argmax (9 us for one Kimi row on
# the H200). KIMI_ARGMAX=torch: torch's (A/B: bench/ablate.py --set backend.engine.sampler.TRITON_ARGMAX=False)
TRITON_ARGMAX = os.environ.get("KIMI_ARGMAX", "triton") != "torch"
# KIMI_SAMPLER_FAST=0: sampled rows always take the torch path (apply_filters + softmax + race_argmax)
_FAST_FILTERS = os.environ.get("KIMI_SAMPLER_FAST", "1") != "0"


def _fast_ok(p) -> bool:
    """Rows the one-launch kernel is measured faster on (H200 12-03, bench/sampling.py, V 163840): with min_p > 0 or
    0 < top_k <= 256 its candidate set stays small (M=64: 156-184 us vs 1456-1523 torch at logit scale 4, 369 vs 1503
    at scale 1); top-p alone on flat logits re-reads the row per search pass (3.2 ms vs 0.2-1.6 ms torch).
    With the nucleus check (kernels.sampling.NUCLEUS) rows without top-k take it too when top_p >= NUC_TOPP_MIN or
    off: the check settles them unless the survivors' 4 best race keys all fall outside top-p, a chance of about
    (1 - top_p)^4 (never without top-p); top-p 0.95 alone, H100 12-06: 24-156 us against 209-1815 torch."""
    if p.min_p > 0.0 or 0 < p.top_k <= KS:  # KS: top-k up to this bounds the kernel's candidate set
        return True
    return _sampling.NUCLEUS and p.top_k <= 0 and p.top_p >= NUC_TOPP_MIN


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """logits [M, V] fp32 (modified in place) -> SamplerOutput on the device."""
    logits = apply_penalties(logits, md)
    want_lp = md.num_top_logprobs >= 0
    ids = None
    if md.any_greedy:  # full-vocab passes only where a row needs them
        ids = argmax_rows(logits) if TRITON_ARGMAX and use_triton(logits) else logits.argmax(dim=-1)
    processed = logits
    if not md.all_greedy:
        if not want_lp and _FAST_FILTERS and md.fast_filters and use_triton(logits):
            # one Triton launch: filters as thresholds + the race on the kept tokens, no sort (kernels/sampling.py);
            # the same tokens as the torch path below. Logprobs need the filtered logits x: torch path.
            from kernels.sampling import filtered_race
            raced = filtered_race(logits, md.temperature, md.seeds, md.steps, md.greedy, md.min_p, md.top_k,
                                  md.top_p)
        else:
            x = apply_filters(logits / md.temperature[:, None], md)
            probs = torch.softmax(x, dim=-1)
            raced = race_argmax(probs, md.seeds, md.steps)
            if want_lp:
                processed = torch.where(md.greedy[:, None], logits, x)
        ids = torch.where(md.greedy, ids, raced) if ids is not None else raced
    if not want_lp:
        return SamplerOutput(ids, None, None, None)
    lp = torch.log_softmax(processed, dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    top_lp, top_ids = lp.topk(max(md.num_top_logprobs, 1), dim=-1)
    return SamplerOutput(ids, chosen, top_ids, top_lp)
