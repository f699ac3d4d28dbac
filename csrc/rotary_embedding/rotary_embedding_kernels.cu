// rotary_embedding on CUDA: one block per token; each thread rotates P pairs of one head with
// vector loads (P adjacent elements of each half for NeoX, 2P adjacent elements for GPT-J, and P
// cosines and sines), using the same fp32 rotation as the CPU (eecore/rotary.h). Positions come
// from device memory: one outside the cache leaves its token unrotated instead of reading past it.
#include <type_traits>

#include "eecore/cuda/common.cuh"
#include "eecore/launch/rotary_embedding.h"
#include "eecore/rotary.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 128;

// Rotates pairs [i0, i0 + P) of the head at x.
template <typename T, typename C, bool kNeox, int P>
__device__ __forceinline__ void rotate_pairs(T* x, const C* cos, const C* sin, int32_t half, int32_t i0) {
  float c[P], s[P], x1[P], x2[P];
  vec_to_float(load_vec<C, P>(cos + i0), c);
  vec_to_float(load_vec<C, P>(sin + i0), s);
  if constexpr (kNeox) {
    vec_to_float(load_vec<T, P>(x + i0), x1);
    vec_to_float(load_vec<T, P>(x + i0 + half), x2);
#pragma unroll
    for (int k = 0; k < P; ++k) rotary::rotate_pair(x1[k], x2[k], c[k], s[k]);
    store_vec(x + i0, vec_from_float<T, P>(x1));
    store_vec(x + i0 + half, vec_from_float<T, P>(x2));
  } else if constexpr (P == 1) {
    // The unaligned fallback: a pair need not start at a 2-element boundary.
    float a = to_float(x[2 * i0]), b = to_float(x[2 * i0 + 1]);
    rotary::rotate_pair(a, b, c[0], s[0]);
    x[2 * i0] = from_float<T>(a);
    x[2 * i0 + 1] = from_float<T>(b);
  } else {
    float xy[2 * P];
    vec_to_float(load_vec<T, 2 * P>(x + 2 * i0), xy);
#pragma unroll
    for (int k = 0; k < P; ++k) rotary::rotate_pair(xy[2 * k], xy[2 * k + 1], c[k], s[k]);
    store_vec(x + 2 * i0, vec_from_float<T, 2 * P>(xy));
  }
}

template <typename T, typename C, bool kNeox, int P>
__global__ void __launch_bounds__(kThreads) rotary_embedding_kernel(const RotaryEmbeddingParams p) {
  const int64_t t = blockIdx.x;
  const int64_t pos = p.positions[t * p.positions_stride];
  if (pos < 0 || pos >= p.max_pos) return;
  const int32_t half = p.rot_dim / 2;
  const C* cos = static_cast<const C*>(p.cos_sin_cache) + pos * p.rot_dim;
  const C* sin = cos + half;
  const int32_t groups = half / P;  // pair groups per head
  const int32_t total = (p.num_q_heads + p.num_kv_heads) * groups;
  for (int32_t i = threadIdx.x; i < total; i += kThreads) {
    const int32_t h = i / groups;
    const int32_t i0 = (i % groups) * P;
    T* x = h < p.num_q_heads
               ? static_cast<T*>(p.query) + t * p.query_stride_token + h * p.query_stride_head
               : static_cast<T*>(p.key) + t * p.key_stride_token + (h - p.num_q_heads) * p.key_stride_head;
    rotate_pairs<T, C, kNeox, P>(x, cos, sin, half, i0);
  }
}

template <typename T, typename C, bool kNeox>
cudaError_t launch_typed(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  // Pairs per thread: 4, except GPT-J on fp32, whose 2P adjacent elements must fit 16 bytes.
  constexpr int P = (!kNeox && sizeof(T) == 4) ? 2 : 4;
  constexpr int64_t kXVec = kNeox ? P : 2 * P;  // elements per x load
  const int32_t half = p.rot_dim / 2;
  const bool vec = half % P == 0 && is_aligned(p.query, kXVec * sizeof(T)) && is_aligned(p.key, kXVec * sizeof(T)) &&
                   p.query_stride_token % kXVec == 0 && p.query_stride_head % kXVec == 0 &&
                   p.key_stride_token % kXVec == 0 && p.key_stride_head % kXVec == 0 &&
                   is_aligned(p.cos_sin_cache, P * sizeof(C));
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (vec)
    rotary_embedding_kernel<T, C, kNeox, P><<<grid, kThreads, 0, stream>>>(p);
  else
    rotary_embedding_kernel<T, C, kNeox, 1><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.rot_dim < 2) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool cache_fp32 = p.cache_dtype == DType::kFloat32;
    if (!cache_fp32 && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
    if (cache_fp32)
      return p.is_neox ? launch_typed<T, float, true>(p, stream) : launch_typed<T, float, false>(p, stream);
    return p.is_neox ? launch_typed<T, T, true>(p, stream) : launch_typed<T, T, false>(p, stream);
  });
}

}  // namespace eecore::cuda
