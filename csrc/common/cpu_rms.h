// RMS normalisation of one row on the CPU, in fp32: the pieces rms_norm, fused_add_rms_norm and
// kv_fill (which normalises the exit hidden state before projecting it) share.
//
//   inverse_rms(x)  = 1 / sqrt(mean(x^2) + eps)
//   scale_row       out = x * inverse_rms * gain, rounded once to the output dtype
#pragma once

#include <cmath>
#include <cstdint>

#include "common/cpu_vec.h"

namespace eecore::cpu {

// sum_i x[i]^2 in fp32, for x of any activation dtype and any length.
template <typename T>
inline float sum_of_squares(const T* x, int64_t d) {
  // Two accumulators: enough independent FMA chains to keep up with the loads.
  Vec8 acc0 = Vec8::zero(), acc1 = Vec8::zero();
  int64_t i = 0;
  for (; i + 2 * kVecWidth <= d; i += 2 * kVecWidth) {
    const Vec8 a = Vec8::load(x + i), b = Vec8::load(x + i + kVecWidth);
    acc0 = fma(a, a, acc0);
    acc1 = fma(b, b, acc1);
  }
  for (; i + kVecWidth <= d; i += kVecWidth) {
    const Vec8 a = Vec8::load(x + i);
    acc0 = fma(a, a, acc0);
  }
  float sum = reduce_add(acc0 + acc1);
  for (; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  return sum;
}

// 1 / sqrt(mean(x^2) + eps) of a row of d > 0 values whose squares sum to sum_sq.
inline float inverse_rms_of_sum(float sum_sq, int64_t d, float eps) {
  return 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
}

template <typename T>
inline float inverse_rms(const T* x, int64_t d, float eps) {
  return inverse_rms_of_sum(sum_of_squares(x, d), d, eps);
}

// out[i] = (x[i] * scale) * gain[i], or x[i] * scale when gain is null, computed in fp32 and
// rounded once to out_t. `out` may alias `x`.
template <typename out_t, typename T>
inline void scale_row(out_t* out, const T* x, float scale, const T* gain, int64_t d) {
  const Vec8 s = Vec8::broadcast(scale);
  int64_t i = 0;
  if (gain != nullptr) {
    for (; i + kVecWidth <= d; i += kVecWidth) (Vec8::load(x + i) * s * Vec8::load(gain + i)).store(out + i);
    for (; i < d; ++i) out[i] = static_cast<out_t>(static_cast<float>(x[i]) * scale * static_cast<float>(gain[i]));
  } else {
    for (; i + kVecWidth <= d; i += kVecWidth) (Vec8::load(x + i) * s).store(out + i);
    for (; i < d; ++i) out[i] = static_cast<out_t>(static_cast<float>(x[i]) * scale);
  }
}

}  // namespace eecore::cpu
