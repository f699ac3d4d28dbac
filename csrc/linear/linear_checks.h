// Argument checks of linear, shared by the CPU and CUDA glue.
#pragma once

#include "common/checks.h"

namespace eecore {

struct LinearDims {
  int64_t rows;     // M: tokens
  int64_t in;       // K: input features
  int64_t out;      // N: output features
};

inline bool is_int8_weight(const at::Tensor& weight) { return weight.scalar_type() == at::kChar; }

// A weight pre-tiled for AMX (amx_tiles.h): bf16 [N / 16, K / 32, 16, 32] (linear_amx_bf16.h) or
// weight-only int8 [N / 16, K / 64, 16, 64] (linear_amx_int8.h), the tile of output rows 16 b.. and
// input features depth * s.. at [b, s].
inline bool is_tiled_weight(const at::Tensor& weight) { return weight.dim() == 4; }

// `out` [M, N] and `bias` [N]? of a linear over `input` [M, K] (linear, linear_gguf).
inline void check_linear_out_and_bias(const char* op, const at::Tensor& out, const at::Tensor& input, int64_t n_out,
                                      const std::optional<at::Tensor>& bias, const char* out_features) {
  check_dim(op, "out", out, 2);
  check_same_dtype(op, "out", out, "input", input);
  check_same_device(op, "out", out, "input", input);
  check_size(op, "out", out, 0, input.size(0), "the rows M of 'input'");
  check_size(op, "out", out, 1, n_out, out_features);
  check_last_dim_contiguous(op, "out", out);
  if (bias.has_value() && bias->defined()) {
    check_dim(op, "bias", *bias, 1);
    check_same_dtype(op, "bias", *bias, "input", input);
    check_same_device(op, "bias", *bias, "input", input);
    check_size(op, "bias", *bias, 0, n_out, "the output features N of 'weight'");
    check_contiguous(op, "bias", *bias);
  }
}

inline LinearDims check_linear_args(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    const std::optional<at::Tensor>& weight_scale) {
  const char* op = "linear";
  check_dim(op, "input", input, 2);
  check_float_dtype(op, "input", input);
  check_last_dim_contiguous(op, "input", input);
  const bool tiled = is_tiled_weight(weight);
  if (tiled) {
    const bool int8 = is_int8_weight(weight);
    const int64_t depth = int8 ? 64 : 32;
    const char* form = int8 ? "tiled int8 [N/16, K/64, 16, 64]" : "tiled bf16 [N/16, K/32, 16, 32]";
    EECORE_CHECK_ARG(op, "weight", int8 || (weight.scalar_type() == at::kBFloat16 && input.scalar_type() == at::kBFloat16),
                     "a tiled weight is bf16 [N/16, K/32, 16, 32] against bf16 'input', or int8 [N/16, K/64, 16, 64], "
                     "got ", weight.scalar_type(), " against ", input.scalar_type());
    EECORE_CHECK_ARG(op, "input", !int8 || input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
                     "must be float32 or bfloat16 against a ", form, " weight, got ", input.scalar_type());
    check_size(op, "weight", weight, 2, 16, int8 ? "16 output rows per tile (tiled int8 [N/16, K/64, 16, 64])"
                                                   : "16 output rows per tile (tiled bf16 [N/16, K/32, 16, 32])");
    check_size(op, "weight", weight, 3, depth, int8 ? "64 input features per tile (tiled int8 [N/16, K/64, 16, 64])"
                                                    : "32 input features per tile (tiled bf16 [N/16, K/32, 16, 32])");
    EECORE_CHECK_ARG(op, "weight", weight.size(1) * depth == input.size(1), form, " with K/", depth, " = ",
                     weight.size(1), " does not match the input features K = ", input.size(1), " of 'input' [M, K]");
    EECORE_CHECK_ARG(op, "weight", !int8 || input.size(1) < 65536, form, ": at most 65,535 input features (the tile "
                     "sums' int32 range), got K = ", input.size(1));
  } else {
    check_dim(op, "weight", weight, 2);
  }
  const bool has_scale = weight_scale.has_value() && weight_scale->defined();
  if (is_int8_weight(weight)) {
    // weight-only int8: weight[j][k] stands for weight_scale[j] * weight[j][k]
    EECORE_CHECK_ARG(op, "weight_scale", has_scale,
                     "is required with an int8 'weight' (one fp32 scale per output row), got None");
    check_dim(op, "weight_scale", *weight_scale, 1);
    check_dtype(op, "weight_scale", *weight_scale, at::kFloat);
    check_same_device(op, "weight_scale", *weight_scale, "input", input);
    check_size(op, "weight_scale", *weight_scale, 0, tiled ? weight.size(0) * 16 : weight.size(0),
               "the output features N of 'weight'");
    check_contiguous(op, "weight_scale", *weight_scale);
  } else {
    EECORE_CHECK_ARG(op, "weight", weight.scalar_type() == input.scalar_type(),
                     "expected the dtype of 'input' (", input.scalar_type(), ") or int8 (with 'weight_scale'), got ",
                     weight.scalar_type());
    EECORE_CHECK_ARG(op, "weight_scale", !has_scale, "applies to an int8 'weight' only, got a ",
                     weight.scalar_type(), " weight");
  }
  check_contiguous(op, "weight", weight);
  check_same_device(op, "weight", weight, "input", input);
  if (!tiled) check_size(op, "weight", weight, 1, input.size(1), "the input features K of 'input' [M, K]");
  const int64_t n_out = tiled ? weight.size(0) * 16 : weight.size(0);
  check_linear_out_and_bias(op, out, input, n_out, bias, "the output features N of 'weight' [N, K]");
  return {input.size(0), input.size(1), n_out};
}

}  // namespace eecore
