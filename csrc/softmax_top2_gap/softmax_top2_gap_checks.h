// Argument checks of softmax_top2_gap, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// logits [B, V], V >= 2, fp32/bf16/fp16, unit stride along V (any row stride).
inline void check_softmax_top2_gap_args(const at::Tensor& logits) {
  const char* op = "softmax_top2_gap";
  check_dim(op, "logits", logits, 2);
  check_float_dtype(op, "logits", logits);
  EECORE_CHECK_ARG(op, "logits", logits.size(1) >= 2, "expected at least 2 vocab entries [B, V >= 2] for a top-2 gap, got shape ",
                   logits.sizes());
  check_last_dim_contiguous(op, "logits", logits);
}

}  // namespace eecore
