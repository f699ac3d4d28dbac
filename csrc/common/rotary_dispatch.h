// Host-side dispatch of the two run-time choices every RoPE kernel compiles out: the layout
// (is_neox) and the element type of the cos_sin_cache (fp32, or the activation dtype), so each
// (layout, cache dtype) pair gets its own inlined inner loop. Shared by rotary_embedding and
// kv_fill; the math itself is in eecore/rotary.h.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

namespace eecore {

// Calls fn(neox, cache): neox is std::true_type (NeoX / Llama halves) or std::false_type (GPT-J
// pairs), cache is the cos_sin_cache's data as `const float*` (an fp32 cache) or
// `const scalar_t*` (a cache in the activation dtype). A null cos_sin_cache (no RoPE to apply)
// passes a null `const float*`. The caller has checked the cache's dtype is one of the two.
template <typename scalar_t, typename Fn>
void dispatch_rotary(const at::Tensor* cos_sin_cache, bool is_neox, Fn&& fn) {
  auto with_layout = [&](auto neox) {
    if (cos_sin_cache == nullptr)
      fn(neox, static_cast<const float*>(nullptr));
    else if (cos_sin_cache->scalar_type() == at::kFloat)
      fn(neox, cos_sin_cache->const_data_ptr<float>());
    else
      fn(neox, cos_sin_cache->const_data_ptr<scalar_t>());
  };
  if (is_neox)
    with_layout(std::true_type{});
  else
    with_layout(std::false_type{});
}

}  // namespace eecore
