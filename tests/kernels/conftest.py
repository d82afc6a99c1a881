"""Kernel tests: Triton kernels run on CUDA, or on CPU through the interpreter (TRITON_INTERPRET=1)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def device() -> str:
    return _device()


def run_offline(code: str | None = None, timeout: int = 400, *, script: str | None = None, args=(),
                unset=()) -> object:
    """Run an offline-compile script in a fresh Python and return the parsed JSON of its last stdout line.

    The child is `sys.executable -c code` (or the file `script`), with `args` after it, in the repo root. Offline
    compiles (kernels/_offline.py: Triton's compiler and its bundled ptxas / cuobjdump, no GPU needed) must run
    without TRITON_INTERPRET: with it set, @triton.jit gives interpreter functions and nothing is compiled, and the
    kernel tests usually run with it set, hence the subprocess with the variable unset (`unset`: further variables
    to drop, e.g. KIMI_PDL so that the child sees its default). Skips the test when the toolchain is missing
    ("Cannot find ptxas" / "Cannot find cuobjdump" in the child's stderr); any other failure fails it with the
    stderr tail."""
    drop = {"TRITON_INTERPRET", *unset}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = [sys.executable, script] if script is not None else [sys.executable, "-c", code]
    r = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 and ("Cannot find ptxas" in r.stderr or "Cannot find cuobjdump" in r.stderr):
        pytest.skip("no bundled ptxas/cuobjdump: " + r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def poll_slot_buffers() -> list:
    """Every v3 logit-slot buffer made so far (kernels.moe.router._poll_slots)."""
    from kernels._tensors import WORKSPACES

    return [b for (name, _), bufs in WORKSPACES.items() if name == "router_poll_slots" for b in bufs]
