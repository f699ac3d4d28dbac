// rotary_embedding_and_cache on the CPU: the two ops it fuses, one after the other (on a CPU the
// rotated keys are still in cache when the copy reads them; a launch costs nothing to save).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "rotary_embedding_and_cache/rotary_embedding_and_cache_checks.h"

namespace eecore {
namespace {

void rotary_embedding_and_cache_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                    const at::Tensor& value, const at::Tensor& cos_sin_cache, bool is_neox,
                                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "rotary_embedding_and_cache";
  const auto [rotary_shape, dims] =
      check_rotary_embedding_and_cache_args(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping);
  // the data checks of both halves before either writes: a bad call changes nothing
  check_positions_in_range(op, positions, rotary_shape.max_pos);
  check_slots_in_range(op, slot_mapping, dims.num_slots);
  static const auto rotary =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eecore::rotary_embedding", "")
          .typed<void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, bool)>();
  static const auto cache =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eecore::reshape_and_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>();
  rotary.call(positions, query, key, cos_sin_cache, is_neox);
  cache.call(key, value, k_cache, v_cache, slot_mapping);
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("rotary_embedding_and_cache", &eecore::rotary_embedding_and_cache_cpu); }
