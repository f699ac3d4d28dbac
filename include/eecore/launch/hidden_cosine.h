// CUDA launcher of hidden_cosine (csrc/hidden_cosine/hidden_cosine_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct HiddenCosineParams {
  const void* prev;      // [B, d], unit stride along d
  const void* cur;       // [B, d]
  int64_t prev_stride;   // elements between rows
  int64_t cur_stride;
  int64_t rows;
  int64_t d;
  DType dtype;
  float* out;            // [B]: <p, c> / (max(|p|, 1e-8) * max(|c|, 1e-8))
};

cudaError_t launch_hidden_cosine(const HiddenCosineParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
