// Argument checks of paged_attention that need no tensor data, shared by the CPU and CUDA glue.
// The checks that read data (query_start_loc, seq_lens, block-table entries) run in the CPU
// kernel; the CUDA kernel guards every index on the device instead.
#pragma once

#include <optional>

#include "common/checks.h"

namespace eecore {

// The sizes every paged_attention implementation works with, once the arguments are checked.
struct PagedAttentionDims {
  int64_t num_tokens;    // Tq: query rows of the whole batch
  int64_t num_q_heads;   // Hq
  int64_t num_kv_heads;  // Hkv
  int64_t head_dim;      // D
  int64_t num_blocks;    // NB
  int64_t block_size;    // BS
  int64_t num_seqs;      // B
  int64_t max_blocks;    // columns of block_table
  int64_t max_distance;  // columns of position_bias (0 without one)
};

// A tree_mask row is one int64 bit set over the keys of its chunk, so a chunk holds at most 64 rows.
constexpr int64_t kTreeMaskMaxQueryLen = 64;

inline PagedAttentionDims check_paged_attention_args(const at::Tensor& out, const at::Tensor& query,
                                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                     const at::Tensor& query_start_loc, int64_t max_query_len,
                                                     const std::optional<at::Tensor>& position_bias,
                                                     bool causal, const std::optional<at::Tensor>& tree_mask) {
  const char* op = "paged_attention";
  PagedAttentionDims dims{};

  // query [Tq, Hq, D]: rows and heads may be strided (a slice of a fused QKV output).
  check_dim(op, "query", query, 3);
  check_float_dtype(op, "query", query);
  check_last_dim_contiguous(op, "query", query);
  dims.num_tokens = query.size(0);
  dims.num_q_heads = query.size(1);
  dims.head_dim = query.size(2);
  EECORE_CHECK_ARG(op, "query", dims.head_dim > 0, "expected a head dim > 0, got shape ", query.sizes());

  check_dim(op, "out", out, 3);
  check_like(op, "out", out, "query", query);
  check_last_dim_contiguous(op, "out", out);

  // k_cache, v_cache [NB, BS, Hkv, D]: views kv_cache[l, 0] / kv_cache[l, 1], contiguous.
  check_dim(op, "k_cache", k_cache, 4);
  check_same_dtype(op, "k_cache", k_cache, "query", query);
  check_contiguous(op, "k_cache", k_cache);
  check_same_device(op, "k_cache", k_cache, "query", query);
  dims.num_blocks = k_cache.size(0);
  dims.block_size = k_cache.size(1);
  dims.num_kv_heads = k_cache.size(2);
  EECORE_CHECK_ARG(op, "k_cache", dims.block_size > 0, "expected a block size > 0, got shape ", k_cache.sizes());
  EECORE_CHECK_ARG(op, "k_cache", dims.num_kv_heads > 0, "expected at least one KV head, got shape ",
                   k_cache.sizes());
  check_size(op, "k_cache", k_cache, 3, dims.head_dim, "the head dim of 'query'");
  EECORE_CHECK_ARG(op, "query", dims.num_q_heads % dims.num_kv_heads == 0, "has ", dims.num_q_heads,
                   " heads, expected a multiple of the ", dims.num_kv_heads, " KV heads of 'k_cache'");

  check_dim(op, "v_cache", v_cache, 4);
  EECORE_CHECK_ARG(op, "v_cache", v_cache.sizes() == k_cache.sizes(), "expected the shape of 'k_cache' ",
                   k_cache.sizes(), ", got ", v_cache.sizes());
  check_same_dtype(op, "v_cache", v_cache, "query", query);
  check_contiguous(op, "v_cache", v_cache);
  check_same_device(op, "v_cache", v_cache, "query", query);

  // Index tensors: int32, any strides.
  check_dim(op, "seq_lens", seq_lens, 1);
  check_dtype(op, "seq_lens", seq_lens, at::kInt);
  check_same_device(op, "seq_lens", seq_lens, "query", query);
  dims.num_seqs = seq_lens.size(0);

  check_dim(op, "block_table", block_table, 2);
  check_dtype(op, "block_table", block_table, at::kInt);
  check_size(op, "block_table", block_table, 0, dims.num_seqs, "one row per sequence of 'seq_lens'");
  check_same_device(op, "block_table", block_table, "query", query);
  dims.max_blocks = block_table.size(1);

  check_dim(op, "query_start_loc", query_start_loc, 1);
  check_dtype(op, "query_start_loc", query_start_loc, at::kInt);
  check_size(op, "query_start_loc", query_start_loc, 0, dims.num_seqs + 1, "the number of sequences + 1");
  check_same_device(op, "query_start_loc", query_start_loc, "query", query);

  EECORE_CHECK_ARG(op, "max_query_len", max_query_len >= 0, "expected >= 0, got ", max_query_len);

  // position_bias fp32 [Hq, max_distance].
  if (position_bias.has_value() && position_bias->defined()) {
    const at::Tensor& bias = *position_bias;
    check_dim(op, "position_bias", bias, 2);
    check_dtype(op, "position_bias", bias, at::kFloat);
    check_size(op, "position_bias", bias, 0, dims.num_q_heads, "the query heads Hq");
    EECORE_CHECK_ARG(op, "position_bias", bias.size(1) > 0, "expected at least one distance column, got shape ",
                     bias.sizes());
    check_contiguous(op, "position_bias", bias);
    check_same_device(op, "position_bias", bias, "query", query);
    dims.max_distance = bias.size(1);
  }

  // tree_mask int64 [Tq]: one bit set per query row over the keys of its chunk (the values are
  // checked where the data is read). The mask only removes keys inside the causal triangle.
  if (tree_mask.has_value() && tree_mask->defined()) {
    const at::Tensor& mask = *tree_mask;
    check_dim(op, "tree_mask", mask, 1);
    check_dtype(op, "tree_mask", mask, at::kLong);
    check_size(op, "tree_mask", mask, 0, dims.num_tokens, "one per query row of 'query'");
    check_same_device(op, "tree_mask", mask, "query", query);
    EECORE_CHECK_ARG(op, "causal", causal, "must be true with a 'tree_mask' (a token tree is causal attention "
                     "with keys removed), got false");
    EECORE_CHECK_ARG(op, "max_query_len", max_query_len <= kTreeMaskMaxQueryLen, "must be <= ",
                     kTreeMaskMaxQueryLen, " with a 'tree_mask' (one int64 bit per key of a chunk), got ",
                     max_query_len);
  }
  return dims;
}

}  // namespace eecore
