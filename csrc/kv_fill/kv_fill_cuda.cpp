// kv_fill on CUDA: normalize (one launch), ONE GEMM over every layer's stacked K/V projection
// (at::mm, cuBLAS), and one fused epilogue launch (bias, RoPE on K, scatter into every layer >= the
// token's start layer). The host never reads slots, positions or start layers, so nothing
// synchronizes; out-of-range ones are skipped on the device (the CPU kernel raises for them).
#include <torch/library.h>

#include <optional>

#include "common/cuda_glue.h"
#include "eecore/launch/kv_fill.h"
#include "kv_fill/kv_fill_checks.h"

namespace eecore {
namespace {

void kv_fill_cuda(at::Tensor& kv_cache, const at::Tensor& hidden, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cos_sin_cache,
                  const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& start_layer,
                  double eps, bool is_neox) {
  const char* op = "kv_fill";
  const KvFillShape s =
      check_kv_fill_args(kv_cache, hidden, weight, bias, cos_sin_cache, positions, slot_mapping, start_layer, eps);
  if (s.num_tokens == 0 || s.num_layers == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const cudaStream_t stream = current_stream(kv_cache.device());
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_rope = s.rot_dim > 0;

  at::Tensor normed = at::empty({s.num_tokens, s.hidden_size}, hidden.options());
  cuda::KvFillParams p{};
  p.kv_cache = kv_cache.data_ptr();
  p.hidden = hidden.const_data_ptr();
  p.hidden_stride = hidden.stride(0);
  p.normed = normed.data_ptr();
  p.bias = has_bias ? bias->const_data_ptr() : nullptr;
  p.cos_sin_cache = has_rope ? cos_sin_cache->const_data_ptr() : nullptr;
  p.positions = positions.const_data_ptr<int64_t>();
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  p.start_layer = start_layer.const_data_ptr<int32_t>();
  p.positions_stride = positions.stride(0);
  p.slot_stride = slot_mapping.stride(0);
  p.start_layer_stride = start_layer.stride(0);
  p.num_tokens = checked_int32(op, "hidden", s.num_tokens, "tokens");
  p.hidden_size = s.hidden_size;
  p.num_layers = checked_int32(op, "kv_cache", s.num_layers, "layers");
  EECORE_CHECK_ARG(op, "kv_cache", s.num_layers <= 65535, "has ", s.num_layers, " layers; at most 65535 supported");
  p.num_blocks = checked_int32(op, "kv_cache", s.num_blocks, "blocks");
  p.block_size = checked_int32(op, "kv_cache", s.block_size, "tokens per block");
  p.num_kv_heads = checked_int32(op, "kv_cache", s.num_kv_heads, "KV heads");
  p.head_dim = checked_int32(op, "kv_cache", s.head_dim, "head dims");
  p.rot_dim = static_cast<int32_t>(s.rot_dim);
  p.max_pos = s.max_pos;
  p.eps = static_cast<float>(eps);
  p.is_neox = is_neox;
  p.dtype = to_dtype(kv_cache.scalar_type());
  p.cache_dtype = has_rope ? to_dtype(cos_sin_cache->scalar_type()) : p.dtype;

  check_launch(op, cuda::launch_kv_fill_normalize(p, stream));
  // The one GEMM: [T, d] x [L * 2 * Hkv * D, d]^T, every layer at once, on the current stream.
  const at::Tensor projected = at::mm(normed, weight.view({s.num_layers * 2 * s.kv_width(), s.hidden_size}).t());
  p.projected = projected.const_data_ptr();
  check_launch(op, cuda::launch_kv_fill_epilogue(p, stream));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("kv_fill", &eecore::kv_fill_cuda); }
