#!/usr/bin/env bash
# The switches that are built and tested on the CPU but not yet timed on a GPU, as one device-tool call (~5 min on an
# H200; carry [".whl"], built by `bash bench/wheels.sh`). Logs go to $OUT (or ./.out). Each A/B is read in ONE process
# against interleaved no-op control cases (bench/ablate.py --set; separate processes differ by more than these gains).
#   1. the MoE alignment on CUDA: the chunked Triton align (ALIGN_CHUNKED, prefill steps of > 2048 ids) and the
#      single-program align raised to 8192 ids (ALIGN_SMALL_MAX) against the torch path, bit for bit
#      (tests/kernels/test_moe.py -k align; the align tests run on CUDA whenever it is present: no gpu marker)
#   2. bench/ablate.py at batch 1: the b1 step with the one-token MoE tile widths DECODE_T1_BN1=16 / BN2=32 (792
#      programs instead of 396), and the first-token time of 512 / 1024 / 8192-token prompts with each align path
#   3. the prefill CUDA graphs (EngineConfig.prefill_graph_tokens) and the fused-MoE graph tests on the device
#   4. (kda) the KDA state pass on the transposed state (kernels.kda.chunk.HPASS_T) at BV 32 / 64 / 16 against the
#      default and fla-core (bench/kda_prefill.py --quick; each variant checked against the default's output), then
#      its GPU test at Kimi shapes
# Adopt a switch only where both of its cases beat both controls.
# Usage: bash bench/pending_ab.sh [moe|kda] [total seconds]   (moe: 1-3, ~9 min; kda: 4, ~5 min)
set -u
what=${1:-moe}
total=${2:-540}
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h' 2>/dev/null | tee -a "$OUT/gpu.txt"
C="kernels.gemv.PDL_L2_MB=4"     # no-op control (the default value)
CH="kernels.moe.fused.ALIGN_CHUNKED=True"
SM="kernels.moe.fused.ALIGN_SMALL_MAX=8192"
T1="kernels.moe.fused.DECODE_T1_BN1=16;kernels.moe.fused.DECODE_T1_BN2=32"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
if [ "$what" = kda ]; then
  timeout "$(left)" python3 bench/kda_prefill.py --quick --variants default,hpass-t,hpass-t-bv64,hpass-t-bv16 \
    > "$OUT/kda_quick.log" 2>&1; echo "kda quick rc $? at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
  [ "$(left)" -gt 60 ] && timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 \
    tests/kernels/test_kda_chunk.py -k "hpass-t" > "$OUT/kda_tests.log" 2>&1
  for f in kda_quick kda_tests; do [ -f "$OUT/$f.log" ] && { echo "=== $f"; tail -c 5000 "$OUT/$f.log"; }; done
  exit 0
fi
timeout 90 python3 -m pytest -q -p no:cacheprovider --timeout=85 tests/kernels/test_moe.py -k align \
  > "$OUT/align_tests.log" 2>&1; echo "align tests rc $? at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
timeout 240 python3 bench/ablate.py --only none --steps 24 --prefill 512,1024,8192 --set "$C" --set "$T1" \
  --set "$CH" --set "$SM" --set "$C" --set "$T1" --set "$CH" --set "$SM" > "$OUT/ablate.log" 2>&1
echo "ablate rc $? at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 tests/engine/test_prefill_graphs.py \
    tests/kernels/test_moe.py -k "graph" > "$OUT/graph_tests.log" 2>&1
  echo "graph tests rc $? at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
fi
for f in align_tests ablate graph_tests; do [ -f "$OUT/$f.log" ] && { echo "=== $f"; tail -c 3500 "$OUT/$f.log"; }; done
cat "$OUT/steps.txt"
