// silu_and_mul on CUDA in one launch: each thread reads a 16-byte vector of the gate and of the up
// half, computes silu(gate) * up in fp32 and rounds once, as the CPU kernel and the ATen
// composition (fp32 silu, fp32 multiply, one cast) do. It replaces four ATen launches a layer.
#include "eecore/cuda/activation.cuh"
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/launch/silu_and_mul.h"

namespace eecore::cuda {
namespace {

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input, int64_t d) {
  pdl_wait();
  pdl_launch_dependents();
  const T* gate = input + static_cast<int64_t>(blockIdx.x) * 2 * d;
  const T* up = gate + d;
  T* y = out + static_cast<int64_t>(blockIdx.x) * d;
  for (int64_t i = threadIdx.x; i < d / VEC; i += blockDim.x) {
    float g[VEC], u[VEC];
    vec_to_float(load_vec<T, VEC>(gate + i * VEC), g);
    vec_to_float(load_vec<T, VEC>(up + i * VEC), u);
#pragma unroll
    for (int k = 0; k < VEC; ++k) g[k] = silu(g[k]) * u[k];
    store_vec(y + i * VEC, vec_from_float<T, VEC>(g));
  }
}

}  // namespace

cudaError_t launch_silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    // 16-byte vectors need d to be a multiple of V (the up half and every row then stay aligned)
    const bool vec = p.d % V == 0 && rows_aligned16({p.out, p.input}, {}, sizeof(T));
    const dim3 grid(static_cast<unsigned>(p.rows));
    return launch_kernel(vec ? silu_and_mul_kernel<T, V> : silu_and_mul_kernel<T, 1>, grid,
                         threads_for_row(vec ? p.d / V : p.d), 0, stream, static_cast<T*>(p.out),
                         static_cast<const T*>(p.input), p.d);
  });
}

}  // namespace eecore::cuda
