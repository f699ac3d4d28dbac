// rms_norm and fused_add_rms_norm on CUDA: one block per row, 16-byte vectors when the rows allow
// them, fp32 accumulation. The row is read twice (sum of squares, then scale); the second read
// hits L1/L2, which is cheaper than holding an arbitrary-length row in registers.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/rms_norm.h"

namespace eecore::cuda {
namespace {

template <typename T, int VEC>
// out may alias input (rms_norm in place): each element is read before the same thread writes it.
__global__ void rms_norm_kernel(T* out, const T* input, const T* __restrict__ weight, int64_t d, float eps) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float scratch[32];
  const T* x = input + static_cast<int64_t>(blockIdx.x) * d;
  T* y = out + static_cast<int64_t>(blockIdx.x) * d;
  const int64_t num_vecs = d / VEC;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float f[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), f);
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum_sq += f[k] * f[k];
  }
  // IEEE sqrt and division, as the CPU kernel computes it.
  const float inv_rms = 1.f / sqrtf(block_sum(sum_sq, scratch) / static_cast<float>(d) + eps);

  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float f[VEC], g[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), f);
    vec_to_float(load_vec<T, VEC>(weight + i * VEC), g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = f[k] * inv_rms * g[k];
    store_vec(y + i * VEC, vec_from_float<T, VEC>(f));
  }
}

// residual += input, rounded to T exactly like an unfused add; the norm is taken over the stored
// (rounded) residual. Each thread re-reads only the elements it wrote itself, so no barrier is
// needed between the write and the second pass beyond the one inside block_sum.
template <typename T, int VEC>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ input, T* __restrict__ residual,
                                          const T* __restrict__ weight, int64_t d, float eps) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float scratch[32];
  T* x = input + static_cast<int64_t>(blockIdx.x) * d;
  T* h = residual + static_cast<int64_t>(blockIdx.x) * d;
  const int64_t num_vecs = d / VEC;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float a[VEC], b[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), a);
    vec_to_float(load_vec<T, VEC>(h + i * VEC), b);
    Vec<T, VEC> sum;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sum.v[k] = from_float<T>(b[k] + a[k]);
      const float s = to_float(sum.v[k]);
      sum_sq += s * s;
    }
    store_vec(h + i * VEC, sum);
  }
  const float inv_rms = 1.f / sqrtf(block_sum(sum_sq, scratch) / static_cast<float>(d) + eps);

  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float f[VEC], g[VEC];
    vec_to_float(load_vec<T, VEC>(h + i * VEC), f);
    vec_to_float(load_vec<T, VEC>(weight + i * VEC), g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = f[k] * inv_rms * g[k];
    store_vec(x + i * VEC, vec_from_float<T, VEC>(f));
  }
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    const bool vec = p.d % V == 0 && rows_aligned16({p.out, p.input, p.weight}, {}, sizeof(T));
    const dim3 grid(static_cast<unsigned>(p.rows));
    return launch_kernel(vec ? rms_norm_kernel<T, V> : rms_norm_kernel<T, 1>, grid,
                         threads_for_row(vec ? p.d / V : p.d), 0, stream, static_cast<T*>(p.out),
                         static_cast<const T*>(p.input), static_cast<const T*>(p.weight), p.d, p.eps);
  });
}

cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.d == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    const bool vec = p.d % V == 0 && rows_aligned16({p.input, p.residual, p.weight}, {}, sizeof(T));
    const dim3 grid(static_cast<unsigned>(p.rows));
    return launch_kernel(vec ? fused_add_rms_norm_kernel<T, V> : fused_add_rms_norm_kernel<T, 1>, grid,
                         threads_for_row(vec ? p.d / V : p.d), 0, stream, static_cast<T*>(p.input),
                         static_cast<T*>(p.residual), static_cast<const T*>(p.weight), p.d, p.eps);
  });
}

}  // namespace eecore::cuda
