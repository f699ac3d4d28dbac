// Weight-only int8 linear at prompt sizes on CPUs with AMX-INT8: the same integers as the
// streaming kernel (each input row rounded to int16 with a scale of its own, eecore/int8_linear.h),
// multiplied by int8 x int8 GEMMs (at::_int_mm, which oneDNN runs on AMX tiles).
//
// Why: a prompt through weight-only int8 layers (the draft copy's catch-up on a prompt, or an int8
// model's prefill) is arithmetic-bound, and the streaming kernel's vpdpwssd does 32 products an
// instruction where an AMX tile multiply does 1,024. On an Intel Xeon with AMX (2 threads) the
// catch-up of 8 prompts (752 rows) through the draft copy's 8 layers took 193 ms as int8 blocks
// and 119 ms with fp32 weights (bench/linear_rows.py).
//
// How: an int16 q splits exactly into a high byte h = floor(q / 256) in [-128, 127] and a low byte
// q - 256 h in [0, 255], sent as l = (q - 256 h) - 128 to fit int8. Then
//     sum_k q[k] w[k] = 256 sum_k h[k] w[k] + sum_k l[k] w[k] + 128 sum_k w[k],
// two int32 GEMMs and the weight rows' sums, each exact (|h w|, |l w| <= 16,384, so no int32 sum
// wraps below 131,072 input features), combined in int64 and rounded to fp32 once. The streaming
// kernel sums its int32 lanes in fp32 instead, so the two paths can differ in the last bits, as the
// float weights' GEMM path differs from their streaming path; each row's result depends on that
// row alone either way.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common/cpu_dots.h"
#include "eecore/int8_linear.h"
#include "linear/linear_checks.h"

namespace eecore {

#if defined(__AMX_INT8__)
constexpr bool kInt8SplitGemm = true;
#else
constexpr bool kInt8SplitGemm = false;
#endif

template <typename scalar_t>
void linear_int8_split_gemm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& weight_scale, const scalar_t* bias, bool accumulate,
                            const LinearDims& dims) {
  const int64_t M = dims.rows, K = dims.in, N = dims.out;
  const at::TensorOptions bytes = input.options().dtype(at::kChar);
  at::Tensor high = at::empty({M, K}, bytes), low = at::empty({M, K}, bytes);
  std::vector<float> row_scale(M);
  const int32_t range = int16_row_range(K);
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  const int64_t ldx = input.stride(0);
  int8_t* hi = high.data_ptr<int8_t>();
  int8_t* lo = low.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int16_t> q(K);
    for (int64_t r = r0; r < r1; ++r) {
      row_scale[r] = cpu::round_row_to_int16(x + r * ldx, K, range, q.data());
      for (int64_t k = 0; k < K; ++k) {
        const int32_t v = q[k];
        hi[r * K + k] = static_cast<int8_t>(v >> 8);            // floor(v / 256)
        lo[r * K + k] = static_cast<int8_t>((v & 0xFF) - 128);  // v - 256 floor(v / 256) - 128
      }
    }
  });

  const int8_t* w = weight.const_data_ptr<int8_t>();
  std::vector<int32_t> w_sum(N);  // what the -128 shift of the low bytes takes away
  at::parallel_for(0, N, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += w[j * K + k];
      w_sum[j] = s;
    }
  });

  const at::Tensor w_t = weight.t();
  const at::Tensor by_high = at::_int_mm(high, w_t), by_low = at::_int_mm(low, w_t);  // int32 [M, N]
  const int32_t* a = by_high.const_data_ptr<int32_t>();
  const int32_t* b = by_low.const_data_ptr<int32_t>();
  const float* scale = weight_scale.const_data_ptr<float>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      scalar_t* dst = o + i * ldo;
      for (int64_t j = 0; j < N; ++j) {
        const int64_t total = 256 * static_cast<int64_t>(a[i * N + j]) + b[i * N + j] + 128 * static_cast<int64_t>(w_sum[j]);
        // the streaming kernel's epilogue, in its order
        float v = static_cast<float>(total) * row_scale[i] * scale[j];
        if (bias != nullptr) v += static_cast<float>(bias[j]);
        if (accumulate) v += static_cast<float>(dst[j]);
        dst[j] = static_cast<scalar_t>(v);
      }
    }
  });
}

}  // namespace eecore
