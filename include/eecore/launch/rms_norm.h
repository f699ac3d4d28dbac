// CUDA launchers of rms_norm and fused_add_rms_norm (csrc/rms_norm/rms_norm_kernels.cu).
// Torch-free: contiguous rows of `d` elements, raw pointers, the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct RmsNormParams {
  void* out;             // [rows, d]
  const void* input;     // [rows, d]
  const void* weight;    // [d]
  int64_t rows;
  int64_t d;
  float eps;
  DType dtype;           // of out, input and weight
};

// out = input * rsqrt(mean(input^2) + eps) * weight, one block per row.
cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream);

struct FusedAddRmsNormParams {
  void* input;           // [rows, d], overwritten with the normalized sum
  void* residual;        // [rows, d], overwritten with residual + input (rounded to dtype)
  const void* weight;    // [d]
  int64_t rows;
  int64_t d;
  float eps;
  DType dtype;
};

cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
