// softmax_top2_gap on CUDA: one block per row, one streaming pass with 16-byte loads. Each
// thread folds its elements (in increasing index order) into an online top-2 state; the block
// merges the states. No [B, V] probabilities, no workspace, one launch.
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/top2.cuh"
#include "eecore/launch/softmax_top2_gap.h"

namespace eecore::cuda {
namespace {

constexpr int kThreads = 512;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    softmax_top2_gap_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, float* __restrict__ gap,
                            int64_t* __restrict__ top1) {
  __shared__ Top2 scratch[kThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  Top2 state = top2_empty();
  const int64_t num_vecs = vocab / VEC;
  for (int64_t i = threadIdx.x; i < num_vecs; i += kThreads) {
    float f[VEC];
    vec_to_float(load_vec<T, VEC>(x + i * VEC), f);
#pragma unroll
    for (int k = 0; k < VEC; ++k) top2_push(state, f[k], i * VEC + k);
  }
  for (int64_t i = num_vecs * VEC + threadIdx.x; i < vocab; i += kThreads) top2_push(state, to_float(x[i]), i);
  state = top2_block_merge(state, scratch);
  if (threadIdx.x == 0) top2_finish(state, gap + row, top1 + row);
}

}  // namespace

cudaError_t launch_softmax_top2_gap(const SoftmaxTop2GapParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_row_vectors(p.dtype, {p.logits}, {p.row_stride}, [&](auto tag, auto vec) {
    using T = typename decltype(tag)::type;
    softmax_top2_gap_kernel<T, decltype(vec)::value><<<dim3(static_cast<unsigned>(p.rows)), kThreads, 0, stream>>>(
        static_cast<const T*>(p.logits), p.row_stride, p.vocab, p.gap, p.top1);
    return cudaGetLastError();
  });
}

}  // namespace eecore::cuda
