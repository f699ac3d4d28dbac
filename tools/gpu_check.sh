#!/usr/bin/env bash
# Everything a session lent a GPU runs, in one command, from the repo root. Steps (EECORE_GPU_STEPS,
# default all of them in this order; build runs first, the others in the order EECORE_GPU_STEPS names
# them: put first what the session needs most, since a run out of time loses the last):
#   build      the extension for the visible GPU (skipped with EECORE_SKIP_BUILD=1: carried .so), and
#              the SASS instruction mix of the decode_mma kernels (sass-decode-mma.txt)
#   attn       paged-attention tests on CUDA, every kernel forced in turn (test_cuda_vs_cpu.py's
#              attention cases, test_op_paged_attention.py's cuda cases)
#   engine     tests/test_engine_cuda.py (CUDA graphs against eager included) and
#              tests/test_fused_projections_engine.py
#   sweep      bench/cuda_decode_sweep.py: every kernel against SDPA -> bench/results/<gpu>/
#   e2e        bench/cuda_e2e.py (end-to-end decode against HF -> bench/results/<gpu>/<device>-e2e-*)
#   profile    bench/cuda_step_profile.py: a decode step's kernels by time and the host's parts of a
#              step, graphed (and eager with EECORE_PROFILE_EAGER=1)
#   ncu        Nsight Compute on the decode kernel at the headline cell -> ncu-decode.txt
#   sanitize   compute-sanitizer memcheck and racecheck over the forced-decode attention tests
#   ops        the other CUDA op tests (test_cuda_vs_cpu.py and the cuda cases of test_op_*.py)
#   rowk       bench/cuda_row_kernels.py: a layer's row kernels against their alternatives behind
#              selectors, and PDL, per call inside a CUDA graph -> bench/results/<gpu>/<device>-row-kernels-*
#   ncurow     Nsight Compute on linear's few-row kernels at Llama-1B's QKV -> ncu-linear-*-rows.txt
#   bench      bench/cuda_ops.py (op benchmarks -> bench/results/<gpu>/<device>-<date>.*)
#   real       the embedded SmolLM2 with its real weights: the exit-ready presets against full depth
#              (bench/cuda_e2e.py --exit-ready-model; the model carried in two parts, below)
# Usage: EECORE_GPU_STEPS="build engine profile sweep" tools/gpu_check.sh
#        tools/gpu_check.sh pack-site   (here, before the call) copies the `gguf` package, which the
#        device image lacks and the GGUF ops' tests import, to .gpu_payload/site (1.4 MB, git-ignored);
#        a call that carries ".gpu_payload/site" runs those tests in the ops step.
#        tools/gpu_check.sh pack-model  (here) the embedded model, xz-compressed and cut in two
#        (.gpu_payload/model1, model2: ~45 MB each), for the real step: a call carries at most 64 MiB
#        with the working tree, so two calls back to back each carry one part (an idle machine goes
#        back after 30 s; the first part stays in the ignored folder there); the real step joins them.
# Environment:
#   EECORE_GPU_CHECK_SECONDS  the whole run's budget (default 470: one call of 8 minutes)
#   EECORE_TEST_ARGS          extra pytest arguments for the test steps
#   EECORE_E2E_ARGS           arguments for bench/cuda_e2e.py
#   EECORE_PROFILE_ARGS       arguments for bench/cuda_step_profile.py (e.g. --exit-configs none static)
#   EECORE_ROWK_ARGS          arguments for bench/cuda_row_kernels.py
#   EECORE_SWEEP_ARGS         arguments for bench/cuda_decode_sweep.py
#   EECORE_REAL_ARGS          arguments for the real step's bench/cuda_e2e.py (after its defaults)
#   EECORE_ATTN_FILTER        a pytest -k expression the attn step's cases must also match, e.g.
#                             "decode_mma or auto" for the kernels a change touched (default: all)
#   EECORE_NCU_KERNELS        kernels Nsight Compute profiles, as the sweep names them (default: decode_mma)
#   EECORE_NCU_CELLS          cells it profiles besides the headline, "B,CTX,HQ,HKV,D" each (default: none)
#   EECORE_SANITIZE_KERNEL    the kernel the sanitizers check (default: decode_mma)
#   EECORE_SANITIZE_TESTS     a pytest -k expression over the sanitizers' test files that replaces
#                             their selection, e.g. "argmax or gemv_mma or silu or rotary"
#   EECORE_SANITIZE_FILES     the test files the sanitizers run (default: tests/test_cuda_vs_cpu.py),
#                             e.g. tests/test_op_fused_projections.py with EECORE_SANITIZE_TESTS=cuda
# Each step's timeout is cut to what is left of the budget, so the logs always come back. Measured
# on an H200 (2026-11-26): build 70 s, sweep 60 s, ncu 10 s, sanitizers 55 s, engine tests 20 s;
# the attention tests ran 524 of 617 cases in 150 s at -n 16 with the CPU oversubscribed (every
# worker's OpenMP pool on 16 cores): the test steps now run with OMP_NUM_THREADS=1.
# Logs go to $OUT (the device tool's output folder) when set, else to /tmp/eecore-gpu-check; what
# comes back is summary.txt, logs.tar.gz (every log and today's results) and the built _C*.so.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack-site ]; then
  mkdir -p .gpu_payload/site
  cp -r "$(python -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" .gpu_payload/site/
  echo "carry [\".gpu_payload/site\"]"; exit 0
fi
if [ "${1:-}" = pack-model ]; then
  gguf="$(python -c "from eecore.models.loader import default_model_path; print(default_model_path())")"
  rm -rf .gpu_payload/model1 .gpu_payload/model2 && mkdir -p .gpu_payload/model1 .gpu_payload/model2
  xz -T0 -6 -c "$gguf" > .gpu_payload/model.gguf.xz || exit 1  # Q4_1 blocks: xz saves ~8%
  split -n 2 -d .gpu_payload/model.gguf.xz .gpu_payload/model.gguf.xz.part && rm .gpu_payload/model.gguf.xz
  mv .gpu_payload/model.gguf.xz.part00 .gpu_payload/model1/ && mv .gpu_payload/model.gguf.xz.part01 .gpu_payload/model2/ \
    || exit 1
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu_payload/model2/model.gguf.sha256
  du -sh .gpu_payload/model1 .gpu_payload/model2
  echo "carry [\".gpu_payload/model1\", \".gpu_payload/site\"], then [\".gpu_payload/model2\"]"; exit 0
fi
LOGS="${OUT:-${TMPDIR:-/tmp}/eecore-gpu-check}"
WORK="$(mktemp -d)"
mkdir -p "$LOGS"
STEPS=" ${EECORE_GPU_STEPS:-build attn engine sweep e2e profile ncu sanitize ops rowk bench} "
[ "${EECORE_SKIP_BUILD:-0}" = "1" ] && STEPS="${STEPS/ build / }"
DEADLINE=$(($(date +%s) + ${EECORE_GPU_CHECK_SECONDS:-470}))
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
[ -d .gpu_payload/site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_payload/site"  # see pack-site
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1
# The device image's default g++ (/opt/gcc) links libstdc++ statically, which setup.py refuses (see
# _links_libstdcxx_statically there): build with the system compiler, as torch's wheels expect.
if [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" LDCXXSHARED="/usr/bin/g++ -shared"
fi
PY="${PYTHON:-python3}"
JOBS="${EECORE_TEST_JOBS:-8}"
PARALLEL=()  # pytest-xdist where installed (the device image has it)
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n "$JOBS")
SANITIZER="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || echo ncu)"
ATTN_CASES="decode or prefill or verification or causal or cross or rows_past or unaligned or invalid"
ATTN_TESTS=(tests/test_cuda_vs_cpu.py -k "($ATTN_CASES)${EECORE_ATTN_FILTER:+ and ($EECORE_ATTN_FILTER)}")
TEST_GUARD=(--durations 8)
# a hung test is named, where pytest-timeout is installed (the device image has it)
"$PY" -c "import pytest_timeout" 2>/dev/null && TEST_GUARD+=(--timeout 90)
status=0

want() { [[ "$STEPS" == *" $1 "* ]]; }
step() { echo "== $1 ($(date +%T))" | tee -a "$LOGS/summary.txt"; }
# limited SECONDS CMD...: run CMD under a timeout of SECONDS, or of what is left of the budget.
limited() {
  local want=$1 left=$((DEADLINE - $(date +%s) - 10))
  shift
  [ "$left" -lt 5 ] && { echo "out of time: skipped $*" | tee -a "$LOGS/summary.txt"; return 124; }
  timeout "$((want < left ? want : left))" "$@"
}
finish() {
  cp bench/results/*/*"$(date +%F)"* "$WORK/" 2>/dev/null
  tar -czf "$LOGS/logs.tar.gz" -C "$WORK" . 2>/dev/null
  cp python/eecore/_C*.so "$LOGS/" 2>/dev/null
  exit $status
}
report() {  # report LOG: its failures and its last lines, into the summary
  grep -E "^(FAILED|ERROR)" "$1" | head -30 | tee -a "$LOGS/summary.txt"
  tail -2 "$1" | tee -a "$LOGS/summary.txt"
}

step "GPU and toolchain"
{ nvidia-smi; "$CUDA_HOME/bin/nvcc" --version; "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$WORK/env.txt" 2>&1
tail -3 "$WORK/env.txt" | tee -a "$LOGS/summary.txt"

if want build; then
  step "build (TORCH_CUDA_ARCH_LIST from the visible GPU)"
  if ! limited 200 "$PY" setup.py build_ext --inplace > "$WORK/build.txt" 2>&1; then
    echo "BUILD FAILED" | tee -a "$LOGS/summary.txt"; grep -E "error|Error" "$WORK/build.txt" | head -40 | tee -a "$LOGS/summary.txt"
    status=1; finish
  fi
fi
"$PY" -c "import eecore._C as c; print(c.build_info())" 2>&1 | tee -a "$LOGS/summary.txt"
if want build && command -v "$CUDA_HOME/bin/cuobjdump" > /dev/null; then
  # Instructions per decode_mma instantiation, by opcode: what a kernel change did, readable without a GPU.
  "$CUDA_HOME/bin/cuobjdump" -sass python/eecore/_C*.so 2>/dev/null | "$PY" tools/sass_mix.py decode_mma \
    > "$WORK/sass-decode-mma.txt" 2>&1
  head -12 "$WORK/sass-decode-mma.txt" | tee -a "$LOGS/summary.txt"
fi

run_attn() {
  step "paged-attention tests on CUDA, every kernel forced in turn"
  OMP_NUM_THREADS=1 limited 240 "$PY" -m pytest -q "${PARALLEL[@]}" "${TEST_GUARD[@]}" -p no:cacheprovider "${ATTN_TESTS[@]}" ${EECORE_TEST_ARGS:-} \
    > "$WORK/pytest-attn.txt" 2>&1 || status=1
  report "$WORK/pytest-attn.txt"
  OMP_NUM_THREADS=1 limited 90 "$PY" -m pytest -q "${PARALLEL[@]}" "${TEST_GUARD[@]}" -p no:cacheprovider tests/test_op_paged_attention.py \
    -k "cuda${EECORE_ATTN_FILTER:+ and ($EECORE_ATTN_FILTER)}" > "$WORK/pytest-attn-op.txt" 2>&1 \
    || [ $? -eq 5 ] || status=1  # 5: a filter that selects none of these is no failure
  report "$WORK/pytest-attn-op.txt"
}

run_engine() {
  step "the engine on CUDA"
  limited 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py ${EECORE_TEST_ARGS:-} \
    > "$WORK/pytest-engine.txt" 2>&1 || status=1
  report "$WORK/pytest-engine.txt"
  # kernels never run on a GPU in a process of their own: a fault there (an illegal address leaves
  # the CUDA context unusable) cannot fail the tests above
  limited 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_fused_projections_engine.py ${EECORE_TEST_ARGS:-} \
    > "$WORK/pytest-engine-fused.txt" 2>&1 || status=1
  report "$WORK/pytest-engine-fused.txt"
}

run_sweep() {
  step "decode sweep: every kernel against SDPA"
  limited 150 "$PY" bench/cuda_decode_sweep.py ${EECORE_SWEEP_ARGS:-} > "$WORK/decode-sweep.txt" 2>&1 || status=1
  grep -E "copy|worst|headline|Error|error" "$WORK/decode-sweep.txt" | tail -8 | tee -a "$LOGS/summary.txt"
  # the headline cell again with each sequence's blocks in order: what scattered blocks cost
  limited 40 "$PY" bench/cuda_decode_sweep.py --headline-only --sequential-blocks --kernels auto \
    > "$WORK/decode-sequential-blocks.txt" 2>&1 || status=1
  grep -E "headline|Error|error" "$WORK/decode-sequential-blocks.txt" | sed 's/^/sequential blocks: /' \
    | tee -a "$LOGS/summary.txt"
}

run_e2e() {
  step "end-to-end decode against HF"
  (cd bench && limited 200 "$PY" cuda_e2e.py ${EECORE_E2E_ARGS:-}) > "$WORK/e2e.txt" 2>&1 || status=1
  grep -E "batch|Error" "$WORK/e2e.txt" | tail -10 | tee -a "$LOGS/summary.txt"
}
run_profile() {
  step "a decode step's kernels (graphed; eager too with EECORE_PROFILE_EAGER=1)"
  (cd bench && limited 150 "$PY" cuda_step_profile.py ${EECORE_PROFILE_ARGS:-} \
    && if [ "${EECORE_PROFILE_EAGER:-0}" = "1" ]; then
         limited 60 "$PY" cuda_step_profile.py --enforce-eager ${EECORE_PROFILE_ARGS:-}; fi) \
    > "$WORK/step-profile.txt" 2>&1 || status=1
  grep -E "a step|Error" "$WORK/step-profile.txt" | tail -12 | tee -a "$LOGS/summary.txt"
}

run_ncu() {
  step "Nsight Compute at the headline cell (B=64, ctx 4096, 32/8 heads, D=128) and the cells in EECORE_NCU_CELLS"
  for kernel in ${EECORE_NCU_KERNELS:-decode_mma}; do  # "decode_mma:v1": the sweep sets the variant
    for cell in headline ${EECORE_NCU_CELLS:-}; do  # "1,256,32,8,128": a small cell, B=1 at a short context
      if [ "$cell" = headline ]; then which=(--headline-only); name="${kernel//:/-}"
      else which=(--cell "$cell"); name="${kernel//:/-}-${cell//,/-}"; fi
      limited 60 "$NCU" --clock-control none --target-processes all -k "regex:paged_attention_${kernel%%:*}_kernel" \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats --section SourceCounters \
        "$PY" bench/cuda_decode_sweep.py "${which[@]}" --kernels "$kernel" > "$WORK/ncu-$name.txt" 2>&1 || status=1
    done
  done
  for f in "$WORK"/ncu-*.txt; do
    grep -E "Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Theoretical Occ|ERR" "$f" \
      | head -8 | tee -a "$LOGS/summary.txt"
  done
}

run_sanitize() {
  SAN_KERNEL="${EECORE_SANITIZE_KERNEL:-decode_mma}"
  step "compute-sanitizer memcheck and racecheck, forced $SAN_KERNEL kernel"
  # Test ids put the forced kernel first: "test_decode[decode_mma-16-heads1-dtype1]"; its variants
  # ("decode_mma-2stages-...", "decode_mma-v1-...", "-v2-") are left out: the plain cases run the build's
  # default or EECORE_DECODE_MMA_LDMATRIX's choice.
  # EECORE_SANITIZE_TESTS replaces both -k expressions (e.g. "argmax or gemv_mma" for the row kernels).
  read -ra SAN_FILES <<< "${EECORE_SANITIZE_FILES:-tests/test_cuda_vs_cpu.py}"
  sub=("${SAN_FILES[@]}" -k "${EECORE_SANITIZE_TESTS:-(test_decode or causal or invalid or rows_past or unaligned or verification) and not large and $SAN_KERNEL- and not 2stages and not 4stages and not v1- and not v2- and not versions_agree}")
  limited 150 "$SANITIZER" --tool memcheck --error-exitcode 99 \
    --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider "${sub[@]}" > "$WORK/memcheck.txt" 2>&1 &
  mc=$!
  limited 150 "$SANITIZER" --tool racecheck --error-exitcode 99 \
    --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider "${SAN_FILES[@]}" \
    -k "${EECORE_SANITIZE_TESTS:-(test_decode or verification) and $SAN_KERNEL- and dtype1 and not large and not 2stages and not 4stages and not v1- and not v2- and not versions_agree}" \
    > "$WORK/racecheck.txt" 2>&1 || status=1
  wait $mc || status=1
  for f in memcheck racecheck; do
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|hazard" "$WORK/$f.txt" | head -4 | tee -a "$LOGS/summary.txt"
    tail -1 "$WORK/$f.txt" | tee -a "$LOGS/summary.txt"
  done
}

run_ops() {
  step "the other CUDA op tests"
  OMP_NUM_THREADS=1 limited 200 "$PY" -m pytest -q "${PARALLEL[@]}" -p no:cacheprovider tests/test_cuda_vs_cpu.py \
    tests/test_op_*.py --deselect tests/test_op_fused_projections.py \
    -k "cuda and not paged_attention and not ($ATTN_CASES)" ${EECORE_TEST_ARGS:-} > "$WORK/pytest-ops.txt" 2>&1 || status=1
  report "$WORK/pytest-ops.txt"
  # as in run_engine: the fused projections' first GPU run, in processes of their own
  OMP_NUM_THREADS=1 limited 60 "$PY" -m pytest -q "${PARALLEL[@]}" -p no:cacheprovider tests/test_op_fused_projections.py \
    -k cuda ${EECORE_TEST_ARGS:-} > "$WORK/pytest-ops-fused.txt" 2>&1 || status=1
  report "$WORK/pytest-ops-fused.txt"
}

run_ncurow() {
  step "Nsight Compute on linear's few-row kernels (Llama-1B's QKV projection, 1 and 8 rows; caches flushed)"
  for kernel in gemv gemv_mma; do
    for rows in 1 8; do
      (cd bench && EECORE_LINEAR_KERNEL=$kernel limited 40 "$NCU" --clock-control none -k "regex:linear_${kernel}_kernel" \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
        "$PY" cuda_row_kernels.py --models llama-3.2-1b --rows "$rows" --repeats 1 --no-save) \
        > "$WORK/ncu-linear-$kernel-$rows-rows.txt" 2>&1 || status=1
      grep -E "linear_gemv|DRAM Throughput|Duration|Registers Per|Achieved Occupancy|ERR" \
        "$WORK/ncu-linear-$kernel-$rows-rows.txt" | head -6 | sed "s/^/$kernel, $rows rows: /" | tee -a "$LOGS/summary.txt"
    done
  done
}

run_rowk() {
  step "a layer's row kernels against their alternatives behind selectors, and PDL"
  (cd bench && limited 90 "$PY" cuda_row_kernels.py ${EECORE_ROWK_ARGS:-}) > "$WORK/row-kernels.txt" 2>&1 || status=1
  grep -E "rows|layer chain|linear qkv|silu|Error" "$WORK/row-kernels.txt" | tail -16 | tee -a "$LOGS/summary.txt"
}

run_real() {
  step "the embedded SmolLM2 on its real weights: exit-ready presets against full depth"
  local model=.gpu_payload/model.gguf
  if [ ! -f "$model" ]; then
    for part in 1 2; do [ -d ".gpu_payload/model$part" ] || { echo "missing .gpu_payload/model$part: carry it" \
      | tee -a "$LOGS/summary.txt"; status=1; return; }; done
    cat .gpu_payload/model1/model.gguf.xz.part* .gpu_payload/model2/model.gguf.xz.part* | xz -dc > "$model.tmp" \
      && [ "$(sha256sum "$model.tmp" | cut -d' ' -f1)" = "$(cat .gpu_payload/model2/model.gguf.sha256)" ] \
      && mv "$model.tmp" "$model" || { echo "the model's parts do not join" | tee -a "$LOGS/summary.txt"; status=1; return; }
  fi
  (cd bench && limited 300 "$PY" cuda_e2e.py --models --exit-models --exit-ready-model "../$model" --no-hf \
    --repeats 2 ${EECORE_REAL_ARGS:-}) > "$WORK/real.txt" 2>&1 || status=1
  grep -E "smollm2|Error|error" "$WORK/real.txt" | tail -30 | tee -a "$LOGS/summary.txt"
}

run_bench() {
  step "op benchmarks"
  limited 60 "$PY" bench/cuda_ops.py --quick > "$WORK/bench.txt" 2>&1 || status=1
  tail -14 "$WORK/bench.txt" | tee -a "$LOGS/summary.txt"
}

# The steps after the build, in the order EECORE_GPU_STEPS names them: a session puts first what it
# needs most, and a run out of time loses the last.
for name in $STEPS; do
  case "$name" in
    build) ;;
    attn|engine|sweep|e2e|profile|ncu|ncurow|sanitize|ops|rowk|bench|real) "run_$name" ;;
    *) echo "unknown step: $name" | tee -a "$LOGS/summary.txt"; status=1 ;;
  esac
done

finish
