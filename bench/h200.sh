#!/usr/bin/env bash
# One device-tool call: carried wheels -> GPU kernel tests at Kimi shapes -> benchmarks.
# Usage (device tool, carry [".whl"]): bash bench/h200.sh [tests|bench|all] [extra pytest args]
# .whl/ (fla-core, flashinfer trimmed, their pure-Python deps) is built here by `bash bench/wheels.sh`.
# Logs go to $OUT (or ./.out) so they come back even when a step fails.
# To run exactly the committed HEAD while files are being edited here, carry a snapshot instead of relying on git
# on the device (its .git may be stale there, so `git stash` there restores an old tree):
#   git archive HEAD -o .snap/head.tar   (.snap/ ignored), carry [".whl", ".snap"], and on the device:
#   mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp -r .whl /tmp/w/ && cd /tmp/w && bash bench/h200.sh ...
set -u
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .whl/flashinfer-trim.tar.xz ]; then tar -xJf .whl/flashinfer-trim.tar.xz -C /tmp/site; fi
fi
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=12
# gRPC stubs for the server benchmarks (generated at install time elsewhere; not committed)
if [ ! -f backend_pb2.py ]; then python3 -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto || true; fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest ${TEST_PATHS:-tests} -m gpu -q --timeout=120 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" \
    || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in ${BENCHES:-kda mla moe}; do
    [ -f bench/$b.py ] || continue
    args_var="ARGS_$b"; echo "== bench/$b.py ${!args_var:-}"; timeout ${BENCH_TIMEOUT:-240} python3 bench/$b.py ${!args_var:-} 2>&1 | tee "$OUT/bench_$b.log" || rc=1
  done
fi
exit $rc
