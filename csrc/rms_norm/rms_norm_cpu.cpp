// rms_norm and fused_add_rms_norm on the CPU: one row per task, fp32 accumulation.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "rms_norm/rms_norm_checks.h"

namespace eecore {
namespace {

// Rows per parallel task: enough work per task to amortize the scheduling.
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

template <typename scalar_t>
inline float sum_of_squares(const scalar_t* x, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]);
    acc += v * v;
  }
  return acc;
}

template <typename scalar_t>
inline void scale_row(scalar_t* out, const scalar_t* x, const scalar_t* w, float inv_rms, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i)
    out[i] = static_cast<scalar_t>(static_cast<float>(x[i]) * inv_rms * static_cast<float>(w[i]));
}

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, const scalar_t* in, const scalar_t* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x = in + r * d;
      const float inv_rms = 1.f / std::sqrt(sum_of_squares(x, d) / static_cast<float>(d) + eps);
      scale_row(out + r * d, x, w, inv_rms, d);
    }
  });
}

// residual += input (rounded to the storage dtype, as an unfused add would be), then
// input = rms_norm(residual) * w, with the norm taken over the stored residual.
template <typename scalar_t>
void fused_add_rms_norm_rows(scalar_t* in, scalar_t* res, const scalar_t* w, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* x = in + r * d;
      scalar_t* h = res + r * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) {
        const scalar_t s = static_cast<scalar_t>(static_cast<float>(h[i]) + static_cast<float>(x[i]));
        h[i] = s;
        const float v = static_cast<float>(s);
        acc += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(acc / static_cast<float>(d) + eps);
      scale_row(x, h, w, inv_rms, d);
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
