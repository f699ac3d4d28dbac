// Online softmax top-2 state on the device, for softmax_top2_gap and lm_head_top2_gap:
//
//   p1 - p2 = (exp(x1 - m) - exp(x2 - m)) / sum_i exp(x_i - m) = -expm1(x2 - x1) / sumexp,  m = x1
//
// so a row needs its largest logit x1 (and the first index holding it), its second largest x2
// (equal to x1 on a tie, giving gap 0), and sumexp relative to x1. States of disjoint pieces merge
// like flash-attention's partial softmaxes, in any order: on equal maxima the lower index wins.
// Special values follow the CPU kernels (softmax + topk + argmax in fp32 where torch defines them):
// -inf entries take no probability; an all -inf row gives gap NaN and top1 0; a +inf or NaN
// anywhere gives gap NaN, and NaN entries never become top1.
#pragma once

#include <cmath>

#include "eecore/cuda/common.cuh"

namespace eecore::cuda {

struct Top2 {
  float max;
  float second;
  float sumexp;    // sum of exp(x - max); 0 while max is -inf
  int64_t argmax;  // -1 until a value above -inf is seen
  bool nan;        // a NaN was seen
};

__device__ __forceinline__ Top2 top2_empty() { return Top2{-INFINITY, -INFINITY, 0.f, -1, false}; }

// Fold in x at vocab index idx. Within one thread, indices must arrive in increasing order.
__device__ __forceinline__ void top2_push(Top2& s, float x, int64_t idx) {
  if (isnan(x)) {
    s.nan = true;
    return;
  }
  if (x > s.max) {
    // exp(x - x) is NaN for x = +inf, exactly as a softmax over the row would make it.
    const float self = isinf(x) ? NAN : 1.f;
    s.sumexp = (s.max == -INFINITY ? 0.f : s.sumexp * expf(s.max - x)) + self;
    s.second = s.max;
    s.max = x;
    s.argmax = idx;
  } else {
    if (x > s.second) s.second = x;
    if (s.max > -INFINITY) s.sumexp += expf(x - s.max);
  }
}

__device__ __forceinline__ Top2 top2_merge(const Top2& a, const Top2& b) {
  const bool b_wins = b.max > a.max || (b.max == a.max && b.argmax >= 0 && (a.argmax < 0 || b.argmax < a.argmax));
  // Field-wise selects rather than references to the winner: keeps the states in registers.
  const float win_max = b_wins ? b.max : a.max;
  const float lose_max = b_wins ? a.max : b.max;
  const float win_sum = b_wins ? b.sumexp : a.sumexp;
  const float lose_sum = b_wins ? a.sumexp : b.sumexp;
  Top2 out;
  out.max = win_max;
  out.argmax = b_wins ? b.argmax : a.argmax;
  // No rescale on equal maxima: keeps -inf - -inf from turning two empty pieces into NaN.
  out.sumexp = win_sum + (lose_max == win_max ? lose_sum : lose_sum * expf(lose_max - win_max));
  out.second = fmaxf(lose_max, fmaxf(a.second, b.second));
  out.nan = a.nan || b.nan;
  return out;
}

__device__ __forceinline__ Top2 top2_shfl_xor(const Top2& s, int offset) {
  Top2 o;
  o.max = __shfl_xor_sync(0xffffffffu, s.max, offset);
  o.second = __shfl_xor_sync(0xffffffffu, s.second, offset);
  o.sumexp = __shfl_xor_sync(0xffffffffu, s.sumexp, offset);
  o.argmax = __shfl_xor_sync(0xffffffffu, static_cast<long long>(s.argmax), offset);
  o.nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(s.nan), offset) != 0;
  return o;
}

// Merge over the warp; every lane gets the result.
__device__ __forceinline__ Top2 top2_warp_merge(Top2 s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) s = top2_merge(s, top2_shfl_xor(s, offset));
  return s;
}

// Merge over the block; the result is valid in thread 0. `scratch` holds >= 32 states.
__device__ __forceinline__ Top2 top2_block_merge(Top2 s, Top2* scratch) {
  s = top2_warp_merge(s);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  __syncthreads();
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < num_warps; ++w) s = top2_merge(s, scratch[w]);
  return s;
}

__device__ __forceinline__ void top2_finish(const Top2& s, float* gap, int64_t* top1) {
  *top1 = s.argmax < 0 ? 0 : s.argmax;
  if (s.nan || !(s.max > -INFINITY)) {
    *gap = NAN;
    return;
  }
  // second == -inf (every other logit -inf) gives expm1(-inf) = -1: gap 1 / sumexp.
  *gap = -expm1f(s.second - s.max) / s.sumexp;
}

}  // namespace eecore::cuda
