// CUDA launchers of kv_fill (csrc/kv_fill/kv_fill_kernels.cu). Torch-free.
//
// The glue runs, on one stream and without any synchronization:
//   1. launch_kv_fill_normalize: normed[t] = hidden[t] * rsqrt(mean(hidden[t]^2) + eps), rounded
//      to the activation dtype (each layer's norm gain is folded into its weight rows);
//   2. one GEMM: projected [T, L * 2 * Hkv * D] = normed @ weight.view(L * 2 * Hkv * D, d)^T;
//   3. launch_kv_fill_epilogue: for every (token, layer >= start_layer[token]): bias, RoPE on K at
//      positions[token], and the store into slot_mapping[token] of that layer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct KvFillParams {
  void* kv_cache;               // [L, 2, NB, BS, Hkv, D], contiguous
  const void* hidden;           // [T, d], unit stride along d
  int64_t hidden_stride;        // elements between rows of hidden
  void* normed;                 // [T, d] contiguous scratch (step 1 output, step 2 input)
  const void* projected;        // [T, L * 2 * Hkv * D] contiguous (step 2 output)
  const void* bias;             // [L, 2 * Hkv * D] contiguous, or nullptr
  const void* cos_sin_cache;    // [max_pos, rot_dim] contiguous, or nullptr (no RoPE)
  const int64_t* positions;     // [T]
  const int64_t* slot_mapping;  // [T]
  const int32_t* start_layer;   // [T]
  int64_t positions_stride, slot_stride, start_layer_stride;
  int64_t num_tokens, hidden_size;
  int32_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  int32_t rot_dim;              // 0 without RoPE
  int64_t max_pos;
  float eps;
  bool is_neox;
  DType dtype;                  // of kv_cache, hidden, normed, projected and bias
  DType cache_dtype;            // of cos_sin_cache: fp32 or dtype
};

cudaError_t launch_kv_fill_normalize(const KvFillParams& p, cudaStream_t stream);

// Tokens whose slot is negative or beyond the cache, whose start layer is negative, or (with RoPE)
// whose position is outside the cos/sin cache write nothing.
cudaError_t launch_kv_fill_epilogue(const KvFillParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
