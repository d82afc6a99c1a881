"""kernels/sampling.py filtered_race against the sampler's torch path: race_argmax(softmax(apply_filters(x / T))).

CPU: the Triton interpreter at small awkward V (fp32 only); small workspace caps (gcap / rcap / nt) force the
multi-pass search, the "full mode" (more candidates than G holds) and the register resolve at these sizes.
GPU: Kimi's vocabulary, M = 64, the compiled kernel against the torch path on the same device."""
from types import SimpleNamespace

import pytest
import torch

from backend.engine import sampler as S
from backend.engine.request import Request, SamplingParams
from kernels.sampling import filtered_race
from tests.kernels.conftest import requires_triton

# (gcap, rcap, nt): the defaults; tiny caps: every search path at V ~ 1000-4000
CAPS = {"default": {}, "tiny": dict(gcap=64, rcap=16, nt=4), "mid": dict(gcap=512, rcap=64, nt=16)}


def ref_tokens(logits, temp, seeds, steps, min_p=None, top_k=None, top_p=None, race=S.race_argmax_ref):
    """The sampler's torch path for sampled rows."""
    x = S.apply_filters(logits / temp[:, None], SimpleNamespace(min_p=min_p, top_k=top_k, top_p=top_p))
    return race(torch.softmax(x, dim=-1), seeds, steps)


def row_params(M, V, gen, which=("min_p", "top_k", "top_p")):
    """Mixed per-row parameters (some rows with a filter off) -> dict of [M] tensors (None for absent filters)."""
    out = {"temp": 0.3 + 1.2 * torch.rand(M, generator=gen)}
    if "min_p" in which:
        mp = torch.rand(M, generator=gen) * 0.2
        mp[::3] = 0.0
        out["min_p"] = mp
    if "top_k" in which:
        tk = torch.randint(1, 200, (M,), generator=gen)
        tk[1::3] = V
        tk[4::6] = 600   # > KS: no top-k lower bound from the group maxima
        out["top_k"] = tk
    if "top_p" in which:
        tp = 0.3 + 0.7 * torch.rand(M, generator=gen)
        tp[2::3] = 1.0
        out["top_p"] = tp
    return out


def check(logits, prm, nseeds, caps=None, device="cpu", nucleus=False):
    M = logits.shape[0]
    for r in range(nseeds):
        seeds = torch.randint(0, 2**62, (M,), device=device)
        steps = torch.randint(0, 10**6, (M,), device=device)
        got = filtered_race(logits, prm["temp"], seeds, steps, None, prm.get("min_p"), prm.get("top_k"),
                            prm.get("top_p"), nucleus=nucleus, **(caps or {}))
        want = ref_tokens(logits, prm["temp"], seeds, steps, prm.get("min_p"), prm.get("top_k"), prm.get("top_p"))
        assert torch.equal(got, want), (r, got.tolist(), want.tolist())


ALL = ("min_p", "top_k", "top_p")
CASES = ([(3, 1000, "tiny", w) for w in [("min_p",), ("top_k",), ("top_p",), ("top_k", "top_p"), ALL]]
         + [(17, 4099, "tiny", ALL), (17, 1000, "mid", ("top_p",)), (17, 1000, "mid", ("top_k", "top_p")),
            (1, 4099, "default", ALL)])


@requires_triton
@pytest.mark.parametrize("M,V,caps,which", CASES)
def test_matches_torch_path(M, V, caps, which):
    """Many seeds, per-row parameters, each filter alone and together; flat-ish logits (scale 2) so that tokens near
    each threshold carry real probability and a wrong threshold shows up as a different token."""
    gen = torch.Generator().manual_seed(M * 7919 + V + len(which))
    logits = torch.randn(M, V, generator=gen) * 2.0
    prm = row_params(M, V, gen, which)
    check(logits, prm, nseeds={1: 3, 3: 4}.get(M, 2), caps=CAPS[caps])


NUC_CASES = [(3, 1000, "tiny", w) for w in [(), ("min_p",), ("top_k",), ("top_p",), ("top_k", "top_p"), ALL]] + [
    (17, 4099, "tiny", ALL), (5, 3000, "mid", ("min_p", "top_p"))]


@requires_triton
@pytest.mark.parametrize("M,V,caps,which", NUC_CASES)
def test_nucleus_matches_torch_path(M, V, caps, which, monkeypatch):
    """The nucleus check (NUCLEUS: three (row, block) launches settle the rows whose min-p race winner is inside
    top-k / top-p; the row kernel the rest) gives the torch path's tokens; 256-token blocks, so rows span 4-17."""
    import kernels.sampling as K

    monkeypatch.setattr(K, "NUC_BLOCK", 256)
    gen = torch.Generator().manual_seed(M * 7919 + V + len(which) + 1)
    logits = torch.randn(M, V, generator=gen) * 2.0
    prm = row_params(M, V, gen, which)
    check(logits, prm, nseeds={3: 4}.get(M, 2), caps=CAPS[caps], nucleus=True)


def _nucleus_settles(logits, prm, seeds, steps, monkeypatch):
    """The rows the nucleus check settles and their tokens, read from the partials in torch: the row's NUC_R best race
    keys (q descending, token ascending), walked in order to the first one not clearly dropped (_nuc_accept's rule)."""
    import kernels.sampling as K

    M, V = logits.shape
    R = K.NUC_R_N
    nb, nbp = K.nuc_blocks(V)
    parts = K._nucleus_partials(logits, prm["temp"], seeds, steps, None, prm.get("min_p"), nb, nbp, prm.get("top_k"))
    f = parts.view(M, K.NUC_PARTS_N, nbp)[:, :, :nb]
    i = f.view(torch.int32)
    rq, rid, ra, rc = (K.NUC_ROWS[k] for k in ("q", "id", "a", "c"))
    q = f[:, rq:rq + R].reshape(M, -1)
    tok = i[:, rid:rid + R].reshape(M, -1)
    n_all = i[:, 2].sum(1)
    a_above = f[:, ra:ra + R].sum(2)                     # [M, R], in candidate order
    c_above = i[:, rc:rc + R].sum(2)
    s_all = f[:, 1].sum(1)
    kk = torch.clamp(prm["top_k"], max=V) if "top_k" in prm else n_all
    # top-p's S in [s_lo, s_hi]: with top-k, s_hi = mass(x >= x_k), s_lo = s_hi where x_k is exact, else the best
    # A_c + exp(x_c - m) of a candidate inside top-k (S_all where top-k keeps every survivor)
    e_c = f[:, K.NUC_ROWS["e"]:K.NUC_ROWS["e"] + R, 0]   # [M, R] exp(x_c - m), in candidate order
    s_hi = f[:, K.NUC_ROWS["sk"]].sum(1) if "top_k" in prm else s_all
    exact = (i[:, K.NUC_ROWS["x"], 0] != 0) if "top_k" in prm else torch.ones(M, dtype=torch.bool)
    ok = torch.zeros(M, dtype=torch.bool)
    w = torch.zeros(M, dtype=torch.int64)
    for row in range(M):
        cands = sorted(zip(q[row].tolist(), tok[row].tolist()), key=lambda e: (-e[0], e[1]))[:R]
        inside = [(c_above[row, c] < kk[row]) & (qc >= 0) for c, (qc, _) in enumerate(cands)]
        s_lo = float(s_hi[row]) if exact[row] else float(s_all[row]) if kk[row] >= n_all[row] else max(
            [float(a_above[row, c] + e_c[row, c]) for c in range(len(cands)) if inside[c]], default=0.0)
        for c, (qc, tc) in enumerate(cands):
            if qc < 0:
                break
            kept, dropped = bool(inside[c]), bool(c_above[row, c] >= kk[row])
            if "top_p" in prm and prm["top_p"][row] < 1:
                p = float(prm["top_p"][row])
                kept &= bool(a_above[row, c] < p * s_lo * (1 - K.NUC_MARGIN_F))
                dropped |= bool(a_above[row, c] >= p * s_hi[row] * (1 + K.NUC_MARGIN_F))
            if not dropped:
                ok[row], w[row] = kept, tc
                break
    return ok, w


def _settled_case(case, M, V):
    """(logits, params) of the poison test: min-p + top-p 0.02 .. 0.95 (a row is left to the row kernel with a chance
    of about (1 - top_p)^NUC_R, so both kinds occur), or top-k 2 .. 60 + top-p without min-p on peaked logits (top-k
    drops survivors in every row: top-p's mass is the top-k set's, exact from the blocks' largest logits, or bounded
    where a block holds more of the top-k set than it lists)."""
    gen = torch.Generator().manual_seed(4)
    if case == "min_p top_p":
        prm = {"temp": torch.full((M,), 0.6), "min_p": torch.full((M,), 0.01), "top_p": torch.linspace(0.02, 0.95, M)}
        return torch.randn(M, V, generator=gen), prm
    prm = {"temp": torch.full((M,), 0.8), "top_k": torch.linspace(2, 60, M).long(),
           "top_p": torch.linspace(0.3, 0.95, M)}
    return torch.randn(M, V, generator=gen) * 3.0, prm


@requires_triton
@pytest.mark.parametrize("case", ["min_p top_p", "top_k top_p"])
def test_nucleus_settled_rows_skip_the_row_kernel(case, monkeypatch):
    """The row kernel stores the partials' token for the rows the accept rule settles and runs only the others: with
    every block's candidate tokens in the partials replaced by a sentinel, exactly the settled rows return the sentinel
    and the rest the torch path's token (fails if the kernel never settles a row, or settles others than the rule).
    min-p + top-p: some rows are settled by a later candidate (the min-p race winner is outside top-p there);
    top-k + top-p: rows are settled although top-k drops survivors."""
    import kernels.sampling as K

    monkeypatch.setattr(K, "NUC_BLOCK", 256)
    M, V, sentinel = 24, 2000, 1999
    logits, prm = _settled_case(case, M, V)
    seeds, steps = torch.arange(M) * 31 + 2, torch.arange(M) + 7
    ok, _ = _nucleus_settles(logits, prm, seeds, steps, monkeypatch)
    real = K._nucleus_partials

    def poisoned(*a):
        parts = real(*a)
        nbp = parts.shape[1] // K.NUC_PARTS_N
        parts.view(M, K.NUC_PARTS_N, nbp)[:, K.NUC_ROWS["id"]:K.NUC_ROWS["a"]].view(torch.int32).fill_(sentinel)
        return parts
    monkeypatch.setattr(K, "_nucleus_partials", poisoned)
    mp, tk = prm.get("min_p"), prm.get("top_k")
    got = filtered_race(logits, prm["temp"], seeds, steps, None, mp, tk, prm["top_p"], nucleus=True)
    want = ref_tokens(logits, prm["temp"], seeds, steps, mp, tk, prm["top_p"])
    assert ok.any() and not ok.all(), ok.tolist()
    assert (got[ok] == sentinel).all() and torch.equal(got[~ok], want[~ok]), (ok.tolist(), got.tolist())
    assert not (want[ok] == sentinel).any()
    if case == "min_p top_p":
        first = ref_tokens(logits, prm["temp"], seeds, steps, mp, None, None)   # the min-p race winner
        assert (ok & (first != want)).any(), (ok.tolist(), first.tolist(), want.tolist())
    else:   # settled rows whose top-p acted on a strict top-k set (k < V survivors) with a real cut
        cut = ref_tokens(logits, prm["temp"], seeds, steps, None, tk, None) != want
        assert int(ok.sum()) >= M // 2 and (ok & cut).any(), (ok.tolist(), cut.tolist())


@requires_triton
def test_nucleus_topk_mass(monkeypatch):
    """Top-k rows' partials: the candidates' pool bound x_k from the blocks' NUC_T largest logits. Where it is exact,
    the S_k partials sum to the mass of the survivors' top-k set (ties kept: x >= the k-th largest; all survivors
    when top-k keeps them all); otherwise to at least that mass. k = 1 and 5 are exact here, k > NB NUC_T is not
    (x_k = -inf: the survivors' mass). Every candidate lies in the top-k set where exact."""
    import kernels.sampling as K

    monkeypatch.setattr(K, "NUC_BLOCK", 256)
    V, T = 3000, K.NUC_T_N
    nb, nbp = K.nuc_blocks(V)
    ks = [1, 5, 40, nb * T, nb * T + 1, V, 40, 3]
    M = len(ks)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(M, V, generator=gen) * 2.0
    logits[6, :2990] = float("-inf")                     # 10 finite tokens: top-k 40 keeps them all
    temp = torch.full((M,), 0.7)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05])
    top_k = torch.tensor(ks)
    seeds, steps = torch.arange(M) + 3, torch.arange(M) + 9
    parts = K._nucleus_partials(logits, temp, seeds, steps, None, min_p, nb, nbp, top_k)
    f = parts.view(M, K.NUC_PARTS_N, nbp)[:, :, :nb]
    i = f.view(torch.int32)
    exact = i[:, K.NUC_ROWS["x"], 0] != 0
    s_hi = f[:, K.NUC_ROWS["sk"]].sum(1)
    tok = i[:, K.NUC_ROWS["id"]:K.NUC_ROWS["id"] + K.NUC_R_N].reshape(M, -1)
    q = f[:, K.NUC_ROWS["q"]:K.NUC_ROWS["q"] + K.NUC_R_N].reshape(M, -1)
    x = logits / temp[:, None]
    m = x.amax(1, keepdim=True)
    surv = (x >= m + torch.log(min_p)[:, None]) & (x > float("-inf"))
    for r in range(M):
        xs = x[r][surv[r]].sort(descending=True).values
        xk = xs[min(ks[r], len(xs)) - 1]
        want = torch.exp(x[r][surv[r] & (x[r] >= xk)] - m[r]).sum()
        assert float(s_hi[r]) >= float(want) * (1 - 1e-5), (r, float(s_hi[r]), float(want))
        if exact[r]:
            assert abs(float(s_hi[r]) - float(want)) <= 1e-5 * float(want), (r, float(s_hi[r]), float(want))
            pool = tok[r][q[r] >= 0]
            assert (x[r][pool] >= xk).all(), r
    assert exact[[0, 1, 7]].all() and not exact[4], exact.tolist()
    s_all = torch.exp(x[4][surv[4]] - m[4]).sum()
    assert abs(float(s_hi[4]) - float(s_all)) <= 1e-5 * float(s_all)


@requires_triton
def test_nucleus_settles_most_rows(monkeypatch):
    """With min-p and top-p 0.95 on flat logits the check settles every row here (a row is left over with a chance of
    about 0.05^NUC_R), each with the torch path's token; min-p alone settles every row."""
    import kernels.sampling as K

    monkeypatch.setattr(K, "NUC_BLOCK", 256)
    M, V = 24, 2000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(M, V, generator=gen)
    seeds, steps = torch.arange(M) * 77 + 5, torch.arange(M) + 100
    for prm, least in (({"temp": torch.full((M,), 0.6), "min_p": torch.full((M,), 0.01)}, M),
                       ({"temp": torch.full((M,), 0.6), "min_p": torch.full((M,), 0.01),
                         "top_p": torch.full((M,), 0.95)}, M)):
        ok, w = _nucleus_settles(logits, prm, seeds, steps, monkeypatch)
        want = ref_tokens(logits, prm["temp"], seeds, steps, prm.get("min_p"), None, prm.get("top_p"))
        got = filtered_race(logits, prm["temp"], seeds, steps, None, prm.get("min_p"), None, prm.get("top_p"),
                            nucleus=True)
        assert int(ok.sum()) >= least and torch.equal(w[ok], want[ok]) and torch.equal(got, want)


@requires_triton
@pytest.mark.parametrize("caps,nucleus", [("tiny", False), ("default", False), ("tiny", True)])
def test_edge_rows(caps, nucleus):
    """One token with all the mass, -inf logits (a few, most, all), min_p = 1, top_k = 1, top_p tiny, top_k > V."""
    V = 1000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, V, generator=gen)
    logits[0, 123] = 80.0                      # all the mass on one token (others underflow at T = 0.5)
    logits[1, ::7] = float("-inf")             # a few -inf
    logits[2, 10:] = float("-inf")             # only 10 finite tokens
    logits[3, :] = float("-inf")               # nothing finite: token 0 (the reference's argmax of a NaN row)
    prm = {"temp": torch.tensor([0.5, 1.0, 0.7, 1.0, 1.0, 0.9, 2.0, 1.0]),
           "min_p": torch.tensor([0.0, 0.05, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0]),
           "top_k": torch.tensor([V, 40, 3, 5, V, 1, V, 5000]),
           "top_p": torch.tensor([0.9, 0.8, 1.0, 0.5, 1.0, 1.0, 1e-6, 0.999])}
    for r in range(4 if caps == "tiny" else 1):   # default caps: the interpreter's tl.sort of 1024 is slow
        seeds, steps = torch.arange(8) * 1000 + r, torch.full((8,), r)
        got = filtered_race(logits, prm["temp"], seeds, steps, None, prm["min_p"], prm["top_k"], prm["top_p"],
                            nucleus=nucleus, **CAPS[caps])
        want = ref_tokens(logits, prm["temp"], seeds, steps, prm["min_p"], prm["top_k"], prm["top_p"])
        assert torch.equal(got, want), (r, got.tolist(), want.tolist())
        assert got[0] == 123 and got[3] == 0 and got[6] == logits[6].argmax() and got[2] < 10


@requires_triton
def test_sample_dispatch_with_greedy_rows(monkeypatch):
    """sample() with the fast path (as on CUDA) == sample() with the torch path, greedy rows mixed in. The fast path
    is taken only when every sampled row has min_p > 0 or top_k <= 256, or (with the nucleus check) no top-k and top_p
    >= 0.8 or off; other rows send the batch to the torch path (slower in the kernel on flat logits)."""
    V = 1500
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, V, generator=gen) * 2
    kw = [dict(temperature=0.0), dict(temperature=0.6, top_p=0.95, min_p=0.01), dict(temperature=0.0, top_k=5),
          dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.7, top_k=200),
          dict(temperature=1.3, min_p=0.05)]
    reqs = []
    for s, k in enumerate(kw):
        r = Request([1, 2], SamplingParams(**k), seed=1000 + s)
        r.output_token_ids = [3] * s
        reqs.append(r)
    md = S.SamplingMetadata.build(reqs, V, torch.device("cpu"))
    monkeypatch.setattr(S, "_FAST_FILTERS", False)
    want = S.sample(logits.clone(), md).token_ids
    monkeypatch.setattr(S, "_FAST_FILTERS", True)
    monkeypatch.setattr(S, "use_triton", lambda t: True)
    called = []
    import kernels.sampling as K
    real = K.filtered_race
    monkeypatch.setattr(K, "filtered_race", lambda *a, **k: called.append(1) or real(*a, **k))
    got = S.sample(logits.clone(), md).token_ids
    assert called and torch.equal(got, want), (got.tolist(), want.tolist())
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    for nuc in (True, False):
        monkeypatch.setattr(K, "NUCLEUS", nuc)
        # with the nucleus check: temperature only, and top-p >= NUC_TOPP_MIN without top-k, take the kernel too
        fast = [dict(temperature=1.3), dict(temperature=0.8, top_p=0.9)] if nuc else []
        slow = [dict(temperature=0.8, top_p=0.7), dict(temperature=1.0, top_k=300)]
        slow += [] if nuc else [dict(temperature=1.3), dict(temperature=0.8, top_p=0.9)]
        for kw, want_fast in [(k, True) for k in fast] + [(k, False) for k in slow]:
            r = Request([1, 2], SamplingParams(**kw), seed=7)
            md = S.SamplingMetadata.build(reqs[:5] + [r], V, torch.device("cpu"))
            assert md.fast_filters == want_fast, (nuc, kw)
            called.clear()
            got = S.sample(logits.clone(), md).token_ids
            assert bool(called) == want_fast, (nuc, kw)
            monkeypatch.setattr(S, "_FAST_FILTERS", False)
            ref = S.sample(logits.clone(), md).token_ids
            monkeypatch.setattr(S, "_FAST_FILTERS", True)
            assert torch.equal(got, ref), (nuc, kw, got.tolist(), ref.tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("nucleus", [False, True])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_gpu_kimi_vocab(scale, nucleus):
    """V = 163840, M = 64, the compiled kernel (with and without the nucleus check) vs the torch path on the GPU
    (Triton race kernel, as the engine runs it): bench/sampling.py's settings and mixed per-row parameters. A
    differing token is allowed only as a float near-tie (at most 1 of 512 rows; see the module doc of
    kernels/sampling.py)."""
    dev = torch.device("cuda")
    M, V = 64, 163840
    gen = torch.Generator(device=dev).manual_seed(int(scale))
    logits = torch.randn(M, V, device=dev, generator=gen) * scale
    fixed = {"temp": torch.full((M,), 0.6, device=dev), "min_p": torch.full((M,), 0.01, device=dev),
             "top_p": torch.full((M,), 0.95, device=dev)}
    cpu_gen = torch.Generator().manual_seed(3)
    mixed = {k: v.to(dev) for k, v in row_params(M, V, cpu_gen).items()}
    topk50 = dict(fixed, top_k=torch.full((M,), 50, device=dev))
    nomin = {"temp": fixed["temp"], "top_p": fixed["top_p"]}   # min_p off: more than GCAP candidates, full mode
    bad = 0
    for prm in (fixed, mixed, topk50, nomin):
        for r in range(2):
            seeds = torch.randint(0, 2**62, (M,), device=dev)
            steps = torch.randint(0, 10**6, (M,), device=dev)
            got = filtered_race(logits, prm["temp"], seeds, steps, None, prm.get("min_p"), prm.get("top_k"),
                                prm.get("top_p"), nucleus=nucleus)
            want = ref_tokens(logits, prm["temp"], seeds, steps, prm.get("min_p"), prm.get("top_k"),
                              prm.get("top_p"), race=S.race_argmax)
            bad += int((got != want).sum())
    assert bad <= 1, bad


def test_workspace_grows_geometrically():
    """The sampling workspace is never freed (kernels._tensors.workspace): growing a batch one row at a time must not
    keep a buffer per size, only one per power of two."""
    from kernels._tensors import WORKSPACES
    from kernels.sampling import _workspace

    dev = torch.device("meta")
    for m in range(1, 130):
        g, gi, r = _workspace(m, dev)
        assert g.shape[0] >= m and gi.shape[0] >= m and r.shape[0] >= m
    assert [ws[0].shape[0] for ws in WORKSPACES[("sampling", dev)]] == [8, 16, 32, 64, 128, 256]
