// Pieces shared by the paged_attention kernels: which sequence owns a query row, the key range a
// row may attend to, the split-K workspace layout, and the kernel that combines split results.
//
// Scores are kept in the log2 domain (scaled by scale * log2(e)) so the softmax uses exp2f; the
// running max `m` and sum `l` of every partial result follow that convention.
#pragma once

#include <cmath>

#include "eecore/cuda/async_copy.cuh"
#include "eecore/cuda/common.cuh"
#include "eecore/cuda/paged_kv.cuh"
#include "eecore/cuda/pdl.cuh"
#include "eecore/launch/paged_attention.h"

namespace eecore::cuda::attention {

constexpr float kLog2e = 1.4426950408889634f;

// The query rows [begin, end) of sequence `seq`, or false when query_start_loc is inconsistent
// there (negative, decreasing, or beyond the query tensor): such a sequence is skipped.
__device__ __forceinline__ bool seq_query_range(const PagedAttentionParams& p, int32_t seq, int32_t& begin,
                                                int32_t& end) {
  begin = p.query_start_loc[seq];
  end = p.query_start_loc[seq + 1];
  return begin >= 0 && end > begin && end <= p.num_tokens;
}

struct RowInfo {
  int32_t seq;      // owning sequence
  int32_t q_local;  // row index within the sequence's query rows
  int64_t q_pos;    // absolute position of this query token: seq_len - q_len + q_local
  int32_t seq_len;  // cached tokens of the sequence (its new ones included)
};

// Finds the sequence owning query row `row` by binary search over query_start_loc. False when no
// sequence owns it or when the row lies beyond max_query_len within its sequence; every kernel uses
// this same predicate, so the combine step touches exactly the rows the split kernels wrote.
__device__ __forceinline__ bool locate_row(const PagedAttentionParams& p, int32_t row, RowInfo& info) {
  if (p.num_seqs <= 0 || p.query_start_loc[0] > row) return false;
  int32_t lo = 0, hi = p.num_seqs - 1;  // the last sequence whose first row is <= row
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (p.query_start_loc[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  int32_t begin, end;
  if (!seq_query_range(p, lo, begin, end) || row < begin || row >= end) return false;
  info.seq = lo;
  info.q_local = row - begin;
  if (info.q_local >= p.max_query_len) return false;
  info.seq_len = max(p.seq_lens[lo], 0);
  info.q_pos = static_cast<int64_t>(info.seq_len) - (end - begin) + info.q_local;
  return true;
}

// Keys [0, key_end) a query at q_pos may see: all cached tokens, or those up to q_pos when causal,
// and never past what the block table can address.
__device__ __forceinline__ int64_t visible_keys(const PagedAttentionParams& p, int32_t seq_len, int64_t q_pos) {
  int64_t end = seq_len;
  if (p.causal) end = min(end, q_pos + 1);
  end = min(end, static_cast<int64_t>(p.max_blocks) * p.block_size);
  return max(end, int64_t{0});
}

// Token trees (tree_mask): whether query row `row` (global index), whose chunk's first key sits
// at `chunk_begin`, sees the key at `pos`. Keys before the chunk are every row's context; within
// it, bit (pos - chunk_begin) of the row's mask decides (the causal limit has already removed
// later keys, and chunks hold at most 64 rows, checked on the host).
__device__ __forceinline__ bool tree_sees(const PagedAttentionParams& p, int64_t row, int64_t chunk_begin,
                                          int64_t pos) {
  if (p.tree_mask == nullptr || pos < chunk_begin) return true;
  const int64_t j = pos - chunk_begin;
  return j < 64 && ((static_cast<uint64_t>(p.tree_mask[row]) >> j) & 1u) != 0;
}

// position_bias[head, clamp(distance, 0, max_distance - 1)] in the log2 domain.
__device__ __forceinline__ float position_bias_log2(const PagedAttentionParams& p, int32_t q_head, int64_t distance) {
  distance = min(max(distance, int64_t{0}), static_cast<int64_t>(p.max_distance) - 1);
  return p.position_bias[q_head * p.bias_stride + distance] * kLog2e;
}

// The packed rows a tensor-core CTA owns (row m = q_local * G + g: query token q_local under query
// head kv_head * G + g) of one sequence and KV head, and the keys [k_begin, k_stop) its context split
// sees (up to the causal limit of its last row).
struct PackedRows {
  int32_t q_begin;    // the sequence's first query row in the [Tq, Hq, D] tensors
  int32_t group;      // G
  int64_t rows;       // packed rows of the sequence (query rows beyond max_query_len excluded)
  int64_t first_pos;  // position of query row 0
  int64_t k_begin, k_stop;
};

// False when the CTA has nothing to do; it reads blockIdx-derived values and device data only, so
// the answer is uniform over the CTA (an early return before any barrier is safe).
__device__ __forceinline__ bool packed_rows(const PagedAttentionParams& p, int32_t seq, int32_t m_begin,
                                            int32_t block_rows, int32_t split, int32_t split_tokens, PackedRows& r) {
  int32_t q_end;
  if (seq >= p.num_seqs || !seq_query_range(p, seq, r.q_begin, q_end)) return false;
  const int32_t q_len = q_end - r.q_begin;
  r.group = p.num_q_heads / p.num_kv_heads;
  r.rows = static_cast<int64_t>(min(q_len, p.max_query_len)) * r.group;
  if (m_begin >= r.rows) return false;
  const int32_t seq_len = max(p.seq_lens[seq], 0);
  r.first_pos = static_cast<int64_t>(seq_len) - q_len;
  const int32_t last_local =
      static_cast<int32_t>(min(r.rows - 1, static_cast<int64_t>(m_begin) + block_rows - 1) / r.group);
  const int64_t key_end = visible_keys(p, seq_len, r.first_pos + last_local);
  r.k_begin = static_cast<int64_t>(split) * split_tokens;
  r.k_stop = min(r.k_begin + split_tokens, key_end);
  return true;
}

// Stages the CTA's Q tile, [kBlockRows][kPitch] elements in shared memory, with 16-byte cp.async
// (zeros for rows past the query and dims past D); the caller commits and waits.
template <typename T, int kBlockRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void load_packed_q(const PagedAttentionParams& p, const PackedRows& r, int32_t m_begin,
                                              int32_t kv_head, T* q_s) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row
  const T* query = static_cast<const T*>(p.query);
  for (int32_t i = threadIdx.x; i < kBlockRows * kChunks; i += kThreads) {
    const int32_t row = i / kChunks, c = i % kChunks;
    const int64_t m = m_begin + row;
    T* dst = q_s + row * kPitch + c * 8;
    if (m < r.rows && c * 8 < p.head_dim) {
      const int32_t q_local = static_cast<int32_t>(m / r.group);
      const int32_t q_head = kv_head * r.group + static_cast<int32_t>(m % r.group);
      cp_async_16(dst, query + (r.q_begin + q_local) * p.q_stride_token + q_head * p.q_stride_head + c * 8);
    } else {
      zero_16(dst);
    }
  }
}

// Split-K workspace: unnormalized outputs [Tq, Hq, splits, D], then the running max m and sum l,
// each [Tq, Hq, splits]. An empty split stores m = -inf, l = 0 (and its outputs are never read).
struct SplitWorkspace {
  float* out;
  float* m;
  float* l;
};

__host__ __device__ inline SplitWorkspace split_workspace(float* ws, const PagedAttentionParams& p, int32_t splits) {
  const int64_t entries = static_cast<int64_t>(p.num_tokens) * p.num_q_heads * splits;
  return SplitWorkspace{ws, ws + entries * p.head_dim, ws + entries * p.head_dim + entries};
}

__host__ __device__ inline int64_t split_workspace_floats(const PagedAttentionParams& p, int32_t splits) {
  return static_cast<int64_t>(p.num_tokens) * p.num_q_heads * splits * (p.head_dim + 2);
}

__host__ __device__ inline int64_t split_index(const PagedAttentionParams& p, int32_t row, int32_t q_head,
                                               int32_t splits, int32_t split) {
  return (static_cast<int64_t>(row) * p.num_q_heads + q_head) * splits + split;
}

// The decode kernels' last step: kParts partial states (one per warp) of one output element merged.
// Part w of slot `slot` keeps m at ml_s[(w * kSlots + slot) * 2], l next to it, and its unnormalized
// output dims at o_s[(w * kSlots + slot) * kHeadDim + ...].
template <int kParts, int kSlots, int kHeadDim>
__device__ __forceinline__ void merge_parts(const float* ml_s, const float* o_s, int32_t slot, int32_t d, float& m,
                                            float& l, float& o) {
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kParts; ++w) m = fmaxf(m, ml_s[(w * kSlots + slot) * 2]);
  const float m_use = m == -INFINITY ? 0.f : m;  // no part saw a key: every weight is 0
  l = 0.f;
  o = 0.f;
#pragma unroll
  for (int w = 0; w < kParts; ++w) {
    const float scale = exp2f(ml_s[(w * kSlots + slot) * 2] - m_use);
    l += ml_s[(w * kSlots + slot) * 2 + 1] * scale;
    o += o_s[(w * kSlots + slot) * kHeadDim + d] * scale;
  }
}

// One output element of query row `token` under `q_head`: normalized into `out` (0 when no key was
// visible), or, with context splits, the split's unnormalized output and its (m, l) into the
// workspace for combine_splits_kernel.
template <typename T>
__device__ __forceinline__ void store_output(const PagedAttentionParams& p, float* workspace, int32_t splits,
                                             int32_t split, int32_t token, int32_t q_head, int32_t d, float m,
                                             float l, float o) {
  if (splits == 1) {
    T* out = static_cast<T*>(p.out) + token * p.o_stride_token + q_head * p.o_stride_head;
    out[d] = from_float<T>(l > 0.f ? o / l : 0.f);
    return;
  }
  const SplitWorkspace ws = split_workspace(workspace, p, splits);
  const int64_t idx = split_index(p, token, q_head, splits, split);
  ws.out[idx * p.head_dim + d] = o;
  if (d == 0) {
    ws.m[idx] = m;
    ws.l[idx] = l;
  }
}

// One CTA per (query row, query head): out = sum_s w_s o_s / sum_s w_s l_s, w_s = 2^(m_s - max m).
template <typename T>
__global__ void combine_splits_kernel(const PagedAttentionParams p, const int32_t splits, const float* ws_base) {
  pdl_launch_dependents();  // as decode_mma's kernel: the next projection may ask L2 for its weights
  const int32_t row = blockIdx.x;
  const int32_t q_head = blockIdx.y;
  RowInfo info;
  if (!locate_row(p, row, info)) return;
  const SplitWorkspace ws = split_workspace(const_cast<float*>(ws_base), p, splits);
  const int64_t first = split_index(p, row, q_head, splits, 0);

  float m_max = -INFINITY;
  for (int32_t s = 0; s < splits; ++s) m_max = fmaxf(m_max, ws.m[first + s]);
  float l_sum = 0.f;
  if (m_max != -INFINITY)
    for (int32_t s = 0; s < splits; ++s)
      if (ws.m[first + s] != -INFINITY) l_sum += ws.l[first + s] * exp2f(ws.m[first + s] - m_max);
  const float inv_l = l_sum > 0.f ? 1.f / l_sum : 0.f;

  T* out = static_cast<T*>(p.out) + row * p.o_stride_token + q_head * p.o_stride_head;
  for (int32_t d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int32_t s = 0; s < splits; ++s) {
      const float m = ws.m[first + s];
      if (m != -INFINITY) acc += ws.out[(first + s) * p.head_dim + d] * exp2f(m - m_max);
    }
    out[d] = from_float<T>(acc * inv_l);
  }
}

}  // namespace eecore::cuda::attention
