// CUDA launchers of paged_attention (csrc/paged_attention/paged_attention_kernels.cu). Torch-free.
//
// Five kernels serve the op:
//  * "decode_mma" (tensor cores, bf16/fp16): one CTA per (sequence, KV head, split) over up to 32
//    packed (query token, query head) rows, its 4 warps splitting the keys, each with a private
//    cp.async pipeline: decode with GQA and short verification queries.
//  * "decode" (SIMT, bf16/fp16, D % 8 == 0, 16-byte aligned rows): one CTA per (query row, KV
//    head, split of the context) computing up to 8 query heads of that KV head's group, with a
//    barrier-free cp.async pipeline; it serves decode without GQA (max_query_len == 1, G == 1).
//  * "rows" (SIMT): the same grid, any dtype and head dim; it serves fp32, odd head dims and
//    unaligned views.
//  * "mma" (tensor cores, bf16/fp16): flash-attention-2 style tiles for prefill, chunked prefill
//    and verification queries too long for "decode_mma". The rows of a tile are (query token, query head)
//    pairs of one KV head, so short queries with GQA still fill the 16-row MMA tiles.
//  * "combine": merges the split-K partial results (flash-decoding) when the context was split.
// The host plans which ones run and how much fp32 workspace the splits need; no launch reads
// device data on the host, so nothing synchronizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

// How the launcher chooses among its kernels, for timing one against another and for batch
// invariance: the torch glue fills these from the environment's switches (eecore/switches.h), so
// this layer reads none itself. The defaults are the planner's own choices.
struct PagedAttentionChoices {
  int32_t forced_kernel = -1;         // a PagedAttentionKernel to take wherever it applies; -1: the planner's
  int32_t min_split_tokens = 256;     // the shortest context split the decode kernels' planner makes
  int32_t decode_mma_stages = 0;      // 2 or 4 where the shape allows; else the default depth
  int32_t decode_mma_version = 0;     // 1 or 2; 0: the default (attention::decode_mma::kDefaultLdmatrix)
  int32_t decode_mma_v2_flags = -1;   // which of v2's changes run; -1: attention::decode_mma::kDefaultV2Flags
  bool batch_invariant = false;       // see eecore/batch_invariant.h
};

struct PagedAttentionParams {
  void* out;                          // [Tq, Hq, D]
  const void* query;                  // [Tq, Hq, D]
  const void* k_cache;                // [NB, BS, Hkv, D]
  const void* v_cache;                // [NB, BS, Hkv, D]
  const int32_t* block_table;         // [B, max_blocks]
  const int32_t* seq_lens;            // [B]
  const int32_t* query_start_loc;     // [B + 1]
  const float* position_bias;         // [Hq, max_distance] or nullptr
  const int64_t* tree_mask;           // [Tq] or nullptr: row i of a chunk sees chunk key j iff bit j is set

  int64_t q_stride_token, q_stride_head;    // elements; the last dim is contiguous
  int64_t o_stride_token, o_stride_head;
  int64_t k_stride_block, k_stride_token, k_stride_head;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  int64_t block_table_stride;               // elements between rows of block_table
  int64_t bias_stride;                      // elements between rows of position_bias

  int32_t num_seqs;          // B
  int32_t num_tokens;        // Tq
  int32_t num_q_heads;       // Hq
  int32_t num_kv_heads;      // Hkv (divides Hq)
  int32_t head_dim;          // D <= kMaxHeadDim
  int32_t block_size;        // BS
  int32_t num_blocks;        // NB
  int32_t max_blocks;        // columns of block_table
  int32_t max_query_len;     // rows of a sequence beyond this are not computed (the caller's promise)
  int32_t max_distance;      // columns of position_bias
  float scale;
  bool causal;
  DType dtype;
  PagedAttentionChoices choices;  // (value-initialized params get its defaults)
};

constexpr int32_t kPagedAttentionMaxHeadDim = 256;

enum class PagedAttentionKernel : int32_t { kRows = 0, kMma = 1, kDecode = 2, kDecodeMma = 3 };

struct PagedAttentionPlan {
  PagedAttentionKernel kernel;
  int32_t num_splits;        // > 1: split-K over the context, then the combine kernel
  int32_t split_tokens;      // keys per split (a multiple of the kernel's key tile)
  int64_t workspace_floats;  // fp32 workspace the launch needs (0 without splits)
};

// Decides kernel and split-K from the shapes alone (and the device's SM count); p.choices can force
// a kernel where it applies (EECORE_PAGED_ATTENTION_KERNEL=decode|decode_mma|mma|rows, via the glue).
PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p);

// `workspace` must hold plan.workspace_floats floats on the same device (unused when 0).
cudaError_t launch_paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* workspace,
                                   cudaStream_t stream);

}  // namespace eecore::cuda
