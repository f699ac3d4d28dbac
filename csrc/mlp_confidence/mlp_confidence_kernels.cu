// mlp_confidence on CUDA: one block per row. Warp w computes the classifier units j = w, w + 8, ...
// (lanes split d, 4-element vector loads when the rows allow), applies b1, relu and w2 at once, and
// keeps one partial sum; the block adds the warps' sums and thread 0 applies b2 and the sigmoid.
// The hidden row is re-read per unit from L1; the [B, m] activations never exist.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/reduce.cuh"
#include "eecore/launch/mlp_confidence.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

template <typename H, typename W, int VEC>
__global__ void __launch_bounds__(kThreads) mlp_confidence_kernel(const MlpConfidenceParams p) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const H* h = static_cast<const H*>(p.hidden) + row * p.hidden_stride;
  const W* w1 = static_cast<const W*>(p.w1);
  const W* b1 = static_cast<const W*>(p.b1);
  const W* w2 = static_cast<const W*>(p.w2);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t num_vecs = p.d / VEC;

  float partial = 0.f;  // sum over this warp's units of relu(z_j + b1_j) * w2_j
  for (int64_t j = warp; j < p.m; j += kWarps) {
    const W* w = w1 + j * p.w1_stride;
    float z = 0.f;
    for (int64_t i = lane; i < num_vecs; i += kWarpSize) {
      float fh[VEC], fw[VEC];
      vec_to_float(load_vec<H, VEC>(h + i * VEC), fh);
      vec_to_float(load_vec<W, VEC>(w + i * VEC), fw);
#pragma unroll
      for (int k = 0; k < VEC; ++k) z += fh[k] * fw[k];
    }
    for (int64_t i = num_vecs * VEC + lane; i < p.d; i += kWarpSize) z += to_float(h[i]) * to_float(w[i]);
    z = warp_sum(z);
    partial += fmaxf(z + to_float(b1[j * p.b1_stride]), 0.f) * to_float(w2[j * p.w2_stride]);
  }
  const float total = block_sum(lane == 0 ? partial : 0.f, scratch);
  if (threadIdx.x == 0) {
    const double logit = static_cast<double>(total) + to_float(static_cast<const W*>(p.b2)[0]);
    p.out[row] = static_cast<float>(1.0 / (1.0 + exp(-logit)));
  }
}

template <typename H, typename W>
cudaError_t launch_typed(const MlpConfidenceParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  // 4 elements per load (8 bytes of bf16/fp16, 16 of fp32): every row must start 4-aligned.
  const bool vec = p.d % 4 == 0 && p.hidden_stride % 4 == 0 && p.w1_stride % 4 == 0 &&
                   is_aligned(p.hidden, 4 * sizeof(H)) && is_aligned(p.w1, 4 * sizeof(W));
  if (vec)
    mlp_confidence_kernel<H, W, 4><<<grid, kThreads, 0, stream>>>(p);
  else
    mlp_confidence_kernel<H, W, 1><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlp_confidence(const MlpConfidenceParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype(p.hidden_dtype, [&](auto tag) {
    using H = typename decltype(tag)::type;
    if (p.weight_dtype == DType::kFloat32) return launch_typed<H, float>(p, stream);
    if (p.weight_dtype != p.hidden_dtype) return cudaErrorInvalidValue;  // the checks allow H or fp32 only
    return launch_typed<H, H>(p, stream);
  });
}

}  // namespace eecore::cuda
