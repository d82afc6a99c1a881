"""Jit helpers shared by the kernels: the interpreter flag and the interpreter-exact bf16 conversion.

INTERPRET: TRITON_INTERPRET=1 (CPU CI). The interpreter multiplies the raw uint16 storage of bf16 operands in tl.dot,
so under it the kernels upcast dot operands to fp32 (exact for bf16 / fp16 products, results unchanged), and it
truncates fp32 -> bf16 where GPUs round to nearest even: cast_to(v, DT, INTERPRET) rounds by hand there.
"""
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET:
    from kernels import _prebuilt

    _prebuilt.install()  # where Triton cannot build (LocalAI's runtime images): it loads install.sh's prebuilt module


@triton.jit
def cast_to(v, DT: tl.constexpr, EMUL_RTNE: tl.constexpr):
    """v.to(DT). The interpreter truncates fp32 -> bf16 (GPUs round to nearest even); with EMUL_RTNE (= INTERPRET)
    the rounding is done by hand so CPU CI sees the GPU numerics."""
    if EMUL_RTNE and DT == tl.bfloat16:
        b = v.to(tl.float32).to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DT)
