"""Read a decode graph's kernel timeline (a chrome trace from `bench/ablate.py --timeline PATH`), off the GPU.

    python bench/timeline.py trace_b1.json [--reps 3] [--seq 40]

One replay (the middle one of --reps back-to-back replays) is cut from the trace. A sweep over its kernels' start /
end times splits the replay's span into idle time (no kernel running) and busy time; each busy interval is shared
equally among the kernels running in it ("attributed" time: what the kernel costs the step with PDL overlap
included). Kernels are grouped by name and grid (the same kernel at another shape is another group). Printed:
the groups by attributed time (count, mean duration, attributed, exclusive), the idle total, and the first --seq
kernels of the replay in order (start offset, duration, overlap with the one before): one layer's pattern.
"""
import argparse
import json
from collections import defaultdict


def load_kernels(path: str) -> list:
    """-> [(ts us, dur us, label)] of the trace's kernels, by start time."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        grid = e.get("args", {}).get("grid")
        name = e["name"].split("(")[0]
        name = name if len(name) <= 48 else name[:45] + "..."
        out.append((float(e["ts"]), float(e["dur"]), f"{name} {grid}" if grid else name))
    out.sort()
    return out


def one_replay(kernels: list, reps: int) -> list:
    n = len(kernels) // reps
    if n * reps != len(kernels):
        raise SystemExit(f"{len(kernels)} kernels are not {reps} equal replays")
    mid = reps // 2
    return kernels[mid * n:(mid + 1) * n]


def sweep(kernels: list) -> tuple:
    """-> (idle us, {index: attributed us}, {index: exclusive us}) over the kernels' span."""
    points = sorted([(ts, 1, i) for i, (ts, _, _) in enumerate(kernels)] +
                    [(ts + d, -1, i) for i, (ts, d, _) in enumerate(kernels)], key=lambda p: (p[0], p[1]))
    active, idle, last = set(), 0.0, points[0][0]
    attributed, exclusive = defaultdict(float), defaultdict(float)
    for t, kind, i in points:
        dt = t - last
        if dt > 0:
            if not active:
                idle += dt
            for j in active:
                attributed[j] += dt / len(active)
                if len(active) == 1:
                    exclusive[j] += dt
        last = t
        if kind > 0:
            active.add(i)
        else:
            active.discard(i)
    return idle, attributed, exclusive


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=40, help="print the first N kernels of the replay in order")
    args = ap.parse_args()
    ks = one_replay(load_kernels(args.trace), args.reps)
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    idle, att, exc = sweep(ks)
    groups = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for i, (_, d, label) in enumerate(ks):
        g = groups[label]
        g[0] += 1
        g[1] += d
        g[2] += att[i]
        g[3] += exc[i]
    print(f"{len(ks)} kernels, span {span:.1f} us, idle {idle:.1f} us, kernel sum {sum(d for _, d, _ in ks):.1f} us")
    print(f"{'group (name grid)':70s} {'n':>4s} {'mean us':>8s} {'attrib us':>10s} {'excl us':>8s}")
    for label, (n, tot, a, x) in sorted(groups.items(), key=lambda kv: -kv[1][2]):
        print(f"{label:70s} {n:4d} {tot / n:8.2f} {a:10.1f} {x:8.1f}")
    print(f"\nfirst {args.seq} kernels: start offset, duration, overlap with the previous kernel (us)")
    t0 = ks[0][0]
    for i, (ts, d, label) in enumerate(ks[:args.seq]):
        ov = (ks[i - 1][0] + ks[i - 1][1] - ts) if i else 0.0
        print(f"{ts - t0:9.2f} {d:7.2f} {ov:7.2f}  {label}")


if __name__ == "__main__":
    main()
