// linear_gguf and dequantize_gguf on CUDA: the weight dequantized on the host for one cuBLAS GEMM
// (correct, not tuned; a quantized GGUF runs dequantized on a GPU, at load).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "linear/linear_gemm.h"
#include "linear/linear_gguf.h"

namespace eecore {
namespace {

void linear_gguf_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t quant_type,
                      const std::optional<at::Tensor>& bias, bool accumulate) {
  const GgufDims dims = check_linear_gguf_args(out, input, weight, quant_type, bias);
  if (dims.rows == 0 || dims.out == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor dense = dequantize_weight(weight.cpu(), quant_type, dims.in, at::kFloat)
                               .to(input.device(), input.scalar_type());
  linear_with_gemm(out, input, dense, bias, accumulate, std::nullopt);
}

at::Tensor dequantize_gguf_cuda(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  check_dequantize_gguf_args(weight, quant_type, features);
  return dequantize_weight(weight.cpu(), quant_type, features, at::kFloat).to(weight.device());
}

void embedding_gguf_cuda(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, int64_t quant_type) {
  const int64_t K = check_embedding_gguf_args(out, token_ids, weight, quant_type);
  if (token_ids.size(0) == 0 || K == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor ids = token_ids.cpu();
  check_token_ids_in_range(ids, weight.size(0));
  const at::Tensor rows = weight.index_select(0, ids.to(weight.device())).cpu();
  out.copy_(dequantize_weight(rows, quant_type, K, at::kFloat));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) {
  m.impl("linear_gguf", &eecore::linear_gguf_cuda);
  m.impl("dequantize_gguf", &eecore::dequantize_gguf_cuda);
  m.impl("embedding_gguf", &eecore::embedding_gguf_cuda);
}
