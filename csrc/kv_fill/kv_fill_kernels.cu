// kv_fill on CUDA, the two kernels around the glue's single GEMM (see eecore/launch/kv_fill.h):
//   normalize  one block per token: the gain-free RMS norm of the exit hidden state, rounded to
//              the activation dtype exactly like the CPU kernel's GEMM input;
//   epilogue   one block per (token, layer): bias, RoPE on K (eecore/rotary.h, fp32) and the store
//              of K and V into the token's slot of that layer, for layers >= its start layer.
// Slots, start layers and positions come from device memory and are range-checked per token.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/kv_fill.h"
#include "eecore/rotary.h"

namespace eecore::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kEpilogueThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kNormThreads) kv_fill_normalize_kernel(const KvFillParams p) {
  __shared__ float scratch[kWarpSize];
  const int64_t t = blockIdx.x;
  const T* x = static_cast<const T*>(p.hidden) + t * p.hidden_stride;
  T* y = static_cast<T*>(p.normed) + t * p.hidden_size;
  const int64_t num_vecs = p.hidden_size / VEC;
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    float f[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), f);
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum_sq += f[k] * f[k];
  }
  const float inv_rms = 1.f / sqrtf(block_sum(sum_sq, scratch) / static_cast<float>(p.hidden_size) + p.eps);
  for (int64_t i = threadIdx.x; i < num_vecs; i += kNormThreads) {
    float f[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), f);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] *= inv_rms;
    store_vec(y + i * VEC, vec_from_float<T, VEC>(f));
  }
}

template <typename T, typename C, bool kNeox>
__global__ void __launch_bounds__(kEpilogueThreads) kv_fill_epilogue_kernel(const KvFillParams p) {
  const int64_t t = blockIdx.x;
  const int32_t layer = blockIdx.y;
  const int64_t slot = p.slot_mapping[t * p.slot_stride];
  const int32_t start = p.start_layer[t * p.start_layer_stride];
  const int64_t num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  if (slot < 0 || slot >= num_slots || start < 0 || layer < start) return;
  const C* cos = nullptr;
  const int32_t half = p.rot_dim / 2;
  if (p.rot_dim > 0) {
    const int64_t pos = p.positions[t * p.positions_stride];
    if (pos < 0 || pos >= p.max_pos) return;
    cos = static_cast<const C*>(p.cos_sin_cache) + pos * p.rot_dim;
  }

  const int64_t kv_width = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;  // one of K or V
  const T* row = static_cast<const T*>(p.projected) + (t * p.num_layers + layer) * 2 * kv_width;
  const T* bias = p.bias == nullptr ? nullptr : static_cast<const T*>(p.bias) + layer * 2 * kv_width;
  T* k_dst = static_cast<T*>(p.kv_cache) + (layer * 2 * num_slots + slot) * kv_width;
  T* v_dst = k_dst + num_slots * kv_width;
  auto value = [&](int64_t e) { return to_float(row[e]) + (bias == nullptr ? 0.f : to_float(bias[e])); };

  for (int64_t e = threadIdx.x; e < 2 * kv_width; e += kEpilogueThreads) {
    if (e >= kv_width) {
      v_dst[e - kv_width] = from_float<T>(value(e));
      continue;
    }
    const int32_t dim = static_cast<int32_t>(e % p.head_dim);
    if (dim >= p.rot_dim) {  // past the rotated dims (or no RoPE at all)
      k_dst[e] = from_float<T>(value(e));
      continue;
    }
    // Both elements of this element's pair, rotated in fp32; keep the one stored here.
    const int64_t head = e - dim;
    const int32_t i = kNeox ? (dim < half ? dim : dim - half) : dim / 2;
    const bool first = kNeox ? dim < half : dim % 2 == 0;
    float x1 = value(head + rotary::first_of_pair<kNeox>(i, half));
    float x2 = value(head + rotary::second_of_pair<kNeox>(i, half));
    rotary::rotate_pair(x1, x2, to_float(cos[i]), to_float(cos[half + i]));
    k_dst[e] = from_float<T>(first ? x1 : x2);
  }
}

}  // namespace

cudaError_t launch_kv_fill_normalize(const KvFillParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    const dim3 grid(static_cast<unsigned>(p.num_tokens));
    if (p.hidden_size % V == 0 && rows_aligned16({p.hidden, p.normed}, {p.hidden_stride}, sizeof(T)))
      kv_fill_normalize_kernel<T, V><<<grid, kNormThreads, 0, stream>>>(p);
    else
      kv_fill_normalize_kernel<T, 1><<<grid, kNormThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t launch_kv_fill_epilogue(const KvFillParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_layers == 0) return cudaSuccess;
  if (p.num_tokens > INT32_MAX || p.num_layers > 65535) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_layers));
    const bool cache_fp32 = p.rot_dim == 0 || p.cache_dtype == DType::kFloat32;
    if (!cache_fp32 && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
    if (cache_fp32) {
      if (p.is_neox) kv_fill_epilogue_kernel<T, float, true><<<grid, kEpilogueThreads, 0, stream>>>(p);
      else kv_fill_epilogue_kernel<T, float, false><<<grid, kEpilogueThreads, 0, stream>>>(p);
    } else {
      if (p.is_neox) kv_fill_epilogue_kernel<T, T, true><<<grid, kEpilogueThreads, 0, stream>>>(p);
      else kv_fill_epilogue_kernel<T, T, false><<<grid, kEpilogueThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace eecore::cuda
