// Weight-only int8 linear: what the op computes, shared by its CPU kernel, its GEMM path and the
// CUDA glue. Torch-free.
//
// A weight int8 [N, K] with weight_scale fp32 [N] stands for weight_scale[j] * weight[j][k]. Each
// input row is rounded to 16-bit integers first, with a scale of its own:
//     range = int16_row_range(K),  inv = range / max_k |x[k]|  (fp32),
//     q[k] = round-half-even(x[k] * inv) clamped to [-range, range],  x_scale = max_k |x[k]| / range,
// and out[j] = x_scale * weight_scale[j] * sum_k q[k] * weight[j][k]. The rounding is why the dot
// products can be exact integers (AVX512-VNNI's vpdpwssd) and it costs less than bf16 inputs do
// (16 bits against bf16's 8 of precision, relative to the row's largest value). A row of zeros has
// scale 0; a row holding inf or NaN gets a NaN scale, so its outputs are NaN.
#pragma once

#include <cstdint>

namespace eecore {

// The integer a row's absmax maps to: 32767, or less where a long row could overflow an int32
// lane of the integer dot product. The narrowest lanes are AVX2's (vpmaddwd into 8 lanes): a lane
// adds 2 products per 16 elements (vpdpwssd's 16 lanes: per 32), each at most range x 128 in
// magnitude, so it holds at most 2 ceil(K / 16) x 128 x range; rows up to 4096 elements keep the
// whole int16 range.
inline int32_t int16_row_range(int64_t k) {
  const int64_t lane_products = 2 * ((k + 15) / 16);
  const int64_t bound = INT32_MAX / (128 * (lane_products > 0 ? lane_products : 1));
  return static_cast<int32_t>(bound < 32767 ? bound : 32767);
}

}  // namespace eecore
