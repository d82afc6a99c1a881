#!/usr/bin/env bash
# What is built and tested here but not yet run on a GPU, as one device-tool call (~8 min on an H200; carry [".whl"],
# built by `bash bench/wheels.sh`; on an H100 bench/e2e.py runs 16 layers and ncu skips decode-b1). Logs: $OUT.
# (Logs go to ./.out without $OUT.)
#   suite:   every GPU test of tests/kernels, tests/model and tests/engine (env suite_paths), 8 pytest-xdist workers
#            (suite_workers) on the one card, the tests part with the whole time; log gpu_tests.log.
#   tests:   GPU tests: the sampler (tests/kernels/test_sampling.py, Kimi's vocabulary, with and without the nucleus
#            check), the MLA decode (test_mla_decode.py, test_mla_fused_decode.py) and the load-time warm-up
#            (tests/engine/test_warmup.py); `nucleus` mode runs test_sampling.py alone.
#   nucleus: KIMI_SAMPLER_NUCLEUS=1 (kernels/sampling.py NUCLEUS: three (row, block) launches settle a sampled row when
#            one of the min-p survivors' NUC_R = 4 best race keys is clearly inside top-p, before the one-program-per-
#            row kernel), first bench/sampling.py --sampled-only (graph us of ours, ours with the check, torch; token
#            agreement), then bench/e2e.py at batch 1 and 64 (greedy + T0.6 top_p 0.95 min_p 0.01 rows) with and
#            without it, interleaved, two processes each way. Adopt (default on) only if both sampled rows gain in
#            both pairs and the greedy rows stay within the spread. (The first form, one candidate, gained at b1 and
#            not at b64 on the H100: BENCHMARKS.md, twenty-seventh round.)
#   splits:  bench/mla.py --decode-only --sweep-decode --split-sweep at B = 64 / 128, S = 8k beside FlashInfer (graph
#            us per split count around the default: is the merge's fixed cost or the units' balance what is left of
#            issue 5's 0.82x there?).
#   ncu:     bash bench/ncu.sh decode-b1 mla64x8k mla64x8k-fi mla1x128k mla1x128k-fi on the H200 (the b1 step's
#            kernels' DRAM efficiency; MLA at B=64 S=8k where it matters, issue 5: 0.82x FlashInfer there against 0.915x
#            on the H100; B=1 S=128k, the other target). Env ncu_cases: bench/ncu.sh's cases (every mode with ncu).
#   e2e:     bench/e2e.py at batch 1 / 8 / 64 (greedy; T0.6 top_p 0.95 min_p 0.01 at 1 and 64) and an 8k prefill, the
#            defaults as they are (issue 6's table). `h200` mode: the sampler's GPU tests, bench/sampling.py on the
#            top-k cases (LocalAI's generic top-k 40 + top-p 0.95; top-k 50 with min-p: H100 figures only so far),
#            e2e with the generic rows too (--sampled-generic; greedy b64 once measured 10.2 ms per step in one
#            check-on process against 8.7-8.9 in six others: BENCHMARKS.md, twenty-eighth round), then ncu.
#            Env samp_cases: bench/sampling.py --cases (empty: all); e2e_extra: more bench/e2e.py arguments.
#   topk:    the nucleus check's top-k rows (each block's 8 largest logits bound the k-th largest value: the
#            candidates come from the top-k set and top-p's S is exact): the sampler's GPU tests, bench/sampling.py
#            on the top-k cases (with min-p; LocalAI's generic T0.9 top-k 40 top-p 0.95), then the nucleus e2e A/B
#            with --sampled-generic, one pair (env pairs=).
#   mla:     the MLA decode's variants (kernels/mla/decode.py): 'ls n64 w4' (the tiles before lz8), 'ls n64 w4
#            lz8' (lazy softmax rescale, the default since session 30) and 'ls n64 w4 lz8 ri2' (unclamped tile rows:
#            887 SASS instructions per tile against 1,155; a tie on the H100, back for the H200, where stage 1 is
#            issue-bound; lz8 and ri2 have never run on an H200). Their GPU tests (Kimi shapes), then bench/mla.py
#            --sweep-decode beside FlashInfer at issue 5's shapes (env mla_shapes, mla_variants).
#   instr:   the mla mode plus KDA akk's AKK_JOUTER (the default since session 30; since session 37 one K pass per
#            program over its off-diagonal blocks j < i): the KDA variants' GPU tests, then the kda part below.
#   kda:     bench/kda_prefill.py --quick --variants default,akk-no-kb,prep-rb2 (the default since session 37,
#            AKK_JOUTER = 3 and AKK_KB, timed on an H100 only; wu reading k and G itself; the row walk 2 rows per
#            step, PREP_ROWS_RB, untimed since session 32; fla-core in the same process). Env kda_variants: the
#            --variants list; kda_cases: --cases (T=16k,varlen; on a fresh H100 the varlen part did not finish in
#            the 190 s after the T=16k part, 12-07: kda_cases=varlen alone).
#   record:  the figures of record on an H200 when little device time is left (~6 min): the defaults' GPU tests
#            (KDA prefill at Kimi shapes, the MLA decode's default schedule, the fused W_UV decode), issue 5's table
#            (bench/mla.py --no-sweep --decode-only), the kda part (the default, whose AKK_JOUTER = 3 and AKK_KB were
#            timed on an H100 only, session 37; akk-no-kb: wu reading k and G; its GPU test first), issue 6's table,
#            then
#            with the time left Nsight Compute over kda16k and mla64x8k with the stall samples per SASS instruction of
#            akk and MLA stage 1 (NCU_SOURCE, bench/ncu_source.py).
#   issue4:  the H200 record of issue 4 in ~6 min: bench/kda.py --batch 1,8,64,256 (decode beside fla-core's
#            fused_recurrent, then prefill at T = 4k / 16k / 64k and varlen 16 x 1k beside chunk_kda), the kda part
#            (default,akk-no-kb), then issue 5's table with the time left.
#   adopt:   after adopting lz8 (MLA), AKK_JOUTER, PREP_ROWS and AKK_KG (KDA) as defaults in sessions 30 and 32
#            (timed on H100s only): their GPU tests, the MLA sweep (the default against the tiles before it), issue
#            5's table (bench/mla.py --no-sweep --decode-only), the kda part, and issue 6's table (bench/e2e.py).
# Usage: bash bench/pending_ab.sh [suite|tests|sampling|nucleus|topk|e2e|splits|ncu|mla|instr|record|issue4|adopt|final|
#        short|h200|all]
#        [total seconds]
set -u
kda_new=default,akk-no-kb   # the default (AKK_JOUTER = 3, AKK_KB since session 37) and wu reading k and G
kda_default=$kda_new,prep-rb2
what=${1:-all}
total=${2:-560}
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .whl/flashinfer-trim.tar.xz ]; then tar -xJf .whl/flashinfer-trim.tar.xz -C /tmp/site; fi
fi
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader,nounits | head -n 1)
echo "$gpu" | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# The full-size model (bench/e2e.py's 27 layers, ncu's decode-b1) needs ~91.5 GiB. On a smaller card (an H100) the
# nucleus A/B runs the first 16 layers (the sampler's cost per step is the same: compare its µs per step, not the % of
# speed of light) and ncu leaves decode-b1 out.
mem=$(echo "$gpu" | cut -d, -f2 | tr -d ' ')
layers=27; b1=decode-b1
if [ "${mem:-0}" -lt 100000 ]; then layers=16; b1=; fi
echo "e2e layers $layers (GPU memory ${mem} MiB)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
left() { echo $(( total - ($(date +%s) - t0) )); }
step() { echo "$1 rc $2 at $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"; }
# the parts to run; short (little device time left): the GPU tests, bench/sampling.py and the split sweep
case $what in
  all) parts="tests sampling nucleus splits ncu" ;;
  short) parts="tests sampling splits" ;;
  nucleus) parts="tests sampling nucleus"; tests=tests/kernels/test_sampling.py; samp_s=150 ;;
  topk) parts="tests sampling nucleus"; tests=tests/kernels/test_sampling.py; samp_s=${samp_s:-200}
        samp_cases=${samp_cases:-top_k,generic}; e2e_extra=${e2e_extra:---sampled-generic}; pairs=${pairs:-1} ;;
  mla) parts="tests mla"; mla_shapes=${mla_shapes:-64x8192,128x8192,1x131072,8x131072}
       tests=${tests:-tests/kernels/test_mla_decode.py::test_gpu_decode_variant_kimi} ;;
  instr) parts="tests mla kda"
         tests="tests/kernels/test_mla_decode.py::test_gpu_decode_variant_kimi"
         tests+=" tests/kernels/test_kda_chunk.py::test_gpu_variants_bf16" ;;
  record) parts="tests mla5 kda e2e ncu"
          kda_variants=${kda_variants:-$kda_new}
          ncu_cases=${ncu_cases:-kda16k mla64x8k}
          export NCU_SOURCE=${NCU_SOURCE:-_kda_akk_lv_kernel|_mla_decode_stage1}
          tests="tests/kernels/test_mla_decode.py::test_gpu_decode_default_schedule_kimi"
          tests+=" tests/kernels/test_mla_fused_decode.py tests/kernels/test_kda_chunk.py::test_gpu_single_bf16"
          tests+=" tests/kernels/test_kda_chunk.py::test_gpu_varlen_bf16_packed"
          tests+=" tests/kernels/test_kda_chunk.py::test_gpu_variants_bf16[akk-no-kb]" ;;
  issue4) parts="kdafull kda mla5"; kda_variants=${kda_variants:-$kda_new} ;;
  adopt) parts="tests mla mla5 kda e2e"
         mla_shapes=${mla_shapes:-64x8192,1x131072,128x8192}
         tests="tests/kernels/test_mla_decode.py::test_gpu_decode_variant_kimi"
         tests+=" tests/kernels/test_mla_decode.py::test_gpu_decode_default_schedule_kimi"
         tests+=" tests/kernels/test_mla_fused_decode.py tests/kernels/test_kda_chunk.py::test_gpu_variants_bf16" ;;
  final) parts="tests mla mla5 e2eb1"        # little device time left: adopt's checks, decode rows only
         mla_shapes=${mla_shapes:-64x8192,1x131072,128x8192}
         tests="tests/kernels/test_mla_decode.py::test_gpu_decode_variant_kimi"
         tests+=" tests/kernels/test_mla_fused_decode.py" ;;
  # the whole GPU suite on one card: xdist workers (pytest-xdist travels in .whl) run Triton's compiles in parallel
  suite) parts="tests"; tests=${suite_paths:-tests/kernels tests/model tests/engine}; tests_s=$total
         tests_args="-n ${suite_workers:-8}"; test_timeout=300 ;;
  h200) parts="tests sampling e2e ncu"; tests=${tests:-tests/kernels/test_sampling.py}; samp_s=${samp_s:-100}
        samp_cases=${samp_cases:-generic,top_k}; e2e_extra=${e2e_extra:---sampled-generic} ;;
  *) parts=$what ;;
esac
tests=${tests:-tests/kernels/test_sampling.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_fused_decode.py \
  tests/engine/test_warmup.py}
samp_s=${samp_s:-90}
tests_s=${tests_s:-200}; tests_args=${tests_args:-}; test_timeout=${test_timeout:-150}
# adopt / record on a card too small for the 27 layers (an H100): issue 6's table is the H200's, so e2e is left out
if { [ "$what" = adopt ] || [ "$what" = record ]; } && [ "$layers" != 27 ]; then parts=${parts/ e2e/}; fi
if [ "$what" = final ] && [ "$layers" != 27 ]; then parts=${parts/ mla5 e2eb1/}; fi
has() { case " $parts " in *" $1 "*) true ;; *) false ;; esac; }
if has tests; then
  # shellcheck disable=SC2086
  timeout "$(( $(left) < tests_s ? $(left) : tests_s ))" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout="$test_timeout" $tests_args $tests > "$OUT/gpu_tests.log" 2>&1; step "gpu tests" $?
fi
if has sampling; then
  timeout "$(( $(left) < samp_s ? $(left) : samp_s ))" python3 bench/sampling.py --m 1,8,64 --sampled-only \
    --cases "${samp_cases:-}" > "$OUT/sampling.log" 2>&1; step sampling $?
fi
if has nucleus; then
  for i in $(seq 1 "${pairs:-2}"); do
    for n in 0 1; do
      [ "$(left)" -gt 70 ] || break
      KIMI_SAMPLER_NUCLEUS=$n timeout "$(left)" python3 bench/e2e.py --layers "$layers" --decode-batches 1,64 \
        --sampled-batches 1,64 --prefill "" --hf-batches "" --warmup ${e2e_extra:-} > "$OUT/e2e_nucleus${n}_$i.log" 2>&1
      step "e2e nucleus=$n #$i" $?
    done
  done
fi
if has e2e; then
  timeout "$(left)" python3 bench/e2e.py --layers "$layers" --decode-batches 1,8,64 --sampled-batches 1,64 \
    --prefill 8192 --hf-batches "" --warmup ${e2e_extra:-} > "$OUT/e2e.log" 2>&1; step e2e $?
fi
if has e2eb1 && [ "$(left)" -gt 100 ]; then
  timeout "$(left)" python3 bench/e2e.py --layers "$layers" --decode-batches 1,64 --sampled-batches "" --prefill "" \
    --hf-batches "" --warmup > "$OUT/e2e_b1.log" 2>&1; step "e2e b1" $?
fi
if has splits && [ "$(left)" -gt 90 ]; then
  timeout "$(( $(left) < 150 ? $(left) : 150 ))" python3 bench/mla.py --decode-only --sweep-decode --split-sweep \
    --shapes 64x8192,128x8192,1x131072 --variants "ls+n64+w4+lz8" > "$OUT/mla_splits.log" 2>&1; step "mla splits" $?
fi
if has mla && [ "$(left)" -gt 90 ]; then
  timeout "$(( $(left) < 200 ? $(left) : 200 ))" python3 bench/mla.py --decode-only --sweep-decode \
    --shapes "${mla_shapes:-64x8192,1x131072,128x8192,8x131072,1x8192}" \
    --variants "${mla_variants:-ls+n64+w4,ls+n64+w4+lz8,ls+n64+w4+lz8+ri2}" > "$OUT/mla_variants.log" 2>&1
  step "mla variants" $?
fi
if has mla5 && [ "$(left)" -gt 90 ]; then
  timeout "$(( $(left) < 120 ? $(left) : 120 ))" python3 bench/mla.py --no-sweep --decode-only > "$OUT/mla5.log" 2>&1
  step "mla issue 5" $?
fi
if has kdafull && [ "$(left)" -gt 90 ]; then
  timeout "$(( $(left) < 220 ? $(left) : 220 ))" python3 bench/kda.py --batch 1,8,64,256 > "$OUT/kda_full.log" 2>&1
  step "kda full" $?
fi
if has kda && [ "$(left)" -gt 90 ]; then
  timeout "$(left)" python3 bench/kda_prefill.py --quick --cases "${kda_cases:-T=16k,varlen}" \
    --variants "${kda_variants:-$kda_default}" \
    > "$OUT/kda_variants.log" 2>&1; step "kda variants" $?
fi
if has ncu && [ "$(left)" -gt 120 ]; then
  # shellcheck disable=SC2086
  OUT="$OUT" timeout "$(left)" bash bench/ncu.sh ${ncu_cases:-$b1 mla64x8k mla64x8k-fi mla1x128k mla1x128k-fi} \
    > "$OUT/ncu.log" 2>&1
  step ncu $?
fi
[ -f "$OUT/gpu_tests.log" ] && { echo "=== gpu tests"; grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -30
  tail -n 5 "$OUT/gpu_tests.log"; }
[ -f "$OUT/sampling.log" ] && { echo "=== sampling"; tail -c 2500 "$OUT/sampling.log"; }
for f in "$OUT"/e2e*.log; do [ -f "$f" ] && { echo "=== $f"; grep -E "^\| (decode|prefill)|warm-up|Error|error" "$f"; }; done
[ -f "$OUT/mla_variants.log" ] && { echo "=== mla variants"; grep -E "^B=|WRONG|rror" "$OUT/mla_variants.log" | tail -40; }
[ -f "$OUT/mla5.log" ] && { echo "=== mla issue 5"; grep -E "^\\||^B=|copy|rror" "$OUT/mla5.log" | tail -20; }
[ -f "$OUT/kda_full.log" ] && { echo "=== kda full"; grep -E "^\||ms|rror" "$OUT/kda_full.log" | tail -40; }
[ -f "$OUT/kda_variants.log" ] && { echo "=== kda variants"; tail -n 25 "$OUT/kda_variants.log"; }
[ -f "$OUT/mla_splits.log" ] && { echo "=== mla splits"; grep -E "^B=|^ls|^\\|" "$OUT/mla_splits.log" | tail -30; }
[ -f "$OUT/ncu_summary.txt" ] && { echo "=== ncu"; grep -E "^===|rc |Duration|DRAM Throughput" "$OUT/ncu_summary.txt" | head -60; }
for f in "$OUT"/src_*.txt; do [ -f "$f" ] && { echo "=== $f"; head -n 30 "$f"; }; done
cat "$OUT/steps.txt"
