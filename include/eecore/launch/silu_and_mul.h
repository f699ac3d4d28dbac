// CUDA launcher of silu_and_mul (csrc/silu_and_mul/silu_and_mul_kernels.cu).
// Torch-free: contiguous rows, raw pointers, the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

struct SiluAndMulParams {
  void* out;             // [rows, d]
  const void* input;     // [rows, 2 d]: gate, then up
  int64_t rows;
  int64_t d;
  DType dtype;           // of out and input
};

// out = silu(gate) * up in fp32, rounded once to dtype; one block per row.
cudaError_t launch_silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
