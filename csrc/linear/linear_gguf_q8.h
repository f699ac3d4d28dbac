// Argument checks of repack_gguf_q8 / linear_gguf_q8, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/ATen.h>

#include "common/checks.h"
#include "linear/gguf_q8.h"
#include "linear/linear_checks.h"
#include "linear/linear_gguf.h"

namespace eecore {

inline void check_q8_type(const char* op, int64_t quant_type) {
  EECORE_CHECK_ARG(op, "quant_type", gguf::q8::packable(quant_type),
                   "must be 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K) or "
                   "14 (Q6_K) for 8-bit activations, got ", quant_type);
}

inline void check_repack_gguf_q8_args(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  const char* op = "repack_gguf_q8";
  check_q8_type(op, quant_type);
  const gguf::BlockFormat& format = *gguf::find_format(quant_type);
  check_whole_blocks(op, "features", features, format);
  check_block_weight(op, weight, features, format);
}

// The output features N (out's columns); `packed` [G, units, unit bytes] covers ceil(N / 16) groups.
inline int64_t check_linear_gguf_q8_args(const at::Tensor& out, const at::Tensor& input, const at::Tensor& packed,
                                         int64_t quant_type, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_gguf_q8";
  check_q8_type(op, quant_type);
  check_dim(op, "input", input, 2);
  check_float_dtype(op, "input", input);
  check_last_dim_contiguous(op, "input", input);
  const int64_t K = input.size(1);
  check_whole_blocks(op, "input", K, *gguf::find_format(quant_type));
  check_dim(op, "packed", packed, 3);
  check_dtype(op, "packed", packed, at::kByte);
  check_contiguous(op, "packed", packed);
  check_same_device(op, "packed", packed, "input", input);
  check_size(op, "packed", packed, 1, gguf::q8::units(quant_type, K),
             "K / 32 blocks (K / 256 for a K format: repack_gguf_q8 of a weight with K features)");
  check_size(op, "packed", packed, 2, gguf::q8::unit_bytes(quant_type), "the unit bytes of quant_type");
  check_dim(op, "out", out, 2);
  const int64_t N = out.size(1);
  EECORE_CHECK_ARG(op, "out", (N + gguf::q8::kRows - 1) / gguf::q8::kRows == packed.size(0),
                   "must have the output features of 'packed' (", packed.size(0), " groups of 16 rows), got ", N);
  check_linear_out_and_bias(op, out, input, N, bias, "the output features N");
  return N;
}

}  // namespace eecore
