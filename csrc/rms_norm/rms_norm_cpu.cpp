// rms_norm and fused_add_rms_norm on the CPU: rows spread over the threads, each normalised with
// the shared fp32 row kernels of common/cpu_rms.h (8-lane vectors for every dtype).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/cpu_rms.h"
#include "rms_norm/rms_norm_checks.h"

namespace eecore {
namespace {

// Rows per parallel task: enough work per task to amortize the scheduling.
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, const scalar_t* in, const scalar_t* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x = in + r * d;
      cpu::scale_row(out + r * d, x, cpu::inverse_rms(x, d, eps), w, d);
    }
  });
}

// h = h + x, rounded to the storage dtype as an unfused add would be; returns the sum of squares
// of the stored (rounded) values.
template <typename scalar_t>
inline float add_in_place_sum_of_squares(scalar_t* h, const scalar_t* x, int64_t d) {
  using cpu::kVecWidth;
  using cpu::Vec8;
  // The squares are of the rounded sums: for bf16/fp16 reload what was stored (forwarded from
  // the store buffer); fp32 stores exactly what it has.
  auto add_chunk = [&](int64_t i) {
    Vec8 sum = Vec8::load(h + i) + Vec8::load(x + i);
    sum.store(h + i);
    if constexpr (!std::is_same_v<scalar_t, float>) sum = Vec8::load(h + i);
    return sum;
  };
  Vec8 acc0 = Vec8::zero(), acc1 = Vec8::zero();  // two FMA chains
  int64_t i = 0;
  for (; i + 2 * kVecWidth <= d; i += 2 * kVecWidth) {
    const Vec8 a = add_chunk(i), b = add_chunk(i + kVecWidth);
    acc0 = fma(a, a, acc0);
    acc1 = fma(b, b, acc1);
  }
  for (; i + kVecWidth <= d; i += kVecWidth) {
    const Vec8 a = add_chunk(i);
    acc0 = fma(a, a, acc0);
  }
  float sum = reduce_add(acc0 + acc1);
  for (; i < d; ++i) {
    h[i] = static_cast<scalar_t>(static_cast<float>(h[i]) + static_cast<float>(x[i]));
    const float v = static_cast<float>(h[i]);
    sum += v * v;
  }
  return sum;
}

// residual += input (rounded to the storage dtype, as an unfused add would be), then
// input = rms_norm(residual) * w, with the norm taken over the stored residual.
template <typename scalar_t>
void fused_add_rms_norm_rows(scalar_t* in, scalar_t* res, const scalar_t* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* x = in + r * d;
      scalar_t* h = res + r * d;
      const float inv_rms = cpu::inverse_rms_of_sum(add_in_place_sum_of_squares(h, x, d), d, eps);
      cpu::scale_row(x, h, inv_rms, w, d);
    }
  });
}

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  const int64_t rows = check_rms_norm_args(out, input, weight, eps);
  const int64_t d = input.size(-1);
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::rms_norm", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                  rows, d, static_cast<float>(eps));
  });
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = check_fused_add_rms_norm_args(input, residual, weight, eps);
  const int64_t d = input.size(-1);
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::fused_add_rms_norm", [&] {
    fused_add_rms_norm_rows(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.const_data_ptr<scalar_t>(), rows, d, static_cast<float>(eps));
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) {
  m.impl("rms_norm", &eecore::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &eecore::fused_add_rms_norm_cpu);
}
