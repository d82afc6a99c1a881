"""pyflakes over every Python file of the project (CI has no GPU, so a GPU-only branch with an undefined name, an
unused import or a name a `del` removed from under a closure would otherwise reach a device run first).
The generated gRPC stubs (backend_pb2*.py) are left out."""
import io
import os

from pyflakes import api, reporter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("backend", "kernels", "bench", "tests", "tools")


def _sources() -> list:
    paths = [os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")]
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [x for x in dirs if not x.startswith((".", "__pycache__"))]
            paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(p for p in paths if "_pb2" not in os.path.basename(p))


def test_pyflakes_clean():
    paths = _sources()
    assert len(paths) > 50 and any(p.endswith(os.path.join("backend", "server.py")) for p in paths)
    out = io.StringIO()
    n = sum(api.checkPath(p, reporter.Reporter(out, out)) for p in paths)
    assert n == 0, out.getvalue()


def test_pyflakes_reports(tmp_path):
    """The check above can fail: a name deleted after a closure captured it is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    x = 1\n    g = lambda: x\n    del x\n    return g\n")
    out = io.StringIO()
    assert api.checkPath(str(bad), reporter.Reporter(out, out)) == 2, out.getvalue()   # unused os, undefined x
