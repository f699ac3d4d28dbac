// linear on CUDA: cuBLAS through ATen, which is what a GEMM on the GPU should be; with
// EECORE_LINEAR_KERNEL=gemv, up to 8 rows of a float weight take the few-row kernel instead
// (linear_kernels.cu: a decode step's projections, where cuBLAS pays a fixed cost a call that is
// most of their time). The few-row kernel becomes the default once tests/test_op_linear.py has
// passed with it on a GPU. A weight-only int8 weight is widened for cuBLAS on every call (correct,
// not tuned: int8 draft copies are a CPU feature so far).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "common/cuda_glue.h"
#include "eecore/launch/linear_gemv.h"
#include "linear/linear_checks.h"
#include "linear/linear_gemm.h"

namespace eecore {
namespace {

// Read on every call, as EECORE_PAGED_ATTENTION_KERNEL is: tests switch it within one process.
bool gemv_kernel_selected() {
  const char* v = std::getenv("EECORE_LINEAR_KERNEL");
  return v != nullptr && std::strcmp(v, "gemv") == 0;
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
  if (gemv_kernel_selected()) {
    const cuda::LinearGemvParams p = gemv_params(out, input, weight, bias, accumulate, dims);
    if (p.rows > 0) {
      check_launch("linear", cuda::launch_linear_gemv(p, current_stream(input.device())));
      return;
    }
  }
  linear_with_gemm(out, input, weight, bias, accumulate, weight_scale);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("linear", &eecore::linear_cuda); }
