// Argument checks of prefetch_l2, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// weight: any contiguous tensor; max_bytes >= 0 (how much of its start to fetch).
inline void check_prefetch_l2_args(const at::Tensor& weight, int64_t max_bytes) {
  const char* op = "prefetch_l2";
  check_defined(op, "weight", weight);
  check_contiguous(op, "weight", weight);
  EECORE_CHECK_ARG(op, "max_bytes", max_bytes >= 0, "expected a byte count >= 0, got ", max_bytes);
}

}  // namespace eecore
