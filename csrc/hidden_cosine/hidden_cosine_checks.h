// Argument checks of hidden_cosine, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// prev, cur [B, d] of one dtype, d >= 1, unit stride along d (any row stride).
inline void check_hidden_cosine_args(const at::Tensor& prev, const at::Tensor& cur) {
  const char* op = "hidden_cosine";
  check_dim(op, "prev", prev, 2);
  check_float_dtype(op, "prev", prev);
  EECORE_CHECK_ARG(op, "prev", prev.size(1) >= 1, "expected a hidden size d >= 1, got shape ", prev.sizes());
  check_last_dim_contiguous(op, "prev", prev);
  check_like(op, "cur", cur, "prev", prev);
  check_last_dim_contiguous(op, "cur", cur);
}

}  // namespace eecore
