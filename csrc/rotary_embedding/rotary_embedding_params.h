// The CUDA launcher's parameters of rotary_embedding from checked tensors, shared by the op's
// glue and the fused rotary_embedding_and_cache's.
#pragma once

#include "common/cuda_glue.h"
#include "eecore/launch/rotary_embedding.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {

inline cuda::RotaryEmbeddingParams rotary_embedding_params(const char* op, const RotaryShape& s,
                                                           const at::Tensor& positions, at::Tensor& query,
                                                           at::Tensor& key, const at::Tensor& cos_sin_cache,
                                                           bool is_neox) {
  cuda::RotaryEmbeddingParams p{};
  p.positions = positions.const_data_ptr<int64_t>();
  p.query = query.data_ptr();
  p.key = key.data_ptr();
  p.cos_sin_cache = cos_sin_cache.const_data_ptr();
  p.positions_stride = positions.stride(0);
  p.query_stride_token = query.stride(0);
  p.query_stride_head = query.stride(1);
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.num_tokens = checked_int32(op, "query", s.num_tokens, "tokens");
  p.num_q_heads = checked_int32(op, "query", s.num_q_heads, "heads");
  p.num_kv_heads = checked_int32(op, "key", s.num_kv_heads, "heads");
  p.head_dim = checked_int32(op, "query", s.head_dim, "head dims");
  p.rot_dim = static_cast<int32_t>(s.rot_dim);
  p.max_pos = s.max_pos;
  p.is_neox = is_neox;
  p.dtype = to_dtype(query.scalar_type());
  p.cache_dtype = to_dtype(cos_sin_cache.scalar_type());
  return p;
}

}  // namespace eecore
