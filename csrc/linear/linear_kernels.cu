// linear for a few rows on CUDA: a decode step multiplies 1-8 rows by each weight, which is a
// matrix-vector product bound by reading the weight once. cuBLAS's kernels for these shapes pay a
// fixed ~3 us each on an H200 (SmolLM2's 1-3.5 MB projections took 3.5-4.8 us, ~0.5 us of it
// reading), and a split-K reduction kernel after the larger ones. Here one warp computes one
// output feature for every row: its lanes stream the weight row in 16-byte vectors, several in
// flight, multiply each by the matching slices of the input rows (small, read through the cache by
// every warp), and reduce by shuffles.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/gemv_mma.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/linear_gemv.h"

namespace eecore::cuda {
namespace {

constexpr int kSimtWarps = 4;
constexpr int kSimtThreads = kSimtWarps * kWarpSize;

// Writes out[row, n] = y (+ bias), or adds y to it, rounded as cuBLAS's path rounds.
template <typename T>
__device__ __forceinline__ void store_result(const LinearGemvParams& p, int row, int64_t n, float y) {
  T* out = static_cast<T*>(p.out) + row * p.out_stride + n;
  const T* bias = static_cast<const T*>(p.bias);
  if (p.accumulate) {
    // out.addmm_(input, weight^T), rounded, then out.add_(bias), rounded again
    y = to_float(from_float<T>(y + to_float(*out)));
    if (bias != nullptr) y += to_float(bias[n]);
    *out = from_float<T>(y);
  } else {
    *out = gemv_mma::projected<T>(y, bias, n);
  }
}

template <typename T, int ROWS>
__global__ void __launch_bounds__(kSimtThreads) linear_gemv_kernel(const LinearGemvParams p) {
  pdl_wait();
  pdl_launch_dependents();
  constexpr int V = kVec16<T>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kSimtWarps + threadIdx.x / kWarpSize;
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
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, kSimtWarps)));
  return launch_kernel(linear_gemv_kernel<T, ROWS>, grid, kSimtThreads, 0, stream, p);
}

// ---- the few-row kernel on tensor cores (EECORE_LINEAR_KERNEL=gemv_mma) --------------------------
//
// The warp-a-feature kernel above matches each weight load with one input load per row, so at 4-8
// rows L1 saturates before DRAM does (an H200 ran it 2x slower than cuBLAS at 8 rows). Here the
// product runs on tensor cores (eecore/cuda/gemv_mma.cuh): a block a tile of 16 output features,
// one input load a lane for every two weight loads at any row count.
template <typename T>
__global__ void __launch_bounds__(gemv_mma::kThreads, 1) linear_gemv_mma_kernel(const LinearGemvParams p) {
  using namespace gemv_mma;
  __shared__ TileSums partial;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kFeatures;
  block_tile<T>(p, plain_tile_rows(first, p.out_features), static_cast<const T*>(p.input), p.input_stride, [] {},
                partial);
  const int t = threadIdx.x;
  if (t >= kTile) return;
  const int feature = t / kRows, row = t % kRows;
  const int64_t n = first + feature;
  if (row >= p.rows || n >= p.out_features) return;
  store_result<T>(p, row, n, tile_sum(partial, t));
}

}  // namespace

bool linear_gemv_mma_supported(const LinearGemvParams& p) {
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && p.in_features % gemv_mma::kChunk == 0 &&
         linear_gemv_supported(p);
}

cudaError_t launch_linear_gemv_mma(const LinearGemvParams& p, cudaStream_t stream) {
  if (!linear_gemv_mma_supported(p)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, gemv_mma::kFeatures)));
  if (p.dtype == DType::kBFloat16)
    return launch_kernel(linear_gemv_mma_kernel<__nv_bfloat16>, grid, gemv_mma::kThreads, 0, stream, p);
  return launch_kernel(linear_gemv_mma_kernel<__half>, grid, gemv_mma::kThreads, 0, stream, p);
}

bool linear_gemv_supported(const LinearGemvParams& p) {
  if (p.rows < 1 || p.rows > kLinearGemvMaxRows || p.out_features < 1) return false;
  if (ceil_div(p.out_features, kSimtWarps) > INT32_MAX) return false;
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
