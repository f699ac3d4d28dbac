// argmax on CUDA: shared checks, then one launch writing the indices on the device.
#include <torch/library.h>

#include "argmax/argmax_checks.h"
#include "common/cuda_glue.h"
#include "eecore/launch/argmax.h"

namespace eecore {
namespace {

void argmax_cuda(at::Tensor& out, const at::Tensor& logits) {
  const char* op = "argmax";
  check_argmax_args(out, logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  cuda::ArgmaxParams p{};
  p.logits = logits.const_data_ptr();
  p.row_stride = logits.stride(0);
  p.rows = checked_int32(op, "logits", logits.size(0), "rows");
  p.vocab = logits.size(1);
  p.dtype = to_dtype(logits.scalar_type());
  p.out = out.data_ptr<int64_t>();
  p.out_stride = out.stride(0);
  check_launch(op, cuda::launch_argmax(p, current_stream(logits.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("argmax", &eecore::argmax_cuda); }
