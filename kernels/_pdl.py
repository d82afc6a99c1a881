"""Programmatic dependent launch (PDL) for the decode chain: shared jit helpers and the launch switch.

A kernel launched with PDL (launch kwarg launch_pdl=True, Triton >= 3.6) may start its CTAs while the previous kernel
in the stream is still running: once every CTA of that kernel has executed griddepcontrol.launch_dependents (or
exited). Contract of every kernel here that takes GDC=True:
  * before gdc_wait(): only pointer math and reads of weights / constants (never an activation, slot index, counter
    or anything a kernel of this step writes), and L2 prefetches (hints: L2 is the coherence point, so a prefetched
    line is never stale for a load after the wait). One exception, the KDA decode's early state
    (kernels/kda/recurrent.py, "Early state"): it reads the slot index (state_slots: written only by host -> device
    copies before the step, never by a kernel of it) before the wait, and with KIMI_KDA_EARLY_STATE=2 the state
    tile of this layer's recurrent pool (written only by this layer's KDA kernels, never by the kernel launched just
    before the decode: the layer's f_b|g_b skinny_bmm_nt). Sound because when kernel N starts, kernel N-1 has passed
    its wait, so every kernel before N-1 has completed and its writes are visible; the activations stay after the
    wait;
  * gdc_wait() in every CTA (it waits for the previous grid's completion and memory flush; a PDL-launched kernel
    that never waits would let its successor's wait see only its own completion: the chain's transitivity breaks);
  * gdc_launch_dependents() right after the wait: the next kernel's pre-wait part overlaps this kernel's body, and
    at most two kernels of the chain are resident at once (signalling before the wait would stack waiting CTAs of
    several kernels on the SMs);
  * no stores before the wait (the previous kernel may still read the buffers).
Without PDL both instructions are no-ops, so GDC kernels give the same bits either way.

KIMI_PDL (read once at import): "1" on, "0" off, unset / "auto" on when CUDA device 0 is sm_90 or newer (Hopper,
Blackwell, GB10: griddepcontrol and launch_pdl need it; H200 12-03 e2e b1 2.51 -> 2.44 ms/step); always off under
TRITON_INTERPRET (no griddepcontrol there).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from kernels._jit import INTERPRET


def _default_on() -> bool:
    """KIMI_PDL unset / auto: a CUDA device of compute capability >= 9.0 (cudaGetDeviceProperties; no context)."""
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9
    except Exception:  # noqa: BLE001  (no driver, no device: off)
        return False


_ENV = os.environ.get("KIMI_PDL", "auto")
ENABLED = (_ENV == "1" or (_ENV in ("", "auto") and _default_on())) and not INTERPRET


def pdl_on(pdl: bool | None = None) -> bool:
    """The effective switch of one launch: `pdl` (None: KIMI_PDL), never under the interpreter."""
    return (ENABLED if pdl is None else bool(pdl)) and not INTERPRET


def pdl_launch(pdl: bool | None = None, **consts) -> dict:
    """Launch kwargs of a GDC kernel: {} off; else GDC=True (plus the kernel's PDL-only constexprs `consts`) and
    launch_pdl=True."""
    if not pdl_on(pdl):
        return {}
    return dict(GDC=True, **consts, launch_pdl=True)


@triton.jit
def gdc_wait():
    """griddepcontrol.wait: block until the previous grid has completed and its writes are visible (no-op when the
    kernel was not launched with PDL)."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gdc_launch_dependents():
    """griddepcontrol.launch_dependents: the next PDL-launched kernel may start its CTAs once every CTA of this grid
    has executed this (or exited); no-op without a PDL dependent."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """The PDL boundary of a GDC kernel: wait for the previous grid, then let the next one start."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()


_INTERP = tl.constexpr(INTERPRET)  # a jit global must be a constexpr


@triton.jit
def prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of the line of each pointer where mask (a hint: no registers, no fault path taken for
    masked lanes; L2 stays coherent, so this may run before gdc_wait on any address). The interpreter (no PTX) skips
    the hint itself; the addresses and masks leading to it are still computed there."""
    if not _INTERP:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } // $0", "=r,l,r",
            [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_span_l2(ptr, n_lines, pid, nprog, LINE: tl.constexpr, BLOCK: tl.constexpr):
    """Program pid of nprog: L2 prefetch of its share of the n_lines 128-byte lines from ptr (LINE elements each;
    lines pid * BLOCK + j, stepping nprog * BLOCK): the grid together hints the whole span, once per line."""
    for start in range(pid * BLOCK, n_lines, nprog * BLOCK):
        o = start + tl.arange(0, BLOCK)
        prefetch_l2(ptr + o.to(tl.int64) * LINE, o < n_lines)


L2_LINE_BYTES = 128




def l2_span_args(spans, dummy) -> dict:
    """Launch kwargs of prefetch_span_l2's two spans for up to two contiguous tensors of one element size: pf0_ptr,
    pf1_ptr and the constexprs PF0_N, PF1_N (the spans' 128-byte line counts, a partial last line counting) and
    PF_LINE (elements per line); `dummy` stands in for a missing span."""
    spans = tuple(spans or ())
    assert len(spans) <= 2, "at most 2 prefetch spans"
    assert all(t.is_contiguous() for t in spans), "an L2 prefetch span must be contiguous"
    assert len({t.element_size() for t in spans}) <= 1, "prefetch spans of one element size"
    lines = [-(-t.numel() * t.element_size() // L2_LINE_BYTES) for t in spans] + [0, 0]
    ptrs = list(spans) + [dummy, dummy]
    line = L2_LINE_BYTES // spans[0].element_size() if spans else 64
    return dict(pf0_ptr=ptrs[0], pf1_ptr=ptrs[1], PF0_N=lines[0], PF1_N=lines[1], PF_LINE=line)


# --------------------------------------------------------------------------------------------------- offline check
PTX_EVENTS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "prefetch.global.L2", "ld.global",
              "st.global", "atom.")


def ptx_events(fn, consts: dict, ptr_types: dict | None = None, num_warps: int = 4, arch: int = 90) -> list:
    """Compile jit kernel `fn` offline for sm_<arch> (kernels/_offline.py; no GPU, not under TRITON_INTERPRET) with
    the constexprs `consts` (the rest: *_ptr args ptr_types.get(name, "*bf16"), eps / scale fp32, other args i32)
    -> the PTX memory and griddepcontrol instructions in program order (PTX_EVENTS names), to check what runs before
    the wait."""
    from kernels._offline import compile_offline

    ptr_types = ptr_types or {}
    sig, cst = {}, {}
    for p in fn.params:
        if p.is_constexpr or p.name in consts:
            cst[p.name] = consts.get(p.name, p.default)
        elif p.name.endswith("_ptr"):
            sig[p.name] = ptr_types.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in ("eps", "scale") else "i32"
    kern = compile_offline(fn, sig, cst, num_warps=num_warps, arch=arch).kernel
    return [e for line in kern.asm["ptx"].splitlines() for e in PTX_EVENTS if e in line]
