"""Packaging the LocalAI way: scripts, Makefile goals, requirement profiles, stub generation."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


@pytest.mark.parametrize("script", ["install.sh", "run.sh", "test.sh", ".ci/run"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, script)], check=True)


def test_makefile_default_goal_installs():
    out = subprocess.run(["make", "-n", "-C", ROOT], capture_output=True, text=True, check=True).stdout
    assert "bash install.sh" in out
    for target, cmd in (("test", "bash test.sh"), ("protogen", "install.sh --protogen"), ("run", "run.sh --addr")):
        out = subprocess.run(["make", "-n", "-C", ROOT, target], capture_output=True, text=True, check=True).stdout
        assert cmd in out, target


def test_requirement_profiles():
    base = read("requirements.txt")
    assert re.search(r"^grpcio==", base, re.M) and re.search(r"^grpcio-tools==", base, re.M)
    assert not re.search(r"^(torch|triton)\b", base, re.M)  # torch/triton only from a profile file
    cpu = read("requirements-cpu.txt")
    assert re.search(r"^torch==2\.13\.0$", cpu, re.M) and re.search(r"^triton==3\.9\.0$", cpu, re.M)
    for profile in ("cublas12", "cublas13", "l4t13"):
        assert re.search(r"^torch==2\.13\.0$", read(f"requirements-{profile}.txt"), re.M), profile
        assert re.search(r"^triton==3\.9\.0$", read(f"requirements-{profile}-after.txt"), re.M), profile
    assert "3.12" in read("install.sh")  # l4t13 (GB10) wheels are cp312
    # test-only packages stay out of the install LocalAI's images run (`make`); test.sh adds them
    test_only = ("pytest", "pytest-xdist", "hypothesis", "pyyaml", "pyflakes")
    listed = {ln.split("#")[0].split()[0].lower() for ln in read("requirements-test.txt").splitlines()
              if ln.split("#")[0].strip()}
    assert set(test_only) <= listed, listed
    for name in test_only:
        assert not re.search(rf"^{name}\b", base, re.M | re.I), name


def test_test_sh_installs_test_requirements(tmp_path):
    """A venv made by `make` lacks pytest & co.: test.sh installs requirements-test.txt (through install.sh
    --test-deps, the venv's own installer) before running pytest; standalone that is the venv's pip."""
    me = tmp_path / "kimi-linear"
    (me / "venv" / "bin").mkdir(parents=True)
    for name in ("test.sh", "install.sh", "requirements-test.txt"):
        (me / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    for name in ("backend_pb2.py", "backend_pb2_grpc.py"):
        (me / name).write_text("")
    log = tmp_path / "calls.txt"
    py = me / "venv" / "bin" / "python"   # no module imports (-c fails); logs pip and pytest calls
    py.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 1\necho "$*" >> "{log}"\n')
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_VENV", "TRITON_INTERPRET", "BUILD_TYPE")}
    env.update(USE_PIP="true", KIMI_STANDALONE="true")
    r = subprocess.run(["bash", str(me / "test.sh"), "tests/x"], cwd=me, capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text().splitlines() == ["-m pip install --requirement requirements-test.txt",
                                            "-m pytest tests/x"], log.read_text()


def test_install_rejects_unknown_profile():
    r = subprocess.run(["bash", os.path.join(ROOT, "install.sh")], capture_output=True, text=True,
                       env={**os.environ, "BUILD_TYPE": "hipblas"}, timeout=60)
    assert r.returncode != 0 and "not supported" in r.stderr


def test_run_sh_without_venv_explains(tmp_path):
    r = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "--addr", "127.0.0.1:1"], capture_output=True,
                       text=True, env={**os.environ, "KIMI_VENV": str(tmp_path / "none"), "KIMI_STANDALONE": "true"},
                       timeout=60)
    assert r.returncode != 0 and "make" in r.stderr


def test_stubs_are_generated_not_committed():
    ignored = read(".gitignore")
    assert "backend_pb2.py" in ignored and "backend_pb2_grpc.py" in ignored
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True).stdout.split()
    if tracked:  # a git checkout
        assert "backend_pb2.py" not in tracked and "backend.proto" in tracked
    assert os.path.exists(os.path.join(ROOT, "backend_pb2.py"))


def _exited(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie nobody reaped: exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("watch", ["", "off"])
def test_backend_stops_when_its_parent_dies(tmp_path, watch):
    """Outside LocalAI's tree the backend watches its parent itself (LocalAI's LOCALAI_BACKEND_PARENT_WATCH /
    _INTERVAL): run.sh under a shell that is then SIGKILLed (as a LocalAI killed without its teardown) -> the
    orphaned backend stops within a few intervals; with the watch off it keeps serving."""
    import signal
    import sys
    import time

    from server_harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    addr = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, KIMI_STANDALONE="true", KIMI_VENV=os.path.dirname(os.path.dirname(sys.executable)),
               LOCALAI_BACKEND_PARENT_WATCH_INTERVAL="200ms", LOCALAI_BACKEND_PARENT_WATCH=watch)
    log = open(tmp_path / "backend.log", "wb")
    parent = subprocess.Popen(["bash", "-c", f'bash "{root}/run.sh" --addr {addr} & echo $!; wait'], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=log)
    pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while b"Listening on" not in (tmp_path / "backend.log").read_bytes():
        assert time.monotonic() < deadline and not _exited(pid), (tmp_path / "backend.log").read_text()
        time.sleep(0.1)
    parent.kill()
    parent.wait()
    try:
        deadline = time.monotonic() + 15
        while not _exited(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _exited(pid) == (watch != "off"), (tmp_path / "backend.log").read_text()
        if watch != "off":
            assert b"exited without stopping this backend" in (tmp_path / "backend.log").read_bytes()
    finally:
        if not _exited(pid):
            os.kill(pid, signal.SIGKILL)


def test_protogen_in_localai_tree(tmp_path):
    """In LocalAI's tree (backend/python/kimi-linear, ../common/libbackend.sh, LocalAI's backend/backend.proto)
    libbackend's runProtogen compiles with -I../../ -I./, where two backend.proto files would be "shadowed":
    install.sh steps ours aside for it (LocalAI's proto is compiled, as for its other backends), then puts it back."""
    import shutil
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tree = tmp_path / "LocalAI" / "backend"
    me, common = tree / "python" / "kimi-linear", tree / "python" / "common"
    me.mkdir(parents=True)
    common.mkdir()
    for f in ("install.sh", "backend.proto"):
        shutil.copy(os.path.join(root, f), me / f)
    shutil.copy(os.path.join(root, "backend.proto"), tree / "backend.proto")
    # libbackend.sh's protoc call as LocalAI makes it (its venv and toolchain set-up stood in by this Python)
    (common / "libbackend.sh").write_text(
        'BUILD_PROFILE=cpu\nEDIR="$(pwd)"\n'
        f'runProtogen() {{ "{sys.executable}" -m grpc_tools.protoc -I../../ -I./ --python_out=. '
        '--grpc_python_out=. backend.proto; }\n')
    r = subprocess.run(["bash", str(me / "install.sh"), "--protogen"], cwd=me, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "KIMI_STANDALONE"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (me / "backend_pb2.py").is_file() and (me / "backend_pb2_grpc.py").is_file()
    assert (me / "backend.proto").read_bytes() == (tree / "backend.proto").read_bytes()
    assert not (me / ".backend.proto.vendored").exists()


def _stub_localai_tree(tmp_path, build_profile):
    """backend/python/{kimi-linear (install.sh, a venv running this Python), common/libbackend.sh (a stub that logs
    ensureVenv / installRequirements)} and a logging `pip` on PATH -> (our dir, the log, env with USE_PIP=true)."""
    import sys

    me, common, bin_ = tmp_path / "python" / "kimi-linear", tmp_path / "python" / "common", tmp_path / "bin"
    for d in (me / "venv" / "bin", common, bin_):
        d.mkdir(parents=True)
    (me / "install.sh").write_bytes(open(os.path.join(ROOT, "install.sh"), "rb").read())
    py = me / "venv" / "bin" / "python"                          # a venv with CPU torch (this test's)
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    log = tmp_path / "calls.txt"
    (common / "libbackend.sh").write_text(
        f'BUILD_PROFILE={build_profile}\nEDIR="$(pwd)"\n'
        f'ensureVenv() {{ echo ensureVenv >> "{log}"; }}\n'
        f'installRequirements() {{ echo "installRequirements $BUILD_PROFILE" >> "{log}"; }}\n')
    (bin_ / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> "{log}"\n')
    (bin_ / "pip").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_STANDALONE", "BUILD_TYPE")}
    env.update(PATH=f"{bin_}:{env['PATH']}", USE_PIP="true")
    return me, log, env


def test_localai_tree_test_deps(tmp_path):
    """In LocalAI's tree `install.sh --test-deps` installs requirements-test.txt into libbackend's venv, nothing
    else (no profile requirements, no protoc)."""
    me, log, env = _stub_localai_tree(tmp_path, "cpu")
    r = subprocess.run(["bash", str(me / "install.sh"), "--test-deps"], cwd=me, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text().splitlines() == ["ensureVenv", f"pip install --requirement {me}/requirements-test.txt"]


@pytest.mark.parametrize("build_type,ok", [("", True), ("intel", False), ("hipblas", False)])
def test_localai_tree_profile_intel_falls_back_to_cpu(tmp_path, build_type, ok):
    """libbackend's getBuildProfile says intel whenever /opt/intel exists, even with BUILD_TYPE unset: install.sh then
    installs the cpu profile (CPU torch first, the CUDA-torch check after), instead of libbackend's requirement list
    resolving torch==2.13.0 to PyPI's CUDA build. An explicit BUILD_TYPE it has no profile for is refused."""
    me, log, env = _stub_localai_tree(tmp_path, "intel" if not build_type else build_type)
    env.update({"BUILD_TYPE": build_type} if build_type else {})
    r = subprocess.run(["bash", str(me / "install.sh")], cwd=me, capture_output=True, text=True, env=env)
    if not ok:
        assert r.returncode == 1 and "is not supported" in r.stderr, r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "ensureVenv" and calls[1].startswith("pip install") and "torch==2.13.0+cpu" in calls[1]
    assert calls[-1] == "installRequirements cpu", calls


def test_gpu_profile_install_prebuilds_tritons_driver_module(tmp_path):
    """A GPU profile's install (here libbackend's path, cublas12) leaves prebuilt/ with Triton's driver module for
    runtime images without a C compiler (kernels/_prebuilt.py); the cpu profile does not build it."""
    from kernels import _prebuilt

    if not _prebuilt.can_build():
        pytest.skip("no C compiler or Python.h")
    for profile in ("cublas12", "cpu"):
        me, log, env = _stub_localai_tree(tmp_path / profile, profile)
        (me / "kernels").mkdir()
        (me / "kernels" / "__init__.py").write_text("")
        (me / "kernels" / "_prebuilt.py").write_bytes(open(os.path.join(ROOT, "kernels", "_prebuilt.py"), "rb").read())
        env.update(BUILD_TYPE="cublas" if profile != "cpu" else "", CUDA_MAJOR_VERSION="12")
        r = subprocess.run(["bash", str(me / "install.sh")], cwd=me, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        built = sorted(os.listdir(me / "prebuilt")) if (me / "prebuilt").exists() else []
        if profile == "cpu":
            assert built == [], built
        else:
            assert len(built) == 2 and built[0].startswith("triton-cuda_utils") and built[1].endswith(".json"), built
