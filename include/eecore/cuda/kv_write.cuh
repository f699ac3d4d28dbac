// One token's K and V rows written into its paged-cache slot by a whole block: the body of
// reshape_and_cache's kernel, shared with the fused rotary_embedding_and_cache kernel.
#pragma once

#include "eecore/cuda/common.cuh"
#include "eecore/cuda/paged_kv.cuh"
#include "eecore/launch/reshape_and_cache.h"

namespace eecore::cuda {

// Token t's rows of every KV head to slot_mapping[t], VEC elements a copy; a slot outside the cache
// (-1 included) skips the token. Every thread of the block takes part, THREADS of them.
template <typename T, int VEC, int THREADS>
__device__ __forceinline__ void write_token_kv(const ReshapeAndCacheParams& p, int64_t t) {
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
  for (int32_t i = threadIdx.x; i < total; i += THREADS) {
    const int32_t h = i / vecs_per_head;
    const int32_t d = (i % vecs_per_head) * VEC;
    store_vec(k_dst + h * p.cache_stride_head + d, load_vec<T, VEC>(key + h * p.key_stride_head + d));
    store_vec(v_dst + h * p.cache_stride_head + d, load_vec<T, VEC>(value + h * p.value_stride_head + d));
  }
}

// Whether every row of p can move in 16-byte vectors.
template <typename T>
inline bool kv_rows_vectorizable(const ReshapeAndCacheParams& p) {
  return p.head_dim % kVec16<T> == 0 &&
         rows_aligned16({p.key, p.value, p.k_cache, p.v_cache},
                        {p.key_stride_token, p.key_stride_head, p.value_stride_token, p.value_stride_head,
                         p.cache_stride_block, p.cache_stride_token, p.cache_stride_head},
                        sizeof(T));
}

}  // namespace eecore::cuda
