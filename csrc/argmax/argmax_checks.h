// Argument checks of argmax, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// out int64 [B]; logits [B, V >= 1], fp32/bf16/fp16, unit stride along V (any row stride).
inline void check_argmax_args(const at::Tensor& out, const at::Tensor& logits) {
  const char* op = "argmax";
  check_dim(op, "logits", logits, 2);
  check_float_dtype(op, "logits", logits);
  EECORE_CHECK_ARG(op, "logits", logits.size(1) >= 1, "expected at least 1 vocab entry [B, V >= 1], got shape ",
                   logits.sizes());
  check_last_dim_contiguous(op, "logits", logits);
  check_dim(op, "out", out, 1);
  check_dtype(op, "out", out, at::kLong);
  check_size(op, "out", out, 0, logits.size(0), "rows of logits");
  check_same_device(op, "out", out, "logits", logits);
}

}  // namespace eecore
