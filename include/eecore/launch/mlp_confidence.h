// CUDA launcher of mlp_confidence (csrc/mlp_confidence/mlp_confidence_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct MlpConfidenceParams {
  const void* hidden;     // [B, d], unit stride along d
  const void* w1;         // [m, d], unit stride along d
  const void* b1;         // [m]
  const void* w2;         // [m]
  const void* b2;         // [1]
  int64_t hidden_stride, w1_stride, b1_stride, w2_stride;  // elements
  int64_t rows, d, m;
  DType hidden_dtype;
  DType weight_dtype;     // of w1, b1, w2, b2: hidden's dtype or fp32
  float* out;             // [B]: sigmoid(w2 . relu(w1 h + b1) + b2)
};

// One block per row; the [B, m] activations never leave registers.
cudaError_t launch_mlp_confidence(const MlpConfidenceParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
