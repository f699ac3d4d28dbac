// linear as one library GEMM (BLAS on the CPU, cuBLAS on the GPU): the large-M path of the CPU
// op and the whole CUDA op.
#pragma once

#include <ATen/ATen.h>

namespace eecore {

inline void linear_with_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, bool accumulate) {
  const bool has_bias = bias.has_value() && bias->defined();
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
