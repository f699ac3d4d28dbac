// lm_head_top2_gap on CUDA: logits = hidden @ weight^T are produced 64 vocab rows at a time and
// immediately reduced to one online top-2 / sum-exp state per (batch row, vocab tile); a second
// launch merges the tile states of each row. The [B, V] logits never reach global memory.
//
// The tile kernel is a small GEMM streaming the weight once: bf16/fp16 use mma.sync tensor cores
// (M = batch rows padded to 16/32/64, N = 64 vocab rows split over 4 warps, K = d in stages of 64,
// double-buffered with cp.async); fp32, or rows that are not 16-byte aligned, use a SIMT tile.
#include <type_traits>

#include "eecore/cuda/async_copy.cuh"
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/mma.cuh"
#include "eecore/cuda/top2.cuh"
#include "eecore/launch/lm_head_top2_gap.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTileV = 64;  // vocab rows per tile (16 per warp in the mma kernel)

// A tile's state in the workspace; a NaN seen anywhere is carried as sumexp = NaN.
struct TilePartial {
  float max, second, sumexp;
  int32_t argmax;
};

__device__ __forceinline__ TilePartial to_partial(const Top2& s) {
  return TilePartial{s.max, s.second, s.nan ? NAN : s.sumexp, static_cast<int32_t>(s.argmax)};
}

__device__ __forceinline__ Top2 from_partial(const TilePartial& t) {
  return Top2{t.max, t.second, t.sumexp, t.argmax, isnan(t.sumexp)};
}

// logits_s [row_count][kTileV + 1] (fp32, this tile's logits) -> one state per batch row.
__device__ __forceinline__ void reduce_tile(const float* logits_s, int row_count, const LmHeadTop2GapParams& p,
                                            int64_t row0, int64_t v0, int64_t num_vtiles, TilePartial* partials) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int r = warp; r < row_count; r += kWarps) {
    Top2 s = top2_empty();
#pragma unroll
    for (int c = lane; c < kTileV; c += kWarpSize)
      if (v0 + c < p.vocab) top2_push(s, logits_s[r * (kTileV + 1) + c], v0 + c);
    s = top2_warp_merge(s);
    if (lane == 0) partials[(row0 + r) * num_vtiles + v0 / kTileV] = to_partial(s);
  }
}

template <int MB>
struct MmaTile {
  static constexpr int kTileK = 64;
  static constexpr int kPitch = kTileK + 8;  // conflict-free 32-bit fragment loads
  static constexpr int kPipelineBytes = 2 * (kTileV + MB) * kPitch * 2;
  static constexpr int kLogitsBytes = MB * (kTileV + 1) * 4;
  static constexpr int kSmemBytes = kPipelineBytes > kLogitsBytes ? kPipelineBytes : kLogitsBytes;
};

template <typename T, int MB>
__global__ void __launch_bounds__(kThreads)
    lm_head_tile_mma_kernel(const LmHeadTop2GapParams p, int64_t num_vtiles, TilePartial* __restrict__ partials) {
  using Tile = MmaTile<MB>;
  constexpr int kTileK = Tile::kTileK;
  constexpr int kPitch = Tile::kPitch;
  constexpr int kChunks = kTileK / 8;
  constexpr int kMTiles = MB / 16;
  __shared__ __align__(16) unsigned char smem[Tile::kSmemBytes];
  T* w_s = reinterpret_cast<T*>(smem);       // [2][kTileV][kPitch]
  T* h_s = w_s + 2 * kTileV * kPitch;        // [2][MB][kPitch]

  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kTileV;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * MB;
  const int row_count = static_cast<int>(min(static_cast<int64_t>(MB), p.rows - row0));
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int quad_row = lane / 4;
  const int quad_lane = lane % 4;
  const T* weight = static_cast<const T*>(p.weight);
  const T* hidden = static_cast<const T*>(p.hidden);

  auto load_stage = [&](int64_t k0, int stage) {
    for (int i = tid; i < kTileV * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int64_t v = v0 + r, k = k0 + c * 8;
      T* dst = w_s + (stage * kTileV + r) * kPitch + c * 8;
      if (v < p.vocab && k < p.hidden_size) cp_async_16(dst, weight + v * p.weight_stride + k);
      else zero_16(dst);
    }
    for (int i = tid; i < MB * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int64_t k = k0 + c * 8;
      T* dst = h_s + (stage * MB + r) * kPitch + c * 8;
      if (r < row_count && k < p.hidden_size) cp_async_16(dst, hidden + (row0 + r) * p.hidden_stride + k);
      else zero_16(dst);
    }
  };

  float acc[kMTiles][2][4] = {};
  const int64_t num_k = (p.hidden_size + kTileK - 1) / kTileK;
  load_stage(0, 0);
  cp_async_commit();
  for (int64_t kt = 0; kt < num_k; ++kt) {
    const int stage = static_cast<int>(kt & 1);
    if (kt + 1 < num_k) load_stage((kt + 1) * kTileK, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* ws = w_s + stage * kTileV * kPitch;
    const T* hs = h_s + stage * MB * kPitch;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t b[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        // B[k][n] = weight[vocab n][dim k]: row n of the weight tile, two dims per register.
        const T* wb = ws + (warp * 16 + nt * 8 + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
        b[nt][0] = load_pair(wb);
        b[nt][1] = load_pair(wb + 8);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const T* ha = hs + (mt * 16 + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
        const uint32_t a[4] = {load_pair(ha), load_pair(ha + 8 * kPitch), load_pair(ha + 8),
                               load_pair(ha + 8 * kPitch + 8)};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) mma<T>(acc[mt][nt], a, b[nt]);
      }
    }
    __syncthreads();  // the next iteration prefetches into the stage just read
  }
  cp_async_wait<0>();

  // The pipeline buffers are free now: reuse them for the tile's logits.
  float* logits_s = reinterpret_cast<float*>(smem);  // [MB][kTileV + 1]
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 16 + quad_row + 8 * (e / 2);
        const int c = warp * 16 + nt * 8 + 2 * quad_lane + (e % 2);
        logits_s[r * (kTileV + 1) + c] = acc[mt][nt][e];
      }
  __syncthreads();
  reduce_tile(logits_s, row_count, p, row0, v0, num_vtiles, partials);
}

// SIMT tile for fp32 (tensor cores would round it to tf32) and for unaligned rows: 16 batch rows x
// 64 vocab rows per block, each thread 8 rows of one vocab column, K staged 32 at a time in fp32.
constexpr int kSimtRows = 16;
constexpr int kSimtK = 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    lm_head_tile_simt_kernel(const LmHeadTop2GapParams p, int64_t num_vtiles, TilePartial* __restrict__ partials) {
  __shared__ float w_s[kTileV][kSimtK + 1];
  __shared__ float h_s[kSimtRows][kSimtK + 1];
  __shared__ float logits_s[kSimtRows * (kTileV + 1)];
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kTileV;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kSimtRows;
  const int row_count = static_cast<int>(min(static_cast<int64_t>(kSimtRows), p.rows - row0));
  const int tid = threadIdx.x;
  const int col = tid % kTileV;
  const int row_group = tid / kTileV;  // rows 8 * row_group .. + 8
  const T* weight = static_cast<const T*>(p.weight);
  const T* hidden = static_cast<const T*>(p.hidden);

  float acc[8] = {};
  for (int64_t k0 = 0; k0 < p.hidden_size; k0 += kSimtK) {
    for (int i = tid; i < kTileV * kSimtK; i += kThreads) {
      const int r = i / kSimtK, c = i % kSimtK;
      const int64_t v = v0 + r, k = k0 + c;
      w_s[r][c] = v < p.vocab && k < p.hidden_size ? to_float(weight[v * p.weight_stride + k]) : 0.f;
    }
    for (int i = tid; i < kSimtRows * kSimtK; i += kThreads) {
      const int r = i / kSimtK, c = i % kSimtK;
      const int64_t k = k0 + c;
      h_s[r][c] = r < row_count && k < p.hidden_size ? to_float(hidden[(row0 + r) * p.hidden_stride + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kSimtK; ++c) {
      const float w = w_s[col][c];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += h_s[row_group * 8 + j][c] * w;
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) logits_s[(row_group * 8 + j) * (kTileV + 1) + col] = acc[j];
  __syncthreads();
  reduce_tile(logits_s, row_count, p, row0, v0, num_vtiles, partials);
}

constexpr int kReduceThreads = 256;

__global__ void __launch_bounds__(kReduceThreads)
    lm_head_reduce_kernel(const TilePartial* __restrict__ partials, int64_t num_vtiles, float* __restrict__ gap,
                          int64_t* __restrict__ top1) {
  __shared__ Top2 scratch[kReduceThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  Top2 s = top2_empty();
  for (int64_t t = threadIdx.x; t < num_vtiles; t += kReduceThreads)
    s = top2_merge(s, from_partial(partials[row * num_vtiles + t]));
  s = top2_block_merge(s, scratch);
  if (threadIdx.x == 0) top2_finish(s, gap + row, top1 + row);
}

inline int64_t num_vocab_tiles(const LmHeadTop2GapParams& p) { return ceil_div(p.vocab, kTileV); }

template <typename T, int MB>
cudaError_t launch_mma_tiles(const LmHeadTop2GapParams& p, TilePartial* partials, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_vocab_tiles(p)), static_cast<unsigned>(ceil_div(p.rows, MB)));
  lm_head_tile_mma_kernel<T, MB><<<grid, kThreads, 0, stream>>>(p, num_vocab_tiles(p), partials);
  return cudaGetLastError();
}

}  // namespace

int64_t lm_head_top2_gap_workspace_bytes(const LmHeadTop2GapParams& p) {
  if (p.rows == 0) return 0;
  return p.rows * num_vocab_tiles(p) * static_cast<int64_t>(sizeof(TilePartial));
}

cudaError_t launch_lm_head_top2_gap(const LmHeadTop2GapParams& p, void* workspace, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.vocab > INT32_MAX || p.rows > INT32_MAX || ceil_div(p.rows, kSimtRows) > 65535) return cudaErrorInvalidValue;
  auto* partials = static_cast<TilePartial*>(workspace);
  const cudaError_t err = dispatch_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    const bool tensor_cores = !std::is_same_v<T, float> && p.hidden_size % 8 == 0 &&
                              rows_aligned16({p.hidden, p.weight}, {p.hidden_stride, p.weight_stride}, sizeof(T));
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) {
        if (p.rows <= 16) return launch_mma_tiles<T, 16>(p, partials, stream);
        if (p.rows <= 32) return launch_mma_tiles<T, 32>(p, partials, stream);
        return launch_mma_tiles<T, 64>(p, partials, stream);
      }
    }
    const dim3 grid(static_cast<unsigned>(num_vocab_tiles(p)), static_cast<unsigned>(ceil_div(p.rows, kSimtRows)));
    lm_head_tile_simt_kernel<T><<<grid, kThreads, 0, stream>>>(p, num_vocab_tiles(p), partials);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  lm_head_reduce_kernel<<<static_cast<unsigned>(p.rows), kReduceThreads, 0, stream>>>(partials, num_vocab_tiles(p),
                                                                                     p.gap, p.top1);
  return cudaGetLastError();
}

}  // namespace eecore::cuda
