// The fused projections on CUDA: one launch each (fused_projections_kernels.cu) for 1-8 rows of a
// bf16 or fp16 layer that the kernels tile; the separate ops otherwise (fused_projections_compose.h),
// and always in batch-invariant mode, where a row's bits must not depend on whether its step had
// more than 8 rows (the kernels keep linear's gemv_mma bits, the separate ops under that mode use
// cuBLAS).
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/batch_invariant.h"
#include "eecore/launch/fused_projections.h"
#include "fused_projections/fused_projections_compose.h"
#include "reshape_and_cache/reshape_and_cache_params.h"
#include "rotary_embedding/rotary_embedding_params.h"

namespace eecore {
namespace {

cuda::LinearGemvParams fused_linear_params(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias) {
  cuda::LinearGemvParams p{};
  p.out = out.data_ptr();
  p.input = input.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.bias = bias.has_value() && bias->defined() ? bias->const_data_ptr() : nullptr;
  p.rows = input.size(0);
  p.in_features = input.size(1);
  p.out_features = weight.size(0);
  p.input_stride = input.stride(0);
  p.out_stride = out.stride(0);
  p.accumulate = false;
  p.dtype = to_dtype(input.scalar_type());
  return p;
}

cuda::FusedNormParams fused_norm_params(at::Tensor& normed, const at::Tensor& norm_weight, double eps) {
  cuda::FusedNormParams p{};
  p.weight = norm_weight.const_data_ptr();
  p.eps = static_cast<float>(eps);
  p.normed = normed.data_ptr();
  p.normed_stride = normed.stride(0);
  return p;
}

// Empty inputs and batch-invariant mode take the separate ops.
bool fused_kernels_apply(const at::Tensor& input) { return input.size(0) > 0 && !batch_invariant_enabled(); }

void qkv_projection_cuda(at::Tensor& out, at::Tensor& normed, const at::Tensor& input, const at::Tensor& norm_weight,
                         double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool is_neox,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "qkv_projection";
  QkvProjectionShape shape = check_qkv_projection_args(out, normed, input, norm_weight, eps, weight, bias, positions,
                                                       cos_sin_cache, k_cache, v_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(input.device());
  if (fused_kernels_apply(input)) {
    cuda::QkvProjectionParams p{};
    p.linear = fused_linear_params(out, input, weight, bias);
    p.norm = fused_norm_params(normed, norm_weight, eps);
    p.rot = rotary_embedding_params(op, shape.rotary, positions, shape.query, shape.key, cos_sin_cache, is_neox);
    p.cache = reshape_and_cache_params(op, shape.cache, shape.key, shape.value, k_cache, v_cache, slot_mapping);
    if (cuda::qkv_projection_supported(p)) {
      check_launch(op, cuda::launch_qkv_projection(p, current_stream(input.device())));
      return;
    }
  }
  compose_qkv_projection(out, normed, input, norm_weight, eps, weight, bias, positions, cos_sin_cache, is_neox,
                         k_cache, v_cache, slot_mapping);
}

void gate_up_projection_cuda(at::Tensor& act, at::Tensor& out, at::Tensor& normed, const at::Tensor& input,
                             const at::Tensor& norm_weight, double eps, const at::Tensor& weight) {
  const char* op = "gate_up_projection";
  check_gate_up_projection_args(act, out, normed, input, norm_weight, eps, weight);
  const c10::cuda::CUDAGuard guard(input.device());
  if (fused_kernels_apply(input)) {
    cuda::GateUpProjectionParams p{};
    p.linear = fused_linear_params(out, input, weight, std::nullopt);
    p.norm = fused_norm_params(normed, norm_weight, eps);
    p.act = act.data_ptr();
    p.act_stride = act.stride(0);
    if (cuda::gate_up_projection_supported(p)) {
      check_launch(op, cuda::launch_gate_up_projection(p, current_stream(input.device())));
      return;
    }
  }
  compose_gate_up_projection(act, out, normed, input, norm_weight, eps, weight);
}

void linear_residual_cuda(at::Tensor& out, at::Tensor& residual, const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  const char* op = "linear_residual";
  check_linear_residual_args(out, residual, input, weight, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  if (fused_kernels_apply(input)) {
    cuda::LinearResidualParams p{};
    p.linear = fused_linear_params(out, input, weight, bias);
    p.residual = residual.data_ptr();
    p.residual_stride = residual.stride(0);
    if (cuda::linear_residual_supported(p)) {
      check_launch(op, cuda::launch_linear_residual(p, current_stream(input.device())));
      return;
    }
  }
  compose_linear_residual(out, residual, input, weight, bias);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) {
  m.impl("qkv_projection", &eecore::qkv_projection_cuda);
  m.impl("gate_up_projection", &eecore::gate_up_projection_cuda);
  m.impl("linear_residual", &eecore::linear_residual_cuda);
}
