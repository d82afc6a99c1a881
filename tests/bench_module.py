"""Load a bench/ script as a module (bench/ is not a package, and its names, e.g. mla / moe, would shadow others)."""
import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/<name>.py as a fresh module named bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
