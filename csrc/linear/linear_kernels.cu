// linear for a few rows on CUDA: a decode step multiplies 1-8 rows by each weight, which is a
// matrix-vector product bound by reading the weight once. cuBLAS's kernels for these shapes pay a
// fixed ~3 us each on an H200 (SmolLM2's 1-3.5 MB projections took 3.5-4.8 us, ~0.5 us of it
// reading), and a split-K reduction kernel after the larger ones. Here one warp computes one
// output feature for every row: its lanes stream the weight row in 16-byte vectors, several in
// flight, multiply each by the matching slices of the input rows (small, read through the cache by
// every warp), and reduce by shuffles.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/mma.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/linear_gemv.h"

namespace eecore::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;

// Writes out[row, n] = y (+ bias), or adds y to it, rounded as cuBLAS's path rounds.
template <typename T>
__device__ __forceinline__ void store_result(const LinearGemvParams& p, int row, int64_t n, float y) {
  T* out = static_cast<T*>(p.out) + row * p.out_stride + n;
  const T* bias = static_cast<const T*>(p.bias);
  if (p.accumulate) {
    // out.addmm_(input, weight^T), rounded, then out.add_(bias), rounded again
    y = to_float(from_float<T>(y + to_float(*out)));
    if (bias != nullptr) y += to_float(bias[n]);
  } else if (bias != nullptr) {
    y += to_float(bias[n]);  // addmm(bias, input, weight^T): one rounding
  }
  *out = from_float<T>(y);
}

template <typename T, int ROWS>
__global__ void __launch_bounds__(kThreads) linear_gemv_kernel(const LinearGemvParams p) {
  pdl_wait();
  pdl_launch_dependents();
  constexpr int V = kVec16<T>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (n >= p.out_features) return;  // a whole warp leaves together: no shuffle misses a lane
  const T* w = static_cast<const T*>(p.weight) + n * p.in_features;
  const T* x = static_cast<const T*>(p.input);
  float acc[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) acc[m] = 0.f;
  const int64_t vecs = p.in_features / V;
#pragma unroll 4
  for (int64_t i = lane; i < vecs; i += kWarpSize) {
    float wf[V];
    vec_to_float(load_vec<T, V>(w + i * V), wf);
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      float xf[V];
      vec_to_float(load_vec<T, V>(x + m * p.input_stride + i * V), xf);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[m] = fmaf(wf[k], xf[k], acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < ROWS; ++m) acc[m] = warp_sum(acc[m]);
  if (lane >= ROWS) return;
  float y = 0.f;
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
    if (lane == m) y = acc[m];  // a constant index keeps acc in registers
  store_result<T>(p, lane, n, y);
}

template <typename T, int ROWS>
cudaError_t launch_rows(const LinearGemvParams& p, cudaStream_t stream) {
  if constexpr (ROWS > 1) {
    if (p.rows < ROWS) return launch_rows<T, ROWS - 1>(p, stream);
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, kWarps)));
  return launch_kernel(linear_gemv_kernel<T, ROWS>, grid, kThreads, 0, stream, p);
}

// ---- the few-row kernel on tensor cores (EECORE_LINEAR_KERNEL=gemv_mma) --------------------------
//
// The warp-a-feature kernel above matches each weight load with one input load per row, so at 4-8
// rows L1 saturates before DRAM does (an H200 ran it 2x slower than cuBLAS at 8 rows). Here
// mma.m16n8k16 takes 16 output features as A and up to 8 input rows, zero-padded, as B, so a
// 16-feature tile costs one 16-byte input load a lane for every two weight loads, whatever the
// row count. The k order inside a tile is permuted, the same way for A and B (a dot product does
// not care): lane (group, tig) loads 8 consecutive elements at k = 8 tig of each 32-wide chunk
// from weight rows group and group + 8 and from input row group, and elements 0-3 feed one mma,
// 4-7 the next, as the fragment pairs {2tig, 2tig+1} and {2tig+8, 2tig+9} (mma.cuh's layout).
// Every load is then a 16-byte one straight from global memory into registers, and four lanes
// read 64 contiguous bytes of a row. A block's 8 warps split the chunks of the row and meet in
// shared memory. Each output element is one column of the mma, which never mixes columns, and the
// reduction order depends only on K: a row's bits do not depend on the rows beside it.

constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kMmaFeatures = 16;  // the mma's M
constexpr int kMmaRows = 8;       // its N
constexpr int kMmaChunk = 32;     // elements of k a warp consumes a step: 4 lanes x 8

// Chunks a warp loads before it multiplies them: 24 16-byte loads in flight a lane, a whole row's
// share in one round at K <= 2048 (Llama-1B's and SmolLM2's projections but the down ones).
constexpr int kAhead = 8;

// __launch_bounds__(..., 1): without it ptxas kept to 56 registers by sinking each chunk's loads
// down to its mma, which left 3 loads in flight a lane and paid a DRAM round trip a chunk (the
// kernel an H200 ran, at a third of DRAM bandwidth on Llama-1B's QKV); with it 21 of a round's 24
// loads are issued before the first mma (110 registers, two CTAs an SM). test_cuda_build.py reads
// the SASS to keep it so.
template <typename T>
__global__ void __launch_bounds__(kMmaThreads, 1) linear_gemv_mma_kernel(const LinearGemvParams p) {
  __shared__ float partial[kMmaWarps][kMmaFeatures * kMmaRows];
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int group = lane / 4, tig = lane % 4;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kMmaFeatures;
  // A feature past the end re-reads the last weight row; its sums are never stored.
  const int64_t last = p.out_features - 1;
  const int64_t lo_row = first + group < last ? first + group : last;
  const int64_t hi_row = first + group + 8 < last ? first + group + 8 : last;
  const T* w_lo = static_cast<const T*>(p.weight) + lo_row * p.in_features + tig * 8;
  const T* w_hi = static_cast<const T*>(p.weight) + hi_row * p.in_features + tig * 8;
  const bool has_row = group < p.rows;  // B's columns past the input rows stay zero
  const T* x = static_cast<const T*>(p.input) + (has_row ? group : 0) * p.input_stride + tig * 8;
  const int64_t chunks = p.in_features / kMmaChunk;
  const int64_t per_warp = ceil_div(chunks, kMmaWarps);
  const int64_t begin = warp * per_warp, end = begin + per_warp < chunks ? begin + per_warp : chunks;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  // A round's chunks are loaded before their mmas; a chunk past the warp's end loads zeros, which
  // leave the sums as they are. The chunks are multiplied in order: a row's bits depend only on K.
  for (int64_t chunk = begin; chunk < end; chunk += kAhead) {
    uint4 lo[kAhead], hi[kAhead], xv[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t k = (chunk + u) * kMmaChunk;
      const bool in_range = chunk + u < end;
      lo[u] = in_range ? *reinterpret_cast<const uint4*>(w_lo + k) : make_uint4(0, 0, 0, 0);
      hi[u] = in_range ? *reinterpret_cast<const uint4*>(w_hi + k) : make_uint4(0, 0, 0, 0);
      xv[u] = in_range && has_row ? *reinterpret_cast<const uint4*>(x + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const uint32_t a0[4] = {lo[u].x, hi[u].x, lo[u].y, hi[u].y}, b0[2] = {xv[u].x, xv[u].y};
      mma<T>(c, a0, b0);
      const uint32_t a1[4] = {lo[u].z, hi[u].z, lo[u].w, hi[u].w}, b1[2] = {xv[u].z, xv[u].w};
      mma<T>(c, a1, b1);
    }
  }
  // c[0], c[1]: feature group, input rows 2tig and 2tig + 1; c[2], c[3]: feature group + 8.
  float* mine = partial[warp];
  mine[group * kMmaRows + 2 * tig] = c[0];
  mine[group * kMmaRows + 2 * tig + 1] = c[1];
  mine[(group + 8) * kMmaRows + 2 * tig] = c[2];
  mine[(group + 8) * kMmaRows + 2 * tig + 1] = c[3];
  __syncthreads();
  const int t = threadIdx.x;
  if (t >= kMmaFeatures * kMmaRows) return;
  const int feature = t / kMmaRows, row = t % kMmaRows;
  const int64_t n = first + feature;
  if (row >= p.rows || n >= p.out_features) return;
  float y = partial[0][t];
#pragma unroll
  for (int w = 1; w < kMmaWarps; ++w) y += partial[w][t];
  store_result<T>(p, row, n, y);
}

}  // namespace

bool linear_gemv_mma_supported(const LinearGemvParams& p) {
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && p.in_features % kMmaChunk == 0 &&
         linear_gemv_supported(p);
}

cudaError_t launch_linear_gemv_mma(const LinearGemvParams& p, cudaStream_t stream) {
  if (!linear_gemv_mma_supported(p)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, kMmaFeatures)));
  if (p.dtype == DType::kBFloat16)
    return launch_kernel(linear_gemv_mma_kernel<__nv_bfloat16>, grid, kMmaThreads, 0, stream, p);
  return launch_kernel(linear_gemv_mma_kernel<__half>, grid, kMmaThreads, 0, stream, p);
}

bool linear_gemv_supported(const LinearGemvParams& p) {
  if (p.rows < 1 || p.rows > kLinearGemvMaxRows || p.out_features < 1) return false;
  if (ceil_div(p.out_features, kWarps) > INT32_MAX) return false;
  const int64_t elem = p.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t vec = 16 / elem;
  return p.in_features % vec == 0 && rows_aligned16({p.weight, p.input}, {p.input_stride}, elem);
}

cudaError_t launch_linear_gemv(const LinearGemvParams& p, cudaStream_t stream) {
  if (!linear_gemv_supported(p)) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    return launch_rows<typename decltype(tag)::type, static_cast<int>(kLinearGemvMaxRows)>(p, stream);
  });
}

}  // namespace eecore::cuda
