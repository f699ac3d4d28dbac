// linear on CUDA: cuBLAS through ATen, which is what a GEMM on the GPU should be; with
// EECORE_LINEAR_KERNEL=gemv, up to 8 rows of a float weight take the few-row kernel instead
// (linear_kernels.cu: a decode step's projections, where cuBLAS pays a fixed cost a call that is
// most of their time). It passes its tests on an H200 and wins at one row, but loses to cuBLAS
// from 2-4 rows (at 8 rows, 8 input loads for each weight load), so it waits for a version that
// wins at every row count (bench/results/nvidia-h200/nvidia-h200-2026-11-27-row-kernels.md). A
// weight-only int8 weight is widened for cuBLAS on every call (correct, not tuned: int8 draft
// copies are a CPU feature so far). EECORE_LINEAR_KERNEL=gemv_mma takes bf16 and fp16 weights
// whose rows are a multiple of 32 long to the same product on tensor cores instead: on an H200 it
// beat cuBLAS on SmolLM2's projections (1.06-1.09x end to end at batch 1-8) but not on Llama-1B's
// (0.90x; 34% of DRAM bandwidth on its QKV), so it stays opt-in. That build had each chunk's loads
// sunk down to its mma (linear_kernels.cu); the kernel now keeps a round of them in flight, not yet
// timed.
// EECORE_LINEAR_KERNEL=auto takes the few-row kernels only where that H200 run had them ahead:
// weights of at most kAutoMaxWeightBytes, where cuBLAS's fixed cost a call outweighs its better
// streaming (per call in a graph, 1-8 rows: Llama-1B's QKV, O and down 3.6-8.8 us against cuBLAS's
// 5.3-11.1, SmolLM2's four projections 2.4-3.2 against 3.4-5.1; its 64 MiB gate/up and the LM heads
// lost, 21.9 against 18.3 us for the gate/up); not yet timed end to end.
#include <torch/library.h>


#include "common/cuda_glue.h"
#include "eecore/batch_invariant.h"
#include "eecore/launch/linear_gemv.h"
#include "linear/linear_checks.h"
#include "linear/linear_gemm.h"

namespace eecore {
namespace {

enum class LinearKernel { kCublas, kGemv, kGemvMma, kAuto };

// EECORE_LINEAR_KERNEL=auto: the few-row kernels for weights up to this size (Llama-1B's down
// projection, 2048 x 8192 in bf16, is the largest that gained), cuBLAS above it.
constexpr int64_t kAutoMaxWeightBytes = int64_t{32} << 20;

// Read on every call, as EECORE_PAGED_ATTENTION_KERNEL is: tests switch it within one process.
LinearKernel selected_kernel() {
  if (batch_invariant_enabled()) return LinearKernel::kCublas;  // see eecore/batch_invariant.h
  using namespace switches;
  if (is(kLinearKernel, "gemv")) return LinearKernel::kGemv;
  if (is(kLinearKernel, "gemv_mma")) return LinearKernel::kGemvMma;
  if (is(kLinearKernel, "auto")) return LinearKernel::kAuto;
  return LinearKernel::kCublas;
}

// The few-row kernel's parameters, or rows = 0 where it does not apply.
cuda::LinearGemvParams gemv_params(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, bool accumulate, const LinearDims& dims) {
  cuda::LinearGemvParams p{};
  if (is_int8_weight(weight) || is_tiled_weight(weight) || dims.rows > cuda::kLinearGemvMaxRows) return p;
  p.out = out.data_ptr();
  p.input = input.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.bias = bias.has_value() && bias->defined() ? bias->const_data_ptr() : nullptr;
  p.rows = dims.rows;
  p.in_features = dims.in;
  p.out_features = dims.out;
  p.input_stride = input.stride(0);
  p.out_stride = out.stride(0);
  p.accumulate = accumulate;
  p.dtype = to_dtype(input.scalar_type());
  if (!cuda::linear_gemv_supported(p)) p.rows = 0;
  return p;
}

void linear_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, bool accumulate, const std::optional<at::Tensor>& weight_scale) {
  const LinearDims dims = check_linear_args(out, input, weight, bias, weight_scale);
  EECORE_CHECK_ARG("linear", "weight", !is_tiled_weight(weight), "is tiled for AMX ([N/16, K/depth, 16, depth]), a "
                   "CPU format; pass the [N, K] weight on CUDA");
  if (dims.rows == 0 || dims.out == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  LinearKernel kernel = selected_kernel();
  if (kernel == LinearKernel::kAuto)
    kernel = dims.out * dims.in * static_cast<int64_t>(weight.element_size()) <= kAutoMaxWeightBytes
                 ? LinearKernel::kGemvMma
                 : LinearKernel::kCublas;
  if (kernel != LinearKernel::kCublas) {
    const cuda::LinearGemvParams p = gemv_params(out, input, weight, bias, accumulate, dims);
    const cudaStream_t stream = current_stream(input.device());
    if (kernel == LinearKernel::kGemvMma && p.rows > 0 && cuda::linear_gemv_mma_supported(p)) {
      check_launch("linear", cuda::launch_linear_gemv_mma(p, stream));
      return;
    }
    // gemv_mma's other shapes (a float weight, rows not a multiple of 32 long) take the SIMT
    // few-row kernel, which is just as row-count invariant, rather than cuBLAS, which is not.
    if (p.rows > 0) {
      check_launch("linear", cuda::launch_linear_gemv(p, stream));
      return;
    }
  }
  linear_with_gemm(out, input, weight, bias, accumulate, weight_scale);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("linear", &eecore::linear_cuda); }
