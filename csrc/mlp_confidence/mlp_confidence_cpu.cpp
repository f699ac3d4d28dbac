// mlp_confidence on the CPU: CALM's exit classifier, sigmoid(w2 . relu(w1 h + b1) + b2), fused.
//
// The first layer is the only real work (B x m x d multiply-adds); it runs a tile of m units at
// a time through the shared weight-streaming kernel (common/cpu_dots.h), and each tile immediately applies b1, relu and w2, leaving
// one partial sum per row. Partial sums are added in tile order, so the result does not depend
// on the thread count. The [B, m] activations never exist.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_dots.h"
#include "mlp_confidence/mlp_confidence_checks.h"

namespace eecore {
namespace {

// Classifier units per task.
constexpr int64_t kTile = 64;
// Multiply-adds per thread below which another thread is not worth waking.
constexpr int64_t kMinWorkPerThread = 1 << 18;

// A small 1-D tensor of any float dtype and stride -> fp32 values.
std::vector<float> to_float_vector(const at::Tensor& t) {
  std::vector<float> out(t.numel());
  EECORE_DISPATCH_FLOAT(t.scalar_type(), "eecore::mlp_confidence", [&] {
    const scalar_t* p = t.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < t.numel(); ++i) out[i] = static_cast<float>(p[i * t.stride(0)]);
  });
  return out;
}

// hidden: [rows, d] rows in dot_rows' input type (row stride ldh). Writes the fp32 confidence of every row.
template <typename h_t, typename w_t>
void mlp_confidence_rows(const h_t* hidden, int64_t ldh, int64_t rows, int64_t d, const w_t* w1, int64_t ldw,
                         int64_t m, const float* b1, const float* w2, float b2, float* out) {
  const int64_t tiles = (m + kTile - 1) / kTile;
  std::vector<float> partial(tiles * rows, 0.f);  // [tile][row]: sum_j relu(z_j) w2_j over the tile
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / (kTile * d * rows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> z(rows * kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTile, n = std::min(kTile, m - j0);
      cpu::dot_rows(hidden, ldh, rows, w1 + j0 * ldw, ldw, n, d, z.data(), kTile);
      for (int64_t r = 0; r < rows; ++r) {
        const float* zr = z.data() + r * kTile;
        float acc = 0.f;
        for (int64_t j = 0; j < n; ++j) acc += std::max(zr[j] + b1[j0 + j], 0.f) * w2[j0 + j];
        partial[t * rows + r] = acc;
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    double logit = b2;
    for (int64_t t = 0; t < tiles; ++t) logit += partial[t * rows + r];
    out[r] = static_cast<float>(1.0 / (1.0 + std::exp(-logit)));
  }
}

at::Tensor mlp_confidence_cpu(const at::Tensor& hidden, const at::Tensor& w1, const at::Tensor& b1,
                              const at::Tensor& w2, const at::Tensor& b2) {
  check_mlp_confidence_args(hidden, w1, b1, w2, b2);
  const int64_t rows = hidden.size(0), d = hidden.size(1), m = w1.size(0);
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kFloat));
  if (rows == 0) return out;

  const std::vector<float> b1f = to_float_vector(b1), w2f = to_float_vector(w2), b2f = to_float_vector(b2);
  // Hidden rows and classifier weights may differ in dtype: the rows are fp32 for dot_rows unless
  // both are bf16 and the CPU multiplies bf16 natively (cpu::dot_input_t).
  EECORE_DISPATCH_FLOAT(w1.scalar_type(), "eecore::mlp_confidence", [&] {
    using w_t = scalar_t;
    const w_t* w1_data = w1.const_data_ptr<w_t>();
    EECORE_DISPATCH_FLOAT(hidden.scalar_type(), "eecore::mlp_confidence", [&] {
      const cpu::DotInput<scalar_t, w_t> h(hidden.const_data_ptr<scalar_t>(), hidden.stride(0), rows, d);
      mlp_confidence_rows(h.row(0), h.ld(), rows, d, w1_data, w1.stride(0), m, b1f.data(), w2f.data(), b2f[0],
                          out.data_ptr<float>());
    });
  });
  return out;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("mlp_confidence", &eecore::mlp_confidence_cpu); }
