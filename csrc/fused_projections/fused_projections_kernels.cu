// The fused projections on CUDA (include/eecore/launch/fused_projections.h): linear's tensor-core
// few-row product (eecore/cuda/gemv_mma.cuh) with the layer's elementwise ops folded in.
//
// Prologue (qkv_projection, gate_up_projection): every block normalizes the few input rows itself
// into shared memory (a row of SmolLM2 or Llama-1B is 1-4 KiB, read from L2 by each block), and
// the tile loop reads its B fragments from there. Block 0 also writes the normed rows out.
// Epilogue: a tile's 16 weight rows are chosen so that each element the epilogue needs sits in the
// block: a RoPE pair's two halves (features i and i + D/2 of a head), a gate feature and its up
// feature. The tensor-core sums do not depend on where a weight row sits in its tile, so every
// output keeps linear's gemv_mma bits.
#include <type_traits>

#include "eecore/cuda/activation.cuh"
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/gemv_mma.cuh"
#include "eecore/cuda/paged_kv.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/fused_projections.h"
#include "eecore/rotary.h"

namespace eecore::cuda {
namespace {

using namespace gemv_mma;

// Shared-memory row stride of the normed rows: d rounded up to 64 elements plus 32, so that the
// rows of groups g and g + 1 start 64 bytes apart modulo 128 and a quarter warp's 16-byte loads
// (two groups x four lanes) hit distinct banks.
__host__ __device__ constexpr int64_t norm_row_stride(int64_t d) { return (d + 63) / 64 * 64 + 32; }

// The most shared memory the normed rows may take (8 rows of d = 6,112 in bf16).
constexpr int64_t kMaxNormBytes = 96 * 1024;

template <typename T>
int64_t norm_bytes(const LinearGemvParams& p) {
  return p.rows * norm_row_stride(p.in_features) * static_cast<int64_t>(sizeof(T));
}

// rms_norm of the input rows into shared memory `normed` [rows][norm_row_stride(d)] (and by block
// 0 into norm.normed), with the bits of rms_norm's kernel. That kernel runs `norm_threads` threads
// a row (threads_for_row): thread v sums the squares of vectors v, v + norm_threads, ... in turn, a
// warp_sum per warp, the warps' sums added in order. Here each of the block's 256 threads plays
// up to four of those threads, v = t + 256 j, and the same sums are formed in the same order. The
// rows go side by side, so each pass waits on one round trip to L2 for all of them.
template <typename T>
__device__ void normalize_rows(const LinearGemvParams& lin, const FusedNormParams& norm, int norm_threads,
                               T* normed) {
  constexpr int V = kVec16<T>;
  constexpr int kPlays = 4;  // norm_threads <= 1024 = 4 x kThreads
  __shared__ float warp_sums[kRows][kPlays * kWarps];
  __shared__ float inv_rms[kRows];
  const int t = threadIdx.x, lane = t % kWarpSize, warp = t / kWarpSize;
  const int rows = static_cast<int>(lin.rows);
  const int64_t d = lin.in_features, vecs = d / V, stride = norm_row_stride(d);
  const int norm_warps = norm_threads / kWarpSize;
  const T* x = static_cast<const T*>(lin.input);
#pragma unroll
  for (int j = 0; j < kPlays; ++j) {
    if (j * kThreads >= norm_threads) break;  // uniform: no thread plays a j-th one
    const int v = t + j * kThreads;
    float sum_sq[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum_sq[r] = 0.f;
    if (v < norm_threads) {
      for (int64_t i = v; i < vecs; i += norm_threads) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          float f[V];
          vec_to_float(load_vec<T, V>(x + r * lin.input_stride + i * V), f);
#pragma unroll
          for (int k = 0; k < V; ++k) sum_sq[r] += f[k] * f[k];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;  // uniform, as warp_sum needs
      const float s = warp_sum(sum_sq[r]);
      if (lane == 0 && warp + j * kWarps < norm_warps) warp_sums[r][warp + j * kWarps] = s;
    }
  }
  __syncthreads();
  if (t < rows) {
    float total = 0.f;
    for (int w = 0; w < norm_warps; ++w) total += warp_sums[t][w];
    // IEEE sqrt and division, as rms_norm's kernels compute it.
    inv_rms[t] = 1.f / sqrtf(total / static_cast<float>(d) + norm.eps);
  }
  __syncthreads();
  const T* gain = static_cast<const T*>(norm.weight);
  T* out = static_cast<T*>(norm.normed);
  for (int64_t i = t; i < vecs; i += kThreads) {
    float g[V];
    vec_to_float(load_vec<T, V>(gain + i * V), g);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;
      float f[V];
      vec_to_float(load_vec<T, V>(x + r * lin.input_stride + i * V), f);
#pragma unroll
      for (int k = 0; k < V; ++k) f[k] = f[k] * inv_rms[r] * g[k];
      const Vec<T, V> y = vec_from_float<T, V>(f);
      store_vec(normed + r * stride + i * V, y);
      if (blockIdx.x == 0) store_vec(out + r * norm.normed_stride + i * V, y);
    }
  }
  __syncthreads();  // the tiles read every row
}

// block_tile against the input rows normalized into shared memory first (`normed`).
template <typename T>
__device__ __forceinline__ void normed_block_tile(const LinearGemvParams& lin, const FusedNormParams& norm,
                                                  int norm_threads, TileRows rows, T* normed,
                                                  TileSums& partial) {
  block_tile<T>(lin, rows, normed, norm_row_stride(lin.in_features),
                [&] { normalize_rows<T>(lin, norm, norm_threads, normed); }, partial);
}

// ---- qkv_projection ------------------------------------------------------------------------------
//
// Tiles: each query and key head of D features has D / 16 tiles, tile j pairing features 8j..8j+7
// (lo) with their RoPE partners D/2 + 8j.. (hi); the value heads follow in plain tiles of 16.
template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 1) qkv_projection_kernel(const QkvProjectionParams p, int norm_threads) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  __shared__ TileSums partial;
  T* normed = reinterpret_cast<T*>(smem_bytes);
  const LinearGemvParams& lin = p.linear;
  const int32_t D = p.rot.head_dim, half = D / 2;
  const int64_t tiles_per_head = D / kFeatures;
  const int64_t rope_tiles = (p.rot.num_q_heads + p.rot.num_kv_heads) * tiles_per_head;
  const int64_t b = blockIdx.x;
  const bool rope = b < rope_tiles;
  const int64_t head = b / tiles_per_head, pair0 = (b % tiles_per_head) * 8;
  const int64_t first =
      rope ? head * D + pair0 : (p.rot.num_q_heads + p.rot.num_kv_heads) * D + (b - rope_tiles) * kFeatures;
  const int64_t lo_row = first + (threadIdx.x % kWarpSize) / 4;
  normed_block_tile<T>(lin, p.norm, norm_threads, {lo_row, rope ? lo_row + half : lo_row + 8}, normed, partial);

  const int t = threadIdx.x;
  const T* bias = static_cast<const T*>(lin.bias);
  const PagedLayout layout{p.cache.cache_stride_block, p.cache.cache_stride_token, p.cache.cache_stride_head,
                           p.cache.block_size, p.cache.num_blocks};
  if (rope) {
    if (t >= 8 * kRows) return;
    const int pair = t / kRows, row = t % kRows;
    if (row >= lin.rows) return;
    const int64_t i = pair0 + pair;  // the pair's index in its head
    const int64_t n1 = head * D + i, n2 = n1 + half;
    float x1 = to_float(projected<T>(tile_sum(partial, pair * kRows + row), bias, n1));
    float x2 = to_float(projected<T>(tile_sum(partial, (pair + 8) * kRows + row), bias, n2));
    // A position outside the cos/sin table leaves the token unrotated, as rotary_embedding's
    // kernel does (the CPU op raises for it).
    const int64_t pos = p.rot.positions[row * p.rot.positions_stride];
    if (pos >= 0 && pos < p.rot.max_pos) {
      const C* cos = static_cast<const C*>(p.rot.cos_sin_cache) + pos * p.rot.rot_dim;
      rotary::rotate_pair(x1, x2, to_float(cos[i]), to_float(cos[half + i]));
    }
    const T y1 = from_float<T>(x1), y2 = from_float<T>(x2);
    T* out = static_cast<T*>(lin.out) + row * lin.out_stride;
    out[n1] = y1;
    out[n2] = y2;
    const int64_t kv_head = head - p.rot.num_q_heads;
    if (kv_head < 0) return;
    const int64_t slot = paged_slot_offset(layout, p.cache.slot_mapping[row * p.cache.slot_stride]);
    if (slot < 0) return;  // -1, or a slot outside the cache: the token is not cached
    T* k = static_cast<T*>(p.cache.k_cache) + slot + kv_head * p.cache.cache_stride_head;
    k[i] = y1;
    k[i + half] = y2;
    return;
  }
  if (t >= kTile) return;
  const int feature = t / kRows, row = t % kRows;
  const int64_t n = first + feature;
  if (row >= lin.rows || n >= lin.out_features) return;
  const T y = projected<T>(tile_sum(partial, t), bias, n);
  static_cast<T*>(lin.out)[row * lin.out_stride + n] = y;
  const int64_t slot = paged_slot_offset(layout, p.cache.slot_mapping[row * p.cache.slot_stride]);
  if (slot < 0) return;
  const int64_t v = n - (p.rot.num_q_heads + p.rot.num_kv_heads) * D;
  static_cast<T*>(p.cache.v_cache)[slot + (v / D) * p.cache.cache_stride_head + v % D] = y;
}

// ---- gate_up_projection --------------------------------------------------------------------------
//
// Tile b pairs gate features 8b..8b+7 (lo) with the up features I + 8b.. (hi).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) gate_up_projection_kernel(const GateUpProjectionParams p,
                                                                        int norm_threads) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  __shared__ TileSums partial;
  T* normed = reinterpret_cast<T*>(smem_bytes);
  const LinearGemvParams& lin = p.linear;
  const int64_t inter = lin.out_features / 2;
  const int64_t gate0 = static_cast<int64_t>(blockIdx.x) * 8;
  const int64_t lo_row = gate0 + (threadIdx.x % kWarpSize) / 4;
  normed_block_tile<T>(lin, p.norm, norm_threads, {lo_row, inter + lo_row}, normed, partial);

  const int t = threadIdx.x;
  if (t >= 8 * kRows) return;
  const int feature = t / kRows, row = t % kRows;
  if (row >= lin.rows) return;
  const int64_t n = gate0 + feature;
  // gate_up as linear writes it, then silu_and_mul over the rounded halves
  const T gate = from_float<T>(tile_sum(partial, feature * kRows + row));
  const T up = from_float<T>(tile_sum(partial, (feature + 8) * kRows + row));
  T* out = static_cast<T*>(lin.out) + row * lin.out_stride;
  out[n] = gate;
  out[inter + n] = up;
  static_cast<T*>(p.act)[row * p.act_stride + n] = from_float<T>(silu(to_float(gate)) * to_float(up));
}

// ---- linear_residual -----------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) linear_residual_kernel(const LinearResidualParams p) {
  __shared__ TileSums partial;
  const LinearGemvParams& lin = p.linear;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFeatures;
  block_tile<T>(lin, plain_tile_rows(first, lin.out_features), static_cast<const T*>(lin.input), lin.input_stride,
                [] {}, partial);

  const int t = threadIdx.x;
  if (t >= kTile) return;
  const int feature = t / kRows, row = t % kRows;
  const int64_t n = first + feature;
  if (row >= lin.rows || n >= lin.out_features) return;
  const T y = projected<T>(tile_sum(partial, t), static_cast<const T*>(lin.bias), n);
  static_cast<T*>(lin.out)[row * lin.out_stride + n] = y;
  T* h = static_cast<T*>(p.residual) + row * p.residual_stride + n;
  *h = from_float<T>(to_float(*h) + to_float(y));  // the separate add's rounding
}

// ---- launchers -----------------------------------------------------------------------------------

bool norm_supported(const LinearGemvParams& lin, const FusedNormParams& norm) {
  const int64_t elem = lin.dtype == DType::kFloat32 ? 4 : 2;
  return lin.rows * norm_row_stride(lin.in_features) * elem <= kMaxNormBytes && norm.weight != nullptr &&
         norm.normed != nullptr && rows_aligned16({norm.weight, norm.normed}, {norm.normed_stride}, elem);
}

// Launches kernel with `smem` bytes of dynamic shared memory, raising the kernel's limit past the
// default 48 KiB where needed.
template <typename Kernel, typename... Args>
cudaError_t launch_with_smem(Kernel kernel, int64_t blocks, int64_t smem, cudaStream_t stream, Args... args) {
  if (smem > 48 * 1024) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kMaxNormBytes));
        err != cudaSuccess)
      return err;
  }
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), kThreads, static_cast<size_t>(smem), stream,
                       args...);
}

}  // namespace

bool qkv_projection_supported(const QkvProjectionParams& p) {
  const LinearGemvParams& lin = p.linear;
  const int64_t D = p.rot.head_dim;
  const int64_t heads = p.rot.num_q_heads + 2 * static_cast<int64_t>(p.rot.num_kv_heads);
  return linear_gemv_mma_supported(lin) && !lin.accumulate && norm_supported(lin, p.norm) && p.rot.is_neox &&
         p.rot.rot_dim == D && D % kFeatures == 0 && p.rot.num_kv_heads > 0 && lin.out_features == heads * D &&
         p.rot.num_tokens == lin.rows && p.cache.num_tokens == lin.rows && p.cache.head_dim == D &&
         p.cache.num_kv_heads == p.rot.num_kv_heads && p.cache.dtype == lin.dtype && p.rot.dtype == lin.dtype &&
         (p.rot.cache_dtype == lin.dtype || p.rot.cache_dtype == DType::kFloat32) &&
         ceil_div(lin.out_features, kFeatures) <= INT32_MAX;
}

bool gate_up_projection_supported(const GateUpProjectionParams& p) {
  const LinearGemvParams& lin = p.linear;
  return linear_gemv_mma_supported(lin) && !lin.accumulate && lin.bias == nullptr && norm_supported(lin, p.norm) &&
         lin.out_features % 16 == 0 && p.act != nullptr;
}

bool linear_residual_supported(const LinearResidualParams& p) {
  return linear_gemv_mma_supported(p.linear) && !p.linear.accumulate && p.residual != nullptr;
}

cudaError_t launch_qkv_projection(const QkvProjectionParams& p, cudaStream_t stream) {
  if (!qkv_projection_supported(p)) return cudaErrorInvalidValue;
  const int64_t blocks = p.linear.out_features / kFeatures;
  const int norm_threads = threads_for_row(p.linear.in_features / 8);
  return dispatch_dtype(p.linear.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // linear_gemv_mma_supported rules fp32 out
    } else {
      const int64_t smem = norm_bytes<T>(p.linear);
      if (p.rot.cache_dtype == DType::kFloat32)
        return launch_with_smem(qkv_projection_kernel<T, float>, blocks, smem, stream, p, norm_threads);
      return launch_with_smem(qkv_projection_kernel<T, T>, blocks, smem, stream, p, norm_threads);
    }
  });
}

cudaError_t launch_gate_up_projection(const GateUpProjectionParams& p, cudaStream_t stream) {
  if (!gate_up_projection_supported(p)) return cudaErrorInvalidValue;
  const int64_t blocks = p.linear.out_features / 16;
  const int norm_threads = threads_for_row(p.linear.in_features / 8);
  return dispatch_dtype(p.linear.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;
    } else {
      return launch_with_smem(gate_up_projection_kernel<T>, blocks, norm_bytes<T>(p.linear), stream, p,
                              norm_threads);
    }
  });
}

cudaError_t launch_linear_residual(const LinearResidualParams& p, cudaStream_t stream) {
  if (!linear_residual_supported(p)) return cudaErrorInvalidValue;
  const int64_t blocks = ceil_div(p.linear.out_features, kFeatures);
  return dispatch_dtype(p.linear.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;
    } else {
      return launch_kernel(linear_residual_kernel<T>, dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream, p);
    }
  });
}

}  // namespace eecore::cuda
