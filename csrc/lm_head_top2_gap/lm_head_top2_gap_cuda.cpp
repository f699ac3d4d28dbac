// lm_head_top2_gap on CUDA: shared checks, a small workspace of per-tile states (B x V / 64, 16
// bytes each, never the [B, V] logits), then the tile and reduce launches.
#include <torch/library.h>

#include <tuple>

#include "common/cuda_glue.h"
#include "eecore/launch/lm_head_top2_gap.h"
#include "lm_head_top2_gap/lm_head_top2_gap_checks.h"

namespace eecore {
namespace {

std::tuple<at::Tensor, at::Tensor> lm_head_top2_gap_cuda(const at::Tensor& hidden, const at::Tensor& weight) {
  const char* op = "lm_head_top2_gap";
  check_lm_head_top2_gap_args(hidden, weight);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t rows = hidden.size(0);
  at::Tensor gap = at::empty({rows}, hidden.options().dtype(at::kFloat));
  at::Tensor top1 = at::empty({rows}, hidden.options().dtype(at::kLong));
  cuda::LmHeadTop2GapParams p{};
  p.hidden = hidden.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.hidden_stride = hidden.stride(0);
  p.weight_stride = weight.stride(0);
  p.rows = checked_int32(op, "hidden", rows, "rows");
  EECORE_CHECK_ARG(op, "hidden", rows <= 1000000, "has ", rows, " rows; at most 10^6 per call are supported");
  p.hidden_size = hidden.size(1);
  p.vocab = checked_int32(op, "weight", weight.size(0), "vocab rows");
  p.dtype = to_dtype(hidden.scalar_type());
  p.gap = gap.data_ptr<float>();
  p.top1 = top1.data_ptr<int64_t>();
  const int64_t bytes = cuda::lm_head_top2_gap_workspace_bytes(p);
  at::Tensor workspace = at::empty({bytes}, hidden.options().dtype(at::kByte));
  check_launch(op, cuda::launch_lm_head_top2_gap(p, workspace.data_ptr(), current_stream(hidden.device())));
  return {gap, top1};
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("lm_head_top2_gap", &eecore::lm_head_top2_gap_cuda); }
