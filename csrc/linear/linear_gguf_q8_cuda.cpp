// repack_gguf_q8 and linear_gguf_q8 on CUDA: through the host (correct, not tuned; an LLM on a GPU
// dequantizes GGUF weights at load and never calls these).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "linear/linear_gguf_q8.h"

namespace eecore {
namespace {

at::Tensor repack_gguf_q8_cuda(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  check_repack_gguf_q8_args(weight, quant_type, features);
  const c10::cuda::CUDAGuard guard(weight.device());
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("eecore::repack_gguf_q8", "").typed<
      at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(weight.cpu(), quant_type, features).to(weight.device());
}

void linear_gguf_q8_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed, int64_t quant_type,
                         const std::optional<at::Tensor>& bias, bool accumulate) {
  check_linear_gguf_q8_args(out, input, packed, quant_type, bias);
  const c10::cuda::CUDAGuard guard(out.device());
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("eecore::linear_gguf_q8", "").typed<
      void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&, bool)>();
  at::Tensor host = out.cpu();
  std::optional<at::Tensor> host_bias;
  if (bias.has_value() && bias->defined()) host_bias = bias->cpu();
  op.call(host, input.cpu(), packed.cpu(), quant_type, host_bias, accumulate);
  out.copy_(host);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) {
  m.impl("repack_gguf_q8", &eecore::repack_gguf_q8_cuda);
  m.impl("linear_gguf_q8", &eecore::linear_gguf_q8_cuda);
}
