"""bench/e2e.py --smoke on the CPU at small sizes: the H200 benchmark's code paths (engine build, steady decode of a
full batch, prefill timing, the speed-of-light table) still run after engine or model changes. 64 sequences of 1024
prompt tokens exceed the scheduler's prefill cap while earlier ones decode, the case that once broke the decode
timing ('a request finished during the measurement')."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_smoke_small():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--decode-batches", "64",
           "--decode-context", "1024", "--decode-steps", "4", "--prefill", "128"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("| decode b64 ctx1024 greedy |", "| prefill 128"):
        assert row in p.stdout, p.stdout[-3000:]


def test_ablate_smoke():
    """bench/ablate.py --smoke: every stand-in (kernel-group ablations, the projection groups) and a --set case run;
    an unknown --set attribute or ablation name is refused."""
    ablate = os.path.join(ROOT, "bench", "ablate.py")
    cmd = [sys.executable, ablate, "--smoke", "--steps", "2", "--context", "16",
           "--set", "kernels.gemv.PDL_L2_MB=8;kernels.gemv.PDL_MAX_LINES=16"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("(none) ", "router ", "lin_o ", "lin_lm_head ", "moe ", "kernels.gemv.PDL_L2_MB=8", "(none, again)"):
        assert row in p.stdout, p.stdout[-3000:]
    for bad in (["--set", "kernels.gemv.NO_SUCH=1"], ["--only", "no_such_group"]):
        p = subprocess.run([sys.executable, ablate, "--smoke", *bad], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode != 0 and ("no attribute" in p.stderr or "unknown ablation" in p.stderr), p.stderr[-2000:]
