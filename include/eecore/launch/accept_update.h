// CUDA launcher of accept_update (csrc/accept_update/accept_update_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace eecore::cuda {

struct AcceptUpdateParams {
  bool* status;              // [B], updated in place
  const float* confidence;   // [B]
  const float* threshold;    // [] or [B]
  const bool* active;        // [B]
  int64_t status_stride, confidence_stride, threshold_stride, active_stride;  // threshold: 0 for a scalar
  int64_t rows;
  int32_t* remaining;        // []: active rows still not confident, written on the device
};

// One block; always launches (remaining is written even for B == 0). Nothing crosses to the host.
cudaError_t launch_accept_update(const AcceptUpdateParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
