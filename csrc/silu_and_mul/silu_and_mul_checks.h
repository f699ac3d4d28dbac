// Argument checks of silu_and_mul, shared by the CPU and CUDA glue.
#pragma once

#include <vector>

#include "common/checks.h"

namespace eecore {

// input [..., 2 d] and out [..., d], contiguous, of one float dtype and device. Returns the rows.
inline int64_t check_silu_and_mul_args(const at::Tensor& out, const at::Tensor& input) {
  const char* op = "silu_and_mul";
  check_defined(op, "input", input);
  EECORE_CHECK_ARG(op, "input", input.dim() >= 1, "expected at least 1 dim [..., 2 d], got shape ", input.sizes());
  check_float_dtype(op, "input", input);
  check_contiguous(op, "input", input);
  EECORE_CHECK_ARG(op, "input", input.size(-1) % 2 == 0,
                   "expected an even last dim (gate and up halves, [..., 2 d]), got ", input.size(-1));
  check_defined(op, "out", out);
  std::vector<int64_t> expected = input.sizes().vec();
  expected.back() /= 2;
  EECORE_CHECK_ARG(op, "out", out.sizes() == at::IntArrayRef(expected), "expected shape ", at::IntArrayRef(expected),
                   " (input's with half its last dim), got ", out.sizes());
  check_same_dtype(op, "out", out, "input", input);
  check_contiguous(op, "out", out);
  check_same_device(op, "out", out, "input", input);
  return out.size(-1) == 0 ? 0 : out.numel() / out.size(-1);
}

}  // namespace eecore
