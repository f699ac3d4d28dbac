// linear on the CPU. Decode-sized inputs (a few rows) stream the weight once through the shared
// "few rows x many weight rows" dot kernel, in parallel over weight-row tiles, with the bias and
// the residual accumulation fused into the store; larger inputs are a GEMM, where BLAS is good.
//
// Why a kernel of our own for few rows: a decode step of a small model is a chain of
// matrix-vector-like products bound by reading the weights, and BLAS small-M paths on many CPUs
// stay well below the memory bandwidth (and widen 16-bit weights through a copy).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/cpu_dots.h"
#include "linear/linear_checks.h"
#include "linear/linear_gemm.h"

namespace eecore {
namespace {

// Up to this many rows the weight-streaming kernel beats a GEMM (measured on AVX2 machines,
// bench/test_bench_linear.py): it keeps every hidden row in registers/L1 per weight slice.
constexpr int64_t kStreamingMaxRows = 16;
// Output columns per parallel task, and the multiply-adds below which one thread does it all.
constexpr int64_t kTileCols = 64;
constexpr int64_t kMinMacsPerThread = 1 << 18;

template <typename scalar_t>
void linear_streaming(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, const scalar_t* bias,
                      bool accumulate, const LinearDims& dims) {
  const int64_t M = dims.rows, K = dims.in, N = dims.out;
  const cpu::DotInput<scalar_t, scalar_t> h(input.const_data_ptr<scalar_t>(), input.stride(0), M, K);
  const scalar_t* w = weight.const_data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t ldo = out.stride(0);
  const int64_t tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, M * K * kTileCols));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float acc[kStreamingMaxRows * kTileCols];  // on the stack: no allocation per call
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * kTileCols, nj = std::min(kTileCols, N - j0);
      cpu::dot_rows(h.row(0), h.ld(), M, w + j0 * K, K, nj, K, acc, kTileCols);
      for (int64_t i = 0; i < M; ++i) {
        scalar_t* dst = o + i * ldo + j0;
        const float* src = acc + i * kTileCols;
        for (int64_t j = 0; j < nj; ++j) {
          float v = src[j];
          if (bias != nullptr) v += static_cast<float>(bias[j0 + j]);
          if (accumulate) v += static_cast<float>(dst[j]);
          dst[j] = static_cast<scalar_t>(v);
        }
      }
    }
  });
}

void linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, bool accumulate) {
  const LinearDims dims = check_linear_args(out, input, weight, bias);
  if (dims.rows == 0 || dims.out == 0) return;
  if (dims.rows > kStreamingMaxRows || dims.in == 0) return linear_with_gemm(out, input, weight, bias, accumulate);
  const bool has_bias = bias.has_value() && bias->defined();
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::linear", [&] {
    linear_streaming<scalar_t>(out, input, weight, has_bias ? bias->const_data_ptr<scalar_t>() : nullptr,
                               accumulate, dims);
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("linear", &eecore::linear_cpu); }
