#!/usr/bin/env bash
# The switches that are built and tested but not yet timed on a GPU, as one device-tool call (~6 min on an H200;
# carry [".whl"], built by `bash bench/wheels.sh`). Logs go to $OUT (or ./.out).
#   moe:    the single-program MoE align raised to 8192 ids (kernels.moe.fused.ALIGN_SMALL_MAX; 2048 by default:
#           above it the chunked align's three launches) in bench/ablate.py, each case three times interleaved with a
#           no-op control in ONE process (separate processes differ by more than these gains), first-token times of
#           512 / 1024 / 2048-token prompts. Session 23 (H200) read these at 512 / 1024 tokens as 28-77 ms for
#           identical cases, so three pairs; adopt only where every case beats every control.
#   graphs: the prefill CUDA graphs (EngineConfig.prefill_graph_tokens, opt-in): bench/e2e.py's prefill rows with and
#           without them, then the same two again (two processes each way; their GPU test passed in session 23)
# Usage: bash bench/pending_ab.sh [moe|graphs|all] [total seconds]
set -u
what=${1:-all}
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
SM="kernels.moe.fused.ALIGN_SMALL_MAX=8192"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
step() { echo "$1 rc $2 at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"; }
if [ "$what" = moe ] || [ "$what" = all ]; then
  timeout "$(left)" python3 bench/ablate.py --only none --steps 8 --prefill 512,1024,2048 --set "$C" --set "$SM" \
    --set "$C" --set "$SM" --set "$C" --set "$SM" > "$OUT/ablate.log" 2>&1; step ablate $?
fi
if [ "$what" = graphs ] || [ "$what" = all ]; then
  for i in 1 2; do
    for g in 0 4096; do
      [ "$(left)" -gt 60 ] || break
      timeout "$(left)" python3 bench/e2e.py --decode-batches "" --prefill 256,512,1024,2048 \
        --prefill-graph-tokens $g > "$OUT/e2e_graphs${g}_$i.log" 2>&1; step "e2e graphs=$g #$i" $?
    done
  done
fi
[ -f "$OUT/ablate.log" ] && { echo "=== ablate"; tail -c 3000 "$OUT/ablate.log"; }
for f in "$OUT"/e2e_graphs*.log; do [ -f "$f" ] && { echo "=== $f"; grep -E "^\| prefill|Error|error" "$f"; }; done
cat "$OUT/steps.txt"
