// reshape_and_cache on the CPU: scatter each token's K and V rows into its cache slot.
//
// A slot of a [NB, BS, Hkv, D] cache is one contiguous run of Hkv * D elements, so a token is
// one copy per head (one copy in all when the token's heads are contiguous in `key`).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "reshape_and_cache/reshape_and_cache_checks.h"

namespace eecore {
namespace {

constexpr const char* kOp = "reshape_and_cache";

// Copies one token's [Hkv, D] rows (head stride `src_head_stride`) to a contiguous cache slot.
template <typename scalar_t>
inline void copy_token(scalar_t* dst, const scalar_t* src, int64_t src_head_stride, int64_t num_heads, int64_t dim) {
  if (src_head_stride == dim) {
    std::memcpy(dst, src, sizeof(scalar_t) * num_heads * dim);
    return;
  }
  for (int64_t h = 0; h < num_heads; ++h) std::memcpy(dst + h * dim, src + h * src_head_stride, sizeof(scalar_t) * dim);
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping) {
  const ReshapeAndCacheDims dims = check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping);
  check_slots_in_range(kOp, slot_mapping, dims.num_slots);
  const at::Tensor slots_tensor = slot_mapping.contiguous();
  const int64_t* slots = slots_tensor.const_data_ptr<int64_t>();
  const int64_t row = dims.num_kv_heads * dims.head_dim;  // elements of one slot

  EECORE_DISPATCH_FLOAT(key.scalar_type(), "eecore::reshape_and_cache", [&] {
    const scalar_t* k = key.const_data_ptr<scalar_t>();
    const scalar_t* v = value.const_data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    // Tokens per task: ~256 KiB of copying each. A decode step (a few KiB) stays on the calling
    // thread; only prefill-sized steps are worth waking the others for.
    const int64_t token_bytes = 2 * row * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(token_bytes, 1));
    at::parallel_for(0, dims.num_tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        copy_token(kc + slot * row, k + t * key.stride(0), key.stride(1), dims.num_kv_heads, dims.head_dim);
        copy_token(vc + slot * row, v + t * value.stride(0), value.stride(1), dims.num_kv_heads, dims.head_dim);
      }
    });
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("reshape_and_cache", &eecore::reshape_and_cache_cpu); }
