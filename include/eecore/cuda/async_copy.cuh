// cp.async (sm_80+): global -> shared copies that bypass registers, so a CTA can prefetch the next
// tile while it computes on the current one. Groups are committed and waited on per thread; a
// __syncthreads() after the wait publishes the data to the whole block.
#pragma once

#include "eecore/cuda/common.cuh"

namespace eecore::cuda {

// 16 bytes; both addresses must be 16-byte aligned. .cg caches in L2 only: streamed KV and
// weights are read once, so they should not evict what L1 holds.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void zero_16(void* smem_dst) { *reinterpret_cast<uint4*>(smem_dst) = make_uint4(0, 0, 0, 0); }

}  // namespace eecore::cuda
