// Programmatic dependent launch (PDL, compute capability 9.0+). A decode step is a chain of a few
// hundred small kernels, and each one normally starts only after the one before it has finished and
// its launch has been processed: ~1-2 us of an idle GPU per kernel, in a CUDA graph too. A kernel
// launched with PDL may be scheduled while its predecessor still runs; it waits in pdl_wait() until
// the predecessor has finished and its writes are visible, so the launch overlaps the work before it.
// EECORE_PDL=1 turns it on for the kernels launched through launch_kernel (the row kernels of a
// decoder layer). On an H200 it kept the bits but, alone, gave 0.94-1.03x end to end at batch 1-8
// (cuBLAS's projections sit between the row kernels and do not take part); with the few-row
// linears it shortened a layer's chain of row kernels, so it waits to be timed with
// EECORE_LINEAR_KERNEL=auto.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "eecore/switches.h"

namespace eecore::cuda {

// The first statement of a kernel launched through launch_kernel: nothing the kernels before it
// may write can be read or written before it (the fused projections prefetch their weights, which
// no kernel writes, ahead of it). A no-op for a kernel launched without PDL, and before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel in the stream, if launched with PDL, be scheduled now (its blocks then wait
// in pdl_wait): called right after pdl_wait by kernels short enough that the next one's blocks
// taking SM slots early costs nothing.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launch_kernel uses PDL: EECORE_PDL=1 (read at every launch, as the kernel selectors are)
// on a device of compute capability 9.0 or newer (cached per device).
inline bool pdl_enabled() {
  if (!switches::is(switches::kPdl, "1")) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> major[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int known = major[device].load(std::memory_order_relaxed);
  if (known == 0) {
    if (cudaDeviceGetAttribute(&known, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    major[device].store(known, std::memory_order_relaxed);
  }
  return known >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL where pdl_enabled(). The kernel must
// begin with pdl_wait().
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args... args) {
  if (!pdl_enabled()) {
    kernel<<<grid, block, smem, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace eecore::cuda
