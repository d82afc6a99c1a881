"""H200 benchmark for the paged MLA kernels (Kimi shape: H=32, L=512, R=64, page 64, bf16).

    python bench/mla.py                 # decode grid + extend + a small config/split sweep
    python bench/mla.py --quick         # fewer shapes, no sweep
    python bench/mla.py --no-sweep --no-dense
    python bench/mla.py --ptxas         # no GPU needed: compile for sm_90 offline, print smem / regs / spills
    python bench/mla.py --ptxas --only decode   # + the main-loop SASS counts of each stage-1 build (ldmatrix, MMA, ...)
    python bench/mla.py --decode-only --sweep-decode   # decode variants (decode.DECODE_VARIANTS) next to FlashInfer
    python bench/mla.py --decode-only --sweep-decode --no-flashinfer --variants "base,w4 n32"  # < 100 s

Decode: B in {1, 8, 64, 128} x S in {1k, 8k, 64k, 128k}; effective bandwidth = cache bytes read (1152 B per key) /
time, beside the device copy bandwidth measured in this run, a dense torch implementation (gather + matmul) and
FlashInfer's MLA decode (fa3) when `import flashinfer` works. Times: triton.testing.do_bench (L2 flushed, median);
"graph" = CUDA-graph replay with an L2 flush inside, flush time subtracted. Extend: 8k-token prefill (causal) and an
8k-token chunk after an 8k prefix. Prints a table and markdown rows.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import triton  # noqa: E402

from kernels._tensors import cdiv, max_shared_mem  # noqa: E402
from kernels.mla import decode as dec  # noqa: E402
from kernels.mla import extend as ext  # noqa: E402
from kernels.mla import prefill as pre  # noqa: E402
from kernels.mla.decode import default_num_splits, mla_decode_triton  # noqa: E402
from kernels.mla import mla_prefill  # noqa: E402
from kernels.mla.cache import gather_latent_triton  # noqa: E402
from kernels.mla.extend import mla_extend_triton  # noqa: E402
from kernels.mla.prefill import mla_prefill_expanded_triton  # noqa: E402
from kernels.mla.ref import mla_decode_ref, mla_extend_ref, mla_prefill_expanded_ref  # noqa: E402

H, L, R, BS = 32, 512, 64, 64
D = L + R
SCALE = 192 ** -0.5
# (cached prefix, new tokens) for the prefill/extend section; the small chunks bracket MLA_EXPANDED_MIN_TOKENS
EXT_CASES = ((0, 8192), (8192, 8192), (65536, 512), (8192, 128), (8192, 256))
# expanded-kernel alternatives timed beside PREFILL_CFG (name -> config)
EXPANDED_ALT = {
    "expanded 2 stages": dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "expanded 64x64 w4": dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    "expanded 128x128": dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
}
ROW_BYTES = D * 2
DT = torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def host_time(fn, reps=50):
    """Median host seconds of one eager call: the launch side (Python, argument binding, launches), the stream
    drained before each call so no launch waits on a full queue. An eager time near this is launch-bound."""
    fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts)


_FLUSH = None


def bench_graph(fn, iters=20):
    """CUDA-graph replay time per call with an L2 flush before each call (flush cost subtracted)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g_both, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_both):
        for _ in range(iters):
            _FLUSH.zero_()
            fn()
    with torch.cuda.graph(g_flush):
        for _ in range(iters):
            _FLUSH.zero_()
    t_both = bench(g_both.replay)
    t_flush = bench(g_flush.replay)
    return max(t_both - t_flush, 1e-9) / iters


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.int8, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * (2 << 30) / t


class Pool:
    """One big cache; each case takes shuffled pages from it."""

    def __init__(self, max_tokens):
        self.nb = max_tokens // BS + 8
        self.cache = torch.empty(self.nb, BS, D, dtype=DT, device="cuda")
        # fill in slices to keep the temporary small
        step = 4096
        for i in range(0, self.nb, step):
            self.cache[i : i + step].normal_()
        self.cache[0].zero_()

    def tables(self, B, S):
        mb = cdiv(S, BS)
        assert B * mb < self.nb
        perm = torch.randperm(self.nb - 1, device="cuda")[: B * mb] + 1
        bt = perm.view(B, mb).to(torch.int32)
        sl = torch.full((B,), S, dtype=torch.int32, device="cuda")
        return bt, sl

    def tables_varlen(self, lens):
        """Mixed lengths; block_table width = the longest (unused entries = page 0)."""
        mb = cdiv(max(lens), BS)
        B = len(lens)
        perm = torch.randperm(self.nb - 1, device="cuda")[: B * mb] + 1
        bt = perm.view(B, mb).to(torch.int32)
        for i, s in enumerate(lens):
            bt[i, cdiv(s, BS) :] = 0
        return bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def dense_decode(q_lat, q_pe, cache, bt, sl, scale):
    """Gather the pages into a contiguous [B, S, 576] tensor, then two bmm (equal lengths only)."""
    B = q_lat.shape[0]
    S = int(sl[0])
    kv = cache[bt.long()].view(B, -1, D)[:, :S]
    s = torch.bmm(q_lat, kv[:, :, :L].transpose(1, 2)) + torch.bmm(q_pe, kv[:, :, L:].transpose(1, 2))
    p = torch.softmax(s.float() * scale, dim=-1).to(q_lat.dtype)
    return torch.bmm(p, kv[:, :, :L])


class FlashInferMLA:
    def __init__(self):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.ws = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        try:
            self.w = BatchMLAPagedAttentionWrapper(self.ws, backend="fa3")
        except TypeError:
            self.w = BatchMLAPagedAttentionWrapper(self.ws)

    def plan(self, bt, sl, qo_lens, causal):
        B = bt.shape[0]
        dev = bt.device
        qo_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        qo_indptr[1:] = torch.cumsum(qo_lens, 0)
        npages = (sl + BS - 1) // BS
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(npages, 0)
        kv_indices = torch.cat([bt[b, : int(npages[b])] for b in range(B)]).to(torch.int32)
        kw = dict(
            num_heads=H, head_dim_ckv=L, head_dim_kpe=R, page_size=BS, causal=causal, sm_scale=SCALE,
            q_data_type=DT, kv_data_type=DT,
        )
        try:
            from flashinfer.mla import MLAPlanMetadata

            self.w.plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, sl), **kw)
        except (ImportError, TypeError):
            self.w.plan(qo_indptr, kv_indptr, kv_indices, sl, H, L, R, BS, causal, SCALE, DT, DT)
        self.packed = None

    def run(self, q_lat, q_pe, cache):
        if self.packed is None:
            try:
                q = torch.cat([q_lat, q_pe], -1)
                o = self.w.run(query=q, kv_cache=cache)
                self.packed = True
                self.q = q
                return o
            except TypeError:
                self.packed = False
        if self.packed:
            return self.w.run(query=self.q, kv_cache=cache)
        return self.w.run(q_lat, q_pe, cache[:, :, :L], cache[:, :, L:])


def kernel_splits(B, bt, sms):
    """The split count mla_decode_triton picks by default (num_splits=None) for this batch on this device: the default
    16-bit config's programs_per_sm (the default table must time what the model runs)."""
    pps = dec._gpu_cfg(dec.DECODE_CFG, DT, max_shared_mem("cuda"), dec.DECODE_LARGE_SMEM).get("programs_per_sm", 1)
    return default_num_splits(B, bt.shape[1], BS, H, sms, pps)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check_small(variants=None, decode_only=False):
    """Quick correctness check on the device before timing (mixed lengths, splits on and off)."""
    lens = [1, 63, 64, 65, 4097, 0]
    nb = sum(cdiv(s, BS) for s in lens) + 4
    cache = torch.randn(nb, BS, D, device="cuda").to(DT)
    perm = (torch.randperm(nb - 1) + 1).tolist()
    bt = torch.zeros(len(lens), 80, dtype=torch.int32)
    k = 0
    for i, s in enumerate(lens):
        n = cdiv(s, BS)
        bt[i, :n] = torch.tensor(perm[k : k + n])
        k += n
    # poison what no sequence owns (page 0, each last page's tail): kernels must mask, not multiply by 0
    cache[0] = float("nan")
    for i, s in enumerate(lens):
        if s % BS:
            cache[int(bt[i, s // BS]), s % BS :] = float("nan")
    bt, sl = bt.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), H, L, device="cuda").to(DT)
    qp = torch.randn(len(lens), H, R, device="cuda").to(DT)
    ref = mla_decode_ref(q.float(), qp.float(), cache.float(), bt, sl, SCALE)
    # ROWIMM reads the rows past seq_len of a last tile and needs them finite (see DECODE_VARIANTS
    # 'ls n64 w4 lz8 ri2'): large finite values there instead of NaN (page 0 stays NaN: no tile reads it)
    fin = cache.clone()
    tails = fin.isnan()
    tails[0] = False
    fin[tails] = (torch.randn(int(tails.sum()), device="cuda").sign() * 3e4).to(DT)
    wrong = []  # variants that fail the check: reported, left out of the timing (one bad variant no longer aborts)
    for name, cfg in [("default", None)] + [(n, dec.DECODE_VARIANTS[n]) for n in (variants or ())]:
        c = fin if cfg is not None and cfg.get("rowimm") else cache
        for ns in (1, 8, None):  # direct, 8 units, default split (a variant's wrong path shows which)
            try:
                e = rel_err(mla_decode_triton(q, qp, c, bt, sl, SCALE, num_splits=ns, config=cfg), ref)
            except Exception as ex:  # noqa: BLE001
                print(f"check decode {name}: {type(ex).__name__}: {str(ex)[:200]}")
                wrong.append(name)
                break
            bad = not e < 1e-2  # NaN counts as bad
            print(f"check decode {name} num_splits={ns}: rel err {e:.2e}" + ("  WRONG" if bad else ""), flush=True)
            assert not bad or cfg is not None, "default decode config is wrong"
            if bad and name not in wrong:
                wrong.append(name)
    if wrong:
        print(f"check decode: WRONG variants (not timed): {wrong}")
    if decode_only:
        return wrong
    cu = torch.tensor([0, 1, 30, 64, 65, 265, 265], dtype=torch.int32, device="cuda")
    T = 265
    qe = torch.randn(T, H, L, device="cuda").to(DT)
    qpe = torch.randn(T, H, R, device="cuda").to(DT)
    ref = mla_extend_ref(qe.float(), qpe.float(), cache.float(), bt, cu, sl, SCALE)
    e = rel_err(mla_extend_triton(qe, qpe, cache, bt, cu, sl, SCALE, max_query_len=200), ref)
    print(f"check extend: rel err {e:.2e}")
    assert e < 1e-2
    # expanded prefill: varlen with prefix offsets (query lens from cu, key lens from sl)
    kl = [1, 63, 64, 65, 4097, 0]
    ql = [1, 29, 34, 1, 200, 0]
    cu_q = torch.tensor([0] + ql, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + kl, device="cuda").cumsum(0).to(torch.int32)
    Tq, Sk = sum(ql), sum(kl)
    qx = torch.randn(Tq, H, 192, device="cuda").to(DT)
    kv = torch.randn(Sk, H, 256, device="cuda").to(DT)
    kpe = torch.randn(Sk, R, device="cuda").to(DT)
    out = torch.full((Tq, H, 128), float("nan"), dtype=DT, device="cuda")
    mla_prefill_expanded_triton(qx, kv[..., :128], kpe, kv[..., 128:], cu_q, cu_k, SCALE, max_query_len=200, out=out)
    ref = mla_prefill_expanded_ref(qx.float(), kv[..., :128].float(), kpe.float(), kv[..., 128:].float(), cu_q, cu_k,
                                   SCALE)
    e = rel_err(out, ref)
    print(f"check expanded prefill: rel err {e:.2e}")
    assert e < 1e-2 and torch.isfinite(out.float()).all()


# The sweep times a CUDA-graph replay at every batch (it stopped at B = 8 before 12-03): the engine replays decode in
# graphs, and an eager call's host side can exceed the kernel time (12-03, default table: B=8 S=8k eager 186 µs,
# graph 44; B=32 S=8k and the 4x8k+28x512 mix were eager-only rows and read 184 / 204 µs)
FI_H200_GRAPH_MAX_B = 8  # FI_H200_US holds graph times up to this batch, eager times above
SWEEP_SHAPES = ((1, 1024), (1, 8192), (1, 131072), (64, 8192), (128, 8192))
# FlashInfer fa3 on the H200 (12-02, same harness): µs, CUDA graph at B=1, eager otherwise; the sweep's ratios use
# these with --no-flashinfer
FI_H200_US = {(1, 8192): 23.8, (1, 131072): 80.6, (64, 8192): 160.0, (128, 8192): 297.0}


def sweep_decode(pool, fi, nsm, variants=None, shapes=SWEEP_SHAPES, split_sweep=False):
    """Each decode variant (decode.DECODE_VARIANTS) at each shape next to FlashInfer fa3: eager µs / TB/s (cache bytes
    only, L2 flushed, median), CUDA-graph µs, output vs FlashInfer
    (without it: vs a dense bf16 torch decode of the same pages). Each variant runs its own default schedule
    (num_splits=None: the split heuristic with the variant's programs_per_sm). split_sweep: then split counts at every
    shape (split_sweep_shape). Rows print as they finish."""
    variants = variants or dec.DECODE_VARIANTS
    res = {}  # (variant, B, S) -> seconds
    print("\n== decode variant sweep (eager, L2 flushed; µs / TB/s; graph µs) ==", flush=True)
    for B, S in shapes:
        bt, sl = pool.tables(B, S)
        q = torch.randn(B, H, L, device="cuda").to(DT)
        qp = torch.randn(B, H, R, device="cuda").to(DT)
        nbytes = B * S * ROW_BYTES
        ref = None
        if fi is None:
            ref = dense_decode(q, qp, pool.cache, bt, sl, SCALE).float()
        if fi is not None:
            try:
                fi.plan(bt, sl, torch.ones(B, dtype=torch.int32, device="cuda"), causal=False)
                fi.packed = None
                ref = fi.run(q, qp, pool.cache).view(B, H, L).clone()
                t = bench(lambda: fi.run(q, qp, pool.cache))
                res[("flashinfer", B, S)] = t
                line = f"B={B:<4} S={S:<7} {'flashinfer fa3':<16} {t * 1e6:9.1f} us {nbytes / t / 1e12:5.2f} TB/s"
                try:
                    tg = bench_graph(lambda: fi.run(q, qp, pool.cache))
                    res[("flashinfer graph", B, S)] = tg
                    line += f"  graph {tg * 1e6:7.1f} us {nbytes / tg / 1e12:5.2f} TB/s"
                except Exception as e:  # noqa: BLE001
                    line += f"  graph failed: {type(e).__name__}"
                print(line, flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  flashinfer failed at B={B} S={S}: {type(e).__name__}: {e}")
        out = torch.empty(B, H, L, dtype=DT, device="cuda")
        for name, cfg in variants.items():
            ns = default_num_splits(B, bt.shape[1], BS, H, nsm, cfg.get("programs_per_sm", 1))

            def run_v():
                mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, out=out, config=cfg)

            try:
                run_v()
                if ref is None:
                    ref = out.clone()
                err = rel_err(out, ref)
                t = bench(run_v)
            except Exception as e:  # noqa: BLE001
                print(f"B={B:<4} S={S:<7} {name:<16} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            res[(name, B, S)] = t
            line = f"B={B:<4} S={S:<7} {name:<16} {t * 1e6:9.1f} us {nbytes / t / 1e12:5.2f} TB/s  err {err:.1e}"
            if ("flashinfer", B, S) in res:
                line += f"  vs FI {res[('flashinfer', B, S)] / t:5.2f}x"
            tg = bench_graph(run_v)
            res[(name + " graph", B, S)] = tg
            line += f"  graph {tg * 1e6:7.1f} us {nbytes / tg / 1e12:5.2f} TB/s"
            if err > 2e-2:
                line += "  WARNING rel err"
            print(line + f"  splits {ns}", flush=True)

    rec = fi is None
    print("\nmarkdown (µs eager / TB/s; [graph µs]; (x) = FlashInfer time / variant time, graph vs graph"
          + ("; FlashInfer = its H200 run of 12-02 (FI_H200_US), not this run):" if rec else "):"))
    names = list(variants)
    print("| B | S | FlashInfer | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for B, S in shapes:
        nbytes = B * S * ROW_BYTES
        fi_t = res.get(("flashinfer", B, S))
        fi_g = res.get(("flashinfer graph", B, S))
        if rec and (B, S) in FI_H200_US:
            fi_t = fi_g = None
            if B <= FI_H200_GRAPH_MAX_B:
                fi_g = FI_H200_US[(B, S)] * 1e-6
            else:
                fi_t = FI_H200_US[(B, S)] * 1e-6
        cells = []
        for n in names:
            t = res.get((n, B, S))
            if t is None:
                cells.append("-")
                continue
            c = f"{t * 1e6:.1f} / {nbytes / t / 1e12:.2f}"
            tg = res.get((n + " graph", B, S))
            if tg:
                c += f" [{tg * 1e6:.1f}]"
            if fi_g and tg:
                c += f" ({fi_g / tg:.2f}x)"
            elif fi_t:
                c += f" ({fi_t / t:.2f}x)"
            cells.append(c)
        fi_c = " ".join(([f"{fi_t * 1e6:.1f}"] if fi_t else []) + ([f"[{fi_g * 1e6:.1f}]"] if fi_g else [])) or "-"
        print(f"| {B} | {S} | {fi_c} | " + " | ".join(cells) + " |")

    if not split_sweep:
        return
    for B, S in shapes:
        split_sweep_shape(pool, nsm, variants, names, B, S)


def split_candidates(B: int, default: int, nsm: int = 132) -> list:
    """Split counts per sequence to time at batch B: around the default (its neighbours, half and double), and at B=1
    fractions and multiples of the SM count; 1 (the direct path, no merge) always; distinct, <= MAX_SPLITS."""
    if B == 1:
        c = {nsm // 2, nsm, 3 * nsm // 2, 2 * nsm, 3 * nsm, default}
    else:
        c = {default - 1, default, default + 1, default // 2, 2 * default}
    return sorted(x for x in c | {1} if 1 <= x <= dec.MAX_SPLITS)


def split_sweep_shape(pool, nsm, variants, names, B, S):
    """Graph µs / TB/s of the decode at B x S per split count (split_candidates; "*" marks the default): the merge's
    fixed cost against the balance of the units (issue 5 at B >= 64, S = 8k)."""
    bt, sl = pool.tables(B, S)
    q = torch.randn(B, H, L, device="cuda").to(DT)
    qp = torch.randn(B, H, R, device="cuda").to(DT)
    out = torch.empty(B, H, L, dtype=DT, device="cuda")
    print(f"\n== B={B} S={S}: split count x variant (graph µs / TB/s) ==", flush=True)
    for name in [n for n in ("base", "ls n64 w4", "ls n64 w4 lz8", "ls n64 w4 p16") if n in variants] or names[:1]:
        cfg = variants[name]
        default = default_num_splits(B, bt.shape[1], BS, H, nsm, cfg.get("programs_per_sm", 1))
        line = f"{name:<16}"
        for ns in split_candidates(B, default, nsm):
            try:
                tg = bench_graph(lambda: mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, num_splits=ns, out=out,
                                                           min_split_tokens=64, config=cfg))
                line += f"  {ns}{'*' if ns == default else ''}: {tg * 1e6:.1f} us {B * S * ROW_BYTES / tg / 1e12:.2f}"
            except Exception as e:  # noqa: BLE001
                line += f"  {ns}: {type(e).__name__}"
        print(line, flush=True)


def b1_chain(pool, sms, uv_sweep=True):
    """Issue 6: the decode chain of one MLA layer, unfused (rmsnorm_head, store_latent, einsum, mla_decode, einsum)
    vs fused (mla_decode_prep, mla_decode with w_uv), CUDA graphs with an L2 flush before each call (flush time
    subtracted), PDL per KIMI_PDL (auto: on on sm_90). Also each half alone, the chain between in_proj / o_proj
    gemvs (their PDL overlap with the fused kernels' weight loads), and the uv block picks (uv_config) at B=1."""
    from kernels._pdl import ENABLED as PDL_ON
    from kernels.gemv import gemv_triton
    from kernels.mla.absorb import mla_decode_prep_triton
    from kernels.mla.cache import store_latent_triton
    from kernels.norm import rmsnorm_head_triton

    nope, V, hidden, eps = 128, 128, 2304, 1e-6
    q_dim = H * (nope + R)
    w_norm = (1 + 0.1 * torch.randn(L, device="cuda")).to(DT)
    kv_b = (torch.randn(H, nope + V, L, device="cuda") / L ** 0.5).to(DT)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    w_in = (torch.randn(q_dim + D, hidden, device="cuda") / hidden ** 0.5).to(DT)
    w_o = (torch.randn(hidden, H * V, device="cuda") / (H * V) ** 0.5).to(DT)
    print(f"\n== b1 chain: one MLA layer's decode path, graph us (L2 flushed), KIMI_PDL {'on' if PDL_ON else 'off'} ==")
    print(f"{'B':>3} {'S':>6} {'splits':>6} {'chain':>8} {'fused':>8} {'saved':>7} | {'prep':>6} {'nrm+st+ein':>10} | "
          f"{'dec+uv':>7} {'dec+ein':>8} | {'gemv+chain':>10} {'gemv+fused':>10} {'rel err':>8}")
    rows = []
    for B in (1, 8):
        for S in (1024, 8192):
            bt, sl = pool.tables(B, S)
            slots = (bt[:, (S - 1) // BS].long() * BS + (S - 1) % BS).contiguous()  # the new token: row S - 1
            x = torch.randn(B, hidden, device="cuda").to(DT)
            ns = kernel_splits(B, bt, sms)  # what mla_decode_triton picks

            def heads(y):  # q_nope, q_pe: views of the in_proj output, as in KimiMLA.forward
                q = y[:, :q_dim].view(B, H, nope + R)
                return q[..., :nope], q[..., nope:]

            def u_prep(y):  # rmsnorm_head + store_latent + einsum -> q_lat
                store_latent_triton(rmsnorm_head_triton(y[:, q_dim:], w_norm, eps), pool.cache, slots)
                return torch.einsum("thn,hnl->thl", heads(y)[0], w_uk)

            def f_prep(y):
                return mla_decode_prep_triton(y, q_dim, w_norm, eps, w_uk, pool.cache, slots)

            def chain(y):
                out_lat = mla_decode_triton(u_prep(y), heads(y)[1], pool.cache, bt, sl, SCALE)
                return torch.einsum("thl,hvl->thv", out_lat, w_uv)

            def fused(y):
                return mla_decode_triton(f_prep(y), heads(y)[1], pool.cache, bt, sl, SCALE, w_uv=w_uv)

            def layer(path):  # in_proj gemv -> decode path -> o_proj gemv (PDL chains through all of it)
                return lambda: gemv_triton(path(gemv_triton(x, w_in)).flatten(1), w_o)

            y = gemv_triton(x, w_in)
            q_lat, q_pe = f_prep(y), heads(y)[1]
            err = rel_err(fused(y), chain(y))
            t = {k: bench_graph(f) for k, f in (
                ("chain", lambda: chain(y)), ("fused", lambda: fused(y)), ("prep", lambda: f_prep(y)),
                ("u_prep", lambda: u_prep(y)),
                ("dec", lambda: mla_decode_triton(q_lat, q_pe, pool.cache, bt, sl, SCALE, w_uv=w_uv)),
                ("u_dec", lambda: torch.einsum("thl,hvl->thv", mla_decode_triton(q_lat, q_pe, pool.cache, bt, sl,
                                                                                 SCALE), w_uv)),
                ("l_chain", layer(chain)), ("l_fused", layer(fused)))}
            us = {k: v * 1e6 for k, v in t.items()}
            rows.append((B, S, ns, us, err))
            print(f"{B:>3} {S:>6} {ns:>6} {us['chain']:8.1f} {us['fused']:8.1f} {us['chain'] - us['fused']:7.1f} | "
                  f"{us['prep']:6.1f} {us['u_prep']:10.1f} | {us['dec']:7.1f} {us['u_dec']:8.1f} | "
                  f"{us['l_chain']:10.1f} {us['l_fused']:10.1f} {err:8.1e}", flush=True)
            if uv_sweep:
                line = f"    uv picks B={B} S={S}:"
                for name, uc in [(f"block_v {bv}", dict(block_v=bv)) for bv in (16, 32, 64, 128)] + [
                        ("stage2 + uv rows", dict(stage2=True))]:
                    tt = bench_graph(lambda: mla_decode_triton(q_lat, q_pe, pool.cache, bt, sl, SCALE, w_uv=w_uv,
                                                               uv_cfg=uc))
                    line += f" {name}: {tt * 1e6:.1f} us"
                print(line, flush=True)
    print("\n| B | S | splits | chain us | fused us | prep us | norm+store+einsum us | decode+uv us | decode+einsum us "
          "| gemv+chain+gemv us | gemv+fused+gemv us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B, S, ns, us, _ in rows:
        print(f"| {B} | {S} | {ns} | {us['chain']:.1f} | {us['fused']:.1f} | {us['prep']:.1f} | {us['u_prep']:.1f} | "
              f"{us['dec']:.1f} | {us['u_dec']:.1f} | {us['l_chain']:.1f} | {us['l_fused']:.1f} |")


def ptx_build(fn, ptrs, consts, num_warps, num_stages, label, arch=90, maxnreg=None, loop=False):
    """Compile one kernel for sm_<arch> without a GPU (kernels/_offline.py: Triton's bundled ptxas); print smem /
    regs / spills, the MMA kind, cp.async count, smem ring stages and the PTX fingerprint (the same across a refactor
    that must not change code); loop: also sass_loop_stats of the main loop
    (ldmatrix x4 loads per tile were what separated the decode variants). cuobjdump failures print "?"."""
    from kernels._offline import CuobjdumpError, compile_offline

    floats = {"qk_scale", "eps"}
    cexpr = {p.name for p in fn.params if p.is_constexpr}   # not given in consts: their defaults (compile_offline)
    sig = {n: ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names if n not in consts and n not in cexpr}
    div = [n for n in sig if n not in floats and n not in ("N", "H", "G") and not sig[n].startswith("tensordesc")]
    b = compile_offline(fn, sig, consts, num_warps=num_warps, num_stages=num_stages, arch=arch, maxnreg=maxnreg,
                        divisible=div)
    ptx = b.ptx
    # smem ring buffers of the pipelined loads (TTGIR allocs with a leading stage dim, e.g. 2x64x512): 1 = no overlap
    bufs = "x".join(map(str, b.ring_stages)) or "-"
    try:
        res = b.res_usage.split(" SHARED")[0]
    except CuobjdumpError:
        res = "?"
    print(f"{label:<60} smem {b.smem / 1024:6.1f} KB  {res:<22} {b.mma:<8} cp.async {ptx.count('cp.async.cg')} "
          f"tile buffers {bufs}  ptx {b.fingerprint}", flush=True)
    if loop:
        try:
            st = b.loop
        except CuobjdumpError:
            print("    loop ?", flush=True)
            return
        if st["loop"] is None:
            print("    loop -", flush=True)
            return
        print(f"    loop {st['instrs']:>5} instrs  HMMA {st['HMMA']:>4} HGMMA {st['HGMMA']:>3}  ldmatrix x4 "
              f"{st['LDSM.M88.4'] + st['LDSM.MT88.4']:>4} (.trans {st['LDSM.MT88.4']:>3}) x2 "
              f"{st['LDSM.M88.2'] + st['LDSM.MT88.2']:>3} x1 {st['LDSM.M88.1'] + st['LDSM.MT88.1']:>3}  "
              f"LDS {st['LDS']:>3} STS {st['STS']:>3} STSM {st['STSM']:>2}  LDGSTS {st['LDGSTS']:>3} "
              f"LDG {st['LDG']:>3}  bar.sync {st['BAR.SYNC']:>3}  SHFL {st['SHFL']:>3}  spills STL {st['STL']:>2} "
              f"LDL {st['LDL']:>2}", flush=True)


def ptxas_report(arch=90, only=None):
    """Resource usage for sm_<arch> of the configurations in DECODE_CFG / EXTEND_CFG / PREFILL_CFG and a few
    alternatives. Strides and pointers get the 16-byte divisibility the JIT infers for the Kimi shapes.
    only: 'decode' / 'extend' / 'prefill' to compile one family."""

    def build(fn, ptrs, consts, num_warps, num_stages, label, maxnreg=None):
        if only is None or label.startswith(only):
            ptx_build(fn, ptrs, consts, num_warps, num_stages, label, arch, maxnreg,
                      loop=fn is dec._mla_decode_stage1)

    for dtn, dts in (("16bit", "*bf16"), ("fp32", "*fp32")):
        ieee = dtn == "fp32"
        dcfgs = [dec.DECODE_CFG[dtn]]
        ecfgs = [ext.EXTEND_CFG[dtn]]
        if not ieee:
            dcfgs += [dict(block_h=16, block_n=64, num_warps=4, num_stages=2)] + [
                dict(v, label=k) for k, v in dec.DECODE_VARIANTS.items()]
            ecfgs += [dict(rows=64, block_n=32, num_warps=8, num_stages=2), dict(rows=64, block_n=32, num_warps=8, num_stages=1),
                      dict(rows=64, block_n=16, num_warps=8, num_stages=2), dict(rows=64, block_n=16, num_warps=8, num_stages=3)]
        pcfgs = [pre.PREFILL_CFG[dtn]]
        if not ieee:
            pcfgs += list(EXPANDED_ALT.values())
        for c in pcfgs:
            build(
                pre._mla_prefill_kernel,
                dict(q_ptr=dts, qpe_ptr=dts, kn_ptr=dts, kpe_ptr=dts, v_ptr=dts, cuq_ptr="*i32", cuk_ptr="*i32",
                     out_ptr=dts),
                dict(DN=128, R=R, DV=128, BLOCK_DN=128, BLOCK_R=R, BLOCK_DV=128, BLOCK_M=c["block_m"],
                     BLOCK_N=c["block_n"], IEEE=ieee, UPCAST=False),
                c["num_warps"], c["num_stages"], f"prefill {dtn} {c}",
            )
        for c in dcfgs:
            build(
                dec._mla_decode_stage1,
                dict(q_ptr=dts, qpe_ptr=dts, cache_ptr=dts, bt_ptr="*i32", seqlen_ptr="*i32", out_ptr=dts,
                     opart_ptr="*bf16" if c.get("part16") else "*fp32", lse_ptr="*fp32"),
                dict(L=L, R=R, BLOCK_L=L, BLOCK_R=R, BS=BS, BLOCK_N=c["block_n"], BLOCK_H=c["block_h"], BLOCK_B=128,
                     MIN_TILES=4, DIRECT=False, IEEE=ieee, UPCAST=False, PAGE_TILE=c.get("page_tile", False),
                     LSPLIT=c.get("lsplit", False), LAZY=c.get("lazy", 0) if c.get("lsplit") else 0,
                     **(dict(ROWIMM=True, S_CR=L + R) if c.get("rowimm") else {})),
                c["num_warps"], c["num_stages"],
                f"decode {dtn} " + (repr(c.get("label")) if "label" in c else str(c)), c.get("maxnreg"),
            )
        if not ieee:
            for n_, ns_ in ((1, 132), (64, 2)):
                mc = dec.merge_config(n_, H, L, ns_, 132)
                build(
                    dec._mla_decode_stage2,
                    dict(seqlen_ptr="*i32", opart_ptr="*fp32", lse_ptr="*fp32", out_ptr=dts),
                    dict(L=L, BLOCK_N=64, BLOCK_B=128, MIN_TILES=1, **mc),
                    4, 2, f"decode stage 2 (merge) B={n_} splits={ns_} {mc}",
                )
        for c in ecfgs:
            bh = min(H, c["rows"])
            build(
                ext._mla_extend_kernel,
                dict(q_ptr=dts, qpe_ptr=dts, cache_ptr=dts, bt_ptr="*i32", cu_ptr="*i32", seqlen_ptr="*i32",
                     out_ptr=dts),
                dict(L=L, R=R, BLOCK_L=L, BLOCK_R=R, BS=BS, BLOCK_N=c["block_n"], BLOCK_T=c["rows"] // bh,
                     BLOCK_H=bh, IEEE=ieee, UPCAST=False),
                c["num_warps"], c["num_stages"], f"extend {dtn} {c}",
            )
        if not ieee:  # the fused decode chain (kernels/mla/absorb.py), PDL builds (GDC: griddepcontrol + prefetch)
            from kernels.mla import absorb

            build(absorb._prep_kernel, dict(q_ptr=dts, lat_ptr=dts, nw_ptr=dts, wuk_ptr=dts, cache_ptr=dts,
                                            slot_ptr="*i64", qlat_ptr=dts),
                  dict(NOPE=128, BLOCK_NOPE=128, BLOCK_L=absorb.PREP_BLOCK_L, BLOCK_T=absorb.PREP_BLOCK_T, BC=1024,
                       BS=BS, EARLY_W=True, IEEE=False, UPCAST=False, GDC=True),
                  4, 2, "absorb prep (GDC)")
            for merge, ns_ in ((True, 16), (True, 128), (False, 1)):
                c = absorb.uv_config(1, H, 128, ns_, 132)
                build(absorb._uv_kernel, dict(seqlen_ptr="*i32", opart_ptr="*fp32", lse_ptr="*fp32", lat_ptr=dts,
                                              wuv_ptr=dts, out_ptr=dts),
                      dict(L=L, BLOCK_L=L, BLOCK_V=c["BLOCK_V"], VC=c["VC"], BLOCK_S=c["BLOCK_S"], BLOCK_N=64,
                           BLOCK_B=128, MIN_TILES=1, MERGE=merge, GDC=True),
                      8, 2, f"absorb uv (GDC) merge={merge} splits={ns_} {c}")
            c = dec.DECODE_CFG["16bit"]
            build(dec._mla_decode_stage1,
                  dict(q_ptr=dts, qpe_ptr=dts, cache_ptr=dts, bt_ptr="*i32", seqlen_ptr="*i32", out_ptr=dts,
                       opart_ptr="*fp32", lse_ptr="*fp32"),
                  dict(L=L, R=R, BLOCK_L=L, BLOCK_R=R, BS=BS, BLOCK_N=c["block_n"], BLOCK_H=c["block_h"], BLOCK_B=128,
                       MIN_TILES=1, DIRECT=False, IEEE=False, UPCAST=False, PAGE_TILE=True, LSPLIT=True,
                       LAZY=c.get("lazy", 0), GDC=True),
                  c["num_warps"], c["num_stages"], "absorb: decode stage 1 default (GDC)", c.get("maxnreg"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptxas", action="store_true", help="offline sm_90 compile report (no GPU)")
    ap.add_argument("--only", choices=["decode", "extend", "prefill", "absorb"],
                    help="with --ptxas: one kernel family")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--decode-only", action="store_true",
                    help="decode only: skip prefill / extend and the old sweeps (the mixed-length cases stay)")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="time decode.DECODE_VARIANTS at B {1,64,128} x S {8k,128k} next to FlashInfer")
    ap.add_argument("--shapes", help="with --sweep-decode: comma-separated BxS, e.g. 1x1024,64x8192 (default: "
                    + ",".join(f"{b}x{s}" for b, s in SWEEP_SHAPES) + ")")
    ap.add_argument("--check-only", action="store_true", help="only the device check of the decode default and "
                    "--variants (tiny GPU repro: wrong variants print WRONG)")
    ap.add_argument("--split-sweep", action="store_true", help="with --sweep-decode: split counts at every shape too")
    ap.add_argument("--b1-chain", action="store_true", help="only the unfused vs fused decode chain of one MLA layer "
                    "(mla_decode_prep + mla_decode(w_uv=)) at B 1/8, S 1k/8k, CUDA graphs")
    ap.add_argument("--variants", help="with --sweep-decode: comma-separated DECODE_VARIANTS names (default: all)")
    args = ap.parse_args()
    if args.ptxas:
        ptxas_report(only=args.only)
        return
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    if args.b1_chain:
        b1_chain(Pool(8 * 8192 + 1024), dev.multi_processor_count)
        return
    # '+' stands for a space in variant names ("w4+n32"): bench/h200.sh passes ARGS_mla word-split, unquoted
    names = ([n.strip().replace("+", " ") for n in args.variants.split(",")] if args.variants
             else list(dec.DECODE_VARIANTS))
    unknown = [n for n in names if n not in dec.DECODE_VARIANTS]
    assert not unknown, f"unknown variants {unknown}; known: {list(dec.DECODE_VARIANTS)}"
    wrong = check_small(variants=names if args.sweep_decode or args.check_only else None,
                        decode_only=args.decode_only or args.check_only) or []
    names = [n for n in names if n not in wrong]
    if args.check_only:
        return
    copy_bw = copy_bandwidth()
    print(f"device copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s")

    fi = None
    if not args.no_flashinfer:
        try:
            fi = FlashInferMLA()
            import flashinfer

            print(f"flashinfer {flashinfer.__version__}")
        except Exception as e:  # noqa: BLE001
            print(f"flashinfer unavailable: {type(e).__name__}: {e}")

    Bs = [1, 8, 64, 128]
    Ss = [1024, 8192, 65536, 131072]
    if args.quick:
        Bs, Ss = [1, 64], [8192, 131072]
    shapes = (tuple(tuple(int(x) for x in bs.split("x")) for bs in args.shapes.split(",")) if args.shapes
              else SWEEP_SHAPES)
    max_tokens = max(b * s for b in Bs for s in Ss)
    if args.sweep_decode and args.decode_only:  # only the sweep runs: a pool just large enough (fast to fill)
        max_tokens = max(b * s for b, s in shapes)
    pool = Pool(max_tokens + 1024)
    if args.sweep_decode:
        t0 = time.time()
        sweep_decode(pool, fi, dev.multi_processor_count, {n: dec.DECODE_VARIANTS[n] for n in names}, shapes,
                     args.split_sweep)
        print(f"sweep: {time.time() - t0:.1f} s", flush=True)
        if args.decode_only:
            return

    rows = []
    hdr = (
        f"{'B':>4} {'S':>7} {'splits':>6} {'triton us':>10} {'TB/s':>6} {'graph us':>9} {'TB/s':>6} {'host us':>8} "
        f"{'dense us':>9} {'TB/s':>6} {'FI us':>8} {'TB/s':>6} {'vs FI':>6}"
    )
    print("\n== decode ==\n" + hdr)
    for B in Bs:
        for S in Ss:
            bt, sl = pool.tables(B, S)
            q = torch.randn(B, H, L, device="cuda").to(DT)
            qp = torch.randn(B, H, R, device="cuda").to(DT)
            nbytes = B * S * ROW_BYTES
            ns = kernel_splits(B, bt, dev.multi_processor_count)
            out = torch.empty(B, H, L, dtype=DT, device="cuda")

            def run_t():
                mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, num_splits=ns, out=out)

            t_tr = bench(run_t)
            t_g = bench_graph(run_t)
            t_host = host_time(run_t)
            t_dense = t_fi = None
            if not args.no_dense and B * S <= (8 << 20):
                try:
                    o_d = dense_decode(q, qp, pool.cache, bt, sl, SCALE)
                    err = rel_err(out, o_d)
                    if err > 2e-2:
                        print(f"  WARNING dense vs triton rel err {err:.2e}")
                    t_dense = bench(lambda: dense_decode(q, qp, pool.cache, bt, sl, SCALE))
                    del o_d
                except torch.OutOfMemoryError:
                    pass
            if fi is not None:
                try:
                    fi.plan(bt, sl, torch.ones(B, dtype=torch.int32, device="cuda"), causal=False)
                    o_fi = fi.run(q, qp, pool.cache)
                    err = rel_err(out, o_fi.view(B, H, L))
                    if err > 2e-2:
                        print(f"  WARNING flashinfer vs triton rel err {err:.2e}")
                    t_fi = bench(lambda: fi.run(q, qp, pool.cache))
                    try:  # like ours, its best of eager and graph: at small B the eager time is launch overhead
                        t_fi = min(t_fi, bench_graph(lambda: fi.run(q, qp, pool.cache)))
                    except Exception as e:  # noqa: BLE001
                        print(f"  flashinfer graph failed at B={B} S={S}: {type(e).__name__}")
                except Exception as e:  # noqa: BLE001
                    print(f"  flashinfer failed at B={B} S={S}: {type(e).__name__}: {e}")
            best = min(t_tr, t_g)
            r = dict(B=B, S=S, ns=ns, tr=t_tr, g=t_g, host=t_host, dense=t_dense, fi=t_fi, bytes=nbytes)
            rows.append(r)

            def f(t):
                return (f"{t * 1e6:9.1f}", f"{nbytes / t / 1e12:6.2f}") if t else (f"{'-':>9}", f"{'-':>6}")

            vs = f"{t_fi / best:6.2f}" if t_fi else f"{'-':>6}"
            print(
                f"{B:>4} {S:>7} {ns:>6} {t_tr * 1e6:10.1f} {nbytes / t_tr / 1e12:6.2f} {' '.join(f(t_g))} "
                f"{t_host * 1e6:8.1f} "
                f"{' '.join(f(t_dense))} {f(t_fi)[0][1:]} {f(t_fi)[1]} {vs}",
                flush=True,
            )

    print("\nmarkdown (decode; TB/s = cache bytes / time; copy = %.2f TB/s; FlashInfer and Triton/FI: each side's "
          "best of eager and CUDA graph; host µs = one eager call's launch side):" % (copy_bw / 1e12))
    print("| B | S | splits | Triton µs | Triton TB/s | graph µs | graph TB/s | host µs | dense TB/s | FlashInfer TB/s "
          "| Triton/FI |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bw = lambda t: f"{r['bytes'] / t / 1e12:.2f}" if t else "-"  # noqa: E731
        best = min(r["tr"], r["g"])
        vs = f"{r['fi'] / best:.2f}x" if r["fi"] else "-"
        print(
            f"| {r['B']} | {r['S']} | {r['ns']} | {r['tr'] * 1e6:.1f} | {bw(r['tr'])} | {r['g'] * 1e6:.1f} | "
            f"{bw(r['g'])} | {r['host'] * 1e6:.1f} | {bw(r['dense'])} | {bw(r['fi'])} | {vs} |"
        )

    # ------------------------------------------------------------------ mixed lengths (decode too: --decode-only)
    print("\n== decode, mixed lengths (balanced schedule vs one program per sequence) ==")
    mixes = {
        "1x128k + 63x2k": [131072] + [2048] * 63,
        "8x32k + 120x1k": [32768] * 8 + [1024] * 120,
        "4x8k + 28x512": [8192] * 4 + [512] * 28,
    }
    for name, lens in mixes.items():
        if sum(lens) + 1024 > pool.nb * BS:
            continue
        bt, sl = pool.tables_varlen(lens)
        B = len(lens)
        q = torch.randn(B, H, L, device="cuda").to(DT)
        qp = torch.randn(B, H, R, device="cuda").to(DT)
        nbytes = sum(lens) * ROW_BYTES
        ns = kernel_splits(B, bt, dev.multi_processor_count)
        out = torch.empty(B, H, L, dtype=DT, device="cuda")
        res = {}
        for label, k in (("default", ns), ("splits=1", 1)):
            fn = lambda: mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, num_splits=k, out=out)  # noqa: E731
            res[label] = bench(fn)
            res[label + " graph"] = bench_graph(fn)  # eager rows below ~200 µs can be launch-bound (host µs)
            if label == "default":
                res["host"] = host_time(fn)
        line = f"{name:<18} " + "  ".join(
            f"{k} {t * 1e6:.1f} us" + ("" if k == "host" else f" {nbytes / t / 1e12:.2f} TB/s") for k, t in res.items())
        if fi is not None:
            try:
                fi.plan(bt, sl, torch.ones(B, dtype=torch.int32, device="cuda"), causal=False)
                fi.run(q, qp, pool.cache)
                t = bench(lambda: fi.run(q, qp, pool.cache))
                tg = bench_graph(lambda: fi.run(q, qp, pool.cache))
                line += (f"  flashinfer {t * 1e6:.1f} us {nbytes / t / 1e12:.2f} TB/s, graph {tg * 1e6:.1f} us "
                         f"{nbytes / tg / 1e12:.2f} TB/s")
            except Exception as e:  # noqa: BLE001
                line += f"  flashinfer failed: {type(e).__name__}"
        print(line, flush=True)
    if args.decode_only:
        return

    # ------------------------------------------------------------------ extend
    print("\n== prefill / extend (bf16, causal, one sequence) ==")
    print("absorbed = mla_extend over the paged latent (FLOPs 2*H*(576+512) per query-key pair); expanded = "
          "mla_prefill_expanded kernel on k_nope/v/k_pe (2*H*(192+128) per pair); expanded full = gather_latent + "
          "kv_b_proj GEMM + kernel (what the model runs for chunks >= 256 new tokens); TFLOP/s on each form's own count")
    ext_rows = []
    w_kvb = (torch.randn(H * 256, L, device="cuda") / L ** 0.5).to(DT)  # kv_b_proj weight: per head k_nope | v
    for prefix, n_new in EXT_CASES:
        S = prefix + n_new
        bt, sl = pool.tables(1, S)
        cu = torch.tensor([0, n_new], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        q = torch.randn(n_new, H, L, device="cuda").to(DT)
        qp = torch.randn(n_new, H, R, device="cuda").to(DT)
        qx = torch.randn(n_new, H, 192, device="cuda").to(DT)  # expanded query: q_nope | q_pe
        pairs = n_new * prefix + n_new * (n_new + 1) // 2
        flops = 2 * H * (D + L) * pairs
        flops_x = 2 * H * (192 + 128) * pairs
        res = {}
        for name, cfg in (("absorbed", None), ("absorbed rows32", dict(rows=32, block_n=32, num_stages=3))):
            try:
                fn = lambda: mla_extend_triton(q, qp, pool.cache, bt, cu, sl, SCALE, max_query_len=n_new, config=cfg)  # noqa: E731
                res[name] = (bench(fn), flops)
            except Exception as e:  # noqa: BLE001
                print(f"  extend {name} failed: {type(e).__name__}: {e}")
        try:
            lat = gather_latent_triton(pool.cache, bt, cu_k, total=S)
            kv = torch.nn.functional.linear(lat[:, :L], w_kvb).view(S, H, 256)
            kn, kpe, v = kv[..., :128], lat[:, L:], kv[..., 128:]
            res["expanded"] = (bench(lambda: mla_prefill_expanded_triton(qx, kn, kpe, v, cu, cu_k, SCALE,
                                                                         max_query_len=n_new)), flops_x)
            for name, cfg in EXPANDED_ALT.items():
                res[name] = (bench(lambda: mla_prefill_expanded_triton(qx, kn, kpe, v, cu, cu_k, SCALE,
                                                                       max_query_len=n_new, config=cfg)), flops_x)
            res["expanded full"] = (bench(lambda: mla_prefill(qx[..., :128], qx[..., 128:], pool.cache, bt, cu, sl,
                                                              w_kvb, SCALE, max_query_len=n_new)), flops_x)
            res["gather"] = (bench(lambda: gather_latent_triton(pool.cache, bt, cu_k, total=S)), 0)
            res["kv_b GEMM"] = (bench(lambda: torch.nn.functional.linear(lat[:, :L], w_kvb)), 2 * S * L * H * 256)
        except Exception as e:  # noqa: BLE001
            print(f"  expanded failed: {type(e).__name__}: {e}")
        if prefix == 0 and "expanded" in res:  # a flash-attention baseline: torch SDPA, v padded to 192, same mask
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                qt = qx.transpose(0, 1)[None]
                kt = torch.cat([kn, kpe[:, None].expand(-1, H, -1)], -1).transpose(0, 1)[None]
                vt = torch.nn.functional.pad(v, (0, 64)).transpose(0, 1)[None]
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    sd = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE)  # noqa: E731
                    o_sd = sd()[0, :, :, :128].transpose(0, 1)
                    o_x = mla_prefill_expanded_triton(qx, kn, kpe, v, cu, cu_k, SCALE, max_query_len=n_new)
                    print(f"  expanded vs torch sdpa: rel err {rel_err(o_x, o_sd):.2e}")
                    res["torch sdpa flash"] = (bench(sd), flops_x)
                del qt, kt, vt, o_sd, o_x
            except Exception as e:  # noqa: BLE001
                print(f"  torch sdpa failed: {type(e).__name__}: {e}")
        lat = kv = kn = kpe = v = None
        if fi is not None:
            try:
                fi.plan(bt, sl, torch.tensor([n_new], dtype=torch.int32, device="cuda"), causal=True)
                fi.packed = None
                fi.run(q, qp, pool.cache)
                res["flashinfer absorbed"] = (bench(lambda: fi.run(q, qp, pool.cache)), flops)
            except Exception as e:  # noqa: BLE001
                print(f"  flashinfer extend failed: {type(e).__name__}: {e}")
        line = f"prefix {prefix:>6} new {n_new:>5}: " + ", ".join(
            f"{k} {t * 1e3:.3f} ms" + (f" ({f / t / 1e12:.0f} TFLOP/s)" if f else "") for k, (t, f) in res.items()
        )
        print(line, flush=True)
        ext_rows.append((prefix, n_new, res))
    cols = ["absorbed", "absorbed rows32", "expanded", "expanded full", "gather", "kv_b GEMM", "flashinfer absorbed",
            "torch sdpa flash"] + list(EXPANDED_ALT)
    print("\nmarkdown (ms, TFLOP/s on the form's own FLOP count; expanded full = gather + kv_b_proj + kernel):")
    print("| prefix | new tokens | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for prefix, n_new, res in ext_rows:
        cells = []
        for c in cols:
            if c not in res:
                cells.append("-")
                continue
            t, f = res[c]
            cells.append(f"{t * 1e3:.3f}" + (f" ({f / t / 1e12:.0f})" if f else ""))
        print(f"| {prefix} | {n_new} | " + " | ".join(cells) + " |")

    # ------------------------------------------------------------------ sweep
    if args.no_sweep:
        return
    print("\n== decode config sweep (eager, L2 flushed; TB/s) ==")
    cfgs = [
        dict(block_h=32, block_n=64, num_warps=8, num_stages=2),
        dict(block_h=32, block_n=32, num_warps=8, num_stages=3),
        dict(block_h=32, block_n=32, num_warps=4, num_stages=2),
        dict(block_h=32, block_n=64, num_warps=4, num_stages=2),
        dict(block_h=16, block_n=64, num_warps=4, num_stages=2),
        dict(block_h=16, block_n=32, num_warps=4, num_stages=3),
    ]
    shapes = [(1, 131072), (8, 8192), (64, 8192), (128, 8192), (128, 1024)]
    print("config".ljust(48) + "".join(f"B{b}/S{s // 1024}k".rjust(12) for b, s in shapes))
    for cfg in cfgs:
        line = str(tuple(cfg.values())).ljust(48)
        for B, S in shapes:
            bt, sl = pool.tables(B, S)
            q = torch.randn(B, H, L, device="cuda").to(DT)
            qp = torch.randn(B, H, R, device="cuda").to(DT)
            hb = cdiv(H, cfg["block_h"])
            ns = max(1, min(cdiv(2 * dev.multi_processor_count, B * hb), cdiv(S, 256), 256))
            try:
                t = bench(lambda: mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, num_splits=ns, config=cfg))
                line += f"{B * S * ROW_BYTES / t / 1e12:12.2f}"
            except Exception as e:  # noqa: BLE001
                line += f"{type(e).__name__[:11]:>12}"
        print(line, flush=True)

    print("\n== split sweep, default config (TB/s, eager) ==")
    for B, S in ((1, 131072), (1, 8192), (8, 65536), (64, 8192), (128, 8192)):
        bt, sl = pool.tables(B, S)
        q = torch.randn(B, H, L, device="cuda").to(DT)
        qp = torch.randn(B, H, R, device="cuda").to(DT)
        out = []
        for ns in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            if ns > cdiv(S, 64):
                break
            t = bench(lambda: mla_decode_triton(q, qp, pool.cache, bt, sl, SCALE, num_splits=ns, min_split_tokens=64))
            out.append(f"{ns}:{B * S * ROW_BYTES / t / 1e12:.2f}")
        dflt = kernel_splits(B, bt, dev.multi_processor_count)
        print(f"B={B} S={S} (default {dflt}): " + " ".join(out), flush=True)


if __name__ == "__main__":
    main()
