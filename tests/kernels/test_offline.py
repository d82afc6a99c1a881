"""kernels/_offline.py: compile_offline (offline sm_90 build through Triton's bundled ptxas / cuobjdump, no GPU) and
sass_loop_stats. The compiles run in a subprocess without TRITON_INTERPRET (this file run as a script: the interpreter
would replace the jit functions); sass_loop_stats is also checked on hand-written SASS."""
import json
import os
import sys

import pytest
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script (the subprocess of test_compile_offline_sm90)
    sys.path.insert(0, ROOT)

from kernels._offline import LOOP_KEYS, cuobjdump_path, loop_summary, ptx_fingerprint, sass_loop_stats


@triton.jit
def _dot_loop_kernel(a_ptr, b_ptr, c_ptr, K, stride_a, stride_b, stride_c, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    """c[BM, BN] = a[BM, K] @ b[K, BN], K in BK steps (a loop with a tl.dot in it)."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * stride_a + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_b + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_c + rn[None, :], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, B: tl.constexpr):
    """y = 2 x over one block (no loop)."""
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2, mask=o < n)


def _offline():
    """Builds of the two kernels above for sm_90 -> {name: fields of OfflineKernel}."""
    from kernels._offline import compile_offline

    out = {}
    sig = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", K="i32", stride_a="i32", stride_b="i32", stride_c="i32")
    div = ("a_ptr", "b_ptr", "c_ptr", "K", "stride_a", "stride_b", "stride_c")
    builds = {
        "dot s3 w4": compile_offline(_dot_loop_kernel, sig, dict(BM=64, BN=64, BK=32), num_warps=4, num_stages=3,
                                     divisible=div),
        "dot s1 w4": compile_offline(_dot_loop_kernel, sig, dict(BM=64, BN=64, BK=32), num_warps=4, num_stages=1,
                                     divisible=div),
        "dot s3 w2": compile_offline(_dot_loop_kernel, sig, dict(BM=64, BN=64, BK=32), num_warps=2, num_stages=3,
                                     divisible=div),
        "copy": compile_offline(_copy_kernel, dict(x_ptr="*fp32", y_ptr="*fp32", n="i32"), dict(B=256),
                                num_warps=4),
    }
    for name, b in builds.items():
        out[name] = dict(regs=b.regs, stack=b.stack, local=b.local, smem=b.smem, mma=b.mma, rings=b.rings,
                         stages=b.ring_stages, loop=b.loop, summary=loop_summary(b.loop),
                         ptx_wgmma="wgmma" in b.ptx, ptx_mma_sync="mma.sync" in b.ptx,
                         sass_hmma=b.sass.count("HMMA"), sass_hgmma=b.sass.count("HGMMA"),
                         target=b.kernel.metadata.target.arch, warps=b.kernel.metadata.num_warps)
    # without cuobjdump: the compile-side fields still there, the cuobjdump ones raise CuobjdumpError on use
    import kernels._offline as off

    real, off.cuobjdump_path = off.cuobjdump_path, lambda: "/nonexistent/cuobjdump"
    try:
        b = compile_offline(_copy_kernel, dict(x_ptr="*fp32", y_ptr="*fp32", n="i32"), dict(B=128), num_warps=4)
        out["no cuobjdump"] = dict(smem=b.smem, mma=b.mma, errors=[])
        for field in ("regs", "sass"):
            try:
                getattr(b, field)
            except off.CuobjdumpError as e:
                out["no cuobjdump"]["errors"].append(str(e))
    finally:
        off.cuobjdump_path = real
    return out


@pytest.mark.slow
def test_compile_offline_sm90():
    """A loop with a tl.dot: registers from cuobjdump, the PTX's MMA kind (4 warps wgmma, 2 warps mma.sync), a
    3-stage smem ring of both operand tiles (64x32 + 32x64 bf16 per stage), the MMAs inside the loop body (ldmatrix
    loads with mma.sync); one stage: no ring; the copy kernel: no loop, no smem, no MMA."""
    if not os.path.exists(cuobjdump_path()):
        pytest.skip("no bundled cuobjdump: " + cuobjdump_path())
    from tests.kernels.conftest import run_offline   # here: this file also runs as the script (no tests package)

    res = run_offline(script=os.path.abspath(__file__), timeout=600)
    print("\n".join(f"{k}: {v}" for k, v in res.items()))
    for name in ("dot s3 w4", "dot s1 w4", "dot s3 w2"):
        b = res[name]
        assert b["target"] == 90 and b["warps"] == int(name[-1]), b
        assert 0 < b["regs"] <= 255 and b["stack"] == 0, b
        assert b["mma"] == ("wgmma" if b["ptx_wgmma"] else "mma.sync" if b["ptx_mma_sync"] else "fma"), b
        lp = b["loop"]
        assert lp["loop"] is not None and lp["loop"][0] < lp["loop"][1], lp
        # the MMAs are in the loop body (the dot is only there; Triton may peel an iteration out of it)
        assert 0 < lp["HGMMA" if b["mma"] == "wgmma" else "HMMA"], (b["mma"], lp)
        assert lp["HMMA"] <= b["sass_hmma"] and lp["HGMMA"] <= b["sass_hgmma"], (lp, b)
        assert lp["instrs"] > lp["HMMA"] + lp["HGMMA"] + lp["LDSM"] + lp["LDGSTS"], lp
        assert lp["LDSM"] == sum(lp[k] for k in LOOP_KEYS if k.startswith("LDSM.")), lp
        assert b["summary"].startswith(f"loop {lp['instrs']} instrs: "), b["summary"]
    s3, s1, w2 = res["dot s3 w4"], res["dot s1 w4"], res["dot s3 w2"]
    # 4 warps: wgmma (operands from smem); 2 warps: mma.sync with ldmatrix loads of the operands in the loop
    assert (s3["mma"], s1["mma"], w2["mma"]) == ("wgmma", "wgmma", "mma.sync"), (s3["mma"], w2["mma"])
    assert w2["loop"]["LDSM"] > 0 and w2["loop"]["HGMMA"] == 0 and s3["loop"]["HMMA"] == 0, (w2["loop"], s3["loop"])
    # 3 stages: a [3, 64, 32] and a [3, 32, 64] bf16 ring (smem >= both, 24 KB); 1 stage: no stage dim
    assert sorted(map(tuple, s3["rings"])) == [(3, 32, 64), (3, 64, 32)] and s3["stages"] == [3], s3["rings"]
    assert s3["smem"] >= 3 * 2 * 64 * 32 * 2, s3["smem"]
    assert s1["rings"] == [] and s1["stages"] == [], s1["rings"]
    assert sorted(r[1:] for r in map(tuple, w2["rings"])) == [(32, 64), (64, 32)] and len(w2["stages"]) == 1
    assert s1["loop"]["LDGSTS"] == 0 < s3["loop"]["LDGSTS"], (s1["loop"], s3["loop"])   # cp.async only pipelined
    c = res["copy"]
    assert c["mma"] == "fma" and c["smem"] == 0 and c["rings"] == [] and 0 < c["regs"], c
    assert c["loop"]["loop"] is None and c["loop"]["instrs"] == 0 and not any(c["loop"][k] for k in LOOP_KEYS)
    assert c["summary"] == "loop -"
    n = res.pop("no cuobjdump")
    assert n["smem"] == 0 and n["mma"] == "fma" and len(n["errors"]) == 2, n
    assert all(e.startswith("cuobjdump -") and "/nonexistent/cuobjdump" in e for e in n["errors"]), n


_SASS = """
        code for sm_90a
                Function : k
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                   /* 0x00000a00ff017b82 */
                                                                                            /* 0x000fe20000000800 */
        /*0010*/              @!P0 BRA 0x40 ;                                               /* 0x0000000000088947 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;                    /* 0x0000000c0804723c */
        /*0030*/                   LDSM.16.M88.4 R8, [R125+UR5+0x10000] ;                   /* 0x000000007d08783b */
        /*0040*/                   LDSM.16.MT88.4 R12, [R3] ;                               /* 0x000000000303783b */
        /*0050*/                   LDSM.16.M88.2 R14, [R3+0x800] ;                          /* 0x000000000303783b */
        /*0060*/                   LDSM.16.M88 R16, [R3+0x800] ;                            /* 0x000000000303783b */
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;                    /* 0x0000000c0804723c */
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                            /* 0x0000000000007b1d */
        /*0090*/                   LDS.128 R20, [R2] ;                                      /* 0x000000000214784 */
        /*00a0*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;             /* 0x000000000603 */
        /*00b0*/              @!P1 BRA 0x60 ;                                               /* 0xfffffffc00fc7947 */
        /*00c0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;           /* 0x0000000008187df0 */
        /*00d0*/                   STL [R1], R4 ;                                           /* 0x0000000401007387 */
        /*00e0*/               @P2 BRA 0x40 ;                                               /* 0xffffffbc00380947 */
        /*00f0*/                   STG.E desc[UR4][R2.64], R4 ;                             /* 0x0000000402007986 */
        /*0100*/                   EXIT ;                                                   /* 0x000000000000794d */
        /*0110*/                   BRA 0x110;                                               /* 0xfffffffc00fc7947 */
"""


def test_sass_loop_stats_synthetic():
    """The widest backward branch (0xe0 -> 0x40, not the inner 0xb0 -> 0x60, nor the forward 0x10 -> 0x40 or the
    trailing self-branch) bounds the body; classes split by LDSM layout / width; the encoding comments are not
    branch targets."""
    s = sass_loop_stats(_SASS)
    assert s["loop"] == (0x40, 0xE0), s
    assert s["instrs"] == 11, s
    want = {"HMMA": 1, "HGMMA": 1, "LDSM": 3, "LDSM.MT88.4": 1, "LDSM.M88.2": 1, "LDSM.M88.1": 1, "BAR.SYNC": 1,
            "LDS": 1, "LDGSTS": 1, "STL": 1}
    assert {k: s[k] for k in LOOP_KEYS if s[k]} == want, s
    assert loop_summary(s).startswith("loop 11 instrs: HMMA 1, HGMMA 1, LDSM 3"), loop_summary(s)
    empty = sass_loop_stats(_SASS.replace("@P2 BRA 0x40", "@P2 BRA 0xf0").replace("@!P1 BRA 0x60", "NOP"))
    assert empty["loop"] is None and empty["instrs"] == 0 and not any(empty[k] for k in LOOP_KEYS), empty
    assert sass_loop_stats("")["loop"] is None


if __name__ == "__main__":
    print(json.dumps(_offline()))


_PTX = """//
// Generated by LLVM NVPTX Back-End
//
.version 8.7
.target sm_90a
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0
)
{
	.loc	1 12 0                          // a.py:12:0
	ld.global.b32 	%r1, [%rd1];  // line @N@
	st.global.b32 	[%rd2], %r1;
	ret;
}
	.file	1 "/work/@P@/a.py"
	.section	.debug_abbrev
	{
.b8 @N@
	}
"""


def test_ptx_fingerprint_ignores_source_positions():
    """Line info, file paths, comments and debug sections do not move the fingerprint; an instruction does."""
    def ptx(n, path):
        return _PTX.replace("@N@", str(n)).replace("@P@", path)

    a = ptx_fingerprint(ptx(1, "x"))
    assert a == ptx_fingerprint(ptx(7, "y").replace("12 0", "40 0"))
    assert a != ptx_fingerprint(ptx(1, "x").replace("ld.global.b32", "ld.global.cg.b32"))
    assert len(a) == 16 and int(a, 16) >= 0
