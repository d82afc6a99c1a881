"""kernels/_prebuilt.py: Triton's driver module built at install time is what Triton loads on a machine without a
C compiler (LocalAI's runtime images), through Triton's own build-and-cache path.

On this CPU machine the host driver is stood in by a generated libcuda.so.1 that defines every cu* symbol the module
imports: loading the module proves the stub-linked file records its libcuda dependency and resolves against the
library it finds at run time. (The device machines have Triton 3.6, whose per-kernel launchers need a compiler
anyway, and a Triton 3.9 wheel is larger than what a device call can carry: no GPU run of this yet.)"""
import os
import subprocess
import sys
import textwrap

import pytest

from kernels import _prebuilt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not _prebuilt.can_build(), reason="no C compiler or Python.h to prebuild with")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """-> (prebuilt dir, dir of a fake libcuda.so.1)"""
    base = tmp_path_factory.mktemp("prebuilt")
    so = _prebuilt.build(str(base / "prebuilt"))
    out = subprocess.run(["readelf", "-d", so], capture_output=True, text=True)
    if out.returncode == 0:
        assert "[libcuda.so.1]" in out.stdout, out.stdout   # the dependency survives --as-needed linkers
    syms = subprocess.run(["nm", "-D", "--undefined-only", so], capture_output=True, text=True, check=True).stdout
    cu = sorted({ln.split()[-1] for ln in syms.splitlines() if ln.split()[-1].startswith("cu")})
    assert "cuGetErrorString" in cu, cu
    fake = base / "driver"
    fake.mkdir()
    (fake / "fake.c").write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in cu))
    subprocess.run([_prebuilt.find_compiler(), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(fake / "libcuda.so.1"), str(fake / "fake.c")], check=True)
    return str(base / "prebuilt"), str(fake)


def _run_with_prebuilt(tmp_path, prebuilt, body, compiler=False):
    """Run body (Python) with no C compiler reachable (empty PATH, CC unset; compiler=True: PATH kept), the fake
    driver library, a fresh Triton cache -> CompletedProcess."""
    directory, fake = prebuilt
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "TRITON_INTERPRET", "PYTHONPATH")}
    env.update(LD_LIBRARY_PATH=fake, TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT,
               PREBUILT=directory, **({} if compiler else {"PATH": str(empty)}))
    code = textwrap.dedent(f"""
        import os
        import triton.backends.nvidia.driver as nv
        from triton.runtime.build import compile_module_from_file
        from kernels import _prebuilt
        assert (_prebuilt.find_compiler() is not None) == {compiler}
        def load(name="cuda_utils"):
            return compile_module_from_file(os.path.join(nv.dirname, "driver.c"), name, library_dirs=[],
                                            include_dirs=nv.include_dirs, libraries=nv.libraries)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_triton_loads_the_prebuilt_module_without_a_compiler(tmp_path, prebuilt):
    r = _run_with_prebuilt(tmp_path, prebuilt, """
        assert _prebuilt.install(os.environ["PREBUILT"])
        mod = load()
        assert hasattr(mod, "launch") and hasattr(mod, "load_binary"), dir(mod)
        print("loaded", mod.__file__)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loaded " + str(tmp_path / "cache") in r.stdout, r.stdout


def test_no_python_headers_uses_the_prebuilt_module(tmp_path, prebuilt):
    """A compiler but no Python.h (a system Python without python3-dev): Triton's build would fail, so the hook is
    set and the prebuilt module is what loads."""
    (tmp_path / "include").mkdir()
    r = _run_with_prebuilt(tmp_path, prebuilt, f"""
        _prebuilt._python_include = lambda: {str(tmp_path / "include")!r}
        assert not _prebuilt.can_build()
        assert _prebuilt.install(os.environ["PREBUILT"])
        mod = load()
        print("loaded", mod.__file__)
    """, compiler=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loaded " + str(tmp_path / "cache") in r.stdout, r.stdout


def test_without_the_hook_triton_needs_a_compiler(tmp_path, prebuilt):
    r = _run_with_prebuilt(tmp_path, prebuilt, """
        load()
    """)
    assert r.returncode != 0 and "Failed to find C compiler" in r.stderr, r.stderr[-2000:]


def test_other_modules_name_gcc(tmp_path, prebuilt):
    """A module the prebuilt file does not cover (Triton < 3.7's per-kernel launchers) fails saying what to do."""
    r = _run_with_prebuilt(tmp_path, prebuilt, """
        assert _prebuilt.install(os.environ["PREBUILT"])
        load("__triton_launcher")
    """)
    assert r.returncode != 0 and "Install gcc and python3-dev" in r.stderr, r.stderr[-2000:]


def test_stale_or_missing_prebuilt_is_not_used(tmp_path, prebuilt):
    r = _run_with_prebuilt(tmp_path, prebuilt, """
        import json, shutil
        src = os.environ["PREBUILT"]
        assert not _prebuilt.install(src + "-none")                     # nothing prebuilt
        stale = src + "-stale"
        shutil.copytree(src, stale)
        stamp = [os.path.join(stale, f) for f in os.listdir(stale) if f.endswith(".json")][0]
        json.dump(dict(json.load(open(stamp)), triton="0.0"), open(stamp, "w"))
        assert not _prebuilt.install(stale)                              # built for another Triton
    """)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_machine_with_a_compiler_keeps_tritons_build(prebuilt):
    from triton import knobs

    assert _prebuilt.install(prebuilt[0]) is False
    assert knobs.build.impl is None
