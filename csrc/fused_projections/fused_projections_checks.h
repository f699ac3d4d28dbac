// Argument checks of the fused projections (qkv_projection, gate_up_projection, linear_residual),
// shared by the CPU and CUDA glue. Nothing here reads tensor data.
#pragma once

#include <ATen/MemoryOverlap.h>

#include <optional>
#include <tuple>

#include "common/checks.h"
#include "linear/linear_checks.h"
#include "reshape_and_cache/reshape_and_cache_checks.h"
#include "rms_norm/rms_norm_checks.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {

// The fused kernels read one tensor while other blocks write another: they must not share memory
// (the separate ops would allow an in-place norm; one launch cannot).
inline void check_no_overlap(const char* op, const char* arg, const at::Tensor& t, const char* other_arg,
                             const at::Tensor& other) {
  const at::MemOverlapStatus status = at::get_overlap_status(t, other);
  EECORE_CHECK_ARG(op, arg, status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
                   "must not share memory with '", other_arg, "'");
}

// input [T, d] contiguous, of a float dtype; weight a dense [N, d] of input's dtype (the fused
// projections take no GGUF blocks, int8 or AMX tiles); out [T, N] (+ bias [N]). Returns N.
inline int64_t check_fused_linear(const char* op, const at::Tensor& out, const at::Tensor& input,
                                  const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_defined(op, "input", input);
  check_dim(op, "input", input, 2);
  check_float_dtype(op, "input", input);
  check_contiguous(op, "input", input);
  check_defined(op, "weight", weight);
  EECORE_CHECK_ARG(op, "weight", weight.dim() == 2, "expected a dense [N, d] weight (GGUF blocks, int8 and AMX "
                   "tiles take the separate ops), got shape ", weight.sizes());
  check_same_dtype(op, "weight", weight, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  check_contiguous(op, "weight", weight);
  check_size(op, "weight", weight, 1, input.size(1), "the features d of 'input'");
  check_defined(op, "out", out);
  check_linear_out_and_bias(op, out, input, weight.size(0), bias, "the output features N of 'weight'");
  check_no_overlap(op, "out", out, "input", input);
  return weight.size(0);
}

// normed [T, d] = rms_norm(input) * norm_weight, as rms_norm takes them.
inline void check_fused_norm(const char* op, const at::Tensor& normed, const at::Tensor& input,
                             const at::Tensor& norm_weight, double eps) {
  check_defined(op, "norm_weight", norm_weight);
  check_dim(op, "norm_weight", norm_weight, 1);
  check_size(op, "norm_weight", norm_weight, 0, input.size(1), "the features d of 'input'");
  check_same_dtype(op, "norm_weight", norm_weight, "input", input);
  check_contiguous(op, "norm_weight", norm_weight);
  check_same_device(op, "norm_weight", norm_weight, "input", input);
  check_like(op, "normed", normed, "input", input);
  check_contiguous(op, "normed", normed);
  check_no_overlap(op, "normed", normed, "input", input);
  check_eps(op, eps);
}

// qkv_projection's query, key and value: views of out [T, (Hq + 2 Hkv) D], with Hkv and D from
// k_cache [NB, BS, Hkv, D].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_views(const char* op, const at::Tensor& out,
                                                                const at::Tensor& k_cache) {
  check_defined(op, "k_cache", k_cache);
  check_dim(op, "k_cache", k_cache, 4);
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t kv_width = kv_heads * head_dim;
  EECORE_CHECK_ARG(op, "out", kv_width > 0 && out.size(1) % head_dim == 0 && out.size(1) > 2 * kv_width,
                   "expected [T, (Hq + 2 Hkv) D] with Hq >= 1 and Hkv = ", kv_heads, ", D = ", head_dim,
                   " from 'k_cache', got shape ", out.sizes());
  const int64_t q_width = out.size(1) - 2 * kv_width, tokens = out.size(0);
  return {out.narrow(1, 0, q_width).view({tokens, q_width / head_dim, head_dim}),
          out.narrow(1, q_width, kv_width).view({tokens, kv_heads, head_dim}),
          out.narrow(1, q_width + kv_width, kv_width).view({tokens, kv_heads, head_dim})};
}

// act [T, I], out [T, 2 I] of gate_up_projection.
inline void check_fused_act(const char* op, const at::Tensor& act, const at::Tensor& out) {
  check_defined(op, "act", act);
  EECORE_CHECK_ARG(op, "out", out.size(1) % 2 == 0, "expected an even number of features [T, 2 I] (gate and up), "
                   "got shape ", out.sizes());
  check_dim(op, "act", act, 2);
  check_size(op, "act", act, 0, out.size(0), "the rows T of 'out'");
  check_size(op, "act", act, 1, out.size(1) / 2, "half the features of 'out'");
  check_same_dtype(op, "act", act, "out", out);
  check_contiguous(op, "act", act);
  check_same_device(op, "act", act, "out", out);
  check_no_overlap(op, "act", act, "out", out);
  check_contiguous(op, "out", out);
}

// residual [T, N] like out.
inline void check_fused_residual(const char* op, const at::Tensor& residual, const at::Tensor& out) {
  check_like(op, "residual", residual, "out", out);
  check_last_dim_contiguous(op, "residual", residual);
  check_no_overlap(op, "residual", residual, "out", out);
}

// ---- each op's whole check ----------------------------------------------------------------------

struct QkvProjectionShape {
  at::Tensor query, key, value;  // views of out
  RotaryShape rotary;
  ReshapeAndCacheDims cache;
};

inline QkvProjectionShape check_qkv_projection_args(const at::Tensor& out, const at::Tensor& normed,
                                                    const at::Tensor& input, const at::Tensor& norm_weight,
                                                    double eps, const at::Tensor& weight,
                                                    const std::optional<at::Tensor>& bias,
                                                    const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                    const at::Tensor& slot_mapping) {
  const char* op = "qkv_projection";
  check_fused_linear(op, out, input, weight, bias);
  check_fused_norm(op, normed, input, norm_weight, eps);
  auto [query, key, value] = qkv_views(op, out, k_cache);
  const RotaryShape rotary = check_rotary_embedding_args(positions, query, key, cos_sin_cache, op);
  const ReshapeAndCacheDims cache = check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping, op);
  return {query, key, value, rotary, cache};
}

inline void check_gate_up_projection_args(const at::Tensor& act, const at::Tensor& out, const at::Tensor& normed,
                                          const at::Tensor& input, const at::Tensor& norm_weight, double eps,
                                          const at::Tensor& weight) {
  const char* op = "gate_up_projection";
  check_fused_linear(op, out, input, weight, std::nullopt);
  check_fused_norm(op, normed, input, norm_weight, eps);
  check_fused_act(op, act, out);
}

inline void check_linear_residual_args(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& input,
                                       const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_residual";
  check_fused_linear(op, out, input, weight, bias);
  check_fused_residual(op, residual, out);
}

}  // namespace eecore
