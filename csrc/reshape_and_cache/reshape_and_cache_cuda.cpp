// reshape_and_cache on CUDA: shared checks, then one launch; out-of-range slots are skipped on the
// device (the CPU kernel raises for them, which needs the data on the host).
#include <torch/library.h>

#include "common/cuda_glue.h"
#include "eecore/launch/reshape_and_cache.h"
#include "reshape_and_cache/reshape_and_cache_checks.h"

namespace eecore {
namespace {

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  const ReshapeAndCacheDims dims = check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  cuda::ReshapeAndCacheParams p{};
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.cache_stride_block = k_cache.stride(0);  // both caches are contiguous with one shape
  p.cache_stride_token = k_cache.stride(1);
  p.cache_stride_head = k_cache.stride(2);
  p.slot_stride = slot_mapping.stride(0);
  p.num_tokens = checked_int32(op, "key", dims.num_tokens, "tokens");
  p.num_kv_heads = checked_int32(op, "k_cache", dims.num_kv_heads, "KV heads");
  p.head_dim = checked_int32(op, "k_cache", dims.head_dim, "head dims");
  p.block_size = checked_int32(op, "k_cache", k_cache.size(1), "tokens per block");
  p.num_blocks = checked_int32(op, "k_cache", k_cache.size(0), "blocks");
  p.dtype = to_dtype(k_cache.scalar_type());
  check_launch(op, cuda::launch_reshape_and_cache(p, current_stream(k_cache.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("reshape_and_cache", &eecore::reshape_and_cache_cuda); }
