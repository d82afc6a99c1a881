"""H200 benchmark: KDA decode step (and, through a hook, the chunked prefill), Kimi-Linear shapes.

    python bench/kda.py [--batch 1,8,64,256] [--sweep] [--decode-only] [--no-fla]

Decode: one token per sequence, H=32, K=V=128, bf16 activations, fp32 state pool [S, H, K, V] updated in place at
random slots (slot 0 null). Rows:
  * ours      kernels.kda.kda_decode_triton with its default launch config (recurrent.decode_config: BV, warps,
              tail, early state load, by N and the SM count): the whole mixer step (conv update + gate + L2 norm +
              beta + delta rule + gated RMSNorm); timed eager (do_bench) and inside a CUDA graph (do_bench_cudagraph);
  * bmm+dec   the model's decode, kda_decode_triton(fg_a=, fg_b=): skinny_bmm_nt (the f_b | g_b up-projection, its
              own launch) then ours on its z, r (the up-projection inside the decode kernel, FG, was removed after
              the H200 measured it 6 / 171 us per step slower at batch 1 / 8);
  * es0/1/2   bench_early_state (N <= 8; --early-state: only these): 20 x (in_proj gemv -> decode) in one
              graph with PDL, per recurrent._EARLY_STATE mode; the decode's us/layer = (chain - gemvs alone) / 20;
  * fla       fla-core `fused_recurrent_kda_fwd` (gate, l2norm, beta sigmoid in kernel, in-place pool through
              ssm_state_indices) when `fla` is importable: the recurrence only (no conv, no output norm).
Bandwidth: state bytes = N*H*K*V*4 read + the same written; compared with a device-to-device copy of a 1 GiB buffer
measured in the same run (copy BW = 2 * bytes / t). us per layer = time of one call; the model has 20 KDA layers.
--sweep: per N, every config of SWEEP (BV x warps x tail x early) in a CUDA graph: us/step, % of copy BW, a
one-step check against the reference, the default marked, fla-core alongside; then the best config per N (what to
put in recurrent.decode_config / _BV_NARROW / _BV_WIDE / _WIDE_PER_SM).
Prefill: `bench_prefill()` below calls bench/kda_prefill.py (the chunk kernel owner's benchmark) when present;
--decode-only skips it.
Prints a table and markdown rows for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernels.kda import kda_decode_ref  # noqa: E402
from kernels.kda.recurrent import (  # noqa: E402
    TAIL_LAST, TAIL_LOOP, TAIL_POST, TAIL_SINGLE, DecodeConfig, decode_config, kda_decode_triton, num_sms, warps_for,
)
from kernels.gemv import skinny_bmm_nt  # noqa: E402
from kernels.testing import assert_close, make_kda_layer, make_kda_tokens  # noqa: E402

H, K, V, W = 32, 128, 128, 4
EPS = 1e-5
N_KDA_LAYERS = 20


def t_ms(fn, graph=False, rep=50):
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=1 << 30):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = t_ms(lambda: b.copy_(a))
    return 2 * nbytes / (ms * 1e-3)


def _setup(N):
    S = N + 1
    L = make_kda_layer(H, K, V, S, device="cuda", conv_dtype=torch.bfloat16)
    tok = make_kda_tokens(N, H, K, V, dtype=torch.bfloat16, device="cuda")
    slots = (torch.randperm(N, device="cuda") + 1).to(torch.int32)
    # low-rank gate inputs as the model has them: fg_a [2, N, K] a strided view of the in_proj output, fg_b [2, HK, K]
    C = 2 * H * K + H * V
    y = torch.randn(N, C + 2 * K + H, device="cuda").to(torch.bfloat16)
    tok["fg_a"] = y[:, C:C + 2 * K].view(-1, 2, K).transpose(0, 1)
    tok["fg_b"] = torch.stack([torch.randn(H * K, K, device="cuda") * (2.0 / K ** 0.5),
                               torch.randn(H * V, K, device="cuda") / K ** 0.5]).to(torch.bfloat16)
    return L, tok, slots


def _chain(L, tok, slots, **kw):
    """The f_b | g_b up-projection (skinny_bmm_nt, bf16 out) by hand, then the decode kernel (check only)."""
    def fn():
        z, r = skinny_bmm_nt(tok["fg_a"], tok["fg_b"]).unbind(0)
        return kda_decode_triton(tok["qkv"], L["conv_w"], z, tok["b"], L["A_log"], L["dt_bias"], r, L["o_norm_w"],
                                 EPS, L["conv_state"], L["rec_state"], slots, **kw)
    return fn


def _lowrank(L, tok, slots, **kw):
    """The model's decode: kda_decode_triton(fg_a=, fg_b=) (skinny_bmm_nt, then the decode kernel)."""
    return lambda: kda_decode_triton(tok["qkv"], L["conv_w"], None, tok["b"], L["A_log"], L["dt_bias"], None,
                                     L["o_norm_w"], EPS, L["conv_state"], L["rec_state"], slots, fg_a=tok["fg_a"],
                                     fg_b=tok["fg_b"], **kw)


def _ours(L, tok, slots, **kw):
    return lambda: kda_decode_triton(tok["qkv"], L["conv_w"], tok["z"], tok["b"], L["A_log"], L["dt_bias"], tok["r"],
                                     L["o_norm_w"], EPS, L["conv_state"], L["rec_state"], slots, **kw)


def _fla_fn(L, tok, slots):
    """fla-core fused_recurrent_kda (recurrence only) on the same pool, or None if fla is not importable."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        print(f"# fla not importable: {type(e).__name__}: {e}")
        return None
    N = tok["qkv"].shape[0]
    qkv = tok["qkv"]
    q = qkv[:, : H * K].reshape(1, N, H, K).contiguous()     # fla indexes token-contiguous tensors
    k = qkv[:, H * K: 2 * H * K].reshape(1, N, H, K).contiguous()
    v = qkv[:, 2 * H * K:].reshape(1, N, H, V).contiguous()
    g = tok["z"].reshape(1, N, H, K)
    beta = tok["b"].reshape(1, N, H)
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    state = L["rec_state"].clone()

    def fn():
        return fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g, beta=beta, A_log=L["A_log"], dt_bias=L["dt_bias"], scale=K ** -0.5,
            initial_state=state, inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=slots,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"# fla fused_recurrent_kda_fwd failed: {type(e).__name__}: {e}")
        return None
    return fn


def check(N=8):
    L, tok, slots = _setup(N)
    A = {k: v.clone() for k, v in L.items()}
    y = _ours(L, tok, slots)()
    y_ref = kda_decode_ref(tok["qkv"], A["conv_w"], tok["z"], tok["b"], A["A_log"], A["dt_bias"], tok["r"],
                           A["o_norm_w"], EPS, A["conv_state"], A["rec_state"], slots)
    assert_close("decode o", y, y_ref, 5e-3)
    assert_close("decode state", L["rec_state"], A["rec_state"], 5e-3)
    P = {k: v.clone() for k, v in L.items()}
    y_chain = _chain(L, tok, slots)()
    assert_close("bmm+dec o", _lowrank(P, tok, slots)(), y_chain, 5e-3)
    assert_close("bmm+dec state", P["rec_state"], L["rec_state"], 5e-3)
    print(f"# check vs reference (and the low-rank path vs skinny_bmm_nt + ours) at N={N}: ok")


def bench_decode(batches, use_fla=True):
    bw_copy = copy_bandwidth()
    print(f"# device copy bandwidth: {bw_copy / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    hdr = (f"{'N':>5} {'impl':<14} {'us/layer':>9} {'graph us':>9} {'tok/s/layer':>12} {'state GB/s':>11} "
           f"{'% copy':>7} {'20 layers us':>13}")
    print(hdr)
    rows = []
    for N in batches:
        L, tok, slots = _setup(N)
        state_bytes = 2 * N * H * K * V * 4
        impls = [("ours", _ours(L, tok, slots)), ("bmm+dec", _lowrank(L, tok, slots))]
        if use_fla:
            f = _fla_fn(L, tok, slots)
            if f is not None:
                impls.append(("fla-core", f))
        for name, fn in impls:
            ms = t_ms(fn)
            ms_g = t_ms(fn, graph=True)
            best = min(ms, ms_g)
            bw = state_bytes / (best * 1e-3)
            r = dict(N=N, impl=name, cfg=_label(tuple(decode_config(N, H, K, V, num_sms("cuda")))),
                     us=ms * 1e3, us_g=ms_g * 1e3, tps=N / (best * 1e-3), bw=bw,
                     pct=100 * bw / bw_copy, l20=N_KDA_LAYERS * best * 1e3)
            rows.append(r)
            print(f"{N:>5} {name:<14} {r['us']:>9.2f} {r['us_g']:>9.2f} {r['tps']:>12.3g} {bw / 1e9:>11.0f} "
                  f"{r['pct']:>6.1f}% {r['l20']:>13.1f}")
        del L, tok, slots
        torch.cuda.empty_cache()
    print("\n| KDA decode (H=32, K=V=128) | N | eager us/layer | graph us/layer | state GB/s | % of copy BW |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        what = {"ours": f"ours (conv+gate+delta+norm, {r['cfg']}; z, r given)",
                "bmm+dec": "ours with fg_a / fg_b (skinny_bmm_nt f_b|g_b, then ours)"}.get(
                    r["impl"], "fla-core 0.6 fused_recurrent (core only)")
        print(f"| {what} | {r['N']} | {r['us']:.2f} | {r['us_g']:.2f} | {r['bw'] / 1e9:.0f} | {r['pct']:.1f}% |")
    print(f"\ncopy bandwidth measured in this run: {bw_copy / 1e12:.2f} TB/s")
    return rows


_TAIL = {TAIL_SINGLE: "single", TAIL_LAST: "last", TAIL_POST: "post", TAIL_LOOP: "loop"}
# DecodeConfig(BV, num_warps, tail, early, pps, maxnreg, store_after) candidates; BV = 128 = V is one program per head.
# TAIL_LOOP: the persistent loop kernel sized for pps programs per SM (offline sm_90 regs, Triton 3.6 of the H200:
# BV16/w4 118 -> 4 per SM, 96 with maxnreg (16 B spill) -> 5; BV32/w4 157 -> 3, 128 capped (48 B spill) -> 4;
# BV32/w8 176 -> 1, 128 capped (16 B) -> 2; BV16/w2 215 -> 4)
SWEEP = [DecodeConfig(bv, warps_for(bv, K), TAIL_LAST, e) for bv in (8, 16, 32, 64) for e in (True, False)] + [
    DecodeConfig(32, 8, TAIL_LAST, False), DecodeConfig(64, 8, TAIL_LAST, True), DecodeConfig(64, 8, TAIL_LAST, False),
    DecodeConfig(128, 16, TAIL_SINGLE, True), DecodeConfig(128, 16, TAIL_SINGLE, False),
    DecodeConfig(8, 1, TAIL_POST, False), DecodeConfig(32, 4, TAIL_POST, False),   # 12-02 kernel's (2 launches)
    # register caps (offline sm_90, Triton 3.6): BV64/w4 141 -> 128 without spills = 4 programs per SM instead of 3;
    # 112: 8 B spilled; BV64/w8 130 -> 128 = 2 programs per SM instead of 1
    DecodeConfig(64, 4, TAIL_LAST, True, 0, 128), DecodeConfig(64, 4, TAIL_LAST, False, 0, 128),
    DecodeConfig(64, 4, TAIL_LAST, True, 0, 112), DecodeConfig(64, 8, TAIL_LAST, True, 0, 128),
    # state stored after the arrival atomic (its release then waits for the o stores only)
    DecodeConfig(64, 4, TAIL_LAST, True, 0, 0, True), DecodeConfig(64, 4, TAIL_LAST, True, 0, 128, True),
    DecodeConfig(32, 4, TAIL_LAST, False, 0, 0, True), DecodeConfig(32, 4, TAIL_LAST, True, 0, 0, True),
    DecodeConfig(16, 2, TAIL_LAST, True, 0, 0, True),
] + [DecodeConfig(bv, nw, TAIL_LOOP, True, pps, mr) for bv, nw, mr, ppss in (
    (16, 4, 0, (3, 4, 8)), (16, 4, 96, (4, 5)), (32, 4, 0, (2, 3)), (32, 4, 128, (3, 4)), (32, 8, 128, (1, 2)),
    (16, 2, 0, (4, 8)), (16, 2, 128, (6, 8)))
    for pps in ppss]


def _label(cfg):
    cfg = DecodeConfig(*cfg)
    s = f"BV{cfg.BV}/w{cfg.num_warps}/{_TAIL[cfg.tail]}"
    s += f"/pps{cfg.pps}" if cfg.tail == TAIL_LOOP else f"/{'early' if cfg.early else 'late'}"
    return s + (f"/r{cfg.maxnreg}" if cfg.maxnreg else "") + ("/sa" if cfg.store_after else "")


def sweep_decode(batches, use_fla=True):
    bw_copy = copy_bandwidth()
    n_sm = num_sms("cuda")
    print(f"\n# decode config sweep (CUDA graph us/step; {n_sm} SMs; copy {bw_copy / 1e12:.2f} TB/s)")
    best = {}
    for N in batches:
        L, tok, slots = _setup(N)
        state_bytes = 2 * N * H * K * V * 4
        dflt = tuple(decode_config(N, H, K, V, n_sm))
        cfgs = list(dict.fromkeys([dflt] + SWEEP))
        P0 = {k: v.clone() for k, v in L.items()}                    # pristine pools (timing advances L)
        R = {k: v.clone() for k, v in L.items()}
        y_ref = kda_decode_ref(tok["qkv"], R["conv_w"], tok["z"], tok["b"], R["A_log"], R["dt_bias"], tok["r"],
                               R["o_norm_w"], EPS, R["conv_state"], R["rec_state"], slots)
        rows = []
        for cfg in cfgs:
            bv, nw, tail, early, pps, mr, sa = cfg[:7]
            kw = dict(BV=bv, num_warps=nw, tail=tail, early=early, pps=pps or None, maxnreg=mr or None,
                      store_after=sa)
            try:
                C = {k: v.clone() for k, v in P0.items()}              # one step on fresh pools: correctness
                y = _ours(C, tok, slots, **kw)()
                ok = "ok"
                try:
                    assert_close("o", y, y_ref, 5e-3)
                    assert_close("state", C["rec_state"], R["rec_state"], 5e-3)
                    assert torch.equal(C["conv_state"], R["conv_state"]), "conv state differs"
                except AssertionError as e:
                    ok = f"MISMATCH ({e})"
                del C
                ms = t_ms(_ours(L, tok, slots, **kw), graph=True, rep=25)
            except Exception as e:  # noqa: BLE001
                print(f"N={N} {_label(cfg)}: {type(e).__name__}: {e}")
                continue
            rows.append((ms * 1e3, cfg, ok))
        if use_fla:
            f = _fla_fn(L, tok, slots)
            if f is not None:
                rows.append((t_ms(f, graph=True, rep=25) * 1e3, None, "fla-core core only"))
        rows.sort(key=lambda r: r[0])
        print(f"{'N':>5} {'config':<26} {'graph us':>9} {'state TB/s':>10} {'% copy':>7}  check")
        for us, cfg, ok in rows:
            name = "fla-core" if cfg is None else _label(cfg) + (" *" if cfg == dflt else "")
            bw = state_bytes / (us * 1e-6)
            print(f"{N:>5} {name:<26} {us:>9.2f} {bw / 1e12:>10.2f} {100 * bw / bw_copy:>6.1f}%  {ok}")
        good = [r for r in rows if r[1] is not None and r[2] == "ok"]
        if good:
            best[N] = good[0]
        del L, tok, slots, P0, R
        torch.cuda.empty_cache()
    print("\n# best config per N (* = default): " + "; ".join(
        f"N={N}: {_label(c)} {us:.2f} us{' *' if c[:7] == tuple(decode_config(N, H, K, V, n_sm))[:7] else ''}"
        for N, (us, c, _) in best.items()))
    return best


def bench_early_state(batches=(1, 8), layers=N_KDA_LAYERS, D=2304):
    """The decode in the b1 / b8 graph's launch order: per layer the in_proj gemv (its own [C + 2K + H, D] weight,
    writes qkv | f_a g_a | b) then kda_decode (low-rank gates, default config) on its own pools, `layers`
    layers in one CUDA graph, every launch PDL (KIMI_PDL unless 0). Rows: the gemvs alone, then the chain per
    early_state (recurrent.py "Early state": 0 slot / state after the wait, 1 slot + L2 prefetches before it, 2 also
    the state tile in registers before it); "decode us/layer" = (chain - gemvs alone) / layers, the decode's cost in
    the chain (what bench/ablate.py measures in the model). Check: every mode ends with bit-identical pools."""
    from bench._timing import time_us
    from kernels._pdl import pdl_on
    from kernels.gemv import gemv_triton

    C = 2 * H * K + H * V
    print(f"\n# early state: {layers} x (in_proj gemv {C + 2 * K + H}x{D} -> kda_decode) in one CUDA graph, "
          f"PDL {'on' if pdl_on() else 'OFF'}")
    print(f"{'N':>5} {'rows':<22} {'graph us':>9} {'us/layer':>9} {'decode us/layer':>16}  check")
    rows = []
    for N in batches:
        gen = torch.Generator(device="cuda").manual_seed(N)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

        Ws = [rnd(C + 2 * K + H, D, scale=D ** -0.5) for _ in range(layers)]
        fgbs = [torch.stack([rnd(H * K, K, scale=2.0 / K ** 0.5), rnd(H * V, K, scale=K ** -0.5)])
                for _ in range(layers)]
        pristine = [make_kda_layer(H, K, V, N + 1, device="cuda", conv_dtype=torch.bfloat16) for _ in range(layers)]
        slots = (torch.randperm(N, device="cuda", generator=gen) + 1).to(torch.int32)
        x = rnd(N, D)

        def chain(pools, es):
            def fn():
                for W, fg_b, st in zip(Ws, fgbs, pools):
                    y = gemv_triton(x, W)
                    if st is None:
                        continue
                    fg_a = y[:, C:C + 2 * K].view(-1, 2, K).transpose(0, 1)
                    kda_decode_triton(y[:, :C], st["conv_w"], None, y[:, C + 2 * K:], st["A_log"], st["dt_bias"],
                                      None, st["o_norm_w"], EPS, st["conv_state"], st["rec_state"], slots,
                                      fg_a=fg_a, fg_b=fg_b, early_state=es)
            return fn

        t_gemv = time_us([chain([None] * layers, 0)], False)
        print(f"{N:>5} {'gemvs alone':<22} {t_gemv:>9.1f} {t_gemv / layers:>9.2f} {'':>16}")
        finals = {}
        for es in (0, 1, 2):
            pools = [{k: v.clone() for k, v in P.items()} for P in pristine]
            t = time_us([chain(pools, es)], False)       # the same number of steps in every mode
            torch.cuda.synchronize()
            finals[es] = pools
            ok = "ok" if es == 0 or all(torch.equal(a["rec_state"], b["rec_state"]) and
                                        torch.equal(a["conv_state"], b["conv_state"])
                                        for a, b in zip(pools, finals[0])) else "MISMATCH vs early_state 0"
            dec = (t - t_gemv) / layers
            rows.append(dict(N=N, es=es, us=t, dec=dec, ok=ok))
            print(f"{N:>5} {f'gemv+decode es{es}':<22} {t:>9.1f} {t / layers:>9.2f} {dec:>16.2f}  {ok}")
        for held in (Ws, fgbs, pristine, finals):  # the closures above still see these: empty them, not del
            held.clear()
        torch.cuda.empty_cache()
    print(f"\n| KDA decode in the in_proj -> decode chain ({layers} layers, graph, PDL) | N | early_state "
          f"| decode us/layer |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| low-rank gates, default config | {r['N']} | {r['es']} | {r['dec']:.2f} |")
    return rows


def compile_report(batches=(1, 8, 64), arch=90, n_sm=132, gdc=True):
    """Offline sm_<arch> compile (kernels/_offline.py: Triton's bundled ptxas and cuobjdump; no GPU, not under
    TRITON_INTERPRET) of the per-tile decode kernel at the default config of each N -> rows (N, label, regs, spill
    stack bytes, shared bytes)."""
    from kernels._offline import compile_offline
    from kernels.kda import recurrent as rec

    fn = rec._kda_decode_kernel
    names = fn.arg_names
    types = {n: "*bf16" for n in names if n.endswith("_ptr")}
    types.update(convw_ptr="*fp32", alog_ptr="*fp32", dtb_ptr="*fp32", state_ptr="*fp32", o_ptr="*fp32",
                 cnt_ptr="*i32", slot_ptr="*i32", scale="fp32", eps="fp32")
    types.update({n: "i32" for n in names if n.startswith("stride")})
    div = [n for n in names if types.get(n, "").startswith("*") or n.startswith("stride")]
    rows = []
    for N in batches:
        cfg = decode_config(N, H, K, V, n_sm)
        c = dict(H=H, K=K, V=V, W=W, BK=K, BV=cfg.BV, NV=V // cfg.BV, BVF=V, TAIL=cfg.tail, EARLY=cfg.early,
                 STORE_AFTER=cfg.store_after, GDC=gdc, EARLY_STATE=rec._EARLY_STATE if gdc else 0)
        b = compile_offline(fn, types, c, num_warps=cfg.num_warps, arch=arch, maxnreg=cfg.maxnreg or None,
                            divisible=div)
        rows.append((N, _label(cfg), b.regs, b.stack, b.smem))
    print(f"# offline sm_{arch} (Triton {triton.__version__}), GDC={gdc}: regs / spill stack bytes / smem")
    for N, lab, reg, st, sh in rows:
        print(f"N={N:<4} {lab:<48} regs {reg:>3}  stack {st:>3} B  smem {sh:>6} B")
    return rows


def bench_prefill():
    """Prefill slot: runs bench/kda_prefill.py::bench_prefill (owned by the chunk-kernel engineer) if present."""
    try:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import kda_prefill  # noqa: F401
    except ImportError:
        print("# bench/kda_prefill.py not present")
        return None
    print("\n== prefill (bench/kda_prefill.py)")
    return kda_prefill.bench_prefill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill hook (same as --no-prefill)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--regs", action="store_true", help="offline sm_90 registers of the decode kernel (no GPU), exit")
    ap.add_argument("--early-state", action="store_true",
                    help="only the early-state rows (in_proj gemv -> decode chain per KIMI_KDA_EARLY_STATE mode), exit")
    a = ap.parse_args()
    batches = [int(x) for x in a.batch.split(",")]
    if a.regs:
        compile_report()
        return
    torch.manual_seed(0)
    if a.early_state:
        bench_early_state([b for b in batches if b <= 8] or [1, 8])
        return
    if not a.no_check:
        check()
    bench_decode(batches, use_fla=not a.no_fla)
    bench_early_state([b for b in batches if b <= 8])
    if a.sweep:
        sweep_decode(batches, use_fla=not a.no_fla)
    if not (a.no_prefill or a.decode_only):
        bench_prefill()


if __name__ == "__main__":
    main()
