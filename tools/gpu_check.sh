#!/usr/bin/env bash
# Everything issue 3 asks of a session that has been lent a GPU, in one command, from the repo root:
#   build the extension for this GPU, run every test (the CUDA ones included), run the op tests
#   under compute-sanitizer memcheck, run the CUDA benchmarks (bench/results/<device>-<date>.*).
# Usage: tools/gpu_check.sh [--quick]      (--quick: fewer benchmark iterations, sanitizer on a subset)
# Logs go to $OUT (the device tool's output folder) when set, else to /tmp/eecore-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${OUT:-${TMPDIR:-/tmp}/eecore-gpu-check}"
mkdir -p "$LOGS"
QUICK="${1:-}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
status=0

step() { echo "== $1" | tee -a "$LOGS/summary.txt"; }

step "GPU and toolchain"
{ nvidia-smi; "$CUDA_HOME/bin/nvcc" --version; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$LOGS/env.txt" 2>&1
tail -3 "$LOGS/env.txt" | tee -a "$LOGS/summary.txt"

step "build (TORCH_CUDA_ARCH_LIST from the visible GPU)"
python setup.py build_ext --inplace > "$LOGS/build.txt" 2>&1 || { echo "BUILD FAILED" | tee -a "$LOGS/summary.txt"; tail -50 "$LOGS/build.txt"; exit 1; }
python -c "import eecore._C as c; print(c.build_info())" | tee -a "$LOGS/summary.txt"

step "tests (all; CUDA ones included)"
python -m pytest -q -x --ignore=tests/test_cuda_build.py > "$LOGS/pytest.txt" 2>&1 || status=1
tail -5 "$LOGS/pytest.txt" | tee -a "$LOGS/summary.txt"

step "compute-sanitizer memcheck over the CUDA op tests"
SANITIZER="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
if [ -x "$SANITIZER" ]; then
  targets=(tests/test_cuda_vs_cpu.py)
  [ "$QUICK" = "--quick" ] && targets+=(-k "decode_head_dims or prefill_varlen or kv_fill or lm_head")
  "$SANITIZER" --tool memcheck --error-exitcode 99 --target-processes all \
    python -m pytest -q -x "${targets[@]}" > "$LOGS/memcheck.txt" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$LOGS/memcheck.txt" | tail -3 | tee -a "$LOGS/summary.txt"
else
  echo "compute-sanitizer not found" | tee -a "$LOGS/summary.txt"
fi

step "benchmarks"
python bench/bench_cuda.py $QUICK > "$LOGS/bench.txt" 2>&1 || status=1
tail -12 "$LOGS/bench.txt" | tee -a "$LOGS/summary.txt"
cp bench/results/*.json bench/results/*.md "$LOGS/" 2>/dev/null || true
exit $status
