// rotary_embedding on CUDA: one block per token; each thread rotates P pairs of one head with
// vector loads (P adjacent elements of each half for NeoX, 2P adjacent elements for GPT-J, and P
// cosines and sines), using the same fp32 rotation as the CPU (eecore/rotary.h). Positions come
// from device memory: one outside the cache leaves its token unrotated instead of reading past it.
#include <type_traits>

#include "eecore/cuda/common.cuh"
#include "eecore/cuda/kv_write.cuh"
#include "eecore/cuda/pdl.cuh"
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

// Token t's query and key heads, rotated by a whole block of kThreads threads.
template <typename T, typename C, bool kNeox, int P>
__device__ __forceinline__ void rotate_token(const RotaryEmbeddingParams& p, int64_t t) {
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

template <typename T, typename C, bool kNeox, int P>
__global__ void __launch_bounds__(kThreads) rotary_embedding_kernel(const RotaryEmbeddingParams p) {
  pdl_wait();
  pdl_launch_dependents();
  rotate_token<T, C, kNeox, P>(p, blockIdx.x);
}

// rotary_embedding, then reshape_and_cache of the rotated keys, in one launch: the block's
// threads write back the rotated keys, wait for each other, then copy the token's K and V rows
// to its slot (the threads that rotate a key pair are not the ones that copy it).
template <typename T, typename C, bool kNeox, int P>
__global__ void __launch_bounds__(kThreads)
    rotary_embedding_and_cache_kernel(const RotaryEmbeddingParams rot, const ReshapeAndCacheParams cache) {
  pdl_wait();
  pdl_launch_dependents();
  rotate_token<T, C, kNeox, P>(rot, blockIdx.x);
  __syncthreads();
  write_token_kv<T, kVec16<T>, kThreads>(cache, blockIdx.x);
}

// Pairs per thread: 4, except GPT-J on fp32, whose 2P adjacent elements must fit 16 bytes.
template <typename T, bool kNeox>
constexpr int kPairs = (!kNeox && sizeof(T) == 4) ? 2 : 4;

// Whether p's heads can be rotated kPairs pairs a thread with vector loads.
template <typename T, typename C, bool kNeox>
bool rotary_vectorizable(const RotaryEmbeddingParams& p) {
  constexpr int P = kPairs<T, kNeox>;
  constexpr int64_t kXVec = kNeox ? P : 2 * P;  // elements per x load
  return (p.rot_dim / 2) % P == 0 && is_aligned(p.query, kXVec * sizeof(T)) && is_aligned(p.key, kXVec * sizeof(T)) &&
         p.query_stride_token % kXVec == 0 && p.query_stride_head % kXVec == 0 && p.key_stride_token % kXVec == 0 &&
         p.key_stride_head % kXVec == 0 && is_aligned(p.cos_sin_cache, P * sizeof(C));
}

template <typename T, typename C, bool kNeox>
cudaError_t launch_typed(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  return launch_kernel(rotary_vectorizable<T, C, kNeox>(p) ? rotary_embedding_kernel<T, C, kNeox, kPairs<T, kNeox>>
                                                          : rotary_embedding_kernel<T, C, kNeox, 1>,
                       grid, kThreads, 0, stream, p);
}

// The fused kernel where both halves take their vector paths; two launches otherwise.
template <typename T, typename C, bool kNeox>
cudaError_t launch_fused_typed(const RotaryEmbeddingParams& rot, const ReshapeAndCacheParams& cache,
                               cudaStream_t stream) {
  if (!rotary_vectorizable<T, C, kNeox>(rot) || !kv_rows_vectorizable<T>(cache) || cache.num_kv_heads == 0 ||
      cache.head_dim == 0) {
    if (cudaError_t err = launch_typed<T, C, kNeox>(rot, stream); err != cudaSuccess) return err;
    return launch_reshape_and_cache(cache, stream);
  }
  const dim3 grid(static_cast<unsigned>(rot.num_tokens));
  return launch_kernel(rotary_embedding_and_cache_kernel<T, C, kNeox, kPairs<T, kNeox>>, grid, kThreads, 0, stream,
                       rot, cache);
}

// Calls f(TypeTag<T>, TypeTag<C>, is_neox) for p's element, cos/sin and rotation types.
template <typename F>
cudaError_t dispatch_rotary(const RotaryEmbeddingParams& p, F&& f) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool cache_fp32 = p.cache_dtype == DType::kFloat32;
    if (!cache_fp32 && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
    if (cache_fp32)
      return p.is_neox ? f(tag, TypeTag<float>{}, std::true_type{}) : f(tag, TypeTag<float>{}, std::false_type{});
    return p.is_neox ? f(tag, tag, std::true_type{}) : f(tag, tag, std::false_type{});
  });
}

}  // namespace

cudaError_t launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.rot_dim < 2) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_rotary(p, [&](auto t, auto c, auto neox) {
    return launch_typed<typename decltype(t)::type, typename decltype(c)::type, decltype(neox)::value>(p, stream);
  });
}

cudaError_t launch_rotary_embedding_and_cache(const RotaryEmbeddingParams& rot, const ReshapeAndCacheParams& cache,
                                              cudaStream_t stream) {
  if (rot.num_tokens != cache.num_tokens || rot.dtype != cache.dtype) return cudaErrorInvalidValue;
  if (rot.num_tokens == 0) return cudaSuccess;
  if (rot.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  if (rot.rot_dim < 2) return launch_reshape_and_cache(cache, stream);
  return dispatch_rotary(rot, [&](auto t, auto c, auto neox) {
    return launch_fused_typed<typename decltype(t)::type, typename decltype(c)::type, decltype(neox)::value>(
        rot, cache, stream);
  });
}

}  // namespace eecore::cuda
