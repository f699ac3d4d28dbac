// paged_attention on CUDA: shared checks, then plan (kernel, context splits, workspace) and launch
// on the current stream. Nothing here reads device data, so the call never synchronizes.
#include <torch/library.h>

#include <optional>

#include "common/cuda_glue.h"
#include "eecore/batch_invariant.h"
#include "eecore/launch/paged_attention.h"
#include "eecore/switches.h"
#include "paged_attention/paged_attention_checks.h"

namespace eecore {
namespace {

// The launcher's kernel choices from the environment's switches, read at every call: tests and
// benchmarks switch them within one process.
cuda::PagedAttentionChoices choices_from_switches() {
  using namespace switches;
  cuda::PagedAttentionChoices c;
  if (is(kPagedAttentionKernel, "rows")) c.forced_kernel = static_cast<int32_t>(cuda::PagedAttentionKernel::kRows);
  if (is(kPagedAttentionKernel, "mma")) c.forced_kernel = static_cast<int32_t>(cuda::PagedAttentionKernel::kMma);
  if (is(kPagedAttentionKernel, "decode")) c.forced_kernel = static_cast<int32_t>(cuda::PagedAttentionKernel::kDecode);
  if (is(kPagedAttentionKernel, "decode_mma")) {
    c.forced_kernel = static_cast<int32_t>(cuda::PagedAttentionKernel::kDecodeMma);
  }
  c.min_split_tokens = static_cast<int32_t>(integer(kDecodeMinSplitTokens, c.min_split_tokens, 16, 4096));
  c.decode_mma_stages = static_cast<int32_t>(integer(kDecodeMmaStages, 0, 2, 4));
  if (value(kDecodeMmaLdmatrix) != nullptr) c.decode_mma_version = is(kDecodeMmaLdmatrix, "0") ? 1 : 2;
  c.decode_mma_v2_flags = static_cast<int32_t>(integer(kDecodeMmaV2Flags, -1, 0, 0xffff));
  c.batch_invariant = batch_invariant_enabled();
  return c;
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, int64_t max_query_len, double scale, bool causal,
                          const std::optional<at::Tensor>& position_bias,
                          const std::optional<at::Tensor>& tree_mask) {
  const char* op = "paged_attention";
  const PagedAttentionDims dims = check_paged_attention_args(out, query, k_cache, v_cache, block_table, seq_lens,
                                                             query_start_loc, max_query_len, position_bias, causal,
                                                             tree_mask);
  const bool has_tree = tree_mask.has_value() && tree_mask->defined();
  // The tree mask's values are not checked here (that would read device data and synchronize;
  // the CPU op checks them): the kernels never index with them beyond bit 63, so a bad mask gives
  // a wrong output, never an out-of-bounds access.
  EECORE_CHECK_ARG(op, "query", dims.head_dim <= cuda::kPagedAttentionMaxHeadDim, "has head dim ", dims.head_dim,
                   "; the CUDA kernels support head dims up to ", cuda::kPagedAttentionMaxHeadDim);
  const c10::cuda::CUDAGuard guard(query.device());
  // The kernels index the small int32 tensors densely; these copies are no-ops when already dense.
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  const at::Tensor tree = has_tree ? tree_mask->contiguous() : at::Tensor();
  const bool has_bias = position_bias.has_value() && position_bias->defined();

  cuda::PagedAttentionParams p{};
  p.choices = choices_from_switches();
  p.out = out.data_ptr();
  p.query = query.const_data_ptr();
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.block_table = table.const_data_ptr<int32_t>();
  p.seq_lens = lens.const_data_ptr<int32_t>();
  p.query_start_loc = starts.const_data_ptr<int32_t>();
  p.position_bias = has_bias ? position_bias->const_data_ptr<float>() : nullptr;
  p.tree_mask = has_tree ? tree.const_data_ptr<int64_t>() : nullptr;
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.k_stride_token = k_cache.stride(1);
  p.k_stride_head = k_cache.stride(2);
  p.v_stride_block = v_cache.stride(0);
  p.v_stride_token = v_cache.stride(1);
  p.v_stride_head = v_cache.stride(2);
  p.block_table_stride = table.stride(0);
  p.bias_stride = has_bias ? position_bias->stride(0) : 0;
  p.num_seqs = checked_int32(op, "seq_lens", dims.num_seqs, "sequences");
  p.num_tokens = checked_int32(op, "query", dims.num_tokens, "tokens");
  p.num_q_heads = checked_int32(op, "query", dims.num_q_heads, "heads");
  p.num_kv_heads = checked_int32(op, "k_cache", dims.num_kv_heads, "KV heads");
  p.head_dim = static_cast<int32_t>(dims.head_dim);
  p.block_size = checked_int32(op, "k_cache", dims.block_size, "tokens per block");
  p.num_blocks = checked_int32(op, "k_cache", dims.num_blocks, "blocks");
  p.max_blocks = checked_int32(op, "block_table", dims.max_blocks, "columns");
  p.max_query_len = checked_int32(op, "max_query_len", max_query_len, "query rows");
  p.max_distance = checked_int32(op, "position_bias", dims.max_distance, "distance columns");
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = to_dtype(query.scalar_type());

  const cuda::PagedAttentionPlan plan = cuda::plan_paged_attention(p);
  at::Tensor workspace;
  if (plan.workspace_floats > 0) workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));
  check_launch(op, cuda::launch_paged_attention(p, plan, workspace.defined() ? workspace.data_ptr<float>() : nullptr,
                                                current_stream(query.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("paged_attention", &eecore::paged_attention_cuda); }
