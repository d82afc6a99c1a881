"""H200 benchmark: short conv + SiLU prefill (kernels/conv.py) at the Kimi-Linear-48B shape, streaming kernel vs the
earlier token-tile kernel.

    python bench/conv.py [--sweep] [--smoke]

x is the q|k|v slice (C = 3 * 32 * 128 = 12288 channels) of the KDA in_proj output [T, 12576] (a row view, as in
backend/model/kimi_linear.py), bf16; w [C, 4] fp32; conv state bf16 [80, 3, C]. Cases: one 8192-token sequence and
16 x 512 tokens (alternating initial state). Per case and kernel: us per call inside a CUDA graph, GB/s counting one
read and one write of [T, C] bf16, % of the device-to-device copy bandwidth of the same run (2 * bytes / t of a
1 GiB copy), and the speed-up of the streaming kernel; each output is first checked against the torch reference.
--sweep: also the streaming kernel's launch configs in SWEEP (adds ~1 s of compilation per config and case).
--smoke: CPU, Triton interpreter, tiny shapes: runs every code path (CI check of this file), timings meaningless.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernels.conv import PREFILL_CONFIG, PrefillConfig, short_conv_prefill_ref, short_conv_prefill_triton  # noqa: E402
from kernels.testing import assert_close, bf16_tol  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: _timing when loaded by path
from _timing import copy_bandwidth, time_us  # noqa: E402  (bench/ is sys.path[0] when run)

C_KIMI, PROJ_KIMI, W = 3 * 32 * 128, 3 * 32 * 128 + 2 * 128 + 32, 4
CASES = [("1 x 8192", [8192]), ("16 x 512", [512] * 16)]
SMOKE_CASES = [("1 x 40", [40]), ("4 x 10", [10, 1, 3, 26])]
SWEEP = [PrefillConfig(RS=4), PrefillConfig(PF=True), PrefillConfig(RS=4, PF=True), PrefillConfig(BT=32),
         PrefillConfig(BT=128), PrefillConfig(BT=32, BC=512, num_warps=2)]


class Case:
    """x [T, C] (row view of the projection), w, a state pool, cu_seqlens / slots / initial-state flags."""

    def __init__(self, lens, C, proj, device):
        T, P = sum(lens), len(lens)
        self.proj = torch.randn(T, proj, device=device).to(torch.bfloat16)
        self.x = self.proj[:, :C]
        self.w = torch.randn(C, W, device=device) * 0.5
        self.state = torch.randn(80, W - 1, C, device=device).to(torch.bfloat16)
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        self.slots = torch.arange(1, P + 1, dtype=torch.int32, device=device)
        self.his = torch.tensor([i % 2 == 0 for i in range(P)], device=device).to(torch.int8)   # no cast per call
        self.out = torch.empty(T, C, device=device, dtype=torch.bfloat16)
        self.nbytes = 2 * T * C * 2

    def run(self, impl, cfg=None):
        return short_conv_prefill_triton(self.x, self.w, self.state, self.cu, self.slots, self.his, out=self.out,
                                         impl=impl, cfg=cfg)

    def check(self, impl, cfg=None):
        s0 = self.state.clone()
        s_ref = s0.clone()
        y_ref = short_conv_prefill_ref(self.x, self.w, s_ref, self.cu, self.slots, self.his)
        assert_close(f"{impl} y", self.run(impl, cfg), y_ref, bf16_tol())
        assert torch.equal(self.state, s_ref), f"{impl}: state differs from the reference"
        self.state.copy_(s0)


def describe(cfg: PrefillConfig) -> str:
    return f"BT{cfg.BT} BC{cfg.BC} w{cfg.num_warps} RS{cfg.RS}{' PF' if cfg.PF else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    t_start = time.perf_counter()
    cases = SMOKE_CASES if smoke else CASES
    C, proj = (48, 60) if smoke else (C_KIMI, PROJ_KIMI)
    bw = copy_bandwidth(device, smoke)
    name = "cpu (interpreter)" if smoke else torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s; C = {C}, bf16, W = {W}; GB/s = 2 * T * C * 2 B / t")
    print(f"{'case':10s} {'kernel':28s} {'us':>8s} {'GB/s':>6s} {'%copy':>6s} {'vs tile':>7s}")
    for cname, lens in cases:
        case = Case(lens, C, proj, device)
        rows = [("tile (old)", "tile", None), (f"stream {describe(PREFILL_CONFIG)}", "stream", None)]
        if args.sweep:
            rows += [(f"stream {describe(c)}", "stream", c) for c in SWEEP]
        t_tile = None
        for label, impl, cfg in rows:
            case.check(impl, cfg)
            us = time_us([lambda: case.run(impl, cfg)] * (1 if smoke else 5), smoke)
            t_tile = t_tile or us
            gbs = case.nbytes / (us * 1e-6)
            print(f"{cname:10s} {label:28s} {us:8.1f} {gbs / 1e9:6.0f} {100 * gbs / bw:6.1f} {t_tile / us:6.2f}x")
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
