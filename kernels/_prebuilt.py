"""Triton's C driver module prebuilt at install time, for machines without a C compiler.

Triton 3.9 builds one C extension at its first GPU use: triton/backends/nvidia/driver.c -> cuda_utils.so, compiled
with the system's cc. LocalAI's runtime images have no C compiler (the backend image is FROM scratch; the builder
stage that runs `make` has one), so install.sh builds the module there (`python -m kernels._prebuilt`) into
prebuilt/, next to a stamp of the driver source, Triton version and extension suffix it was built from. On import
of the kernels, when Triton could not build it (no compiler found the way Triton looks: CC, gcc, clang; or no
Python.h), triton.knobs.build.impl hands Triton that file instead; Triton then caches and loads it as if it had
compiled it. Modules the prebuilt file does not cover (another source: a different Triton; Triton < 3.7 also compiles
one launcher per kernel signature) fail with an error that says to install gcc and python3-dev.

The module links libcuda.so.1 (its cu* calls are direct), which a builder stage without a driver does not have: the
link goes against an empty stub with that soname, so the file records the dependency and the loader resolves the
symbols against the host driver's library at import (--no-as-needed: the stub defines none of them, and a linker
that drops unused libraries would drop the dependency).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREBUILT_DIR = os.path.join(ROOT, "prebuilt")
NAME = "cuda_utils"


def _paths(directory: str) -> tuple[str, str]:
    """-> (module file, stamp file) in directory."""
    so = os.path.join(directory, f"triton-{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}")
    return so, so + ".json"


def _driver_source() -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "driver.c")


def _stamp(src_path: str) -> dict:
    import triton

    with open(src_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"triton": triton.__version__, "driver_sha256": digest,
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX")}


def _python_include() -> str:
    """The include directory Triton's build passes for Python.h (Debian's posix_local scheme mapped as Triton does)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def _have_python_h() -> bool:
    return os.path.exists(os.path.join(_python_include(), "Python.h"))


def can_build() -> bool:
    """Whether Triton could build its C modules here: a compiler and Python's headers."""
    return find_compiler() is not None and _have_python_h()


def find_compiler() -> str | None:
    """The C compiler Triton would use (CC, else gcc, else clang), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def build(directory: str = PREBUILT_DIR, cc: str | None = None) -> str:
    """Compile Triton's NVIDIA driver.c into directory (flags as Triton's own build) -> the module's path."""
    cc = cc or find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (CC, gcc or clang) to prebuild Triton's driver module with")
    src = _driver_source()
    so, stamp = _paths(directory)
    os.makedirs(directory, exist_ok=True)
    if not _have_python_h():
        raise RuntimeError(f"no Python.h in {_python_include()} (Debian / Ubuntu: apt install python3-dev)")
    with tempfile.TemporaryDirectory() as tmp:
        stub = os.path.join(tmp, "libcuda.so.1")   # an empty library with the driver's soname (see the docstring)
        empty = os.path.join(tmp, "empty.c")
        open(empty, "w").close()
        subprocess.check_call([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub, empty])
        out = os.path.join(tmp, os.path.basename(so))
        subprocess.check_call([cc, src, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", out,
                               "-Wl,--no-as-needed", "-l:libcuda.so.1", f"-L{tmp}",
                               f"-I{os.path.join(os.path.dirname(src), 'include')}", f"-I{os.path.dirname(src)}",
                               f"-I{_python_include()}"])
        shutil.move(out, so)
    with open(stamp, "w") as f:
        json.dump(_stamp(src), f)
    return so


def _make_impl(so: str, stamp: dict):
    def impl(name, src, srcdir, library_dirs, include_dirs, libraries):
        # Triton's build hook: src is the C file it would compile, srcdir a scratch directory for the result
        if name == NAME and os.path.exists(src) and _stamp(src) == stamp:
            out = os.path.join(srcdir, os.path.basename(so))
            shutil.copyfile(so, out)
            return out
        raise RuntimeError(f"Triton needs to compile {name} and cannot here (no C compiler: CC unset, no gcc or "
                           f"clang on PATH; or no Python.h); the prebuilt {os.path.basename(so)} covers only {NAME} "
                           f"of Triton {stamp.get('triton')}. Install gcc and python3-dev (apt) or set CC.")
    return impl


def install(directory: str = PREBUILT_DIR) -> bool:
    """Where Triton cannot build (no C compiler, or no Python.h), let it use the prebuilt driver module (when one
    matches this Triton) -> whether the build hook was set. A machine that can build keeps Triton's own build."""
    if can_build():
        return False
    so, stamp_path = _paths(directory)
    if not (os.path.exists(so) and os.path.exists(stamp_path)):
        return False
    try:
        import triton
        from triton import knobs

        with open(stamp_path) as f:
            stamp = json.load(f)
    except (ImportError, OSError, ValueError):
        return False
    if stamp.get("triton") != triton.__version__ or knobs.build.impl is not None:
        return False
    knobs.build.impl = _make_impl(so, stamp)
    return True


def main() -> int:
    """python -m kernels._prebuilt [DIR]: install.sh's step for the GPU profiles."""
    directory = sys.argv[1] if len(sys.argv) > 1 else PREBUILT_DIR
    try:
        so = build(directory)
    except (RuntimeError, OSError, subprocess.CalledProcessError, ImportError) as e:
        print(f"kernels._prebuilt: Triton's driver module not prebuilt ({e}); Triton will need a C compiler at run "
              "time", file=sys.stderr)
        return 1
    print(f"kernels._prebuilt: {so}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
