// rotary_embedding on CUDA: shared checks, then one launch. Positions are range-checked on the
// device (a token whose position is outside the cos/sin cache is left as is); the CPU kernel raises.
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/launch/rotary_embedding.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {
namespace {

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           const at::Tensor& cos_sin_cache, bool is_neox) {
  const char* op = "rotary_embedding";
  const RotaryShape s = check_rotary_embedding_args(positions, query, key, cos_sin_cache);
  const c10::cuda::CUDAGuard guard(query.device());
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
  check_launch(op, cuda::launch_rotary_embedding(p, current_stream(query.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("rotary_embedding", &eecore::rotary_embedding_cuda); }
