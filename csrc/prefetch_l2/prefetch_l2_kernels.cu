// prefetch_l2 on CUDA: a few blocks issue L2 prefetches over a byte range and exit.
//
// Why: at small batches a decode layer spends much of its time in kernels that leave HBM idle
// (attention over a short context, norms, the activation), while its projections read weights
// from HBM. Issued on a side stream as attention starts, prefetches of the next projections'
// weights fill that idle time, and the projections then read from L2. Nothing here waits for the
// data: the kernel ends once its requests are out.
#include <cstdint>

#include "eecore/cuda/common.cuh"
#include "eecore/launch/prefetch_l2.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kChunk = 16 * 1024;  // bytes a thread asks for at a time (a multiple of 16)
constexpr int kMaxBlocks = 32;

__global__ void __launch_bounds__(kThreads) prefetch_l2_kernel(const char* __restrict__ base, int64_t bytes) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kChunk;
  for (int64_t off = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kChunk; off < bytes;
       off += stride) {
    const int64_t n = bytes - off < kChunk ? bytes - off : kChunk;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // one request for the whole chunk, served by the SM's tensor memory accelerator
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(static_cast<uint32_t>(n))
                 : "memory");
#else
    constexpr int64_t kLine = 128;
    for (int64_t line = 0; line < n; line += kLine) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off + line));
#endif
  }
}

}  // namespace

cudaError_t launch_prefetch_l2(const void* data, int64_t bytes, cudaStream_t stream) {
  // The bulk prefetch takes a 16-byte aligned address and a multiple of 16 bytes: the aligned
  // interior of the range (never a byte outside it).
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + 15) / 16 * 16;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) / 16 * 16;
  if (bytes <= 0 || end <= begin) return cudaSuccess;
  const int64_t span = static_cast<int64_t>(end - begin);
  const int64_t chunks = ceil_div(span, kChunk);
  const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, ceil_div(chunks, kThreads)));
  prefetch_l2_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const char*>(begin), span);
  return cudaGetLastError();
}

}  // namespace eecore::cuda
