// CUDA launcher of prefetch_l2 (csrc/prefetch_l2/prefetch_l2_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace eecore::cuda {

// Asks the L2 cache to fetch [data, data + bytes): the 16-byte aligned part of it (a hint: a few
// bytes at either end may stay behind). Bulk prefetches of the tensor memory accelerator on sm_90,
// a prefetch per 128-byte line elsewhere. Nothing waits for the data.
cudaError_t launch_prefetch_l2(const void* data, int64_t bytes, cudaStream_t stream);

}  // namespace eecore::cuda
