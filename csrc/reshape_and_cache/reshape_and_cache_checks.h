// Argument checks of reshape_and_cache that need no tensor data, shared by the CPU and CUDA glue.
// The slot range check reads slot_mapping, so it runs in the kernels (the CPU one raises; the
// CUDA one skips out-of-range slots on the device).
#pragma once

#include "common/checks.h"

namespace eecore {

struct ReshapeAndCacheDims {
  int64_t num_tokens;    // T
  int64_t num_kv_heads;  // Hkv
  int64_t head_dim;      // D
  int64_t num_slots;     // NB * BS
};

inline ReshapeAndCacheDims check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                        const at::Tensor& slot_mapping,
                                                        const char* op = "reshape_and_cache") {
  // k_cache, v_cache [NB, BS, Hkv, D]: views kv_cache[l, 0] / kv_cache[l, 1], contiguous.
  check_dim(op, "k_cache", k_cache, 4);
  check_float_dtype(op, "k_cache", k_cache);
  check_contiguous(op, "k_cache", k_cache);
  check_dim(op, "v_cache", v_cache, 4);
  check_like(op, "v_cache", v_cache, "k_cache", k_cache);
  check_contiguous(op, "v_cache", v_cache);

  // key, value [T, Hkv, D] in the cache dtype; tokens and heads may be strided (slices of a fused
  // QKV output), the head dim may not.
  for (const auto& [arg, t] : {std::pair<const char*, const at::Tensor&>{"key", key}, {"value", value}}) {
    check_dim(op, arg, t, 3);
    check_same_dtype(op, arg, t, "k_cache", k_cache);
    check_size(op, arg, t, 1, k_cache.size(2), "the KV heads of 'k_cache'");
    check_size(op, arg, t, 2, k_cache.size(3), "the head dim of 'k_cache'");
    check_last_dim_contiguous(op, arg, t);
    check_same_device(op, arg, t, "k_cache", k_cache);
  }
  check_size(op, "value", value, 0, key.size(0), "the tokens of 'key'");

  check_dim(op, "slot_mapping", slot_mapping, 1);
  check_dtype(op, "slot_mapping", slot_mapping, at::kLong);
  check_size(op, "slot_mapping", slot_mapping, 0, key.size(0), "the tokens of 'key'");
  check_same_device(op, "slot_mapping", slot_mapping, "k_cache", k_cache);

  return {key.size(0), k_cache.size(2), k_cache.size(3), k_cache.size(0) * k_cache.size(1)};
}

// Reads the data (host memory only): every slot is -1 (skip) or a slot of the cache. Run before
// anything is written, so a bad slot_mapping leaves the caches untouched.
inline void check_slots_in_range(const char* op, const at::Tensor& slot_mapping, int64_t num_slots) {
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t stride = slot_mapping.stride(0);
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    const int64_t s = slots[t * stride];
    EECORE_CHECK_ARG(op, "slot_mapping", s >= -1 && s < num_slots, "entry ", t, " is ", s,
                     ", expected -1 (skip) or a slot in [0, ", num_slots, ")");
  }
}

}  // namespace eecore
