// CUDA launcher of softmax_top2_gap (csrc/softmax_top2_gap/softmax_top2_gap_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct SoftmaxTop2GapParams {
  const void* logits;  // [B, V], unit stride along V
  int64_t row_stride;  // elements between rows
  int64_t rows;        // B
  int64_t vocab;       // V >= 2
  DType dtype;
  float* gap;          // [B] fp32: p1 - p2 of softmax(logits)
  int64_t* top1;       // [B] int64: first argmax
};

// One block per row, one pass over the logits, no workspace.
cudaError_t launch_softmax_top2_gap(const SoftmaxTop2GapParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
