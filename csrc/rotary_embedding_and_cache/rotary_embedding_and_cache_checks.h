// Argument checks of rotary_embedding_and_cache: those of its two halves, under its own name.
#pragma once

#include <utility>

#include "reshape_and_cache/reshape_and_cache_checks.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {

inline std::pair<RotaryShape, ReshapeAndCacheDims> check_rotary_embedding_and_cache_args(
    const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cos_sin_cache, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping) {
  const char* op = "rotary_embedding_and_cache";
  const RotaryShape rotary = check_rotary_embedding_args(positions, query, key, cos_sin_cache, op);
  const ReshapeAndCacheDims cache = check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping, op);
  return {rotary, cache};
}

}  // namespace eecore
