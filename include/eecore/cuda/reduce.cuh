// Warp and block reductions over fp32. Every thread of the block must call the block versions.
#pragma once

#include "eecore/cuda/common.cuh"

namespace eecore::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the whole block, returned to every thread. `scratch` holds >= 32 floats of shared
// memory; the leading barrier makes back-to-back calls on the same scratch safe.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  return total;
}

// Three sums at once (one pair of barriers instead of three): used by cosine similarity.
__device__ __forceinline__ float3 block_sum3(float3 v, float3* scratch) {
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  v.z = warp_sum(v.z);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float3 total = make_float3(0.f, 0.f, 0.f);
  for (int w = 0; w < num_warps; ++w) {
    total.x += scratch[w].x;
    total.y += scratch[w].y;
    total.z += scratch[w].z;
  }
  return total;
}

}  // namespace eecore::cuda
