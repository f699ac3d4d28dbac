// reshape_and_cache on CUDA: one block per token writes its key and value rows of every KV head
// into the token's slot. Slots come from device memory, so each one is range-checked here: -1 (or
// anything outside the cache) skips the token, and nothing is ever written out of bounds.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/paged_kv.cuh"
#include "eecore/launch/reshape_and_cache.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  const int64_t t = blockIdx.x;
  const PagedLayout layout{p.cache_stride_block, p.cache_stride_token, p.cache_stride_head, p.block_size,
                           p.num_blocks};
  const int64_t slot_off = paged_slot_offset(layout, p.slot_mapping[t * p.slot_stride]);
  if (slot_off < 0) return;
  const T* key = static_cast<const T*>(p.key) + t * p.key_stride_token;
  const T* value = static_cast<const T*>(p.value) + t * p.value_stride_token;
  T* k_dst = static_cast<T*>(p.k_cache) + slot_off;
  T* v_dst = static_cast<T*>(p.v_cache) + slot_off;
  const int32_t vecs_per_head = p.head_dim / VEC;
  const int32_t total = p.num_kv_heads * vecs_per_head;
  for (int32_t i = threadIdx.x; i < total; i += kThreads) {
    const int32_t h = i / vecs_per_head;
    const int32_t d = (i % vecs_per_head) * VEC;
    store_vec(k_dst + h * p.cache_stride_head + d, load_vec<T, VEC>(key + h * p.key_stride_head + d));
    store_vec(v_dst + h * p.cache_stride_head + d, load_vec<T, VEC>(value + h * p.value_stride_head + d));
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || p.head_dim == 0) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    const bool vec = p.head_dim % V == 0 &&
                     rows_aligned16({p.key, p.value, p.k_cache, p.v_cache},
                                    {p.key_stride_token, p.key_stride_head, p.value_stride_token, p.value_stride_head,
                                     p.cache_stride_block, p.cache_stride_token, p.cache_stride_head},
                                    sizeof(T));
    const dim3 grid(static_cast<unsigned>(p.num_tokens));
    if (vec)
      reshape_and_cache_kernel<T, V><<<grid, kThreads, 0, stream>>>(p);
    else
      reshape_and_cache_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace eecore::cuda
