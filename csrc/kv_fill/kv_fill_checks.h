// Argument checks of kv_fill, shared by the CPU and CUDA glue. Nothing here reads tensor data:
// the slots, positions and start layers are range-checked by the CPU kernel (kv_fill_cpu.cpp)
// and guarded on the device by the CUDA kernel.
#pragma once

#include <optional>

#include "common/checks.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {

struct KvFillShape {
  int64_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  int64_t num_tokens, hidden_size;
  int64_t rot_dim;  // 0 when no RoPE is applied (cos_sin_cache is None)
  int64_t max_pos;  // rows of cos_sin_cache, 0 without it

  int64_t kv_width() const { return num_kv_heads * head_dim; }      // Hkv * D: one of K or V
  int64_t num_slots() const { return num_blocks * block_size; }     // slots per layer
};

inline KvFillShape check_kv_fill_args(const at::Tensor& kv_cache, const at::Tensor& hidden, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& cos_sin_cache, const at::Tensor& positions,
                                      const at::Tensor& slot_mapping, const at::Tensor& start_layer, double eps) {
  const char* op = "kv_fill";
  check_dim(op, "kv_cache", kv_cache, 6);
  check_float_dtype(op, "kv_cache", kv_cache);
  check_contiguous(op, "kv_cache", kv_cache);
  check_size(op, "kv_cache", kv_cache, 1, 2, "K and V, as in [L, 2, NB, BS, Hkv, D]");
  KvFillShape s{};
  s.num_layers = kv_cache.size(0);
  s.num_blocks = kv_cache.size(2);
  s.block_size = kv_cache.size(3);
  s.num_kv_heads = kv_cache.size(4);
  s.head_dim = kv_cache.size(5);

  check_dim(op, "hidden", hidden, 2);
  check_same_dtype(op, "hidden", hidden, "kv_cache", kv_cache);
  check_last_dim_contiguous(op, "hidden", hidden);
  check_same_device(op, "hidden", hidden, "kv_cache", kv_cache);
  s.num_tokens = hidden.size(0);
  s.hidden_size = hidden.size(1);
  EECORE_CHECK_ARG(op, "hidden", s.hidden_size > 0, "expected a non-empty hidden size d, got shape ", hidden.sizes());

  check_dim(op, "weight", weight, 3);
  check_same_dtype(op, "weight", weight, "kv_cache", kv_cache);
  check_size(op, "weight", weight, 0, s.num_layers, "the layers L of 'kv_cache'");
  check_size(op, "weight", weight, 1, 2 * s.kv_width(), "2 * Hkv * D: the K then the V projection rows");
  check_size(op, "weight", weight, 2, s.hidden_size, "the hidden size d of 'hidden'");
  check_contiguous(op, "weight", weight);
  check_same_device(op, "weight", weight, "kv_cache", kv_cache);

  if (bias.has_value() && bias->defined()) {
    check_dim(op, "bias", *bias, 2);
    check_same_dtype(op, "bias", *bias, "kv_cache", kv_cache);
    check_size(op, "bias", *bias, 0, s.num_layers, "the layers L of 'kv_cache'");
    check_size(op, "bias", *bias, 1, 2 * s.kv_width(), "2 * Hkv * D");
    check_contiguous(op, "bias", *bias);
    check_same_device(op, "bias", *bias, "kv_cache", kv_cache);
  }

  if (cos_sin_cache.has_value() && cos_sin_cache->defined()) {
    s.rot_dim = check_cos_sin_cache(op, *cos_sin_cache, s.head_dim, "kv_cache", kv_cache);
    s.max_pos = cos_sin_cache->size(0);
  }
  check_positions(op, positions, s.num_tokens, "hidden", hidden);

  check_dim(op, "slot_mapping", slot_mapping, 1);
  check_dtype(op, "slot_mapping", slot_mapping, at::kLong);
  check_size(op, "slot_mapping", slot_mapping, 0, s.num_tokens, "the number of tokens T");
  check_same_device(op, "slot_mapping", slot_mapping, "hidden", hidden);

  check_dim(op, "start_layer", start_layer, 1);
  check_dtype(op, "start_layer", start_layer, at::kInt);
  check_size(op, "start_layer", start_layer, 0, s.num_tokens, "the number of tokens T");
  check_same_device(op, "start_layer", start_layer, "hidden", hidden);

  EECORE_CHECK_ARG(op, "eps", eps >= 0.0, "expected eps >= 0, got ", eps);
  return s;
}

}  // namespace eecore
