// accept_update on CUDA: shared checks, then one launch. `remaining` is returned as a device
// tensor: the caller decides when that single int32 crosses to the host.
#include <torch/library.h>

#include "accept_update/accept_update_checks.h"
#include "common/cuda_glue.h"
#include "eecore/launch/accept_update.h"

namespace eecore {
namespace {

at::Tensor accept_update_cuda(at::Tensor& status, const at::Tensor& confidence, const at::Tensor& threshold,
                              const at::Tensor& active) {
  check_accept_update_args(status, confidence, threshold, active);
  const c10::cuda::CUDAGuard guard(status.device());
  at::Tensor remaining = at::empty({}, status.options().dtype(at::kInt));
  cuda::AcceptUpdateParams p{};
  p.status = status.data_ptr<bool>();
  p.confidence = confidence.const_data_ptr<float>();
  p.threshold = threshold.const_data_ptr<float>();
  p.active = active.const_data_ptr<bool>();
  p.status_stride = status.stride(0);
  p.confidence_stride = confidence.stride(0);
  p.threshold_stride = threshold.dim() == 0 ? 0 : threshold.stride(0);  // a scalar threshold: stride 0
  p.active_stride = active.stride(0);
  p.rows = status.size(0);
  p.remaining = remaining.data_ptr<int32_t>();
  check_launch("accept_update", cuda::launch_accept_update(p, current_stream(status.device())));
  return remaining;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("accept_update", &eecore::accept_update_cuda); }
