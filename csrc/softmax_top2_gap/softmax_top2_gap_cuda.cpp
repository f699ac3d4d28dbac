// softmax_top2_gap on CUDA: shared checks, then one launch writing (gap, top1) on the device.
#include <torch/library.h>

#include <tuple>

#include "common/cuda_glue.h"
#include "eecore/launch/softmax_top2_gap.h"
#include "softmax_top2_gap/softmax_top2_gap_checks.h"

namespace eecore {
namespace {

std::tuple<at::Tensor, at::Tensor> softmax_top2_gap_cuda(const at::Tensor& logits) {
  const char* op = "softmax_top2_gap";
  check_softmax_top2_gap_args(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  at::Tensor gap = at::empty({rows}, logits.options().dtype(at::kFloat));
  at::Tensor top1 = at::empty({rows}, logits.options().dtype(at::kLong));
  cuda::SoftmaxTop2GapParams p{};
  p.logits = logits.const_data_ptr();
  p.row_stride = logits.stride(0);
  p.rows = checked_int32(op, "logits", rows, "rows");
  p.vocab = logits.size(1);
  p.dtype = to_dtype(logits.scalar_type());
  p.gap = gap.data_ptr<float>();
  p.top1 = top1.data_ptr<int64_t>();
  check_launch(op, cuda::launch_softmax_top2_gap(p, current_stream(logits.device())));
  return {gap, top1};
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("softmax_top2_gap", &eecore::softmax_top2_gap_cuda); }
