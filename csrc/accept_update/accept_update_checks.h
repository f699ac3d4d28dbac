// Argument checks of accept_update, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// status bool [B] (updated in place); confidence fp32 [B]; threshold fp32 [] (one for the batch)
// or [B] (one per row); active bool [B]. Any strides.
inline void check_accept_update_args(const at::Tensor& status, const at::Tensor& confidence,
                                     const at::Tensor& threshold, const at::Tensor& active) {
  const char* op = "accept_update";
  check_dim(op, "status", status, 1);
  check_dtype(op, "status", status, at::kBool);
  const int64_t rows = status.size(0);

  check_dim(op, "confidence", confidence, 1);
  check_dtype(op, "confidence", confidence, at::kFloat);
  check_size(op, "confidence", confidence, 0, rows, "the batch size B of 'status'");
  check_same_device(op, "confidence", confidence, "status", status);

  check_defined(op, "threshold", threshold);
  EECORE_CHECK_ARG(op, "threshold", threshold.dim() == 0 || (threshold.dim() == 1 && threshold.size(0) == rows),
                   "expected shape [] (one threshold) or [", rows, "] (one per row), got shape ", threshold.sizes());
  check_dtype(op, "threshold", threshold, at::kFloat);
  check_same_device(op, "threshold", threshold, "status", status);

  check_dim(op, "active", active, 1);
  check_dtype(op, "active", active, at::kBool);
  check_size(op, "active", active, 0, rows, "the batch size B of 'status'");
  check_same_device(op, "active", active, "status", status);
}

}  // namespace eecore
