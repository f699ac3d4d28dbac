// argmax on the CPU: one pass per row, rows spread over the threads.
//
// The engine's own CPU path takes fp32 logits through numpy's SIMD argmax (eecore.engine.sampler);
// this kernel serves the other dtypes, other engines, and is what the CUDA kernel is held to.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "argmax/argmax_checks.h"

namespace eecore {
namespace {

template <typename scalar_t>
inline float as_float(scalar_t x) {
  return static_cast<float>(x);
}

// torch.argmax's rule: the first NaN if the row has one, else the first index of the maximum.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t vocab) {
  float best = as_float(x[0]);
  if (std::isnan(best)) return 0;
  int64_t at = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    const float v = as_float(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return at;
}

void argmax_cpu(at::Tensor& out, const at::Tensor& logits) {
  check_argmax_args(out, logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t row_stride = logits.stride(0), out_stride = out.stride(0);
  int64_t* dst = out.data_ptr<int64_t>();
  EECORE_DISPATCH_FLOAT(logits.scalar_type(), "eecore::argmax", [&] {
    const scalar_t* src = logits.const_data_ptr<scalar_t>();
    // a thread per ~32K logits at least: a row of a large vocabulary is worth one
    const int64_t grain = std::max<int64_t>(1, 32768 / vocab);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r * out_stride] = argmax_row(src + r * row_stride, vocab);
    });
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("argmax", &eecore::argmax_cpu); }
