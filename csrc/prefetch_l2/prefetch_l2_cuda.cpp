// prefetch_l2 on CUDA: shared checks, then one small launch of prefetch instructions.
#include <torch/library.h>

#include <algorithm>

#include "common/cuda_glue.h"
#include "eecore/launch/prefetch_l2.h"
#include "prefetch_l2/prefetch_l2_checks.h"

namespace eecore {
namespace {

void prefetch_l2_cuda(const at::Tensor& weight, int64_t max_bytes) {
  check_prefetch_l2_args(weight, max_bytes);
  const int64_t bytes = std::min<int64_t>(max_bytes, weight.numel() * weight.element_size());
  if (bytes == 0) return;
  const c10::cuda::CUDAGuard guard(weight.device());
  const cudaStream_t stream = current_stream(weight.device());
  check_launch("prefetch_l2", cuda::launch_prefetch_l2(weight.const_data_ptr(), bytes, stream));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("prefetch_l2", &eecore::prefetch_l2_cuda); }
