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
