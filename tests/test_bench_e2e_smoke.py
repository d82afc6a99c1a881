"""bench/e2e.py --smoke on the CPU at small sizes: the H200 benchmark's code paths (engine build, steady decode of a
full batch, prefill timing, the speed-of-light table) still run after engine or model changes. 64 sequences of 256
prompt tokens take 8 steps of 2048 tokens to admit while earlier ones decode, the case that once broke the decode
timing ('a request finished during the measurement'; 1024-token prompts and 8192-token steps as on the GPU took 2-5
minutes of CI here, the same paths)."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_smoke_small():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--decode-batches", "64",
           "--decode-context", "256", "--max-num-batched-tokens", "2048", "--decode-steps", "4", "--prefill", "128", "--multi-turn", "200",
           "--turn-tokens", "40", "--grammar", "--grammar-threads", "2", "--score", "150", "--score-candidates", "4",
           "--warmup", "--sampled-batches", "1,64", "--sampled-generic"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("| decode b64 ctx256 greedy |", "| prefill 128", "| next turn TTFT, 200 cached + 40 new |",
                "| decode b64 ctx256 greedy, JSON grammar |",
                "| decode b64 ctx256 greedy, 1 row with a JSON grammar |",
                "| decode b64 ctx256 greedy, repetition_penalty 1.1 |",
                "| decode b64 ctx256 greedy, JSON grammar, 2 mask threads |",
                "| Score, 150-token prompt, 4 candidates x 8 tokens |"):
        assert row in p.stdout, p.stdout[-3000:]
    assert re.search(r"warm-up \(\d+ requests, backend/engine/warmup\.py\) #2:", p.stdout), p.stdout[-3000:]
    for b in (1, 64):   # --sampled-batches
        assert f"| decode b{b} ctx256 T0.6 top_p0.95 min_p0.01 |" in p.stdout, p.stdout[-3000:]
        assert f"| decode b{b} ctx256 T0.9 top_k40 top_p0.95 |" in p.stdout, p.stdout[-3000:]   # --sampled-generic


def test_e2e_profile_smoke():
    """--profile on the CPU: the decode case and the prefill step report their activities (the prefill case once
    profiled an empty step: its unprofiled lead step had run the prompt)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--decode-batches", "1",
           "--decode-steps", "2", "--prefill", "", "--profile", "--profile-prefill", "32", "--sampled-generic"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if "the 32-token step]" in x)
    assert int(line.split("]")[1].split()[0]) > 100, line  # device activities (CPU: aten ops) in that step
    assert "by launches" in p.stdout and "=== profile: decode b1 greedy" in p.stdout
    # --sampled-generic: LocalAI's generic rows profiled at the smallest batch too
    assert "=== profile: decode b1 T0.9 top_k40 top_p0.95 (batch 1" in p.stdout, p.stdout[-3000:]


def test_ablate_smoke():
    """bench/ablate.py --smoke: every stand-in (kernel-group ablations, the projection groups) and a --set case run;
    an unknown --set attribute or ablation name is refused."""
    ablate = os.path.join(ROOT, "bench", "ablate.py")
    cmd = [sys.executable, ablate, "--smoke", "--steps", "2", "--context", "16", "--prefill", "24,40",
           "--set", "kernels.gemv.PDL_L2_MB=8;kernels.gemv.PDL_MAX_LINES=16"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("(none) ", "router ", "lin_o ", "lin_lm_head ", "moe ", "kernels.gemv.PDL_L2_MB=8", "(none, again)",
                "prefill 24 prefill 40"):
        assert row in p.stdout, p.stdout[-3000:]
    for bad in (["--set", "kernels.gemv.NO_SUCH=1"], ["--only", "no_such_group"]):
        p = subprocess.run([sys.executable, ablate, "--smoke", *bad], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode != 0 and ("no attribute" in p.stderr or "unknown ablation" in p.stderr), p.stderr[-2000:]


def test_timeline_sweep(tmp_path):
    """bench/timeline.py on a synthetic trace: 2 replays of [a 0-10, b 8-14 (overlaps a by 2), c 16-20]; the second
    replay is read: idle 2 us (14-16), a gets 8 + 2/2, b 1 + 4, c 4."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import timeline

    ev = []
    for r in (0, 100):
        for name, ts, dur, grid in (("a", 0, 10, [4, 1, 1]), ("b", 8, 6, [2, 1, 1]), ("c", 16, 4, [1, 1, 1])):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": r + ts, "dur": dur, "args": {"grid": grid}})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    ks = timeline.one_replay(timeline.load_kernels(str(path)), 2)
    assert [k[0] for k in ks] == [100, 108, 116] and ks[0][2] == "a [4, 1, 1]"
    idle, att, exc = timeline.sweep(ks)
    assert idle == 2.0
    assert (att[0], att[1], att[2]) == (9.0, 5.0, 4.0) and (exc[0], exc[1], exc[2]) == (8.0, 4.0, 4.0)


def test_sampling_bench_smoke():
    """bench/sampling.py --smoke (interpreter, V = 1000): the greedy table (torch.argmax vs kernels/argmax.py, equal
    ids) and every sampled case (the filtered race, and with the nucleus check, agreeing with the torch path) run."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sampling.py"), "--smoke"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "greedy argmax, V=1000" in p.stdout and "| yes |" in p.stdout, p.stdout[-3000:]
    from tests.bench_module import load_bench

    n = len(load_bench("sampling").CASES)                              # every case: ours and nucleus agree
    assert n >= 5 and p.stdout.count("2/2, 2/2") == n and "MISMATCH" not in p.stdout, p.stdout[-3000:]


def test_e2e_speed_of_light_bandwidth_by_card():
    """bench/e2e.py's default --bw: the card's datasheet HBM bandwidth (an H100 run was once rated at the H200's)."""
    from tests.bench_module import load_bench

    e2e = load_bench("e2e")
    assert e2e.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert e2e.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert e2e.hbm_bandwidth("NVIDIA GB10") == 0.273e12
    assert e2e.hbm_bandwidth("cpu") == 4.8e12
