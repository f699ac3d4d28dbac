// accept_update on CUDA: one block updates the sticky status bits and counts the active rows
// still not confident with __syncthreads_count, writing the count to device memory. The host never
// waits: the caller decides when (and whether) that one int32 crosses over.
#include "eecore/cuda/common.cuh"
#include "eecore/launch/accept_update.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) accept_update_kernel(const AcceptUpdateParams p) {
  int32_t remaining = 0;
  // Every thread runs the same number of iterations: __syncthreads_count needs the whole block.
  for (int64_t base = 0; base < p.rows; base += kThreads) {
    const int64_t r = base + threadIdx.x;
    bool left = false;
    if (r < p.rows) {
      const bool live = p.active[r * p.active_stride];
      bool done = p.status[r * p.status_stride];
      // NaN confidence compares false: never accepted.
      done = done || (live && p.confidence[r * p.confidence_stride] > p.threshold[r * p.threshold_stride]);
      p.status[r * p.status_stride] = done;
      left = live && !done;
    }
    remaining += __syncthreads_count(left);
  }
  if (threadIdx.x == 0) *p.remaining = remaining;
}

}  // namespace

cudaError_t launch_accept_update(const AcceptUpdateParams& p, cudaStream_t stream) {
  accept_update_kernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace eecore::cuda
