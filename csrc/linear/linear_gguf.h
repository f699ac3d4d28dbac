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

// The block format of `quant_type`, once it is a type the kernels compute.
inline const gguf::BlockFormat& check_quant_type(const char* op, int64_t quant_type) {
  const gguf::BlockFormat* format = gguf::find_format(quant_type);
  EECORE_CHECK_ARG(op, "quant_type", format != nullptr, "must be a GGUF block type these kernels compute, one of ",
                   gguf::format_list(), "; got ", quant_type);
  return *format;
}

// `K` (of argument `arg`) holds whole blocks of `format`.
inline void check_whole_blocks(const char* op, const char* arg, int64_t K, const gguf::BlockFormat& format) {
  EECORE_CHECK_ARG(op, arg, K >= 0 && K % format.weights == 0, "must have a multiple of ", format.weights,
                   " features (whole ", format.name, " blocks), got ", K);
}

// `weight`: uint8 [N, K / W * block bytes], contiguous, rows of whole blocks of `format`.
inline void check_block_weight(const char* op, const at::Tensor& weight, int64_t K, const gguf::BlockFormat& format) {
  check_dim(op, "weight", weight, 2);
  check_dtype(op, "weight", weight, at::kByte);
  check_contiguous(op, "weight", weight);
  check_size(op, "weight", weight, 1, K / format.weights * format.bytes, "the bytes of one row of whole blocks");
}

inline GgufDims check_linear_gguf_args(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                       int64_t quant_type, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_gguf";
  const gguf::BlockFormat& format = check_quant_type(op, quant_type);
  check_dim(op, "input", input, 2);
  check_float_dtype(op, "input", input);
  check_last_dim_contiguous(op, "input", input);
  const int64_t K = input.size(1);
  check_whole_blocks(op, "input", K, format);
  check_block_weight(op, weight, K, format);
  check_same_device(op, "weight", weight, "input", input);
  const int64_t N = weight.size(0);
  check_linear_out_and_bias(op, out, input, N, bias, "the output features N of 'weight' [N, row bytes]");
  return {input.size(0), K, N, weight.size(1)};
}

inline void check_dequantize_gguf_args(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  const char* op = "dequantize_gguf";
  const gguf::BlockFormat& format = check_quant_type(op, quant_type);
  check_whole_blocks(op, "features", features, format);
  check_block_weight(op, weight, features, format);
}

// embedding_gguf's arguments; the token ids are range-checked where they are read.
inline int64_t check_embedding_gguf_args(const at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight,
                                         int64_t quant_type) {
  const char* op = "embedding_gguf";
  const gguf::BlockFormat& format = check_quant_type(op, quant_type);
  check_dim(op, "out", out, 2);
  check_float_dtype(op, "out", out);
  check_last_dim_contiguous(op, "out", out);
  const int64_t K = out.size(1);
  check_whole_blocks(op, "out", K, format);
  check_dim(op, "token_ids", token_ids, 1);
  check_dtype(op, "token_ids", token_ids, at::kLong);
  check_contiguous(op, "token_ids", token_ids);
  check_same_device(op, "token_ids", token_ids, "out", out);
  check_size(op, "out", out, 0, token_ids.size(0), "the number of token ids");
  check_block_weight(op, weight, K, format);
  check_same_device(op, "weight", weight, "out", out);
  return K;
}

// Every id of a CPU `token_ids` within [0, rows).
inline void check_token_ids_in_range(const at::Tensor& token_ids, int64_t rows) {
  const int64_t* ids = token_ids.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < token_ids.size(0); ++t)
    EECORE_CHECK_ARG("embedding_gguf", "token_ids", ids[t] >= 0 && ids[t] < rows, "must be in [0, ", rows,
                     ") (the rows of 'weight'), got ", ids[t], " at index ", t);
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
