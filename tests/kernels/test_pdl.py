"""PDL chain of the decode kernels (kernels/_pdl.py, KIMI_PDL): the switch, the launch arguments every wrapper passes,
the sm_90 lowering of each GDC kernel (what runs before griddepcontrol.wait), and on a GPU a CUDA graph of PDL
launches bit-identical to the same chain without PDL."""
import os
import subprocess
import sys

import pytest
import torch

import kernels._pdl as pdl_mod
from kernels import gemv as gemv_mod
from kernels import norm as norm_mod
from kernels.kda import recurrent as rec_mod
from kernels.moe import router as router_mod
from kernels.testing import make_kda_layer
from tests.kernels.conftest import requires_triton, run_offline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env_without_interpreter(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KIMI_PDL")}
    env.update(extra)
    return env


_AUTO = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9   # unset / auto: on for sm_90+


@pytest.mark.parametrize("env,expect", [(dict(KIMI_PDL="1"), True), (dict(KIMI_PDL="0"), False), ({}, _AUTO),
                                        (dict(KIMI_PDL="auto"), _AUTO),
                                        (dict(KIMI_PDL="1", TRITON_INTERPRET="1"), False)])
def test_switch_read_at_import(env, expect):
    code = "import kernels._pdl as p; print(p.ENABLED, p.pdl_on(), p.pdl_on(True))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env_without_interpreter(**env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    interp = env.get("TRITON_INTERPRET") == "1"
    assert r.stdout.split() == [str(expect), str(expect), str(not interp)]


def test_launch_kwargs(monkeypatch):
    monkeypatch.setattr(pdl_mod, "INTERPRET", False)
    monkeypatch.setattr(pdl_mod, "ENABLED", False)
    assert pdl_mod.pdl_launch() == {} and pdl_mod.pdl_launch(False) == {}
    assert pdl_mod.pdl_launch(True, PF_N=3) == dict(GDC=True, PF_N=3, launch_pdl=True)
    monkeypatch.setattr(pdl_mod, "ENABLED", True)
    assert pdl_mod.pdl_launch() == dict(GDC=True, launch_pdl=True) and pdl_mod.pdl_launch(False) == {}
    monkeypatch.setattr(pdl_mod, "INTERPRET", True)       # never under the interpreter, whatever is asked
    assert pdl_mod.pdl_launch(True) == {} and not pdl_mod.pdl_on()


class _Recorder:
    """Stands in for a jit kernel: kernel[grid](*args, **kwargs) records the kwargs."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(kw)


def _wrapper_calls(monkeypatch, pdl):
    """Every decode wrapper once on small CPU tensors with its kernel(s) replaced by recorders -> {name: kwargs}."""
    names = {norm_mod: ["_rmsnorm_kernel", "_rmsnorm_head_kernel", "_add_rmsnorm_kernel",
                        "_combine_add_rmsnorm_kernel"],
             gemv_mod: ["_gemv_kernel"], rec_mod: ["_kda_decode_kernel", "_kda_decode_post_kernel",
                                                   "_kda_decode_loop_kernel"],
             router_mod: ["_router_fused_gemv_kernel", "_router_decode_kernel"]}
    recs = {}
    for mod, ks in names.items():
        for k in ks:
            recs[k] = _Recorder()
            monkeypatch.setattr(mod, k, recs[k])
    T, D, bf = 2, 64, torch.bfloat16
    x, w = torch.randn(T, D, dtype=bf), torch.randn(D, dtype=bf)
    norm_mod.rmsnorm_triton(x, w, 1e-6, pdl=pdl)
    norm_mod.rmsnorm_head_triton(x, w[:48], 1e-6, pdl=pdl)
    norm_mod.add_rmsnorm_triton(x, x, w, 1e-6, pdl=pdl)
    norm_mod.combine_add_rmsnorm_triton(torch.randn(T * 3, D, dtype=bf), torch.rand(T, 3), x, w, 1e-6, pdl=pdl)
    gemv_mod.gemv_triton(x, torch.randn(96, D, dtype=bf), pdl=pdl)
    H, K, V, S = 2, 16, 16, 4
    L = make_kda_layer(H, K, V, S, conv_dtype=bf)
    args = (torch.randn(T, 2 * H * K + H * V, dtype=bf), L["conv_w"], torch.randn(T, H * K, dtype=bf),
            torch.randn(T, H, dtype=bf), L["A_log"], L["dt_bias"], torch.randn(T, H * V, dtype=bf), L["o_norm_w"],
            1e-5, L["conv_state"], L["rec_state"], torch.tensor([1, 2], dtype=torch.int32))
    rec_mod.kda_decode_triton(*args, BV=8, tail=rec_mod.TAIL_POST, pdl=pdl)
    rec_mod.kda_decode_triton(*args, BV=8, tail=rec_mod.TAIL_LOOP, pdl=pdl)
    gate, bias = torch.randn(16, D, dtype=bf), torch.randn(16)
    router_mod._router_decode_v1(x, gate, bias, 4, 1.0, True, False, 16, pdl=pdl)
    router_mod._router_decode_v2(x, gate, bias, 4, 1.0, True, False, 16, poll=True, pdl=pdl)
    return {k: r.calls for k, r in recs.items()}


@pytest.mark.parametrize("mode", ["on", "off", "env"])
def test_wrappers_pass_pdl(monkeypatch, mode):
    """pdl=True (or None with KIMI_PDL on): every decode kernel launch carries GDC (WAIT for router v2/v3) and
    launch_pdl; pdl=False: neither. The interpreter check is patched away (no kernel runs here)."""
    monkeypatch.setattr(pdl_mod, "INTERPRET", False)
    monkeypatch.setattr(pdl_mod, "ENABLED", mode == "env")
    calls = _wrapper_calls(monkeypatch, {"on": True, "off": False, "env": None}[mode])
    on = mode != "off"
    for name, kws in calls.items():
        assert kws, name
        for kw in kws:
            flag = "WAIT" if name == "_router_decode_kernel" else "GDC"
            assert kw.get(flag, False) == on and kw.get("launch_pdl", False) == on, (name, kw)
    gkw = calls["_gemv_kernel"][0]
    if on:   # 96 rows x 64 bf16 = one 128-byte line each, all of it under the L2 budget
        assert (gkw["PF_N"], gkw["PF_L"], gkw["PF_STEP"]) == (1, 1, 64), gkw
    else:
        assert "PF_N" not in gkw


def test_gemv_prefetch_budget(monkeypatch):
    monkeypatch.setattr(gemv_mod, "PDL_L2_MB", 16)
    assert gemv_mod._pdl_prefetch(1, 2304, 3, 1408, 2) == dict(PF_N=18, PF_L=32, PF_STEP=64)     # o_proj
    assert gemv_mod._pdl_prefetch(1, 12576, 1, 2304, 2) == dict(PF_N=10, PF_L=16, PF_STEP=64)    # in_proj
    assert gemv_mod._pdl_prefetch(2, 4096, 1, 128, 2) == dict(PF_N=2, PF_L=2, PF_STEP=64)        # f_b | g_b
    assert gemv_mod._pdl_prefetch(1, 64, 1, 1 << 20, 4)["PF_N"] == gemv_mod.PDL_MAX_LINES
    monkeypatch.setattr(gemv_mod, "PDL_L2_MB", 4)     # the default since 12-04: 2-4 lines (256-512 B) per row
    assert gemv_mod._pdl_prefetch(1, 2304, 3, 1408, 2) == dict(PF_N=4, PF_L=4, PF_STEP=64)       # o_proj
    assert gemv_mod._pdl_prefetch(1, 12576, 1, 2304, 2) == dict(PF_N=2, PF_L=2, PF_STEP=64)      # in_proj
    assert gemv_mod._pdl_prefetch(1, 2304, 3, 1408, 2, mb=8.0)["PF_N"] == 9                      # per-shape l2_mb
    monkeypatch.setattr(gemv_mod, "PDL_L2_MB", 0)
    assert gemv_mod._pdl_prefetch(1, 2304, 3, 1408, 2)["PF_N"] == 0
    assert gemv_mod._pdl_prefetch(1, 2304, 3, 1408, 2, mb=19.0)["PF_N"] == 22                   # the whole slab


def test_gemv_l2_mb_field_reaches_launch(monkeypatch):
    """A config's l2_mb (e.g. a SHAPE_OVERRIDES entry set by bench/ablate.py) replaces PDL_L2_MB for that shape."""
    monkeypatch.setattr(pdl_mod, "INTERPRET", False)
    rec = _Recorder()
    monkeypatch.setattr(gemv_mod, "_gemv_kernel", rec)
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16)
    gemv_mod.gemv_triton(x, w, pdl=True)
    monkeypatch.setattr(gemv_mod, "SHAPE_OVERRIDES", {(1, 96, 64): {"l2_mb": 0.0}})
    gemv_mod.gemv_triton(x, w, pdl=True)
    assert [kw["PF_N"] for kw in rec.calls] == [1, 0]


@pytest.mark.parametrize("pdl", [True, False])
def test_router_l2_hint_args(monkeypatch, pdl):
    """The fused decode router's l2_hint reaches the launch as two spans of 128-byte lines under PDL (the hint's
    prefetches sit after the wait), and not at all without PDL."""
    monkeypatch.setattr(pdl_mod, "INTERPRET", False)
    rec = _Recorder()
    monkeypatch.setattr(router_mod, "_router_decode_kernel", rec)
    T, D, E, bf = 1, 64, 16, torch.bfloat16
    a, r, nw = torch.randn(T, D, dtype=bf), torch.randn(T, D, dtype=bf), torch.randn(D, dtype=bf)
    spans = (torch.zeros(1000, dtype=bf), torch.zeros(70, dtype=bf))
    router_mod.moe_router_add_norm_triton(a, r, nw, 1e-6, torch.randn(E, D, dtype=bf), torch.randn(E), 4,
                                          append_expert=E, pdl=pdl, l2_hint=spans)
    (kw,) = rec.calls
    if pdl:
        assert (kw["PF0_N"], kw["PF1_N"], kw["PF_LINE"]) == (16, 2, 64), kw
        assert kw["pf0_ptr"] is spans[0] and kw["pf1_ptr"] is spans[1]
    else:
        assert "PF0_N" not in kw and "pf0_ptr" not in kw


_LOWERING = r"""
import json
from kernels._pdl import ptx_events
from kernels import gemv, norm
from kernels.kda import recurrent as rec
from kernels.moe import router as r
from kernels.mla import decode as mla
f32 = dict(convw_ptr="*fp32", alog_ptr="*fp32", dtb_ptr="*fp32", state_ptr="*fp32", o_ptr="*fp32", cnt_ptr="*i32",
           slot_ptr="*i32")
rt = dict(logits_ptr="*fp32", cnt_ptr="*i32", bias_ptr="*fp32", w_out_ptr="*fp32", id_out_ptr="*i32")
topk = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=256, HAS_BIAS=True, BIASED_WEIGHTS=False, RENORM=True, HAS_EXTRA=True,
            OUT_K=9)
gc = dict(BM=16, BN=64, BK=128, EVEN_K=True, DOT=True, PREC="tf32", UPCAST=False, SPLIT=2, W_EVICT="evict_first",
          W_CACHE="", R=8, PREFETCH=False, TMA=False, w_desc=None, PF_N=18, PF_L=32, PF_STEP=64)
kc = dict(H=32, K=128, V=128, W=4, BK=128, BV=32, NV=4, BVF=128, TAIL=1, EARLY=False, STORE_AFTER=False)
BK, NK, BKT = r.decode_k_split(2304, 1, 1)
cases = {
    "add_rmsnorm": (norm._add_rmsnorm_kernel, dict(BD=4096, EARLY_W=True), {}, 4),
    "rmsnorm": (norm._rmsnorm_kernel, dict(BD=4096, EARLY_W=True), {}, 4),
    "rmsnorm_head": (norm._rmsnorm_head_kernel, dict(BC=1024, EARLY_W=True), {}, 4),
    "combine_add_rmsnorm": (norm._combine_add_rmsnorm_kernel,
                            dict(TOP_K=9, SPLIT=1, BD=4096, INTERP=False, EARLY_W=True), dict(tw_ptr="*fp32"), 4),
    "gemv_dot": (gemv._gemv_kernel, gc, dict(p_ptr="*fp32", cnt_ptr="*i32"), 4),
    "gemv_fma": (gemv._gemv_kernel, dict(gc, BM=1, BN=8, DOT=False, SPLIT=0, PREFETCH=True, PF_N=2, PF_L=2),
                 dict(p_ptr="*fp32", cnt_ptr="*i32"), 2),
    "kda_decode": (rec._kda_decode_kernel, kc, f32, 4),
    "kda_post": (rec._kda_decode_post_kernel, dict(H=32, K=128, V=128, W=4, BK=128, BVF=128), f32, 4),
    "kda_loop": (rec._kda_decode_loop_kernel, dict(H=32, K=128, V=128, W=4, BK=128, BV=16, NV=8, BVF=128), f32, 4),
    "mla_stage2": (mla._mla_decode_stage2, dict(L=512, BLOCK_N=64, BLOCK_B=128, MIN_TILES=1, BLOCK_S=256, BLOCK_H2=1,
                   BLOCK_L2=32), dict(seqlen_ptr="*i32", opart_ptr="*fp32", lse_ptr="*fp32"), 4),
    "router_v1": (r._router_fused_gemv_kernel, dict(topk, BE=2, BK=4096), rt, 4),
    "router_v3": (r._router_decode_kernel, dict(topk, BE=1, BK=BK, NK=NK, BK_TAIL=BKT, POLL=True,
                  MAX_SPINS=1 << 20, GDC=True), dict(rt, cnt_ptr="*i64", logits_ptr="*i64"), 1),
    "router_v3_hint": (r._router_decode_kernel, dict(topk, BE=1, BK=BK, NK=NK, BK_TAIL=BKT, POLL=True,
                       MAX_SPINS=1 << 20, GDC=True, NORM=True, PF0_N=300, PF1_N=20, PF_LINE=64),
                       dict(rt, cnt_ptr="*i64", logits_ptr="*i64"), 2),
}
out = {}
for name, (fn, consts, pt, nw) in cases.items():
    flag = "WAIT" if name.startswith("router_v3") else "GDC"
    # the router's L2 hint goes with PDL launches only (_hint_args): its off build has no spans
    nohint = dict(PF0_N=0, PF1_N=0) if name.endswith("_hint") else {}
    out[name] = {str(on): ptx_events(fn, dict(consts, **{flag: on}, **({} if on else nohint)), pt, nw)
                 for on in (False, True)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_lowering():
    """Offline sm_90 PTX of every GDC kernel (Triton's compiler, no GPU): with the flag, one griddepcontrol.wait;
    before it no store, atomic or (except the weight loads of norms and routers) load, only L2 prefetches (gemv,
    KDA decode); launch_dependents right after the wait (router v3: first, as before); without the flag neither
    instruction (router v3 keeps its early signal) and the same memory instructions."""
    res = run_offline(_LOWERING, 600, unset=("KIMI_PDL",))
    W, L = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    weights_first = {"add_rmsnorm", "rmsnorm", "rmsnorm_head", "combine_add_rmsnorm", "router_v1", "router_v3",
                     "router_v3_hint"}
    prefetch_first = {"gemv_dot", "gemv_fma", "kda_decode"}
    for name, ev in res.items():
        off, on = ev["False"], ev["True"]
        assert on.count(W) == 1 and W not in off, name
        pre, post = on[:on.index(W)], on[on.index(W) + 1:]
        assert "st.global" not in pre and "atom." not in pre, (name, pre)
        if name.startswith("router_v3"):
            assert pre[0] == L and off[0] == L and L not in post, name
        else:
            assert post[0] == L and L not in off and L not in pre, (name, post[:3])
        assert ("ld.global" in pre) == (name in weights_first), (name, pre)
        assert ("prefetch.global.L2" in pre) == (name in prefetch_first), (name, pre)
        if name == "router_v3_hint":   # the L2 hint: after the wait and the logit's store, never without PDL
            assert "prefetch.global.L2" in post and "prefetch.global.L2" not in off, name
            assert post.index("prefetch.global.L2") > post.index("st.global"), name
        strip = [e for e in on if e not in (W, L, "prefetch.global.L2")]
        if name != "router_v1":  # v1 peels the first K step under GDC (its loop body is compiled twice)
            assert strip == [e for e in off if e != L], name


# --------------------------------------------------------------------------------------------------- GPU
def _chain(P, S, pdl):
    """The decode chain of one KDA + MoE-router layer (plus the other norms) on P's weights and S's state pools,
    every launch with pdl -> dict of outputs. 11 kernels in stream order, each reading its predecessor's output."""
    from kernels.kda import kda_decode_triton
    eps, k, E, top_k = 1e-6, P["K"], P["E"], P["top_k"]
    out = {}
    out["xn"], out["h"] = norm_mod.add_rmsnorm_triton(P["x"], P["res"], P["w1"], eps, pdl=pdl)
    y = gemv_mod.gemv_triton(out["xn"], P["W_in"], pdl=pdl)                                    # in_proj
    C, HK, H = P["C"], P["HK"], P["H"]
    out["y"] = y
    out["o"] = kda_decode_triton(y[:, :C], S["conv_w"], y[:, C:C + HK], y[:, C + HK:C + HK + H], S["A_log"],
                                 S["dt_bias"], y[:, C + HK + H:], S["o_norm_w"], 1e-5, S["conv_state"],
                                 S["rec_state"], P["slots"], pdl=pdl)
    out["a"] = gemv_mod.gemv_triton(out["o"], P["W_o"], pdl=pdl)                               # o_proj (split K)
    out["xn2"], out["h2"] = norm_mod.add_rmsnorm_triton(out["a"], out["h"], P["w2"], eps, pdl=pdl)
    out["tw"], out["ids"] = router_mod._router_decode_v1(out["xn2"], P["gate"], P["bias"], top_k, 2.5, True, False,
                                                         E, pdl=pdl)
    out["tw3"], out["ids3"] = router_mod._router_decode_v2(out["xn2"], P["gate"], P["bias"], top_k, 2.5, True,
                                                           False, E, poll=True, pdl=pdl)
    out["m"], out["h3"] = norm_mod.combine_add_rmsnorm_triton(P["Y"], out["tw"], out["h2"], P["w3"], eps, pdl=pdl)
    fg_a = out["m"][:, :2 * k].view(-1, 2, k).transpose(0, 1)                                 # [2, N, K] strided
    out["fg"] = gemv_mod.gemv_triton(fg_a, P["fg_b"], pdl=pdl)                                 # batched f_b | g_b
    out["r"] = norm_mod.rmsnorm_triton(out["fg"][0], P["w4"], eps, pdl=pdl)
    out["lat"] = norm_mod.rmsnorm_head_triton(out["r"][:, :P["w5"].numel() + P["rope"]], P["w5"], eps, pdl=pdl)
    return out


def _chain_inputs(N, device="cuda", D=2304, H=32, K=128, E=256, top_k=8):
    """Kimi shapes by default (V = K; MLA latent 512 + rope 64 for rmsnorm_head)."""
    g = torch.Generator(device=device).manual_seed(N)
    bf, V = torch.bfloat16, K

    def rnd(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    C, HK = 2 * H * K + H * V, H * K
    rope = 64 if HK >= 576 else 8
    lat = min(512, HK - rope)
    P = dict(x=rnd(N, D), res=rnd(N, D), w1=rnd(D, scale=0.1) + 1, w2=rnd(D, scale=0.1) + 1,
             w3=rnd(D, scale=0.1) + 1, w4=rnd(HK, scale=0.1) + 1, w5=rnd(lat, scale=0.1) + 1,
             W_in=rnd(C + HK + H + H * V, D, scale=D ** -0.5), W_o=rnd(D, H * V, scale=(H * V) ** -0.5),
             gate=rnd(E, D, scale=D ** -0.5), bias=rnd(E, scale=0.01, dtype=torch.float32),
             Y=rnd(N * (top_k + 1), D), fg_b=rnd(2, HK, K, scale=K ** -0.5), C=C, HK=HK, H=H, K=K, E=E, top_k=top_k, rope=rope,
             slots=torch.tensor([3, 1, 0, 7, 2, 0, 5, 4][:N], dtype=torch.int32, device=device))
    S = make_kda_layer(H, K, V, 8, device=device, conv_dtype=bf)
    return P, S


def _clone(S):
    return {k: v.clone() for k, v in S.items()}


def _close(a, b, key, tol=2e-2):
    a, b = a.float(), b.float()
    assert (a - b).abs().max() <= tol * max(1.0, b.abs().max().item()), (key, (a - b).abs().max())


def _check_chain_refs(P, S0, got):
    """Each launch of _chain against its torch reference, fed the kernels' own inputs (so errors do not compound):
    S0 is the state pools before the chain ran."""
    from kernels.kda import kda_decode_ref
    from kernels.moe.ref import moe_router_ref

    eps, C, HK, H, k = 1e-6, P["C"], P["HK"], P["H"], P["K"]
    xn, h = norm_mod.add_rmsnorm_ref(P["x"], P["res"], P["w1"], eps)
    _close(got["xn"], xn, "xn")
    _close(got["h"], h, "h")
    _close(got["y"], gemv_mod.gemv_ref(got["xn"], P["W_in"]), "y")
    y, S = got["y"], _clone(S0)
    o = kda_decode_ref(y[:, :C], S["conv_w"], y[:, C:C + HK], y[:, C + HK:C + HK + H], S["A_log"], S["dt_bias"],
                       y[:, C + HK + H:], S["o_norm_w"], 1e-5, S["conv_state"], S["rec_state"], P["slots"])
    _close(got["o"], o, "o")
    _close(got["a"], gemv_mod.gemv_ref(got["o"], P["W_o"]), "a")
    xn2, h2 = norm_mod.add_rmsnorm_ref(got["a"], got["h"], P["w2"], eps)
    _close(got["xn2"], xn2, "xn2")
    _close(got["h2"], h2, "h2")
    tw, ids = moe_router_ref(got["xn2"], P["gate"], P["bias"], P["top_k"], 2.5, True, False,
                             append_expert=P["E"])                                  # + the shared expert's id E
    for w_key, id_key in (("tw", "ids"), ("tw3", "ids3")):
        assert torch.equal(got[id_key].long().sort(-1).values, ids.long().sort(-1).values), id_key
        order_got, order_ref = got[id_key].long().argsort(-1), ids.long().argsort(-1)
        _close(got[w_key].gather(-1, order_got), tw.gather(-1, order_ref), w_key, 1e-3)
    m, h3 = norm_mod.combine_add_rmsnorm_ref(P["Y"], got["tw"], got["h2"], P["w3"], eps)
    _close(got["m"], m, "m")
    _close(got["h3"], h3, "h3")
    fg_a = got["m"][:, :2 * k].view(-1, 2, k).transpose(0, 1)
    _close(got["fg"], gemv_mod.gemv_ref(fg_a, P["fg_b"]), "fg")
    _close(got["r"], norm_mod.rmsnorm_ref(got["fg"][0], P["w4"], eps), "r")
    _close(got["lat"], norm_mod.rmsnorm_head_ref(got["r"][:, :P["w5"].numel() + P["rope"]], P["w5"], eps), "lat")
    return S


@requires_triton
def test_chain_small():
    """The GPU test's chain at small shapes on any device: every launch against its torch reference (state pools
    included, two steps), and pdl on / off bit for bit (the interpreter forces PDL off, so that part only means
    something on a GPU, where this is a real PDL chain, eager)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    P, S = _chain_inputs(2, dev, D=64, H=2, K=16, E=16, top_k=4)
    A, B = _clone(S), _clone(S)
    for _ in range(2):
        before = _clone(B)
        ref, got = _chain(P, A, False), _chain(P, B, True)
        for key in ref:
            assert torch.equal(ref[key], got[key]), key
        after = _check_chain_refs(P, before, got)
        _close(B["rec_state"], after["rec_state"], "rec_state")
        _close(B["conv_state"], after["conv_state"], "conv_state")
    assert torch.equal(A["rec_state"], B["rec_state"]) and torch.equal(A["conv_state"], B["conv_state"])
    assert not torch.equal(A["rec_state"], S["rec_state"])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8])
def test_pdl_chain_cuda_graph_gpu(N):
    """The chain captured in a CUDA graph with every launch PDL (programmatic edges) vs the same chain without PDL:
    every output and the KDA state pools bit-identical over 3 replays (state carried); eager PDL launches too."""
    P, S = _chain_inputs(N)
    S_ref, S_pdl, S_eager, S_eager_pdl = _clone(S), _clone(S), _clone(S), _clone(S)
    _chain(P, _clone(S), False)                      # compile both variants outside the captures
    _chain(P, _clone(S), True)
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for name, st, flag in (("ref", S_ref, False), ("pdl", S_pdl, True)):
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            outs[name] = _chain(P, st, flag)
    for step in range(3):
        graphs["ref"].replay()
        graphs["pdl"].replay()
        e_ref = _chain(P, S_eager, False)
        e_pdl = _chain(P, S_eager_pdl, True)
        torch.cuda.synchronize()
        for key in outs["ref"]:
            for got, name in ((outs["pdl"][key], "graph pdl"), (e_pdl[key], "eager pdl"), (e_ref[key], "eager")):
                assert torch.equal(got, outs["ref"][key]), (step, key, name)
        for st in (S_pdl, S_eager, S_eager_pdl):
            assert torch.equal(st["rec_state"], S_ref["rec_state"]), step
            assert torch.equal(st["conv_state"], S_ref["conv_state"]), step
    assert not torch.equal(S_ref["rec_state"], S["rec_state"])        # the chain did update the pools


@pytest.mark.gpu
def test_pdl_kda_variants_gpu():
    """The KDA decode's other tails (two-launch post kernel, persistent loop) with PDL: bit-identical to no PDL."""
    from kernels.kda import kda_decode_triton
    P, S = _chain_inputs(8)
    toks = [torch.randn(8, P["W_in"].shape[0], device="cuda").to(torch.bfloat16)
            for _ in range(3)]
    C, HK, H = P["C"], P["HK"], P["H"]
    for kw in (dict(BV=32, tail=rec_mod.TAIL_POST), dict(BV=16, tail=rec_mod.TAIL_LOOP, pps=2)):
        A, B = _clone(S), _clone(S)
        for y in toks:
            res = []
            for st, flag in ((A, False), (B, True)):
                res.append(kda_decode_triton(y[:, :C], st["conv_w"], y[:, C:C + HK], y[:, C + HK:C + HK + H],
                                             st["A_log"], st["dt_bias"], y[:, C + HK + H:], st["o_norm_w"], 1e-5,
                                             st["conv_state"], st["rec_state"], P["slots"], pdl=flag, **kw))
            assert torch.equal(res[0], res[1]), kw
        assert torch.equal(A["rec_state"], B["rec_state"]) and torch.equal(A["conv_state"], B["conv_state"]), kw
