#!/usr/bin/env bash
# Everything issue 3 asks of a session that has been lent a GPU, in one command, from the repo root:
#   1. build the extension for the visible GPU;
#   2. the op tests on CUDA (test_cuda_vs_cpu.py, and the cuda cases of every test_op_*.py);
#   3. the op benchmarks (bench/bench_cuda.py -> bench/results/<device>-<date>.*);
#   4. compute-sanitizer memcheck over test_cuda_vs_cpu.py, alongside the engine on CUDA
#      (tests/test_engine_cuda.py). The CPU-only tests are left to CI, which runs them all.
#   5. the decode sweep (bench/cuda_decode_sweep.py) and end-to-end decode against HF
#      (bench/e2e_cuda.py -> bench/results/<device>-e2e-<date>.json).
# Usage: tools/gpu_check.sh [--quick]      (--quick: memcheck on a subset of the CUDA op tests)
# Environment:
#   EECORE_SKIP_BUILD=1     reuse an eecore/_C*.so built by an earlier run on the same image (carried)
#   EECORE_SKIP_TESTS=1     steps 1, 3 and 5 only
#   EECORE_TEST_ARGS        extra pytest arguments for step 2 (-k ...)
#   EECORE_GPU_CHECK_SECONDS  the whole run's budget (default 570: the device tool allows 600)
# Each step's timeout is cut to what is left of the budget, so the logs always come back. Measured
# on an H100: build 40 s, step 2 ~190 s at -n 8 with the CPU cases too (now left out), step 3 10 s,
# memcheck ~120 s.
# Logs go to $OUT (the device tool's output folder) when set, else to /tmp/eecore-gpu-check; what
# comes back is summary.txt, logs.tar.gz (every log and today's results) and the built _C*.so.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${OUT:-${TMPDIR:-/tmp}/eecore-gpu-check}"
WORK="$(mktemp -d)"
mkdir -p "$LOGS"
QUICK="${1:-}"
DEADLINE=$(($(date +%s) + ${EECORE_GPU_CHECK_SECONDS:-570}))
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
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
status=0

step() { echo "== $1 ($(date +%T))" | tee -a "$LOGS/summary.txt"; }
# limited SECONDS CMD...: run CMD under a timeout of SECONDS, or of what is left of the budget.
limited() {
  local want=$1 left=$((DEADLINE - $(date +%s) - 10))
  shift
  [ "$left" -lt 5 ] && { echo "out of time: skipped $*" | tee -a "$LOGS/summary.txt"; return 124; }
  timeout "$((want < left ? want : left))" "$@"
}
finish() {
  cp bench/results/*"$(date +%F)"* "$WORK/" 2>/dev/null
  tar -czf "$LOGS/logs.tar.gz" -C "$WORK" . 2>/dev/null
  cp python/eecore/_C*.so "$LOGS/" 2>/dev/null
  exit $status
}
report() {  # report LOG: its failures and its last lines, into the summary
  grep -E "^(FAILED|ERROR)" "$1" | head -40 | tee -a "$LOGS/summary.txt"
  tail -2 "$1" | tee -a "$LOGS/summary.txt"
}

step "GPU and toolchain"
{ nvidia-smi; "$CUDA_HOME/bin/nvcc" --version; "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$WORK/env.txt" 2>&1
tail -3 "$WORK/env.txt" | tee -a "$LOGS/summary.txt"

if [ "${EECORE_SKIP_BUILD:-0}" != "1" ]; then
  step "build (TORCH_CUDA_ARCH_LIST from the visible GPU)"
  if ! limited 150 "$PY" setup.py build_ext --inplace > "$WORK/build.txt" 2>&1; then
    echo "BUILD FAILED" | tee -a "$LOGS/summary.txt"; grep -E "error|Error" "$WORK/build.txt" | head -40 | tee -a "$LOGS/summary.txt"
    status=1; finish
  fi
fi
"$PY" -c "import eecore._C as c; print(c.build_info())" 2>&1 | tee -a "$LOGS/summary.txt"

if [ "${EECORE_SKIP_TESTS:-0}" != "1" ]; then
  step "op tests on CUDA (test_cuda_vs_cpu.py, and the cuda cases of every test_op_*.py)"
  limited 250 "$PY" -m pytest -q "${PARALLEL[@]}" -p no:cacheprovider tests/test_cuda_vs_cpu.py tests/test_op_*.py \
    -k cuda ${EECORE_TEST_ARGS:-} > "$WORK/pytest-ops.txt" 2>&1 || status=1
  report "$WORK/pytest-ops.txt"
fi

step "op benchmarks"
limited 60 "$PY" bench/bench_cuda.py > "$WORK/bench.txt" 2>&1 || status=1
tail -14 "$WORK/bench.txt" | tee -a "$LOGS/summary.txt"

if [ "${EECORE_SKIP_TESTS:-0}" != "1" ]; then
  step "memcheck over the CUDA op tests, and the engine on CUDA, side by side"
  SANITIZER="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
  targets=(tests/test_cuda_vs_cpu.py)
  [ "$QUICK" = "--quick" ] && targets+=(-k "decode_head_dims or prefill_varlen or kv_fill or lm_head")
  limited 150 "$SANITIZER" --tool memcheck --error-exitcode 99 --target-processes all \
    "$PY" -m pytest -q -x -p no:cacheprovider "${targets[@]}" > "$WORK/memcheck.txt" 2>&1 &
  memcheck=$!
  limited 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py > "$WORK/pytest-engine.txt" 2>&1 || status=1
  wait $memcheck || status=1
  report "$WORK/pytest-engine.txt"
  grep -E "ERROR SUMMARY|Invalid" "$WORK/memcheck.txt" | head -5 | tee -a "$LOGS/summary.txt"
  report "$WORK/memcheck.txt"
fi

step "decode sweep and end-to-end decode against HF"
limited 40 "$PY" bench/cuda_decode_sweep.py > "$WORK/decode-sweep.txt" 2>&1 || status=1
tail -8 "$WORK/decode-sweep.txt" | tee -a "$LOGS/summary.txt"
(cd bench && limited 150 "$PY" e2e_cuda.py) > "$WORK/e2e.txt" 2>&1 || status=1
grep -E "batch|Error" "$WORK/e2e.txt" | tail -8 | tee -a "$LOGS/summary.txt"
finish
