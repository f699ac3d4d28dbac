// mlp_confidence on CUDA: shared checks, then one launch.
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/launch/mlp_confidence.h"
#include "mlp_confidence/mlp_confidence_checks.h"

namespace eecore {
namespace {

at::Tensor mlp_confidence_cuda(const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& b1,
                               const at::Tensor& w2, const at::Tensor& b2) {
  const char* op = "mlp_confidence";
  check_mlp_confidence_args(hidden, w1, b1, w2, b2);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t rows = hidden.size(0);
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kFloat));
  cuda::MlpConfidenceParams p{};
  p.hidden = hidden.const_data_ptr();
  p.w1 = w1.const_data_ptr();
  p.b1 = b1.const_data_ptr();
  p.w2 = w2.const_data_ptr();
  p.b2 = b2.const_data_ptr();
  p.hidden_stride = hidden.stride(0);
  p.w1_stride = w1.stride(0);
  p.b1_stride = b1.stride(0);
  p.w2_stride = w2.stride(0);
  p.rows = checked_int32(op, "hidden", rows, "rows");
  p.d = hidden.size(1);
  p.m = w1.size(0);
  p.hidden_dtype = to_dtype(hidden.scalar_type());
  p.weight_dtype = to_dtype(w1.scalar_type());
  p.out = out.data_ptr<float>();
  check_launch(op, cuda::launch_mlp_confidence(p, current_stream(hidden.device())));
  return out;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("mlp_confidence", &eecore::mlp_confidence_cuda); }
