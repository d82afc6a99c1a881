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
