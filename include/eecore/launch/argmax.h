// CUDA launcher of argmax (csrc/argmax/argmax_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct ArgmaxParams {
  const void* logits;  // [B, V], unit stride along V
  int64_t row_stride;  // elements between rows
  int64_t rows;        // B
  int64_t vocab;       // V >= 1
  DType dtype;
  int64_t* out;        // [B] int64: the first NaN, else the first index of the maximum
  int64_t out_stride;
};

// One block per row, one streaming pass with several 16-byte loads in flight per thread.
cudaError_t launch_argmax(const ArgmaxParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
