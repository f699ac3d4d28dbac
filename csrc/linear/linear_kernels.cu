// linear for a few rows on CUDA: a decode step multiplies 1-8 rows by each weight, which is a
// matrix-vector product bound by reading the weight once. cuBLAS's kernels for these shapes pay a
// fixed ~3 us each on an H200 (SmolLM2's 1-3.5 MB projections took 3.5-4.8 us, ~0.5 us of it
// reading), and a split-K reduction kernel after the larger ones.
//
// Here a block computes FEATS consecutive output features for every row. Its four warps split the
// weight rows' length in four; a warp's lanes stream their slice in 16-byte vectors, multiply each
// by the matching slices of the input rows (small, read through the cache by every block), and
// reduce by shuffles; the four partial sums meet in shared memory. Each input slice is loaded once
// for all FEATS features: with one feature a warp, 8 rows meant 8 input loads for each weight load,
// which saturated L1 (Llama-1B's projections ran 2x slower than cuBLAS at 8 rows on an H200).
// Splitting the length keeps four warps a feature group, so a projection of 2048 features still
// has thousands of warps streaming.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/linear_gemv.h"

namespace eecore::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;

// Writes out[row, n] = y (+ bias), or adds to it, with linear's roundings.
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

// Each (feature, row) result is the sum, in warp order, of four warps' sums over fixed slices of
// the length, each taken lane-strided and reduced by shuffles: the same order whatever ROWS and
// FEATS are, so a row's result does not depend on the rows beside it.
template <typename T, int ROWS, int FEATS>
__global__ void __launch_bounds__(kThreads, 1) linear_gemv_kernel(const LinearGemvParams p) {
  static_assert(ROWS * FEATS <= kWarpSize, "one lane holds each (feature, row) result");
  __shared__ float partial[kWarps][ROWS * FEATS];
  pdl_wait();
  pdl_launch_dependents();
  constexpr int V = kVec16<T>;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * FEATS;
  // Feature f's weight row is min(f, last) rows past the first's: a feature past the end re-reads
  // the last row, and its sums are never stored.
  const int64_t last = p.out_features - 1 - first;
  const T* w = static_cast<const T*>(p.weight) + first * p.in_features;
  const T* x = static_cast<const T*>(p.input);
  const int64_t vecs = p.in_features / V;
  const int64_t slice = ceil_div(vecs, kWarps);
  const int64_t begin = warp * slice, end = begin + slice < vecs ? begin + slice : vecs;
  float acc[FEATS][ROWS];
#pragma unroll
  for (int f = 0; f < FEATS; ++f)
#pragma unroll
    for (int m = 0; m < ROWS; ++m) acc[f][m] = 0.f;
#pragma unroll(FEATS == 1 ? 4 : 2)
  for (int64_t i = begin + lane; i < end; i += kWarpSize) {
    // The weight vectors stay packed (4 registers each, not 8 floats) and widen at each use: at 8
    // rows and 4 features the floats would not fit beside the 32 sums.
    Vec<T, V> wv[FEATS];
#pragma unroll
    for (int f = 0; f < FEATS; ++f) wv[f] = load_vec<T, V>(w + (f < last ? f : last) * p.in_features + i * V);
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      float xf[V];
      vec_to_float(load_vec<T, V>(x + m * p.input_stride + i * V), xf);
#pragma unroll
      for (int f = 0; f < FEATS; ++f) {
        float wf[V];
        vec_to_float(wv[f], wf);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[f][m] = fmaf(wf[k], xf[k], acc[f][m]);
      }
    }
  }
  // Lane f * ROWS + m of each warp holds its sum for (feature f, row m); constant indices keep acc
  // in registers.
#pragma unroll
  for (int f = 0; f < FEATS; ++f)
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const float sum = warp_sum(acc[f][m]);
      if (lane == f * ROWS + m) partial[warp][f * ROWS + m] = sum;
    }
  __syncthreads();
  if (warp != 0 || lane >= ROWS * FEATS) return;
  float y = partial[0][lane];
#pragma unroll
  for (int k = 1; k < kWarps; ++k) y += partial[k][lane];
  const int64_t n = first + lane / ROWS;
  if (n < p.out_features) store_result<T>(p, lane % ROWS, n, y);
}

template <typename T, int ROWS, int FEATS>
cudaError_t launch_features(const LinearGemvParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, FEATS)));
  return launch_kernel(linear_gemv_kernel<T, ROWS, FEATS>, grid, kThreads, 0, stream, p);
}

// Features a block: 1 up to 2 rows, 2 up to 4, 4 beyond; fewer where that would leave under two
// blocks an SM (a small projection needs every SM streaming to reach bandwidth).
int features_per_block(const LinearGemvParams& p) {
  int feats = p.rows <= 2 ? 1 : (p.rows <= 4 ? 2 : 4);
  const int64_t min_blocks = 2 * static_cast<int64_t>(num_sms_of_current_device());
  while (feats > 1 && ceil_div(p.out_features, feats) < min_blocks) feats /= 2;
  return feats;
}

template <typename T, int ROWS>
cudaError_t launch_rows(const LinearGemvParams& p, cudaStream_t stream) {
  if constexpr (ROWS > 1) {
    if (p.rows < ROWS) return launch_rows<T, ROWS - 1>(p, stream);
  }
  if constexpr (ROWS <= 2) {
    return launch_features<T, ROWS, 1>(p, stream);
  } else {
    switch (features_per_block(p)) {
      case 4: return launch_features<T, ROWS, 4>(p, stream);
      case 2: return launch_features<T, ROWS, 2>(p, stream);
      default: return launch_features<T, ROWS, 1>(p, stream);
    }
  }
}

}  // namespace

bool linear_gemv_supported(const LinearGemvParams& p) {
  if (p.rows < 1 || p.rows > kLinearGemvMaxRows || p.out_features < 1) return false;
  if (p.out_features > INT32_MAX) return false;  // a block a feature at most
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
