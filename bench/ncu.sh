#!/usr/bin/env bash
# Nsight Compute over bench/ncu_kernels.py's cases (one process per case; the device tool's H200, carry [".whl"]).
# Per kernel: duration, DRAM / SM / L1 / L2 throughput, issue activity, pipe utilisation, occupancy, registers and
# shared memory, and the stall reasons (cycles per issued instruction). Full reports: $OUT/ncu_<case>.txt (a + in
# the case name as _, which the device tool brings back).
# NCU_SOURCE=REGEX: also the warp-stall samples per SASS instruction of the kernels whose name matches (one more
# profiled pass per case: $OUT/src_<case>.csv.xz, summarised by bench/ncu_source.py into $OUT/src_<case>.txt).
# Usage: bash bench/ncu.sh [case ...]   (default: kda16k kda16k-fla mla64x8k mla64x8k-fi mla1x128k mla1x128k-fi;
#        decode-b1, the full-size batch-1 decode step, needs an H200)
set -u
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .whl/flashinfer-trim.tar.xz ]; then tar -xJf .whl/flashinfer-trim.tar.xz -C /tmp/site; fi
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
cases=${*:-kda16k kda16k-fla mla64x8k mla64x8k-fi mla1x128k mla1x128k-fi}
STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
EXTRA="sm__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum"
EXTRA+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
EXTRA+=",dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum"
for c in $cases; do
  echo "=== $c" | tee -a "$OUT/ncu_summary.txt"
  secs="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy
    --section LaunchStats --section SchedulerStats --section WarpStateStats"
  metrics="$STALLS,$EXTRA"
  if [ "$c" = decode-b1 ]; then   # ~230 kernels: the speed-of-light section and the DRAM bytes only (few passes)
    secs="--section SpeedOfLight"; metrics="dram__bytes_read.sum,dram__bytes_write.sum"
  fi
  # shellcheck disable=SC2086
  timeout 300 "$NCU" --profile-from-start off --clock-control none $secs --metrics "$metrics" \
    python3 bench/ncu_kernels.py "$c" > "$OUT/ncu_${c//+/_}.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then   # an unknown metric name fails the whole run: the sections alone
    mv "$OUT/ncu_${c//+/_}.txt" "$OUT/ncu_${c//+/_}.failed.txt"
    # shellcheck disable=SC2086
    timeout 300 "$NCU" --profile-from-start off --clock-control none $secs \
      python3 bench/ncu_kernels.py "$c" > "$OUT/ncu_${c//+/_}.txt" 2>&1
    rc="$rc, sections only: $?"
  fi
  echo "rc $rc" | tee -a "$OUT/ncu_summary.txt"
  # the lines that matter, per kernel: name, time, throughputs, issue, pipes, occupancy, top stalls
  grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Cache Thr|L2 Cache Thr|L1/TEX Hit Rate|L2 Hit Rate|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Block Limit|Warp Cycles Per Issued|No Eligible|sm__inst_executed.sum|ldsm.sum|wavefronts_mem_shared|bank_conflicts|dram__bytes|lts__t_bytes|Grid Size|Block Size" \
    "$OUT/ncu_${c//+/_}.txt" | tee -a "$OUT/ncu_summary.txt" | head -400 > /dev/null
  # stall reasons above 0.5 cycles per issued instruction
  awk '/stalled_.*per_issue_active/ { if ($NF+0 > 0.5) print }' "$OUT/ncu_${c//+/_}.txt" >> "$OUT/ncu_summary.txt"
  if [ -n "${NCU_SOURCE:-}" ]; then
    src="$OUT/src_${c//+/_}"
    timeout 300 "$NCU" --profile-from-start off --clock-control none -k "regex:$NCU_SOURCE" --section SourceCounters \
      --section WarpStateStats -f -o "$src" python3 bench/ncu_kernels.py "$c" > "$src.log" 2>&1 \
      && "$NCU" --import "$src.ncu-rep" --page source --csv --print-source sass > "$src.csv" 2>> "$src.log" \
      && python3 bench/ncu_source.py "$src.csv" > "$src.txt" 2>&1
    echo "source $c rc $?" | tee -a "$OUT/ncu_summary.txt"
    [ -f "$src.csv" ] && xz -f "$src.csv"
    rm -f "$src.ncu-rep"
  fi
done
