// Argument checks of mlp_confidence, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

// hidden [B, d] (fp32/bf16/fp16, d >= 1); w1 [m, d]; b1 [m]; w2 [m]; b2 [1]. The four weights
// share one dtype: hidden's, or fp32 (a classifier trained in fp32 can serve a bf16 model as is).
// hidden and w1 need unit stride along d; the vectors may have any stride.
inline void check_mlp_confidence_args(const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& b1,
                                      const at::Tensor& w2, const at::Tensor& b2) {
  const char* op = "mlp_confidence";
  check_dim(op, "hidden", hidden, 2);
  check_float_dtype(op, "hidden", hidden);
  EECORE_CHECK_ARG(op, "hidden", hidden.size(1) >= 1, "expected a hidden size d >= 1, got shape ", hidden.sizes());
  check_last_dim_contiguous(op, "hidden", hidden);

  check_dim(op, "w1", w1, 2);
  check_dtype_in(op, "w1", w1, {hidden.scalar_type(), at::kFloat});
  check_size(op, "w1", w1, 1, hidden.size(1), "the hidden size d of 'hidden'");
  check_last_dim_contiguous(op, "w1", w1);
  check_same_device(op, "w1", w1, "hidden", hidden);
  const int64_t m = w1.size(0);

  check_dim(op, "b1", b1, 1);
  check_size(op, "b1", b1, 0, m, "the classifier width m of 'w1'");
  check_same_dtype(op, "b1", b1, "w1", w1);
  check_same_device(op, "b1", b1, "hidden", hidden);

  check_dim(op, "w2", w2, 1);
  check_size(op, "w2", w2, 0, m, "the classifier width m of 'w1'");
  check_same_dtype(op, "w2", w2, "w1", w1);
  check_same_device(op, "w2", w2, "hidden", hidden);

  check_dim(op, "b2", b2, 1);
  check_size(op, "b2", b2, 0, 1, "one output logit");
  check_same_dtype(op, "b2", b2, "w1", w1);
  check_same_device(op, "b2", b2, "hidden", hidden);
}

}  // namespace eecore
