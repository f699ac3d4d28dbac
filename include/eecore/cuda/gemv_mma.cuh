// The few-row product on tensor cores, shared by linear's gemv_mma kernel and the fused
// projections (csrc/linear/linear_kernels.cu, csrc/fused_projections/).
//
// A decode step multiplies 1-8 rows by each weight: a matrix-vector product bound by reading the
// weight once. mma.m16n8k16 takes 16 weight rows as A and up to 8 input rows, zero-padded, as B, so
// a 16-feature tile costs one 16-byte input load a lane for every two weight loads, whatever the
// row count. The k order inside a tile is permuted, the same way for A and B (a dot product does
// not care): lane (group, tig) loads 8 consecutive elements at k = 8 tig of each 32-wide chunk
// from weight rows `lo` and `hi` (A's rows group and group + 8) and from input row group, and
// elements 0-3 feed one mma, 4-7 the next, as the fragment pairs {2tig, 2tig+1} and
// {2tig+8, 2tig+9} (mma.cuh's layout). Every load is then a 16-byte one straight into registers,
// and four lanes read 64 contiguous bytes of a row. A block's 8 warps split the chunks of the row
// and meet in shared memory. Each output element is one column of the mma, which never mixes
// columns, and the reduction order depends only on K: a row's bits do not depend on the rows
// beside it, nor on which weight rows share its tile (a fused kernel pairs the rows its epilogue
// needs together: a gate row with its up row, a RoPE pair's two halves).
#pragma once

#include "eecore/cuda/common.cuh"
#include "eecore/cuda/mma.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/launch/linear_gemv.h"

namespace eecore::cuda::gemv_mma {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kFeatures = 16;  // the mma's M: a tile's weight rows
constexpr int kRows = 8;       // its N: input rows
constexpr int kChunk = 32;     // elements of k a warp consumes a step: 4 lanes x 8
constexpr int kTile = kFeatures * kRows;

// Where a block's warps meet: every warp's sums of its tile, in shared memory. Passed by reference,
// not as a pointer, so that a buffer of another shape does not compile: a kernel whose own kWarps
// shadowed this one once declared 4 warps' rows, and its warps 4-7 wrote past them.
using TileSums = float[kWarps][kTile];

// Chunks a warp loads before it multiplies them: 24 16-byte loads in flight a lane, a whole row's
// share in one round at K <= 2048 (Llama-1B's and SmolLM2's projections but the down ones).
// Kernels built on this need __launch_bounds__(kThreads, 1): without it ptxas kept to 56 registers
// by sinking each chunk's loads down to its mma, which left 3 loads in flight a lane and paid a
// DRAM round trip a chunk (the build an H200 ran at a third of DRAM bandwidth on Llama-1B's QKV);
// with it 21 of a round's 24 loads are issued before the first mma. test_cuda_build.py reads the
// SASS to keep it so.
constexpr int kAhead = 8;

// One warp's share of a tile: c += the products of weight rows lo and hi (this lane's pointers,
// already offset by 8 tig) with input row `group`, over the warp's chunks of `in_features`.
// `load_input(k)` returns the lane's 16 bytes of its input row at element k + 8 tig (zeros for a
// padding row). The chunks are multiplied in order: a row's bits depend only on K.
template <typename T, typename LoadInput>
__device__ __forceinline__ void warp_tile(float (&c)[4], const T* w_lo, const T* w_hi, int64_t in_features,
                                          LoadInput load_input) {
  const int warp = threadIdx.x / kWarpSize;
  const int64_t chunks = in_features / kChunk;
  const int64_t per_warp = ceil_div(chunks, kWarps);
  const int64_t begin = warp * per_warp, end = begin + per_warp < chunks ? begin + per_warp : chunks;
  // A round's chunks are loaded before their mmas; a chunk past the warp's end loads zeros, which
  // leave the sums as they are.
  for (int64_t chunk = begin; chunk < end; chunk += kAhead) {
    uint4 lo[kAhead], hi[kAhead], xv[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t k = (chunk + u) * kChunk;
      const bool in_range = chunk + u < end;
      lo[u] = in_range ? *reinterpret_cast<const uint4*>(w_lo + k) : make_uint4(0, 0, 0, 0);
      hi[u] = in_range ? *reinterpret_cast<const uint4*>(w_hi + k) : make_uint4(0, 0, 0, 0);
      xv[u] = in_range ? load_input(k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const uint32_t a0[4] = {lo[u].x, hi[u].x, lo[u].y, hi[u].y}, b0[2] = {xv[u].x, xv[u].y};
      mma<T>(c, a0, b0);
      const uint32_t a1[4] = {lo[u].z, hi[u].z, lo[u].w, hi[u].w}, b1[2] = {xv[u].z, xv[u].w};
      mma<T>(c, a1, b1);
    }
  }
}

// The warps' sums of a tile meet in `partial` (shared): afterwards tile_sum(partial, i) is the
// whole sum of tile element i = feature * kRows + row, features 0-7 being the lo weight rows of
// groups 0-7 and 8-15 their hi rows. Every thread of the block calls it.
__device__ __forceinline__ void share_tile(const float (&c)[4], TileSums& partial) {
  const int lane = threadIdx.x % kWarpSize;
  const int group = lane / 4, tig = lane % 4;
  // c[0], c[1]: weight row lo, input rows 2tig and 2tig + 1; c[2], c[3]: weight row hi.
  float* mine = partial[threadIdx.x / kWarpSize];
  mine[group * kRows + 2 * tig] = c[0];
  mine[group * kRows + 2 * tig + 1] = c[1];
  mine[(group + 8) * kRows + 2 * tig] = c[2];
  mine[(group + 8) * kRows + 2 * tig + 1] = c[3];
  __syncthreads();
}

// A projection's output element from its fp32 sum: + bias, rounded once, as addmm(bias, x, w^T)
// (and mm without a bias) rounds it.
template <typename T>
__device__ __forceinline__ T projected(float y, const T* bias, int64_t n) {
  return from_float<T>(bias != nullptr ? y + to_float(bias[n]) : y);
}

// Asks L2 for this lane's share of the weight rows a warp_tile call will read: one prefetch a
// 128-byte line. Weights are never written by the kernels before this one, so a kernel launched
// with PDL may call it before pdl_wait(), streaming its weights while its predecessor finishes.
template <typename T>
__device__ __forceinline__ void prefetch_tile(const T* w_lo, const T* w_hi, int64_t in_features) {
  const int warp = threadIdx.x / kWarpSize, tig = threadIdx.x % 4;
  const int64_t chunks = in_features / kChunk;
  const int64_t per_warp = ceil_div(chunks, kWarps);
  const int64_t begin = warp * per_warp, end = begin + per_warp < chunks ? begin + per_warp : chunks;
  // w_lo and w_hi sit 8 tig elements into a chunk; a line is two chunks, one lane of four asks.
  for (int64_t chunk = begin + 2 * tig; chunk < end; chunk += 8) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w_lo + chunk * kChunk - 8 * tig));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w_hi + chunk * kChunk - 8 * tig));
  }
}

// The two weight rows a lane multiplies: A's rows group and group + 8.
struct TileRows {
  int64_t lo, hi;
};

// Rows first + group and first + group + 8 of a plain tile; a feature past the end re-reads the
// last weight row (its sums are never stored).
__device__ __forceinline__ TileRows plain_tile_rows(int64_t first, int64_t out_features) {
  const int group = (threadIdx.x % kWarpSize) / 4;
  const int64_t last = out_features - 1;
  return {first + group < last ? first + group : last, first + group + 8 < last ? first + group + 8 : last};
}

// A block's whole tile of p's product: it asks L2 for its weight rows, waits for the kernel before
// it (PDL), runs `prepare()` (a fused kernel's prologue), multiplies its rows against the input
// rows at x (global or shared memory, row stride `stride`, p.rows of them), and shares the sums
// in `partial` for tile_sum.
template <typename T, typename Prepare>
__device__ __forceinline__ void block_tile(const LinearGemvParams& p, TileRows rows, const T* x, int64_t stride,
                                           Prepare prepare, TileSums& partial) {
  const int lane = threadIdx.x % kWarpSize;
  const int group = lane / 4, tig = lane % 4;
  const T* w_lo = static_cast<const T*>(p.weight) + rows.lo * p.in_features + tig * 8;
  const T* w_hi = static_cast<const T*>(p.weight) + rows.hi * p.in_features + tig * 8;
  prefetch_tile<T>(w_lo, w_hi, p.in_features);
  pdl_wait();
  pdl_launch_dependents();
  prepare();
  const bool has_row = group < p.rows;  // B's columns past the input rows stay zero
  const T* x_row = x + (has_row ? group : 0) * stride + tig * 8;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  warp_tile<T>(c, w_lo, w_hi, p.in_features, [&](int64_t k) {
    return has_row ? *reinterpret_cast<const uint4*>(x_row + k) : make_uint4(0, 0, 0, 0);
  });
  share_tile(c, partial);
}

__device__ __forceinline__ float tile_sum(const TileSums& partial, int i) {
  float y = partial[0][i];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) y += partial[w][i];
  return y;
}

}  // namespace eecore::cuda::gemv_mma
