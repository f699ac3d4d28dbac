// Argument checks of lm_head_top2_gap, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// hidden [B, d], weight [V, d] of hidden's dtype, d >= 1, V >= 2; both with unit stride along d
// (any row stride, so a slice of a larger embedding matrix works).
inline void check_lm_head_top2_gap_args(const at::Tensor& hidden, const at::Tensor& weight) {
  const char* op = "lm_head_top2_gap";
  check_dim(op, "hidden", hidden, 2);
  check_float_dtype(op, "hidden", hidden);
  EECORE_CHECK_ARG(op, "hidden", hidden.size(1) >= 1, "expected a hidden size d >= 1, got shape ", hidden.sizes());
  check_last_dim_contiguous(op, "hidden", hidden);
  check_dim(op, "weight", weight, 2);
  check_same_dtype(op, "weight", weight, "hidden", hidden);
  check_size(op, "weight", weight, 1, hidden.size(1), "the hidden size d of 'hidden'");
  EECORE_CHECK_ARG(op, "weight", weight.size(0) >= 2, "expected at least 2 vocab rows [V >= 2, d] for a top-2 gap, got shape ",
                   weight.sizes());
  check_last_dim_contiguous(op, "weight", weight);
  check_same_device(op, "weight", weight, "hidden", hidden);
}

}  // namespace eecore
