// The fused projections on the CPU: the ops they fuse, one after the other
// (fused_projections_compose.h), after every check of the whole call, so a bad call changes nothing.
#include <torch/library.h>

#include "fused_projections/fused_projections_compose.h"

namespace eecore {
namespace {

void qkv_projection_cpu(at::Tensor& out, at::Tensor& normed, const at::Tensor& input, const at::Tensor& norm_weight,
                        double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool is_neox,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "qkv_projection";
  const QkvProjectionShape shape = check_qkv_projection_args(out, normed, input, norm_weight, eps, weight, bias,
                                                             positions, cos_sin_cache, k_cache, v_cache,
                                                             slot_mapping);
  check_positions_in_range(op, positions, shape.rotary.max_pos);
  check_slots_in_range(op, slot_mapping, shape.cache.num_slots);
  compose_qkv_projection(out, normed, input, norm_weight, eps, weight, bias, positions, cos_sin_cache, is_neox,
                         k_cache, v_cache, slot_mapping);
}

void gate_up_projection_cpu(at::Tensor& act, at::Tensor& out, at::Tensor& normed, const at::Tensor& input,
                            const at::Tensor& norm_weight, double eps, const at::Tensor& weight) {
  check_gate_up_projection_args(act, out, normed, input, norm_weight, eps, weight);
  compose_gate_up_projection(act, out, normed, input, norm_weight, eps, weight);
}

void linear_residual_cpu(at::Tensor& out, at::Tensor& residual, const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_linear_residual_args(out, residual, input, weight, bias);
  compose_linear_residual(out, residual, input, weight, bias);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) {
  m.impl("qkv_projection", &eecore::qkv_projection_cpu);
  m.impl("gate_up_projection", &eecore::gate_up_projection_cpu);
  m.impl("linear_residual", &eecore::linear_residual_cpu);
}
