"""The device scripts (bench/pending_ab.sh, h200.sh, ncu.sh) checked on the CPU before a device call spends time on
them: shell syntax, every flag they pass to a bench/ script is one that script documents in --help, the default
variant / case names they name exist, the kernels NCU_SOURCE filters on exist, and every test they select exists.
A typo in any of these would otherwise cost a device start (minutes) to find."""
import os
import re
import subprocess
import sys

import pytest

from tests.bench_module import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_SCRIPTS = ("bench/pending_ab.sh", "bench/h200.sh", "bench/ncu.sh")
SHELL = DEVICE_SCRIPTS + ("bench/wheels.sh", "install.sh", "run.sh", "test.sh", ".ci/run")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read().replace("\\\n", " ")   # continuation lines joined


def _assignments(text: str) -> dict:
    """Top-level `name=value` lines (no spaces in value), expanded in order: `b=$a,x` sees a."""
    env = {}
    for name, value in re.findall(r"^([a-z_0-9]+)=([^\s#;]+)", text, re.M):
        env[name] = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), value)
    return env


def _defaults(text: str, var: str) -> list:
    """The defaults of every `${var:-...}` in text, with top-level `$name`s expanded."""
    env = _assignments(text)
    return [re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), d)
            for d in re.findall(r"\$\{%s:-([^}]*)\}" % var, text)]


def _invocations(text: str) -> list:
    """(script name, argument text) of each `python3 bench/NAME.py ...` up to its redirection / pipe / end."""
    return [(name, re.split(r"[>|;]|&&", args)[0])
            for name, args in re.findall(r"python3 bench/(\w+)\.py([^\n]*)", text)]


@pytest.mark.parametrize("rel", SHELL)
def test_shell_syntax(rel):
    r = subprocess.run(["bash", "-n", os.path.join(ROOT, rel)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_bench_flags_are_documented():
    calls = {}
    for rel in DEVICE_SCRIPTS:
        for name, args in _invocations(_read(rel)):
            calls.setdefault(name, set()).update(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args))
    assert {"mla", "kda", "kda_prefill", "e2e", "sampling", "ncu_kernels"} <= set(calls), sorted(calls)
    env = {**os.environ, "PYTHONPATH": ROOT}
    for name, flags in sorted(calls.items()):
        if not flags:
            continue
        r = subprocess.run([sys.executable, f"bench/{name}.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        missing = [f for f in sorted(flags) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", r.stdout)]
        assert not missing, f"bench/{name}.py --help does not know {missing}"


def test_default_variant_and_case_names_exist():
    from kernels.mla.decode import DECODE_VARIANTS

    text = _read("bench/pending_ab.sh")
    mla = {n for d in _defaults(text, "mla_variants") for n in d.split(",")}
    mla |= set(re.findall(r'bench/mla\.py[^>\n]*--variants "([^"$]+)"', text))
    mla = {n.replace("+", " ") for v in mla for n in v.split(",")}
    assert mla and mla <= set(DECODE_VARIANTS), mla - set(DECODE_VARIANTS)

    quick = {n for n, _ in load_bench("kda_prefill").QUICK_VARIANTS}
    kda = {n for d in _defaults(text, "kda_variants") for n in d.split(",")}
    assert {"default", "akk-no-kb", "prep-rb2"} <= kda and kda <= quick, kda - quick

    known_case = load_bench("ncu_kernels").known_case
    named = {c for d in _defaults(text, "ncu_cases") for c in d.split()}
    assert named and all(known_case(c) for c in named), [c for c in named if not known_case(c)]


def test_ncu_source_kernels_exist():
    text = _read("bench/pending_ab.sh")
    names = [n for d in _defaults(text, "NCU_SOURCE") for n in d.split("|")]
    assert names
    kernels = set()
    for d, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    kernels |= set(re.findall(r"^def (\w+)\(", fh.read(), re.M))
    assert set(names) <= kernels, set(names) - kernels


def test_selected_tests_exist():
    text = _read("bench/pending_ab.sh")
    refs = set(re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?(?:\[([^\]\s]+)\])?", text))
    assert len(refs) > 5
    for path, func, param in sorted(refs):
        with open(os.path.join(ROOT, path)) as f:
            src = f.read()
        if func:
            assert re.search(rf"^def {func}\(", src, re.M), f"{path}::{func}"
        if param:
            assert f'"{param}"' in src, f"{path}::{func}[{param}]"
    suite = [p for d in _defaults(text, "suite_paths") for p in d.split()]
    assert suite and all(os.path.exists(os.path.join(ROOT, p)) for p in suite), suite
