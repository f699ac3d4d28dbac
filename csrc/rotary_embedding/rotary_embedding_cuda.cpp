// rotary_embedding on CUDA: shared checks, then one launch. Positions are range-checked on the
// device (a token whose position is outside the cos/sin cache is left as is); the CPU kernel raises.
#include <torch/library.h>

#include "rotary_embedding/rotary_embedding_params.h"

namespace eecore {
namespace {

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           const at::Tensor& cos_sin_cache, bool is_neox) {
  const char* op = "rotary_embedding";
  const RotaryShape s = check_rotary_embedding_args(positions, query, key, cos_sin_cache);
  const c10::cuda::CUDAGuard guard(query.device());
  const cuda::RotaryEmbeddingParams p = rotary_embedding_params(op, s, positions, query, key, cos_sin_cache, is_neox);
  check_launch(op, cuda::launch_rotary_embedding(p, current_stream(query.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("rotary_embedding", &eecore::rotary_embedding_cuda); }
