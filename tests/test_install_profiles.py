"""Install profiles (cpu, cublas12, cublas13, l4t13) and ./Dockerfile.

Offline: every profile pins the torch / triton the code is tested with (the versions in this venv, which the cpu
profile installed), install.sh maps BUILD_TYPE/CUDA_MAJOR_VERSION to the profiles the way LocalAI's libbackend.sh
does and switches l4t13 to Python 3.12, and the Dockerfile installs through the Makefile with those build args.
Online (short, skipped when the index is unreachable): the PyPI-resolvable pins have a wheel for the profile's
target (Python 3.12; manylinux x86_64 for cublas13, manylinux aarch64 for l4t13 / GB10), found in PyPI's simple
index and matched with packaging.tags like pip's finder -- nothing is downloaded or installed. The cu128 torch of
cublas12 comes from download.pytorch.org: checked when reachable, else skipped saying so.
"""

import json
import os
import re
import subprocess
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = {  # profile -> (BUILD_TYPE, CUDA_MAJOR_VERSION, wheel platform of the image, python)
    "cublas12": ("cublas", "12", "x86_64", "3.12"),
    "cublas13": ("cublas", "13", "x86_64", "3.12"),
    "l4t13": ("l4t", "13", "aarch64", "3.12"),
}
PYPI = "https://pypi.org/simple"
TIMEOUT = 10


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def pins(name):
    """requirements file -> ({package: version}, [index options])"""
    out, opts = {}, []
    if not os.path.exists(os.path.join(ROOT, name)):
        return out, opts
    for line in read(name).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            opts.append(line)
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out, opts


def profile_pins(profile):
    a, opts_a = pins(f"requirements-{profile}.txt")
    b, opts_b = pins(f"requirements-{profile}-after.txt")
    return {**a, **b}, opts_a + opts_b


def install_sh_profile(build_type, cuda_major):
    """Run install.sh's profile selection (up to the supported-profile check) -> (profile, PYTHON_VERSION)."""
    src = read("install.sh")
    start = src.index("getBuildProfileStandalone() {")
    call = 'requireSupportedProfile "${PROFILE}"'
    end = src.index(call, start) + len(call)
    env = {k: v for k, v in os.environ.items() if k not in ("BUILD_TYPE", "CUDA_MAJOR_VERSION", "PYTHON_VERSION")}
    env.update(BUILD_TYPE=build_type, CUDA_MAJOR_VERSION=cuda_major)
    out = subprocess.run(["bash", "-c", src[start:end] + '\necho "${PROFILE} ${PYTHON_VERSION:-default}"'], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ offline

def test_profiles_pin_the_tested_versions():
    import torch
    import triton

    cpu, _ = profile_pins("cpu")
    tested = {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}
    assert cpu["torch"] == tested["torch"] and cpu["triton"] == tested["triton"], (cpu, tested)
    for profile in PROFILES:
        p, _ = profile_pins(profile)
        assert p.get("torch") == tested["torch"], (profile, p)
        assert p.get("triton") == tested["triton"], (profile, p)
        # triton after torch (-after file), so torch's own triton pin cannot win
        assert "triton" in pins(f"requirements-{profile}-after.txt")[0], profile
    base, _ = pins("requirements.txt")
    assert "torch" not in base and "triton" not in base


def test_install_sh_profiles_and_python():
    assert install_sh_profile("", "") == ("cpu", "default")
    for profile, (build_type, major, _, python) in PROFILES.items():
        got, py = install_sh_profile(build_type, major)
        assert got == profile
        if profile == "l4t13":
            assert py == python  # aarch64 CUDA 13 images use Python 3.12 (as LocalAI's vllm/sglang l4t13)
    src = read("install.sh")
    assert 'PYTHON_VERSION="3.12"' in src and 'PY_STANDALONE_TAG="20251120"' in src


def test_index_options():
    """cublas12 needs PyTorch's cu128 channel; cublas13 and l4t13 take PyPI's CUDA 13 builds (no extra index)."""
    assert profile_pins("cublas12")[1] == ["--extra-index-url https://download.pytorch.org/whl/cu128"]
    assert profile_pins("cublas13")[1] == [] and profile_pins("l4t13")[1] == []
    assert "aarch64" in read("requirements-l4t13.txt") and "3.12" in read("requirements-l4t13.txt")


def test_dockerfile_builds_through_makefile():
    src = read("Dockerfile")
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", src, re.M)
    assert stages[-1] == ("scratch", ""), "final stage must be FROM scratch (image root = backend dir)"
    assert ("${BASE_IMAGE}", "builder") in stages and re.search(r"^ARG BASE_IMAGE=ubuntu:24\.04$", src, re.M)
    for arg in ("BACKEND=kimi-linear", "BUILD_TYPE", "CUDA_MAJOR_VERSION", "CUDA_MINOR_VERSION", "SKIP_DRIVERS=false",
                "TARGETARCH", "UBUNTU_VERSION=2404"):
        assert re.search(rf"^ARG {re.escape(arg)}$", src, re.M), arg
    # install.sh reads BUILD_TYPE / CUDA_MAJOR_VERSION from the environment
    assert re.search(r"^ENV BUILD_TYPE=\$\{BUILD_TYPE\}$", src, re.M)
    assert re.search(r"^ENV CUDA_MAJOR_VERSION=\$\{CUDA_MAJOR_VERSION\}$", src, re.M)
    assert re.search(r"^COPY \. /\$\{BACKEND\}$", src, re.M)
    assert re.search(r"^RUN cd /\$\{BACKEND\} && PORTABLE_PYTHON=true make$", src, re.M)
    assert re.search(r"^COPY --from=builder /\$\{BACKEND\}/ /$", src, re.M)
    # `make` (default goal) is the install; the copied context keeps everything it needs
    out = subprocess.run(["make", "-n", "-C", ROOT], capture_output=True, text=True, check=True).stdout
    assert "bash install.sh" in out
    ignored = [ln.strip() for ln in read(".dockerignore").splitlines() if ln.strip() and not ln.startswith("#")]
    assert "venv" in ignored and ".git" in ignored
    needed = ["Makefile", "install.sh", "run.sh", "backend.proto", "requirements.txt", "backend", "kernels",
              "models"] + [f"requirements-{p}.txt" for p in ["cpu", *PROFILES]]
    for path in needed:
        assert os.path.exists(os.path.join(ROOT, path)), path
        assert not any(path == i or path.startswith(i.rstrip("/") + "/") for i in ignored), path


# ------------------------------------------------------------------------------------------------ online

_cache = {}


def _simple_files(base, project):
    """PEP 691 JSON simple index -> wheel filenames (or skip: unreachable)."""
    key = (base, project)
    if key not in _cache:
        req = urllib.request.Request(f"{base}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                _cache[key] = [f["filename"] for f in json.load(r)["files"]]
        except (urllib.error.URLError, OSError, ValueError) as e:
            _cache[key] = e
    if isinstance(_cache[key], Exception):
        pytest.skip(f"{base} not reachable from here ({_cache[key]}); {project} not resolved")
    return _cache[key]


def _target_tags(python, arch, glibc=(2, 39)):
    """Tags pip accepts on the image: CPython `python`, manylinux up to `glibc` (ubuntu 24.04: 2.39)."""
    from packaging import tags

    platforms = [f"manylinux_{glibc[0]}_{m}_{arch}" for m in range(glibc[1], 16, -1)]
    platforms += [f"manylinux2014_{arch}", f"linux_{arch}"]
    pyver = tuple(int(x) for x in python.split("."))
    return set(tags.cpython_tags(pyver, platforms=platforms)) | set(tags.compatible_tags(pyver, platforms=platforms))


def resolve(base, project, version, python, arch):
    """-> a wheel filename of project==version installable on the target, or None (pip's finder logic)."""
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    want = _target_tags(python, arch)
    for fn in _simple_files(base, project):
        if not fn.endswith(".whl"):
            continue
        name, ver, _, wtags = parse_wheel_filename(fn)
        if Version(str(ver)) == Version(version) and wtags & want:
            return fn
    return None


@pytest.mark.parametrize("profile", ["cublas13", "l4t13"])
def test_pypi_pins_resolve_for_target(profile):
    _, _, arch, python = PROFILES[profile]
    p, _ = profile_pins(profile)
    for project in ("torch", "triton"):
        fn = resolve(PYPI, project, p[project], python, arch)
        assert fn, f"{profile}: no {project}=={p[project]} wheel on PyPI for cp{python.replace('.', '')} {arch}"
        assert arch in fn


def test_cublas12_pins_resolve():
    _, _, arch, python = PROFILES["cublas12"]
    p, opts = profile_pins("cublas12")
    assert resolve(PYPI, "triton", p["triton"], python, arch), "triton not on PyPI for the cublas12 target"
    index = opts[0].split()[-1]
    # download.pytorch.org serves PEP 691 too; the local version (+cu128) is what pip picks from that channel
    fn = resolve(index, "torch", p["torch"] + "+cu128", python, arch)
    assert fn, f"no torch=={p['torch']}+cu128 wheel for cp312 {arch} at {index}"


def base_requirement(project):
    """requirements.txt's line for `project` -> packaging Requirement."""
    from packaging.requirements import Requirement

    for line in read("requirements.txt").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and Requirement(line).name.lower() == project:
            return Requirement(line)
    raise AssertionError(f"{project} is not in requirements.txt")


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_compiled_base_requirements_have_wheels(profile):
    """Base requirements with compiled code and no sdist fallback worth building on the image (llguidance: Rust) have
    a wheel within their version range for each profile's target (cp312; x86_64, aarch64 for GB10)."""
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    _, _, arch, python = PROFILES[profile]
    want = _target_tags(python, arch)
    for project in ("llguidance", "grpcio"):
        req = base_requirement(project)
        ok = [fn for fn in _simple_files(PYPI, project) if fn.endswith(".whl")
              and Version(str(parse_wheel_filename(fn)[1])) in req.specifier and parse_wheel_filename(fn)[3] & want]
        assert ok, f"{profile}: no {req} wheel on PyPI for cp{python.replace('.', '')} {arch}"
