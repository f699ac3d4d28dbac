// Argument checks of rms_norm and fused_add_rms_norm, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// x [..., d] contiguous; weight [d] of x's dtype. Returns the number of rows.
inline int64_t check_rms_norm_operand(const char* op, const char* arg, const at::Tensor& x, const at::Tensor& weight) {
  check_defined(op, arg, x);
  EECORE_CHECK_ARG(op, arg, x.dim() >= 1, "expected at least 1 dim [..., d], got shape ", x.sizes());
  check_float_dtype(op, arg, x);
  check_contiguous(op, arg, x);
  check_dim(op, "weight", weight, 1);
  check_size(op, "weight", weight, 0, x.size(-1), "the hidden size d");
  check_same_dtype(op, "weight", weight, arg, x);
  check_contiguous(op, "weight", weight);
  check_same_device(op, "weight", weight, arg, x);
  return x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
}

inline void check_eps(const char* op, double eps) {
  EECORE_CHECK_ARG(op, "eps", eps >= 0.0, "expected eps >= 0, got ", eps);
}

inline int64_t check_rms_norm_args(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                   double eps) {
  const char* op = "rms_norm";
  int64_t rows = check_rms_norm_operand(op, "input", input, weight);
  check_like(op, "out", out, "input", input);
  check_contiguous(op, "out", out);
  check_eps(op, eps);
  return rows;
}

inline int64_t check_fused_add_rms_norm_args(const at::Tensor& input, const at::Tensor& residual,
                                             const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  int64_t rows = check_rms_norm_operand(op, "input", input, weight);
  check_like(op, "residual", residual, "input", input);
  check_contiguous(op, "residual", residual);
  check_eps(op, eps);
  return rows;
}

}  // namespace eecore
