// linear as one library GEMM (BLAS on the CPU, cuBLAS on the GPU): the large-M path of the CPU
// op (float weights) and the whole CUDA op.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "eecore/int8_linear.h"
#include "linear/linear_checks.h"

namespace eecore {

// Input rows [M, K] rounded to int16 as eecore/int8_linear.h defines, returned as fp32 values
// (q * scale): the same q and scales as the CPU kernel's, made of whole-tensor ops.
inline at::Tensor rows_rounded_to_int16(const at::Tensor& input) {
  const at::Tensor x = input.to(at::kFloat);
  if (x.size(1) == 0) return x;  // rows of no elements: nothing to round (and no max to take)
  const float range = static_cast<float>(int16_row_range(x.size(1)));
  const at::Tensor amax = x.abs().amax(1, /*keepdim=*/true);
  const at::Tensor finite = x.isfinite().all(1, /*keepdim=*/true);
  const at::Tensor q = at::where(finite.logical_and(amax.gt(0)),
                                 x.mul(at::full_like(amax, range).div(amax)).round().clamp(-range, range),
                                 at::zeros_like(x));
  const at::Tensor scale =
      at::where(finite, amax.div(range), at::full_like(amax, std::numeric_limits<float>::quiet_NaN()));
  return q.mul(scale);
}

inline void linear_with_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, bool accumulate,
                             const std::optional<at::Tensor>& weight_scale) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (is_int8_weight(weight)) {
    // Weight-only int8 (the CUDA op; the CPU op streams int8 at every size): the rows rounded to
    // int16 and the weight widened, whole, to fp32 for one fp32 GEMM.
    at::Tensor y = at::mm(rows_rounded_to_int16(input), weight.to(at::kFloat).mul_(weight_scale->unsqueeze(1)).t());
    if (has_bias) y.add_(bias->to(at::kFloat));
    if (accumulate) y.add_(out.to(at::kFloat));
    out.copy_(y);
    return;
  }
  if (accumulate) {
    out.addmm_(input, weight.t());
    if (has_bias) out.add_(*bias);
  } else if (has_bias) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

}  // namespace eecore
