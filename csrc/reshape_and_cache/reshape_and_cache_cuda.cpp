// reshape_and_cache on CUDA: shared checks, then one launch; out-of-range slots are skipped on the
// device (the CPU kernel raises for them, which needs the data on the host).
#include <torch/library.h>

#include "reshape_and_cache/reshape_and_cache_params.h"

namespace eecore {
namespace {

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  const ReshapeAndCacheDims dims = check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const cuda::ReshapeAndCacheParams p = reshape_and_cache_params(op, dims, key, value, k_cache, v_cache, slot_mapping);
  check_launch(op, cuda::launch_reshape_and_cache(p, current_stream(k_cache.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("reshape_and_cache", &eecore::reshape_and_cache_cuda); }
