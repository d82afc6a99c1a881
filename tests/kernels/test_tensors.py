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
