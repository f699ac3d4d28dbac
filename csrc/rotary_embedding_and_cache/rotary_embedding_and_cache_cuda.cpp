// rotary_embedding_and_cache on CUDA: one launch (rotary_embedding_kernels.cu: the block rotates
// its token's heads, then copies its K and V rows to the slot), or with
// EECORE_ROTARY_AND_CACHE_KERNEL=separate, the two ops' launches. Fused, a layer of a decode step
// saves a launch and a read of the keys, with the same bits (tests/test_op_rotary_embedding_and_
// cache.py, passed on an H200).
#include <torch/library.h>


#include "eecore/switches.h"
#include "reshape_and_cache/reshape_and_cache_params.h"
#include "rotary_embedding/rotary_embedding_params.h"
#include "rotary_embedding_and_cache/rotary_embedding_and_cache_checks.h"

namespace eecore {
namespace {

// Read on every call, as EECORE_PAGED_ATTENTION_KERNEL is: tests switch it within one process.
bool separate_launches_selected() { return switches::is(switches::kRotaryAndCacheKernel, "separate"); }

void rotary_embedding_and_cache_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                     const at::Tensor& value, const at::Tensor& cos_sin_cache, bool is_neox,
                                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "rotary_embedding_and_cache";
  const auto [rotary, dims] =
      check_rotary_embedding_and_cache_args(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(query.device());
  const cuda::RotaryEmbeddingParams rot = rotary_embedding_params(op, rotary, positions, query, key, cos_sin_cache,
                                                                  is_neox);
  const cuda::ReshapeAndCacheParams cache = reshape_and_cache_params(op, dims, key, value, k_cache, v_cache,
                                                                     slot_mapping);
  const cudaStream_t stream = current_stream(query.device());
  if (separate_launches_selected()) {
    check_launch(op, cuda::launch_rotary_embedding(rot, stream));
    check_launch(op, cuda::launch_reshape_and_cache(cache, stream));
    return;
  }
  check_launch(op, cuda::launch_rotary_embedding_and_cache(rot, cache, stream));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("rotary_embedding_and_cache", &eecore::rotary_embedding_and_cache_cuda); }
