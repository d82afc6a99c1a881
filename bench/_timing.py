"""Timing helpers shared by the kernel benchmarks (bench/conv.py, bench/gemv.py, bench/moe.py)."""
from __future__ import annotations

import statistics
import time

import torch


def time_us(fns, smoke: bool, replays: int = 20) -> float:
    """Median us per call of one CUDA graph running each fn once (smoke / CPU: wall time of one eager pass)."""
    if smoke:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e6 / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:                                     # compile + warm up outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def copy_bandwidth(device, smoke: bool) -> float:
    """Device copy bandwidth (read + write bytes / s) of a 1 GiB copy, in a graph."""
    n = (64 << 20) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = time_us([lambda: b.copy_(a)] * (1 if smoke else 5), smoke)
    return 2 * n / (us * 1e-6)
