// linear on CUDA: cuBLAS through ATen, which is what a GEMM on the GPU should be. A weight-only
// int8 weight is widened for it on every call (correct, not tuned: int8 draft copies are a CPU
// feature so far).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "linear/linear_checks.h"
#include "linear/linear_gemm.h"

namespace eecore {
namespace {

void linear_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, bool accumulate, const std::optional<at::Tensor>& weight_scale) {
  const LinearDims dims = check_linear_args(out, input, weight, bias, weight_scale);
  EECORE_CHECK_ARG("linear", "weight", !is_tiled_weight(weight), "is tiled for AMX ([N/16, K/depth, 16, depth]), a "
                   "CPU format; pass the [N, K] weight on CUDA");
  if (dims.rows == 0 || dims.out == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  linear_with_gemm(out, input, weight, bias, accumulate, weight_scale);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("linear", &eecore::linear_cuda); }
