// hidden_cosine on CUDA: shared checks, then one launch.
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/launch/hidden_cosine.h"
#include "hidden_cosine/hidden_cosine_checks.h"

namespace eecore {
namespace {

at::Tensor hidden_cosine_cuda(const at::Tensor& prev, const at::Tensor& cur) {
  const char* op = "hidden_cosine";
  check_hidden_cosine_args(prev, cur);
  const c10::cuda::CUDAGuard guard(prev.device());
  const int64_t rows = prev.size(0);
  at::Tensor out = at::empty({rows}, prev.options().dtype(at::kFloat));
  cuda::HiddenCosineParams p{};
  p.prev = prev.const_data_ptr();
  p.cur = cur.const_data_ptr();
  p.prev_stride = prev.stride(0);
  p.cur_stride = cur.stride(0);
  p.rows = checked_int32(op, "prev", rows, "rows");
  p.d = prev.size(1);
  p.dtype = to_dtype(prev.scalar_type());
  p.out = out.data_ptr<float>();
  check_launch(op, cuda::launch_hidden_cosine(p, current_stream(prev.device())));
  return out;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("hidden_cosine", &eecore::hidden_cosine_cuda); }
