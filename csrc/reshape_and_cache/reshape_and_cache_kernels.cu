// reshape_and_cache on CUDA: one block per token writes its key and value rows of every KV head
// into the token's slot. Slots come from device memory, so each one is range-checked here: -1 (or
// anything outside the cache) skips the token, and nothing is ever written out of bounds.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/kv_write.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/launch/reshape_and_cache.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  pdl_wait();
  pdl_launch_dependents();
  write_token_kv<T, VEC, kThreads>(p, blockIdx.x);
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || p.head_dim == 0) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    const dim3 grid(static_cast<unsigned>(p.num_tokens));
    return launch_kernel(kv_rows_vectorizable<T>(p) ? reshape_and_cache_kernel<T, V> : reshape_and_cache_kernel<T, 1>,
                         grid, kThreads, 0, stream, p);
  });
}

}  // namespace eecore::cuda
