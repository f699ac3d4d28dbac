// The CUDA launcher's parameters of reshape_and_cache from checked tensors, shared by the op's
// glue and the fused rotary_embedding_and_cache's.
#pragma once

#include "common/cuda_glue.h"
#include "eecore/launch/reshape_and_cache.h"
#include "reshape_and_cache/reshape_and_cache_checks.h"

namespace eecore {

inline cuda::ReshapeAndCacheParams reshape_and_cache_params(const char* op, const ReshapeAndCacheDims& dims,
                                                            const at::Tensor& key, const at::Tensor& value,
                                                            at::Tensor& k_cache, at::Tensor& v_cache,
                                                            const at::Tensor& slot_mapping) {
  cuda::ReshapeAndCacheParams p{};
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.cache_stride_block = k_cache.stride(0);  // both caches are contiguous with one shape
  p.cache_stride_token = k_cache.stride(1);
  p.cache_stride_head = k_cache.stride(2);
  p.slot_stride = slot_mapping.stride(0);
  p.num_tokens = checked_int32(op, "key", dims.num_tokens, "tokens");
  p.num_kv_heads = checked_int32(op, "k_cache", dims.num_kv_heads, "KV heads");
  p.head_dim = checked_int32(op, "k_cache", dims.head_dim, "head dims");
  p.block_size = checked_int32(op, "k_cache", k_cache.size(1), "tokens per block");
  p.num_blocks = checked_int32(op, "k_cache", k_cache.size(0), "blocks");
  p.dtype = to_dtype(k_cache.scalar_type());
  return p;
}

}  // namespace eecore
