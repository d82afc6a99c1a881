#!/usr/bin/env bash
# Build .whl/ (gitignored): the side-by-side baselines the H200 lacks, for the device tool's carry (64 MiB in all).
# The device runs Python 3.12 with torch + triton preinstalled and no network; bench/h200.sh installs these into
# /tmp/site. fla-core 0.6.0 (bench/kda.py, bench/kda_prefill.py, bench/e2e.py's HF baseline) and flashinfer-python
# 0.7.2.post1 (bench/mla.py: fa3 MLA decode, JIT-built on the device) with its pure-Python dependencies, and
# llguidance (requirements.txt; the device image lacks it) for the grammar tests, and pytest-xdist + execnet (the whole
# GPU suite on one card in one call: `python3 -m pytest -m gpu -n 8 ...`, compiles on 8 CPU workers).
# flashinfer's wheel is 62 MB: its data/csrc subdirectories (kernels for other features: cake_*, kda, gdn, fused_moe,
# blackwell_*, ...) are dropped, leaving the top-level csrc sources the MLA JIT build uses plus the headers (cutlass,
# cccl, include): flashinfer-trim.tar.xz, ~13 MB, unpacked into /tmp/site by bench/h200.sh.
# Usage (here, with PyPI reachable): bash bench/wheels.sh [dir, default .whl]   (~3 minutes, most of it xz)
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
pip=${PIP:-pip}
dl() { local d=$1; shift; "$pip" download -q --no-deps --python-version 3.12 --only-binary=:all: -d "$d" "$@"; }
dl "$dest" --platform manylinux_2_28_x86_64 fla-core==0.6.0 apache-tvm-ffi==0.1.15.post2 click einops nvidia-ml-py \
  tabulate
dl "$dest" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 ninja
dl "$dest" --platform manylinux_2_31_x86_64 llguidance==1.9.1   # the backend's own dependency (grammar tests)
dl "$dest" --platform any pytest-xdist==3.8.0 execnet==2.1.2
dl "$dest/.fi" --platform manylinux_2_28_x86_64 flashinfer-python==0.7.2.post1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$dest/.fi"' EXIT
(cd "$tmp" && python3 -m zipfile -e "$dest"/.fi/flashinfer_python-*.whl . \
  && find flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
  && tar -cJf "$dest/flashinfer-trim.tar.xz" flashinfer flashinfer_python-*.dist-info)
ls -la "$dest"
