// What every csrc/<op>/<op>_cuda.cpp needs between the shared argument checks and the torch-free
// launcher: the launcher's dtype, the current stream, 32-bit size limits and launch-error
// reporting. Every op's checks header already requires all its tensors on one device.
// Deliberately light: no ATen/cuda/CUDAContext.h (it drags in cuBLAS/cuSPARSE headers that a
// CUDA torch wheel does not ship), only the c10/cuda pieces.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "common/checks.h"
#include "eecore/dtype.h"

namespace eecore {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "eecore: no CUDA kernel for dtype ", t);
  }
}

// Kernels index some sizes (tokens, blocks, heads) in 32 bits.
inline int32_t checked_int32(const char* op, const char* arg, int64_t value, const char* what) {
  EECORE_CHECK_ARG(op, arg, value >= 0 && value <= INT32_MAX, "has ", value, " ", what,
                   "; the CUDA kernels support at most 2^31 - 1");
  return static_cast<int32_t>(value);
}

inline cudaStream_t current_stream(const c10::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "eecore::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace eecore
