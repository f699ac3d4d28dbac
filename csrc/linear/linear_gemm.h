// linear as one library GEMM (BLAS on the CPU, cuBLAS on the GPU): the large-M path of the CPU
// op and the whole CUDA op.
#pragma once

#include <ATen/ATen.h>

namespace eecore {

inline void linear_with_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, bool accumulate,
                             const std::optional<at::Tensor>& weight_scale) {
  // A weight-only int8 weight is widened to the input's dtype, whole, for the GEMM: at the sizes
  // that take this path (prompts) the GEMM's arithmetic outweighs one pass over the weight.
  const at::Tensor dense = weight.scalar_type() == at::kChar
                               ? weight.to(at::kFloat).mul_(weight_scale->unsqueeze(1)).to(input.scalar_type())
                               : weight;
  const bool has_bias = bias.has_value() && bias->defined();
  if (accumulate) {
    out.addmm_(input, dense.t());
    if (has_bias) out.add_(*bias);
  } else if (has_bias) {
    at::addmm_out(out, *bias, input, dense.t());
  } else {
    at::mm_out(out, input, dense.t());
  }
}

}  // namespace eecore
