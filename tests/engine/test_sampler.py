"""Sampler semantics on CPU: each parameter shows its effect; seeding and batch-composition independence."""

import math
import os
import subprocess
import sys

import pytest
import torch

from backend.engine.request import Request, SamplingParams
from backend.engine.sampler import (LOGPROB_FLOOR, SamplingMetadata, _exp1_from_bits, exponential_noise,
                                    race_argmax_ref, race_keys_ref, sample)

CPU = torch.device("cpu")


def rq(prompt=(1,), output=(), seed=0, **kw):
    r = Request(list(prompt), SamplingParams(**kw), seed=seed)
    r.output_token_ids = list(output)
    return r


def run(logits, reqs):
    md = SamplingMetadata.build(reqs, logits.shape[-1], CPU)
    return sample(logits.clone(), md).to_host(md)


def freqs(logits_row, n=4000, **kw):
    """Empirical distribution over n rows with different seeds."""
    reqs = [rq(seed=s, **kw) for s in range(n)]
    ids, _ = run(logits_row.expand(n, -1), reqs)
    return torch.bincount(torch.tensor(ids), minlength=logits_row.shape[-1]).double() / n


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def test_noise_is_exponential_and_deterministic():
    seeds = torch.tensor([0, 1, 2**40 + 3, 2**62 + 5])
    steps = torch.tensor([0, 0, 7, 123456])
    e = exponential_noise(seeds, steps, 50_000)
    assert torch.equal(e, exponential_noise(seeds, steps, 50_000))
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1.0) < 0.02 and abs(e.var().item() - 1.0) < 0.05
    # rows with different (seed, step) are not the same stream
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[2], e[3])
    assert abs(torch.corrcoef(e[:2])[0, 1].item()) < 0.02


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    ids, lps = run(logits, [rq(temperature=0.0) for _ in range(5)])
    assert ids == logits.argmax(-1).tolist() and lps == [None] * 5


def test_temperature_matches_softmax():
    f = freqs(LOGITS, temperature=1.0)
    assert torch.allclose(f, PROBS.double(), atol=0.03)
    f = freqs(LOGITS, temperature=0.5)
    assert torch.allclose(f, torch.softmax(LOGITS / 0.5, -1).double(), atol=0.03)
    f = freqs(LOGITS, temperature=3.0)
    assert torch.allclose(f, torch.softmax(LOGITS / 3.0, -1).double(), atol=0.03)


def test_top_k():
    f = freqs(LOGITS, top_k=2)
    assert f[2:].sum() == 0
    assert torch.allclose(f[:2], (PROBS[:2] / PROBS[:2].sum()).double(), atol=0.03)
    assert (freqs(LOGITS, top_k=-1) > 0).all()  # LocalAI sends -1: off


def test_top_p():
    f = freqs(LOGITS, top_p=0.7)  # 0.5 + 0.3 reach 0.7: tokens 0 and 1 stay
    assert f[2:].sum() == 0 and torch.allclose(f[:2], torch.tensor([0.625, 0.375]).double(), atol=0.03)
    f = freqs(LOGITS, top_p=0.3)  # the best token always stays
    assert f[0] == 1.0


def test_min_p():
    f = freqs(LOGITS, min_p=0.2)  # threshold 0.2 * 0.5 = 0.1: token 3 (0.05) goes
    assert f[3] == 0 and (f[:3] > 0).all()
    assert torch.allclose(f[:3], (PROBS[:3] / PROBS[:3].sum()).double(), atol=0.03)


def test_top_k_top_p_min_p_combined():
    f = freqs(LOGITS, top_k=3, top_p=0.9, min_p=0.2)
    assert f[3] == 0 and (f[:3] > 0).all()
    f = freqs(LOGITS, top_k=3, top_p=0.6)
    assert f[2:].sum() == 0


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2, 0.0]])
    # token 0 in the prompt: 2.0 / 2 = 1.0 < 1.5
    ids, _ = run(logits, [rq(prompt=(0,), temperature=0.0, repetition_penalty=2.0)])
    assert ids == [1]
    # seen negative logits are multiplied: token 2 (-1.0 -> -2.0) falls below token 3
    logits = torch.tensor([[-1.0, -1.2, -5.0]])
    ids, _ = run(logits, [rq(prompt=(2,), output=(0,), temperature=0.0, repetition_penalty=2.0)])
    assert ids == [1]
    ids, _ = run(logits, [rq(prompt=(2,), output=(0,), temperature=0.0, repetition_penalty=1.0)])
    assert ids == [0]


def test_presence_and_frequency_penalties_openai_semantics():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    # token 0 twice in the output: 3 - 2 * 0.4 = 2.2 < 2.5
    ids, _ = run(logits, [rq(output=(0, 0), temperature=0.0, frequency_penalty=0.4)])
    assert ids == [1]
    ids, _ = run(logits, [rq(output=(0,), temperature=0.0, frequency_penalty=0.4)])
    assert ids == [0]
    ids, _ = run(logits, [rq(output=(0, 0, 0), temperature=0.0, presence_penalty=0.6)])
    assert ids == [1]
    # prompt tokens are not penalised by presence/frequency
    ids, _ = run(logits, [rq(prompt=(0, 0, 0), temperature=0.0, presence_penalty=5.0, frequency_penalty=5.0)])
    assert ids == [0]


def test_logit_bias():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    ids, _ = run(logits, [rq(temperature=0.0, logit_bias={0: -100.0})])
    assert ids == [1]
    f = freqs(LOGITS, n=500, logit_bias={3: 100.0})
    assert f[3] == 1.0


def test_seeded_reproducible_and_batch_composition_independent():
    torch.manual_seed(0)
    V = 1000
    row = torch.randn(V) * 2
    mine = [rq(seed=1234, output=[5] * step, temperature=0.8, top_p=0.95) for step in range(20)]
    alone = [run(row[None], [r])[0][0] for r in mine]
    assert alone == [run(row[None], [r])[0][0] for r in mine]
    assert len(set(alone)) > 5  # it does sample
    # same request inside batches of other requests (greedy and sampled), at various positions
    for pos, others in ((0, 3), (2, 5), (7, 7)):
        for step, r in enumerate(mine):
            batch = [rq(seed=s, temperature=1.0 + s % 2, top_k=s % 5) for s in range(others)]
            batch.insert(pos, r)
            batch.append(rq(temperature=0.0))
            logits = torch.randn(len(batch), V)
            logits[pos] = row
            assert run(logits, batch)[0][pos] == alone[step]
    other_seed = [run(row[None], [rq(seed=99, output=[5] * s, temperature=0.8, top_p=0.95)])[0][0] for s in range(20)]
    assert other_seed != alone


def test_logprobs_of_processed_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    reqs = [rq(temperature=0.0, logprobs=True, top_logprobs=3), rq(temperature=0.5, top_k=2, logprobs=True)]
    ids, lps = run(logits, reqs)
    ref0 = torch.log_softmax(logits[0], -1)
    assert ids[0] == 0 and lps[0]["token_id"] == 0 and math.isclose(lps[0]["logprob"], ref0[0].item(), rel_tol=1e-5)
    assert [t for t, _ in lps[0]["top"]] == [0, 1, 2]
    assert all(math.isclose(lp, ref0[t].item(), rel_tol=1e-5) for t, lp in lps[0]["top"])
    # row 1: temperature 0.5 then top-2 -> a two-token distribution
    ref1 = torch.log_softmax(logits[1, 3:] / 0.5, -1)
    assert ids[1] in (3, 4) and lps[1]["top"] == []
    assert math.isclose(lps[1]["logprob"], ref1[ids[1] - 3].item(), rel_tol=1e-5)
    # removed tokens show the floor, not -inf
    ids, lps = run(logits[1:], [rq(temperature=0.5, top_k=2, logprobs=True, top_logprobs=4)])
    assert [lp for _, lp in lps[0]["top"][2:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    # rows without logprobs in a step that has some get None
    ids, lps = run(logits, [rq(temperature=0.0), rq(temperature=0.0, top_logprobs=2)])
    assert lps[0] is None and len(lps[1]["top"]) == 2


def chi2_pvalue(counts, probs):
    """Pearson chi-square goodness of fit: p-value of observed counts [V] against probabilities [V] (df = V - 1)."""
    counts, probs = counts.double(), probs.double()
    exp = counts.sum() * probs / probs.sum()
    stat = ((counts - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2).item()


def same_race_winner(ids, probs, seeds, steps, rel=1e-6):
    """ids (any implementation) against the reference race. Implementations agree only up to float rounding (FMA
    contraction in the E series, log ulps on the E >= log 2 branch: keys within ~5e-7 relative), so a different id
    is accepted only where the reference's own key for it is within ``rel`` of the reference's best key, i.e. the
    reference's top-2 keys are a near-tie (probability ~rel per row). Returns the number of such rows."""
    keys = race_keys_ref(probs, seeds, steps)
    ref = keys.argmax(-1)
    diff = (ids != ref).nonzero().flatten()
    best = keys.gather(1, ref[:, None])[:, 0]
    got = keys.gather(1, ids[:, None].long())[:, 0]
    near = got[diff] >= best[diff] * (1 - rel)
    assert near.all(), f"rows {diff[~near].tolist()}: ids {ids[diff[~near]].tolist()} vs {ref[diff[~near]].tolist()}"
    return len(diff)


def test_exp1_accurate_near_zero():
    """E = -log(1 - w) to ~1 ulp *relative* for every w; the race is decided where E is tiny (a token of probability p
    wins with E ~ p), which a log of u = 1 - w near 1 gets wrong. Also exact CDF counts there."""
    bits = torch.cat([torch.arange(0, 1 << 16), torch.randint(0, 1 << 32, (1 << 18,), generator=torch.Generator()
                      .manual_seed(0)), torch.arange((1 << 32) - 512, 1 << 32), torch.arange((1 << 31) - 256, (1 << 31) + 256)])
    e = _exp1_from_bits(bits)
    assert e.dtype == torch.float32 and (e > 0).all() and torch.isfinite(e).all()
    w = ((bits.to(torch.float32) + 0.5) * 2.0**-32).double()  # the uniform the formula sees
    ok = w < 1  # bits >= 2^32 - 128 round to w = 1: E = 32 log 2 (clamped), a certain loser
    exact = -torch.log1p(-w[ok])
    rel = (e[ok].double() - exact).abs() / exact
    assert rel.max().item() < 2.5e-7, rel.max().item()
    assert torch.allclose(e[~ok].double(), torch.tensor(32 * math.log(2), dtype=torch.float64)) and (~ok).sum() == 128
    assert (e[1:1 << 16] > e[:(1 << 16) - 1]).all()  # strictly increasing on the first 65536 bits: full resolution
    # P(E < x) = 1 - exp(-x): count the 32-bit values below x exactly (E is monotone in bits)
    for x in (1e-9, 1e-7, 3e-6):
        n = int((_exp1_from_bits(torch.arange(0, int(x * 2**32) + 64)) < x).sum())
        assert abs(n - 2**32 * -math.expm1(-x)) <= 1.0, (x, n)


# skewed distributions for the statistical tests; the 0.999 one is where an inaccurate E near 0 shows
SKEWED = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
PEAKED = torch.tensor([0.999, 0.0006, 0.0003, 0.0001])


@pytest.mark.parametrize("probs,n", [(SKEWED, 20000), (PEAKED, 200000)])
def test_race_distribution_chi_square(probs, n):
    """Reference race over n seeds (fixed set) against the target distribution."""
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    steps = torch.arange(n, dtype=torch.int64) % 13
    ids = race_argmax_ref(probs.expand(n, -1).contiguous(), seeds, steps)
    counts = torch.bincount(ids, minlength=len(probs))
    assert chi2_pvalue(counts, probs) > 1e-4, (counts.tolist(), (probs * n).tolist())


def test_race_distribution_rare_tail():
    """p = 0.999 on token 0 and the rest spread over 1023 tokens of ~1e-6 each: the tail wins with E ~ 1e-6, the
    region the old formula quantised (u near 1). The tail's share must be 0.001 (counted over 20000 seeds; the exact
    CDF check in test_exp1_accurate_near_zero is the sharp one, test_cuda_race_distribution the large-sample one)."""
    V, n = 1024, 20000
    probs = torch.full((V,), 0.001 / (V - 1))
    probs[0] = 0.999
    tail = 0
    for c in range(0, n, 10000):
        seeds = torch.arange(c, c + 10000, dtype=torch.int64) + (1 << 40)
        tail += int((race_argmax_ref(probs.expand(10000, -1), seeds, seeds % 5) != 0).sum())
    assert chi2_pvalue(torch.tensor([n - tail, tail]), torch.tensor([0.999, 0.001])) > 1e-4, tail


_RACE_SCRIPT = """
import torch
from backend.engine.sampler import race_argmax, race_argmax_ref
from tests.engine.test_sampler import PEAKED, SKEWED, chi2_pvalue, same_race_winner
torch.manual_seed(0)
seeds, steps = torch.tensor([0, 1, 2**40 + 3, 2**62 + 5, 7, 7]), torch.tensor([0, 0, 7, 123456, 1, 2])
for probs in (torch.softmax(torch.randn(6, 9000) * 3, -1), torch.full((6, 9000), 1 / 9000)):
    assert same_race_winner(race_argmax(probs, seeds, steps), probs, seeds, steps) == 0
# statistics through the kernel (the interpreter runs ~25 programs / s: 1000 and 400 seeds)
for probs, n in ((SKEWED, 1000), (PEAKED, 400)):
    seeds, steps = torch.arange(n, dtype=torch.int64) * 7919 + 11, torch.arange(n, dtype=torch.int64) % 13
    p = probs.expand(n, -1).contiguous()
    ids = race_argmax(p, seeds, steps)
    assert same_race_winner(ids, p, seeds, steps) == 0
    counts = torch.bincount(ids, minlength=len(probs))
    if probs is SKEWED:
        assert chi2_pvalue(counts, probs) > 1e-4, counts.tolist()
    else:  # too few draws for the rare bins: token 0 against the rest
        assert chi2_pvalue(torch.stack([counts[0], counts[1:].sum()]), torch.tensor([0.999, 0.001])) > 1e-4
print("OK")
"""


def test_race_kernel_matches_reference_interpreted():
    """The fused Triton race (CUDA path) against the torch reference, through the Triton interpreter on CPU: same
    winners (up to float-rounding near-ties, see same_race_winner) and the target distribution.
    A flat distribution makes the winner depend on every bit of the hash."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_KERNELS="triton", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _RACE_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_matches_cpu():
    torch.manual_seed(0)
    logits = torch.randn(8, 5000)
    reqs = [rq(seed=s, output=[1, 2, 3], temperature=0.7, top_p=0.9, top_k=50, min_p=0.01,
               repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, logit_bias={7: 2.0},
               logprobs=True, top_logprobs=5) for s in range(8)]
    cpu_ids, _ = run(logits, reqs)
    dev = torch.device("cuda")
    md = SamplingMetadata.build(reqs, 5000, dev)
    gpu_ids, _ = sample(logits.to(dev), md).to_host(md)
    assert gpu_ids == cpu_ids
    from backend.engine.sampler import race_argmax
    # Kimi's vocabulary: the Triton race against the reference (torch ops on the same GPU). Equal up to float-rounding
    # near-ties only (same_race_winner: a differing id must have a reference key within 1e-6 of the best; that has
    # probability ~1e-6 per row, so more than one such row out of 256 means a real discrepancy).
    for scale in (1.0, 4.0):
        probs = torch.softmax(torch.randn(256, 163840, device=dev) * scale, -1)
        seeds, steps = torch.randint(0, 2**62, (256,), device=dev), torch.randint(0, 10**6, (256,), device=dev)
        assert same_race_winner(race_argmax(probs, seeds, steps), probs, seeds, steps) <= 1
    noise = exponential_noise(torch.tensor([3, 2**50]), torch.tensor([1, 9]), 1000)
    gpu_noise = exponential_noise(torch.tensor([3, 2**50], device=dev), torch.tensor([1, 9], device=dev), 1000)
    torch.testing.assert_close(gpu_noise.cpu(), noise, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["greedy", "sampled", "logprobs"])
def test_cuda_sampling_never_syncs(kind):
    """Penalties, bias and a grammar mask on the device queue no host sync (the engine queues a step's sampling
    behind its forward and goes on with host work): torch's sync debug mode raises on any."""
    dev = torch.device("cuda")
    extra = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9, min_p=0.01),
             "logprobs": dict(temperature=0.7, top_k=50, logprobs=True, top_logprobs=3)}[kind]
    reqs = [rq(prompt=(1, 5, 9), seed=s, output=[1, 2, 3], repetition_penalty=1.1, presence_penalty=0.3,
               frequency_penalty=0.2, logit_bias={7: 2.0}, **extra) for s in range(4)]
    md = SamplingMetadata.build(reqs, 5000, dev)
    md.grammar = (torch.tensor([0, 2], device=dev), torch.full((2, 157), -1, dtype=torch.int32, device=dev))
    logits = torch.randn(4, 5000, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (4,)


@pytest.mark.gpu
def test_cuda_race_distribution():
    """The compiled kernel's distribution with many draws: peaked (0.999 + a rare tail of ~2.4e-7 per token, where an
    inaccurate E near 0 biases the tail by tens of %) and skewed; rows share one probability row (stride 0)."""
    from backend.engine.sampler import race_argmax
    dev = torch.device("cuda")
    n = 1 << 20
    seeds = torch.arange(n, dtype=torch.int64, device=dev) * 1000003 + 5
    steps = torch.arange(n, dtype=torch.int64, device=dev) % 97
    V = 4096
    tailp = torch.full((V,), 0.001 / (V - 1), device=dev)
    tailp[0] = 0.999
    for probs in (tailp, SKEWED.to(dev), PEAKED.to(dev)):
        ids = race_argmax(probs.expand(n, -1), seeds, steps)
        counts = torch.bincount(ids, minlength=len(probs)).cpu()
        target = probs.cpu()
        if len(probs) == V:  # token 0 against the tail
            counts, target = torch.stack([counts[0], counts[1:].sum()]), torch.tensor([0.999, 0.001])
        assert chi2_pvalue(counts, target) > 1e-4, (counts.tolist(), (target * n).tolist())
        m = 8192
        same_race_winner(ids[:m], probs.expand(m, -1).contiguous(), seeds[:m], steps[:m])
