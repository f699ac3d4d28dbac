// hidden_cosine on CUDA: one block per row accumulates <p, c>, |p|^2 and |c|^2 in fp32 (16-byte
// loads where the rows allow), then torch's formula <p, c> / (max(|p|, eps) * max(|c|, eps)).
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/hidden_cosine.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr double kEps = 1e-8;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    hidden_cosine_kernel(const T* __restrict__ prev, int64_t prev_stride, const T* __restrict__ cur,
                         int64_t cur_stride, int64_t d, float* __restrict__ out) {
  __shared__ float3 scratch[kThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const T* a = prev + row * prev_stride;
  const T* b = cur + row * cur_stride;
  float3 acc = make_float3(0.f, 0.f, 0.f);  // <p, c>, |p|^2, |c|^2
  const int64_t num_vecs = d / VEC;
  for (int64_t i = threadIdx.x; i < num_vecs; i += kThreads) {
    float fa[VEC], fb[VEC];
    vec_to_float(load_vec<T, VEC>(a + i * VEC), fa);
    vec_to_float(load_vec<T, VEC>(b + i * VEC), fb);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc.x += fa[k] * fb[k];
      acc.y += fa[k] * fa[k];
      acc.z += fb[k] * fb[k];
    }
  }
  for (int64_t i = num_vecs * VEC + threadIdx.x; i < d; i += kThreads) {
    const float fa = to_float(a[i]), fb = to_float(b[i]);
    acc.x += fa * fb;
    acc.y += fa * fa;
    acc.z += fb * fb;
  }
  acc = block_sum3(acc, scratch);
  if (threadIdx.x == 0) {
    const double norm_p = fmax(sqrt(static_cast<double>(acc.y)), kEps);
    const double norm_c = fmax(sqrt(static_cast<double>(acc.z)), kEps);
    out[row] = static_cast<float>(static_cast<double>(acc.x) / (norm_p * norm_c));
  }
}

}  // namespace

cudaError_t launch_hidden_cosine(const HiddenCosineParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_row_vectors(p.dtype, {p.prev, p.cur}, {p.prev_stride, p.cur_stride}, [&](auto tag, auto vec) {
    using T = typename decltype(tag)::type;
    hidden_cosine_kernel<T, decltype(vec)::value><<<dim3(static_cast<unsigned>(p.rows)), kThreads, 0, stream>>>(
        static_cast<const T*>(p.prev), p.prev_stride, static_cast<const T*>(p.cur), p.cur_stride, p.d, p.out);
    return cudaGetLastError();
  });
}

}  // namespace eecore::cuda
