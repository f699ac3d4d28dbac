// CUDA launcher of lm_head_top2_gap (csrc/lm_head_top2_gap/lm_head_top2_gap_kernels.cu). Torch-free.
//
// Two launches, no [B, V] logits: a tile kernel computes logits for 64 vocab rows at a time
// (tensor cores for bf16/fp16) and reduces each tile to a top-2/log-sum-exp state per batch row in
// the workspace; a second kernel merges the tile states of each row.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct LmHeadTop2GapParams {
  const void* hidden;      // [B, d], unit stride along d
  const void* weight;      // [V, d], unit stride along d
  int64_t hidden_stride;   // elements between rows of hidden
  int64_t weight_stride;   // elements between rows of weight
  int64_t rows;            // B
  int64_t hidden_size;     // d
  int64_t vocab;           // V
  DType dtype;             // of hidden and weight
  float* gap;              // [B]
  int64_t* top1;           // [B]
};

// Bytes of device workspace the launch needs (0 when there is nothing to do).
int64_t lm_head_top2_gap_workspace_bytes(const LmHeadTop2GapParams& p);

cudaError_t launch_lm_head_top2_gap(const LmHeadTop2GapParams& p, void* workspace, cudaStream_t stream);

}  // namespace eecore::cuda
