// Argument checks and whole-weight dequantization of linear_gguf / dequantize_gguf, shared by the
// CPU and CUDA glue.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/checks.h"
#include "linear/gguf_blocks.h"
#include "linear/linear_checks.h"

namespace eecore {

struct GgufDims {
  int64_t rows, in, out, row_bytes;
};

// The block bytes of `quant_type`, once it is a type the kernels compute.
inline int64_t check_quant_type(const char* op, int64_t quant_type) {
  const int64_t bytes = gguf::block_bytes(quant_type);
  EECORE_CHECK_ARG(op, "quant_type", bytes > 0, "must be a GGUF block type these kernels compute: 2 (Q4_0), "
                   "3 (Q4_1) or 8 (Q8_0), got ", quant_type);
  return bytes;
}

inline GgufDims check_linear_gguf_args(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                       int64_t quant_type, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_gguf";
  const int64_t bytes = check_quant_type(op, quant_type);
  check_dim(op, "input", input, 2);
  check_float_dtype(op, "input", input);
  check_last_dim_contiguous(op, "input", input);
  const int64_t K = input.size(1);
  EECORE_CHECK_ARG(op, "input", K % gguf::kBlockWeights == 0, "must have a multiple of 32 features (whole ",
                   gguf::type_name(quant_type), " blocks), got K = ", K);
  check_dim(op, "weight", weight, 2);
  check_dtype(op, "weight", weight, at::kByte);
  check_contiguous(op, "weight", weight);
  check_same_device(op, "weight", weight, "input", input);
  const int64_t row_bytes = K / gguf::kBlockWeights * bytes;
  check_size(op, "weight", weight, 1, row_bytes, "the bytes of one row of K / 32 blocks");
  const int64_t N = weight.size(0);
  check_linear_out_and_bias(op, out, input, N, bias, "the output features N of 'weight' [N, row bytes]");
  return {input.size(0), K, N, row_bytes};
}

inline void check_dequantize_gguf_args(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  const char* op = "dequantize_gguf";
  const int64_t bytes = check_quant_type(op, quant_type);
  EECORE_CHECK_ARG(op, "features", features >= 0 && features % gguf::kBlockWeights == 0,
                   "must be a multiple of 32 (whole blocks), got ", features);
  check_dim(op, "weight", weight, 2);
  check_dtype(op, "weight", weight, at::kByte);
  check_contiguous(op, "weight", weight);
  check_size(op, "weight", weight, 1, features / gguf::kBlockWeights * bytes,
             "the bytes of one row of features / 32 blocks");
}

// The whole weight (a CPU tensor) dequantized [N, K] in `dtype`.
inline at::Tensor dequantize_weight(const at::Tensor& weight, int64_t quant_type, int64_t K, at::ScalarType dtype) {
  const int64_t N = weight.size(0), row_bytes = weight.size(1);
  at::Tensor dense = at::empty({N, K}, weight.options().dtype(at::kFloat));
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  float* d = dense.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) gguf::dequantize_row(quant_type, w + j * row_bytes, K, d + j * K);
  });
  return dtype == at::kFloat ? dense : dense.to(dtype);
}

}  // namespace eecore
