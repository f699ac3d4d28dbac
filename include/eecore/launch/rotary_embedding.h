// CUDA launcher of rotary_embedding (csrc/rotary_embedding/rotary_embedding_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"
#include "eecore/launch/reshape_and_cache.h"

namespace eecore::cuda {

struct RotaryEmbeddingParams {
  const int64_t* positions;    // [T]; a position outside [0, max_pos) leaves its token untouched
  void* query;                 // [T, Hq, D], rotated in place; unit stride along D
  void* key;                   // [T, Hkv, D]
  const void* cos_sin_cache;   // [max_pos, rot_dim] = cat(cos, sin), contiguous
  int64_t positions_stride;
  int64_t query_stride_token, query_stride_head;  // elements
  int64_t key_stride_token, key_stride_head;
  int64_t num_tokens;
  int32_t num_q_heads, num_kv_heads, head_dim, rot_dim;
  int64_t max_pos;
  bool is_neox;                // rotate halves (NeoX/Llama) or interleaved pairs (GPT-J)
  DType dtype;                 // of query and key
  DType cache_dtype;           // fp32 or dtype
};

// One block per token rotates every query and key head, several pairs per thread.
cudaError_t launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream);

// launch_rotary_embedding(rot), then launch_reshape_and_cache(cache) of the rotated keys, in one
// launch where both take 16-byte vectors (two launches otherwise). cache.key must be rot.key; both
// describe the same tokens and dtype.
cudaError_t launch_rotary_embedding_and_cache(const RotaryEmbeddingParams& rot, const ReshapeAndCacheParams& cache,
                                              cudaStream_t stream);

}  // namespace eecore::cuda
