// rms_norm and fused_add_rms_norm on CUDA: the shared checks, then the torch-free launchers.
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/launch/rms_norm.h"
#include "rms_norm/rms_norm_checks.h"

namespace eecore {
namespace {

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  const int64_t rows = check_rms_norm_args(out, input, weight, eps);
  checked_int32("rms_norm", "input", rows, "rows");
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::RmsNormParams p{};
  p.out = out.data_ptr();
  p.input = input.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.rows = rows;
  p.d = input.size(-1);
  p.eps = static_cast<float>(eps);
  p.dtype = to_dtype(input.scalar_type());
  check_launch("rms_norm", cuda::launch_rms_norm(p, current_stream(input.device())));
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = check_fused_add_rms_norm_args(input, residual, weight, eps);
  checked_int32("fused_add_rms_norm", "input", rows, "rows");
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::FusedAddRmsNormParams p{};
  p.input = input.data_ptr();
  p.residual = residual.data_ptr();
  p.weight = weight.const_data_ptr();
  p.rows = rows;
  p.d = input.size(-1);
  p.eps = static_cast<float>(eps);
  p.dtype = to_dtype(input.scalar_type());
  check_launch("fused_add_rms_norm", cuda::launch_fused_add_rms_norm(p, current_stream(input.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) {
  m.impl("rms_norm", &eecore::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &eecore::fused_add_rms_norm_cuda);
}
