// The fused projections as the ops they fuse, through the dispatcher: the CPU implementation (on a
// CPU a launch costs nothing to save) and the CUDA one's wherever its kernel does not apply (more
// than 8 rows, fp32, shapes it does not tile, batch-invariant mode).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "fused_projections/fused_projections_checks.h"

namespace eecore {

template <typename Signature>
auto eecore_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline void compose_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  static const auto op = eecore_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, bool, const std::optional<at::Tensor>&)>(
      "eecore::linear");
  op.call(out, input, weight, bias, false, std::nullopt);
}

inline void compose_rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  static const auto op =
      eecore_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("eecore::rms_norm");
  op.call(out, input, weight, eps);
}

inline void compose_qkv_projection(at::Tensor& out, at::Tensor& normed, const at::Tensor& input,
                                   const at::Tensor& norm_weight, double eps, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const at::Tensor& positions,
                                   const at::Tensor& cos_sin_cache, bool is_neox, at::Tensor& k_cache,
                                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  static const auto rotary_and_cache =
      eecore_op<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                     at::Tensor&, at::Tensor&, const at::Tensor&)>("eecore::rotary_embedding_and_cache");
  compose_rms_norm(normed, input, norm_weight, eps);
  compose_linear(out, normed, weight, bias);
  auto [query, key, value] = qkv_views("qkv_projection", out, k_cache);
  rotary_and_cache.call(positions, query, key, value, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping);
}

inline void compose_gate_up_projection(at::Tensor& act, at::Tensor& out, at::Tensor& normed, const at::Tensor& input,
                                       const at::Tensor& norm_weight, double eps, const at::Tensor& weight) {
  static const auto silu_and_mul = eecore_op<void(at::Tensor&, const at::Tensor&)>("eecore::silu_and_mul");
  compose_rms_norm(normed, input, norm_weight, eps);
  compose_linear(out, normed, weight, std::nullopt);
  silu_and_mul.call(act, out);
}

inline void compose_linear_residual(at::Tensor& out, at::Tensor& residual, const at::Tensor& input,
                                    const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  compose_linear(out, input, weight, bias);
  residual.add_(out);  // rounded once to the dtype, as fused_add_rms_norm's add
}

}  // namespace eecore
