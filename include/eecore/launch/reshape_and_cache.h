// CUDA launcher of reshape_and_cache (csrc/reshape_and_cache/reshape_and_cache_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct ReshapeAndCacheParams {
  const void* key;        // [T, Hkv, D], unit stride along D
  const void* value;      // [T, Hkv, D]
  void* k_cache;          // [NB, BS, Hkv, D]
  void* v_cache;          // [NB, BS, Hkv, D]
  const int64_t* slot_mapping;  // [T]: block * BS + offset; negative or >= NB * BS skips the token
  int64_t key_stride_token, key_stride_head;      // elements
  int64_t value_stride_token, value_stride_head;
  int64_t cache_stride_block, cache_stride_token, cache_stride_head;  // shared by k_cache and v_cache
  int64_t slot_stride;
  int64_t num_tokens;
  int32_t num_kv_heads, head_dim, block_size, num_blocks;
  DType dtype;            // of key, value and the caches
};

// One block per token copies its K and V rows of every head (16-byte vectors where aligned).
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
