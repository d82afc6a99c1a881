"""kernels/_tensors.py host helpers: cdiv / next_pow2 agree with triton.cdiv / triton.next_power_of_2 (which the
launch paths used before; they are constexpr functions in Triton 3.9, ~30x slower to call from the host)."""
import ast
import os

import pytest
import triton

from kernels._tensors import cdiv, next_pow2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("n", [-5, -1, 0, 1, 2, 3, 4, 5, 7, 8, 9, 127, 128, 129, 1000, 1 << 20, (1 << 20) + 1])
def test_next_pow2_matches_triton(n):
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_cdiv_matches_triton():
    for a in range(-70, 300):
        for b in (1, 2, 3, 7, 16, 64, 65):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def _host_triton_calls(path):
    """triton.cdiv / triton.next_power_of_2 calls outside @triton.jit functions of one source file."""
    tree = ast.parse(open(path).read())
    found = []

    def visit(node, in_jit):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_jit = in_jit or any("jit" in ast.unparse(d) for d in node.decorator_list)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton"
                and node.func.attr in ("cdiv", "next_power_of_2") and not in_jit):
            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
        for c in ast.iter_child_nodes(node):
            visit(c, in_jit)

    visit(tree, False)
    return found


def test_launch_paths_use_the_host_helpers():
    """No host-side triton.cdiv / triton.next_power_of_2 in kernels/ or backend/ (the launch paths)."""
    hits = []
    for top in ("kernels", "backend"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            hits += [h for f in files if f.endswith(".py") for h in _host_triton_calls(os.path.join(d, f))]
    assert not hits, hits


def test_workspace_grows_and_keeps_old_buffers():
    """kernels._tensors.workspace: the newest buffer while it fits; a larger one made (from the newest) when not,
    the older kept alive (a captured CUDA graph may still point at it); separate per name; the users share it."""
    import torch

    from kernels._tensors import WORKSPACES, arrival_counters, workspace

    made = []

    def make(old):
        made.append(old)
        return torch.zeros(max(8, 2 * (old.numel() if old is not None else 0)))

    a = workspace("test_ws", "cpu", lambda b: b.numel() >= 5, make)
    assert workspace("test_ws", "cpu", lambda b: b.numel() >= 8, make) is a and made == [None]
    b = workspace("test_ws", "cpu", lambda b: b.numel() >= 9, make)
    kept = WORKSPACES[("test_ws", torch.device("cpu"))]
    assert b.numel() == 16 and made[1] is a and len(kept) == 2 and kept[0] is a and kept[1] is b
    assert workspace("test_ws2", "cpu", lambda b: True, make) is not b
    c = arrival_counters("cpu", 3)
    assert c.dtype == torch.int32 and not c.any() and arrival_counters("cpu", 2) is c
