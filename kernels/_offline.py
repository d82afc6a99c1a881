"""Offline compile of a Triton kernel for an NVIDIA target without a GPU, and what ptxas made of it.

``compile_offline(fn, signature, constexprs, num_warps=..., arch=90)`` runs ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))`` (Triton's bundled ptxas; no GPU, and not under TRITON_INTERPRET, which
replaces the JIT functions) and returns an ``OfflineKernel``: the compiled kernel, its shared memory, the registers
/ stack / local bytes of ``cuobjdump -res-usage`` (Triton's bundled cuobjdump), the MMA kind of the PTX, the TTGIR
ring buffers of the pipelined loads and the SASS (``cuobjdump -sass``), and a fingerprint of its PTX
(ptx_fingerprint: equal across pure refactors). The cuobjdump parts are read on first use, so a missing or failing
cuobjdump raises ``CuobjdumpError`` only where they are asked for (message names cuobjdump).

``sass_loop_stats(sass)`` counts the instruction classes of the main loop body: the address range of the backward
branch (``BRA`` to a lower address) with the largest span. Used by the compile reports of kernels/gemv.py,
kernels/conv.py, kernels/kda/chunk.py, kernels/_pdl.py (ptx_events), bench/kda.py, bench/mla.py (--ptxas, with the
loop statistics of each decode stage-1 build) and the offline tests.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any, Iterable, Optional

import triton


class CuobjdumpError(RuntimeError):
    """Triton's bundled cuobjdump is missing or failed on the cubin."""


def cuobjdump_path() -> str:
    """Triton's bundled cuobjdump (``<triton>/backends/nvidia/bin/cuobjdump``)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cuobjdump(cubin: bytes, *args: str) -> str:
    """stdout of ``cuobjdump <args> <cubin>`` (the cubin written to a temporary file); CuobjdumpError when the tool
    is missing or exits non-zero."""
    exe = cuobjdump_path()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            r = subprocess.run([exe, *args, f.name], capture_output=True, text=True)
        except OSError as e:
            raise CuobjdumpError(f"cuobjdump {' '.join(args)}: {e}") from e
    if r.returncode != 0:
        raise CuobjdumpError(f"cuobjdump {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout


# "local_alloc : () -> !ttg.memdesc<2x64x512xbf16, ...>": an smem buffer with a leading stage dim (3+ dims)
_ALLOC = re.compile(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+(?:x\d+)+)x(?=[a-z])")


@dataclasses.dataclass
class OfflineKernel:
    """One offline build. ``kernel``: triton.compile's CompiledKernel (``.asm["ptx" / "ttgir" / "cubin"]``)."""
    kernel: Any
    arch: int

    @property
    def smem(self) -> int:
        """Shared memory bytes of a launch (``kernel.metadata.shared``)."""
        return int(self.kernel.metadata.shared)

    @property
    def ptx(self) -> str:
        return self.kernel.asm["ptx"]

    @property
    def mma(self) -> str:
        """MMA instructions of the PTX: "tcgen05", "wgmma", "mma.sync", or "fma" (none)."""
        ptx = self.ptx
        return next((t for t in ("tcgen05", "wgmma", "mma.sync") if t in ptx), "fma")

    @property
    def rings(self) -> list:
        """Shapes (tuples) of the TTGIR smem allocations with a leading stage dim (3+ dims, e.g. (2, 64, 512)): the
        ring buffers of the pipelined loads, in TTGIR order."""
        return [tuple(int(d) for d in s.split("x")) for s in _ALLOC.findall(self.kernel.asm["ttgir"])
                if s.count("x") >= 2]

    @property
    def ring_stages(self) -> list:
        """Sorted distinct leading (stage) dims of ``rings``; [] = no ring, nothing overlapped by the pipeliner."""
        return sorted({r[0] for r in self.rings})

    @functools.cached_property
    def res_usage(self) -> str:
        """The resource line of ``cuobjdump -res-usage`` ("Function <name>:REG:.. STACK:.. SHARED:.. LOCAL:.. ...")."""
        out = cuobjdump(self.kernel.asm["cubin"], "-res-usage")
        lines = [x.strip() for x in out.splitlines() if "REG:" in x]
        if not lines:
            raise CuobjdumpError(f"cuobjdump -res-usage: no REG line in {out[-500:]!r}")
        return lines[0]

    def _res(self, key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", self.res_usage)
        if m is None:
            raise CuobjdumpError(f"cuobjdump -res-usage: no {key} in {self.res_usage!r}")
        return int(m.group(1))

    @property
    def regs(self) -> int:
        """Registers per thread."""
        return self._res("REG")

    @property
    def stack(self) -> int:
        """Stack bytes per thread (register spills land here)."""
        return self._res("STACK")

    @property
    def local(self) -> int:
        """Local memory bytes per thread."""
        return self._res("LOCAL")

    @property
    def fingerprint(self) -> str:
        """ptx_fingerprint of the PTX: equal for builds that differ only in source lines (a refactor's check)."""
        return ptx_fingerprint(self.ptx)

    @functools.cached_property
    def sass(self) -> str:
        """``cuobjdump -sass`` of the cubin."""
        return cuobjdump(self.kernel.asm["cubin"], "-sass")

    @property
    def loop(self) -> dict:
        """sass_loop_stats of ``sass``."""
        return sass_loop_stats(self.sass)


def ptx_fingerprint(ptx: str) -> str:
    """16 hex digits of the SHA-1 of ``ptx`` without what moves with the source text: the debug sections, .loc /
    .file lines, comments and blank lines (instructions, registers and the kernel's parameters remain)."""
    keep, debug = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            debug = True
        if debug:
            debug = s != "}"
            continue
        if s and not s.startswith((".loc", ".file", "//")):
            keep.append(re.sub(r"\s+//.*", "", line))
    return hashlib.sha1("\n".join(keep).encode()).hexdigest()[:16]


def compile_offline(fn, signature: dict, constexprs: Optional[dict] = None, *, num_warps: Optional[int] = None,
                    num_stages: Optional[int] = None, arch: int = 90, maxnreg: Optional[int] = None,
                    divisible: Iterable[str] = (), attrs: Optional[dict] = None,
                    extra_options: Optional[dict] = None) -> OfflineKernel:
    """Compile jit kernel ``fn`` for sm_<arch> (GPUTarget("cuda", arch, 32)) without a GPU.

    signature: {arg name: Triton type ("*bf16", "i32", "fp32", "tensordesc<...>")}; keys that are not arguments of
        fn are ignored, arguments not in it are "constexpr".
    constexprs: {arg name or argument path tuple: value}; a constexpr not given takes its default, where it has one.
    divisible: argument names that get the tt.divisibility 16 attribute (what the JIT infers for 16-aligned pointers
        and multiples of 16); attrs: further {path tuple: [[attr, value], ...]} (merged after, replacing per path).
    Options: extra_options, then num_warps / num_stages / maxnreg where given (None = Triton's default).
    Run without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: signature.get(n, "constexpr") for n in names}
    cst = {(names.index(k),) if isinstance(k, str) else k: v for k, v in (constexprs or {}).items()}
    for i, p in enumerate(fn.params):     # constexprs not given: the parameter's default (as a JIT launch does)
        if sig[p.name] == "constexpr" and (i,) not in cst and p.default is not inspect.Parameter.empty:
            cst[(i,)] = p.default
    att = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    att.update(attrs or {})
    opts = dict(extra_options or {})
    for k, v in (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg)):
        if v is not None:
            opts[k] = v
    kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cst, attrs=att),
                          target=GPUTarget("cuda", arch, 32), options=opts)
    return OfflineKernel(kern, arch)


# ----------------------------------------------------------------------------------------------------- SASS loops
# "        /*2460*/                   LDSM.16.M88.4 R8, [R125+UR5+0x10000] ;" / "/*74e0*/  @P0 BRA 0x31d0 ;"
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)([^;]*)")
_BRA_TARGET = re.compile(r"\b0x([0-9a-fA-F]+)\b")
LOOP_KEYS = ("HMMA", "HGMMA", "LDSM", "LDSM.M88.4", "LDSM.M88.2", "LDSM.M88.1", "LDSM.MT88.4", "LDSM.MT88.2",
             "LDSM.MT88.1", "LDS", "STS", "STSM", "LDGSTS", "LDG", "STG", "BAR.SYNC", "SHFL", "MUFU", "STL", "LDL")


def sass_instructions(sass: str) -> list:
    """[(address, opcode with modifiers, operands up to the ';')] of the instruction lines of ``cuobjdump -sass``
    output."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def sass_loop_stats(sass: str) -> dict:
    """Instruction counts of the loop body = [target, address] of the backward branch (BRA to a lower address) with
    the largest span (the outermost loop; nested loops are inside it).

    -> {"loop": (start, end) addresses or None, "instrs": instructions in it, and per class (LOOP_KEYS): "HMMA",
    "HGMMA", "LDSM" (all) and "LDSM.M88.4" / ".2" / ".1", "LDSM.MT88.4" / ..., "LDS", "STS", "STSM", "LDGSTS", "LDG",
    "STG", "BAR.SYNC", "SHFL", "MUFU", "STL", "LDL"}. No backward branch: loop None and every count 0."""
    ins = sass_instructions(sass)
    best = None
    for addr, op, rest in ins:
        if op.split(".")[0] == "BRA":
            targets = _BRA_TARGET.findall(rest)
            if targets:
                dst = int(targets[-1], 16)
                if dst < addr and (best is None or addr - dst > best[1] - best[0]):
                    best = (dst, addr)
    stats = dict(loop=best, instrs=0, **{k: 0 for k in LOOP_KEYS})
    if best is None:
        return stats
    for addr, op, _ in ins:
        if not best[0] <= addr <= best[1]:
            continue
        stats["instrs"] += 1
        parts = op.split(".")
        base = parts[0]
        if base == "LDSM":
            stats["LDSM"] += 1
            lay = "MT88" if "MT88" in parts else "M88" if "M88" in parts else None
            n = next((p for p in parts[1:] if p in ("2", "4")), "1")
            if lay:
                stats[f"LDSM.{lay}.{n}"] += 1
        elif op.startswith("BAR.SYNC"):
            stats["BAR.SYNC"] += 1
        elif base in LOOP_KEYS:
            stats[base] += 1
    return stats


def loop_summary(stats: dict) -> str:
    """One line of sass_loop_stats: the loop's instructions and the nonzero classes ("-" without a loop)."""
    if stats.get("loop") is None:
        return "loop -"
    parts = [f"{k} {stats[k]}" for k in LOOP_KEYS if stats[k]]
    return f"loop {stats['instrs']} instrs: " + (", ".join(parts) or "no counted classes")
