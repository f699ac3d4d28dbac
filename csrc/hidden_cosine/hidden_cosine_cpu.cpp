// hidden_cosine on the CPU: one pass per row accumulates <p, c>, |p|^2 and |c|^2 in fp32.
//
// Semantics are torch.nn.functional.cosine_similarity(prev.float(), cur.float(), dim=-1,
// eps=1e-8): each norm is clamped below at eps, i.e. <p, c> / (max(|p|, eps) * max(|c|, eps)),
// so an all-zero row gives 0 rather than NaN.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common/cpu_vec.h"
#include "hidden_cosine/hidden_cosine_checks.h"

namespace eecore {
namespace {

constexpr double kEps = 1e-8;
// Elements per thread below which another thread is not worth waking.
constexpr int64_t kMinWorkPerThread = 1 << 16;

template <typename scalar_t>
float cosine_of_row(const scalar_t* p, const scalar_t* c, int64_t d) {
  using cpu::Vec8;
  using cpu::kVecWidth;
  // Two sets of accumulators: enough independent FMA chains to hide their latency.
  Vec8 pc0 = Vec8::zero(), pp0 = pc0, cc0 = pc0, pc1 = pc0, pp1 = pc0, cc1 = pc0;
  int64_t k = 0;
  for (; k + 2 * kVecWidth <= d; k += 2 * kVecWidth) {
    const Vec8 a0 = Vec8::load(p + k), b0 = Vec8::load(c + k);
    const Vec8 a1 = Vec8::load(p + k + kVecWidth), b1 = Vec8::load(c + k + kVecWidth);
    pc0 = fma(a0, b0, pc0);
    pp0 = fma(a0, a0, pp0);
    cc0 = fma(b0, b0, cc0);
    pc1 = fma(a1, b1, pc1);
    pp1 = fma(a1, a1, pp1);
    cc1 = fma(b1, b1, cc1);
  }
  for (; k + kVecWidth <= d; k += kVecWidth) {
    const Vec8 a0 = Vec8::load(p + k), b0 = Vec8::load(c + k);
    pc0 = fma(a0, b0, pc0);
    pp0 = fma(a0, a0, pp0);
    cc0 = fma(b0, b0, cc0);
  }
  float pc = reduce_add(pc0 + pc1), pp = reduce_add(pp0 + pp1), cc = reduce_add(cc0 + cc1);
  for (; k < d; ++k) {
    const float a = static_cast<float>(p[k]), b = static_cast<float>(c[k]);
    pc += a * b;
    pp += a * a;
    cc += b * b;
  }
  const double norm_p = std::max(std::sqrt(static_cast<double>(pp)), kEps);
  const double norm_c = std::max(std::sqrt(static_cast<double>(cc)), kEps);
  return static_cast<float>(static_cast<double>(pc) / (norm_p * norm_c));
}

template <typename scalar_t>
void hidden_cosine_rows(const scalar_t* prev, int64_t ld_prev, const scalar_t* cur, int64_t ld_cur, int64_t rows,
                        int64_t d, float* out) {
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / d);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = cosine_of_row(prev + r * ld_prev, cur + r * ld_cur, d);
  });
}

at::Tensor hidden_cosine_cpu(const at::Tensor& prev, const at::Tensor& cur) {
  check_hidden_cosine_args(prev, cur);
  const int64_t rows = prev.size(0), d = prev.size(1);
  at::Tensor out = at::empty({rows}, prev.options().dtype(at::kFloat));
  if (rows == 0) return out;
  EECORE_DISPATCH_FLOAT(prev.scalar_type(), "eecore::hidden_cosine", [&] {
    hidden_cosine_rows(prev.const_data_ptr<scalar_t>(), prev.stride(0), cur.const_data_ptr<scalar_t>(), cur.stride(0),
                       rows, d, out.data_ptr<float>());
  });
  return out;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("hidden_cosine", &eecore::hidden_cosine_cpu); }
