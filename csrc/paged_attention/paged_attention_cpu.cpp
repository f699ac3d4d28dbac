// paged_attention on the CPU: flash-style attention straight out of the paged KV cache.
//
// Work is split into items of (sequence, KV head, a tile of that sequence's query rows). An item
// computes all the query heads of its KV group together, so each key/value row it reads from the
// cache serves G = Hq / Hkv heads (and, in prefill, every query row of the tile). It walks the
// sequence's keys in tiles of kKeyTile tokens through the block table and keeps an online softmax
// (running max and sum per query vector, fp32 accumulators), so the KV is never gathered into a
// contiguous copy and no [q_len, seq_len] score matrix exists.
//
// Decode (max_query_len == 1) uses one item per (sequence, KV head) and reads the cache rows in
// place. Prefill / varlen tiles the query rows so a key tile, converted once to fp32, is reused by
// every row of the tile.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention/attention_tile_cpu.h"
#include "paged_attention/paged_attention_checks.h"

namespace eecore {
namespace {

using cpu::kVecWidth;
using cpu::round_up_to_vec;

constexpr const char* kOp = "paged_attention";

// fp32 / bf16 / fp16 only: EECORE_DISPATCH_FLOAT would also instantiate double, which the
// argument checks reject and the vector loads do not support.
#define EECORE_DISPATCH_ATTENTION_DTYPE(TYPE, NAME, ...)                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                      \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)               \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Keys per tile: long enough to amortise the softmax rescale of the accumulators, short enough
// that the tile's scores and packed K/V stay in L1/L2.
constexpr int64_t kKeyTile = 64;
// Query vectors (rows x heads of a KV group) per prefill tile: each packed key is reused this
// many times. 32 keeps the fp32 accumulators of a 128-dim head at 16 KiB.
constexpr int64_t kQueryVectorsPerTile = 32;

// One sequence of the batch, as read from the index tensors.
struct SeqSpan {
  int64_t q_begin;  // first query row in `query`
  int64_t q_len;    // query rows: the last q_len of the seq_len cached tokens
  int64_t seq_len;  // cached tokens, the new ones included
};

// Reads query_start_loc / seq_lens / block_table and checks every value the kernel will use, so
// that nothing is written (or read) out of bounds. These are the checks that need tensor data.
std::vector<SeqSpan> read_batch_layout(const PagedAttentionDims& dims, const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                       int64_t max_query_len, bool causal) {
  const auto starts = query_start_loc.accessor<int32_t, 1>();
  const auto lens = seq_lens.accessor<int32_t, 1>();
  const auto table = block_table.accessor<int32_t, 2>();
  EECORE_CHECK_ARG(kOp, "query_start_loc", starts[0] == 0, "must start at 0, got ", starts[0]);
  EECORE_CHECK_ARG(kOp, "query_start_loc", starts[dims.num_seqs] == dims.num_tokens,
                   "must end at the number of query rows ", dims.num_tokens, ", got ", starts[dims.num_seqs]);

  std::vector<SeqSpan> seqs(dims.num_seqs);
  for (int64_t b = 0; b < dims.num_seqs; ++b) {
    const int64_t q_len = int64_t{starts[b + 1]} - starts[b];
    const int64_t seq_len = lens[b];
    EECORE_CHECK_ARG(kOp, "query_start_loc", q_len >= 0, "must be non-decreasing, got ", starts[b], " then ",
                     starts[b + 1], " at sequence ", b);
    EECORE_CHECK_ARG(kOp, "seq_lens", seq_len >= 0, "must be >= 0, got ", seq_len, " for sequence ", b);
    EECORE_CHECK_ARG(kOp, "max_query_len", q_len <= max_query_len, "is ", max_query_len, " but sequence ", b,
                     " has ", q_len, " query rows");
    if (causal) {
      EECORE_CHECK_ARG(kOp, "seq_lens", q_len <= seq_len, "sequence ", b, " has ", q_len,
                       " query rows but only ", seq_len, " cached tokens (its query rows are its last tokens)");
    } else {
      EECORE_CHECK_ARG(kOp, "seq_lens", q_len == 0 || seq_len > 0, "sequence ", b, " has ", q_len,
                       " query rows but no keys to attend to");
    }
    const int64_t blocks_used = (seq_len + dims.block_size - 1) / dims.block_size;
    EECORE_CHECK_ARG(kOp, "seq_lens", blocks_used <= dims.max_blocks, "sequence ", b, " has ", seq_len,
                     " tokens, more than its block_table row holds (", dims.max_blocks, " blocks of ",
                     dims.block_size, ")");
    for (int64_t i = 0; i < blocks_used; ++i) {
      const int64_t block = table[b][i];
      EECORE_CHECK_ARG(kOp, "block_table", block >= 0 && block < dims.num_blocks, "entry [", b, ", ", i, "] is ",
                       block, ", expected a block id in [0, ", dims.num_blocks, ") for a block in use");
    }
    seqs[b] = {starts[b], q_len, seq_len};
  }
  return seqs;
}

// Everything an item needs, as raw pointers and strides.
template <typename scalar_t>
struct AttentionArgs {
  const scalar_t* query;
  int64_t q_stride_token, q_stride_head;
  scalar_t* out;
  int64_t o_stride_token, o_stride_head;
  const scalar_t* k_cache;
  const scalar_t* v_cache;
  const int32_t* block_table;  // contiguous [B, max_blocks]
  int64_t max_blocks;
  const float* position_bias;  // [Hq, max_distance] or null
  int64_t max_distance;
  int64_t block_size, num_kv_heads, head_dim;
  int64_t group;       // query heads per KV head
  int64_t padded_dim;  // head_dim rounded up to a multiple of the vector width
  float scale;
  bool causal;
};

// A unit of parallel work: the query heads of one KV head for rows [row_begin, row_end) of
// sequence `seq` (rows counted from the sequence's first query row).
struct WorkItem {
  int64_t seq, kv_head, row_begin, row_end;
  int64_t cost;  // ~ query rows x keys they see; for scheduling only
};

// Per-thread buffers, sized once for the largest tile.
template <typename scalar_t>
struct TileScratch {
  std::vector<float> q, acc, scores, row_max, row_sum, k_packed, v_packed;
  std::vector<const scalar_t*> k_rows, v_rows;           // rows read in place
  std::vector<const float*> k_packed_rows, v_packed_rows;  // rows of k_packed / v_packed

  TileScratch(int64_t max_vectors, int64_t padded_dim)
      : q(max_vectors * padded_dim),
        acc(max_vectors * padded_dim),
        scores(max_vectors * kKeyTile),
        row_max(max_vectors),
        row_sum(max_vectors),
        k_packed(kKeyTile * padded_dim, 0.f),
        v_packed(kKeyTile * padded_dim, 0.f),
        k_rows(kKeyTile),
        v_rows(kKeyTile),
        k_packed_rows(kKeyTile),
        v_packed_rows(kKeyTile) {
    for (int64_t n = 0; n < kKeyTile; ++n) {
      k_packed_rows[n] = k_packed.data() + n * padded_dim;
      v_packed_rows[n] = v_packed.data() + n * padded_dim;
    }
  }
};

// Loads the item's query vectors (row-major over rows, then the group's heads) into fp32,
// pre-multiplied by the softmax scale, zero-padded to padded_dim.
template <typename scalar_t>
void load_query_tile(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item, float* q) {
  const int64_t num_rows = item.row_end - item.row_begin;
  for (int64_t r = 0; r < num_rows; ++r) {
    const scalar_t* row = a.query + (seq.q_begin + item.row_begin + r) * a.q_stride_token;
    for (int64_t g = 0; g < a.group; ++g) {
      const scalar_t* src = row + (item.kv_head * a.group + g) * a.q_stride_head;
      float* dst = q + (r * a.group + g) * a.padded_dim;
      for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
      for (int64_t d = a.head_dim; d < a.padded_dim; ++d) dst[d] = 0.f;
    }
  }
}

// Points k_rows / v_rows at the cache rows of tokens [first, first + count) of sequence `seq`
// for one KV head, following its block table.
template <typename scalar_t>
void locate_kv_rows(const AttentionArgs<scalar_t>& a, int64_t seq, int64_t kv_head, int64_t first, int64_t count,
                    const scalar_t** k_rows, const scalar_t** v_rows) {
  const int32_t* blocks = a.block_table + seq * a.max_blocks;
  for (int64_t n = 0; n < count; ++n) {
    const int64_t pos = first + n;
    const int64_t slot = int64_t{blocks[pos / a.block_size]} * a.block_size + pos % a.block_size;
    const int64_t offset = (slot * a.num_kv_heads + kv_head) * a.head_dim;
    k_rows[n] = a.k_cache + offset;
    v_rows[n] = a.v_cache + offset;
  }
}

// Converts `count` rows to fp32 rows of padded_dim (the padding stays zero from construction).
template <typename scalar_t>
void pack_rows(const scalar_t* const* rows, int64_t count, int64_t head_dim, int64_t padded_dim, float* packed) {
  for (int64_t n = 0; n < count; ++n) {
    const scalar_t* src = rows[n];
    float* dst = packed + n * padded_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// Adds the position bias and applies the causal mask to the scores of one query vector against
// keys [first_key, first_key + count). `q_pos` is the query row's position in its sequence.
inline void bias_and_mask_row(float* s, int64_t count, int64_t first_key, int64_t q_pos, const float* bias_row,
                              int64_t max_distance, bool causal) {
  if (bias_row != nullptr) {
    for (int64_t n = 0; n < count; ++n) {
      const int64_t distance = std::clamp<int64_t>(q_pos - (first_key + n), 0, max_distance - 1);
      s[n] += bias_row[distance];
    }
  }
  if (causal) {
    // Keys after the query's own position are in its future.
    for (int64_t n = std::max<int64_t>(0, q_pos + 1 - first_key); n < count; ++n)
      s[n] = -std::numeric_limits<float>::infinity();
  }
}

// Attention of one work item. kPackKV: convert each key/value tile to padded fp32 first (needed
// when head_dim is not a multiple of 8; worth it when many query vectors reuse the tile).
template <bool kPackKV, typename scalar_t>
void attend_item(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item,
                 TileScratch<scalar_t>& scratch) {
  const int64_t num_vectors = (item.row_end - item.row_begin) * a.group;
  const int64_t dim = a.padded_dim;
  float* q = scratch.q.data();
  float* acc = scratch.acc.data();
  float* scores = scratch.scores.data();
  load_query_tile(a, seq, item, q);
  std::fill_n(acc, num_vectors * dim, 0.f);
  std::fill_n(scratch.row_max.data(), num_vectors, -std::numeric_limits<float>::infinity());
  std::fill_n(scratch.row_sum.data(), num_vectors, 0.f);

  // Position of the tile's first query row; the causal tile needs no key past its last row.
  const int64_t first_q_pos = seq.seq_len - seq.q_len + item.row_begin;
  const int64_t last_q_pos = first_q_pos + (item.row_end - item.row_begin) - 1;
  const int64_t kv_end = a.causal ? last_q_pos + 1 : seq.seq_len;

  for (int64_t first_key = 0; first_key < kv_end; first_key += kKeyTile) {
    const int64_t count = std::min(kKeyTile, kv_end - first_key);
    const int64_t padded_count = round_up_to_vec(count);
    locate_kv_rows(a, item.seq, item.kv_head, first_key, count, scratch.k_rows.data(), scratch.v_rows.data());
    if constexpr (kPackKV) {
      pack_rows(scratch.k_rows.data(), count, a.head_dim, dim, scratch.k_packed.data());
      pack_rows(scratch.v_rows.data(), count, a.head_dim, dim, scratch.v_packed.data());
      cpu::tile_scores(q, dim, num_vectors, scratch.k_packed_rows.data(), count, dim, scores, kKeyTile);
    } else {
      cpu::tile_scores(q, dim, num_vectors, scratch.k_rows.data(), count, dim, scores, kKeyTile);
    }

    const bool needs_mask = a.causal && first_key + count - 1 > first_q_pos;
    for (int64_t m = 0; m < num_vectors; ++m) {
      float* s = scores + m * kKeyTile;
      std::fill(s + count, s + padded_count, -std::numeric_limits<float>::infinity());
      const int64_t row = m / a.group;
      const int64_t head = item.kv_head * a.group + m % a.group;
      const float* bias_row = a.position_bias ? a.position_bias + head * a.max_distance : nullptr;
      if (bias_row != nullptr || needs_mask)
        bias_and_mask_row(s, count, first_key, first_q_pos + row, bias_row, a.max_distance, needs_mask);
      const float correction = cpu::online_softmax_row(s, padded_count, scratch.row_max[m], scratch.row_sum[m]);
      if (correction != 1.f) cpu::scale_row(acc + m * dim, dim, correction);
    }

    if constexpr (kPackKV) {
      cpu::tile_accumulate(scores, kKeyTile, num_vectors, scratch.v_packed_rows.data(), count, dim, acc, dim);
    } else {
      cpu::tile_accumulate(scores, kKeyTile, num_vectors, scratch.v_rows.data(), count, dim, acc, dim);
    }
  }

  // out = acc / sum, rounded once to the output dtype.
  for (int64_t m = 0; m < num_vectors; ++m) {
    const int64_t row = seq.q_begin + item.row_begin + m / a.group;
    const int64_t head = item.kv_head * a.group + m % a.group;
    scalar_t* dst = a.out + row * a.o_stride_token + head * a.o_stride_head;
    const float inv_sum = 1.f / scratch.row_sum[m];
    const float* src = acc + m * dim;
    for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv_sum);
  }
}

// Splits the batch into work items of at most `rows_per_item` query rows per (sequence, KV head),
// most expensive first so the dynamic schedule below ends with small items (balanced threads).
std::vector<WorkItem> plan_work(const std::vector<SeqSpan>& seqs, int64_t num_kv_heads, int64_t rows_per_item,
                                bool causal) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const SeqSpan& seq = seqs[b];
    for (int64_t r0 = 0; r0 < seq.q_len; r0 += rows_per_item) {
      const int64_t r1 = std::min(seq.q_len, r0 + rows_per_item);
      const int64_t keys = causal ? seq.seq_len - seq.q_len + r1 : seq.seq_len;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({b, h, r0, r1, (r1 - r0) * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

// Runs every item on at::parallel_for's threads, each thread taking the next item when it is
// free: items differ in cost (causal tiles, varlen batches), so a static split would idle threads.
template <typename scalar_t>
void run_items(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, const std::vector<WorkItem>& items,
               int64_t rows_per_item, bool pack_kv) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch<scalar_t> scratch(rows_per_item * a.group, a.padded_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const WorkItem& item = items[i];
      if (pack_kv) {
        attend_item<true>(a, seqs[item.seq], item, scratch);
      } else {
        attend_item<false>(a, seqs[item.seq], item, scratch);
      }
    }
  });
}

template <typename scalar_t>
void paged_attention_impl(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, int64_t max_query_len) {
  const bool dim_is_vector_multiple = a.head_dim % kVecWidth == 0;
  if (max_query_len == 1) {
    // Decode: one query row per sequence, G query vectors per item. Reading the cache rows in
    // place beats packing them, since each row is used by at most G vectors.
    const auto items = plan_work(seqs, a.num_kv_heads, /*rows_per_item=*/1, a.causal);
    run_items(a, seqs, items, 1, /*pack_kv=*/!dim_is_vector_multiple);
    return;
  }
  // Prefill / varlen: tiles of query rows, every key tile packed once to fp32 and reused by the
  // whole tile (fp32 caches with a vector-multiple head dim are already in the right form).
  const int64_t rows_per_item = std::max<int64_t>(1, kQueryVectorsPerTile / a.group);
  const auto items = plan_work(seqs, a.num_kv_heads, rows_per_item, a.causal);
  const bool pack_kv = !dim_is_vector_multiple || !std::is_same_v<scalar_t, float>;
  run_items(a, seqs, items, rows_per_item, pack_kv);
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t max_query_len, double scale, bool causal,
                         const std::optional<at::Tensor>& position_bias) {
  const PagedAttentionDims dims = check_paged_attention_args(out, query, k_cache, v_cache, block_table, seq_lens,
                                                             query_start_loc, max_query_len, position_bias);
  const at::Tensor table = block_table.contiguous();
  const std::vector<SeqSpan> seqs =
      read_batch_layout(dims, table, seq_lens, query_start_loc, max_query_len, causal);
  if (dims.num_tokens == 0) return;
  const bool has_bias = position_bias.has_value() && position_bias->defined();

  EECORE_DISPATCH_ATTENTION_DTYPE(query.scalar_type(), "eecore::paged_attention", [&] {
    AttentionArgs<scalar_t> a{};
    a.query = query.const_data_ptr<scalar_t>();
    a.q_stride_token = query.stride(0);
    a.q_stride_head = query.stride(1);
    a.out = out.data_ptr<scalar_t>();
    a.o_stride_token = out.stride(0);
    a.o_stride_head = out.stride(1);
    a.k_cache = k_cache.const_data_ptr<scalar_t>();
    a.v_cache = v_cache.const_data_ptr<scalar_t>();
    a.block_table = table.const_data_ptr<int32_t>();
    a.max_blocks = dims.max_blocks;
    a.position_bias = has_bias ? position_bias->const_data_ptr<float>() : nullptr;
    a.max_distance = dims.max_distance;
    a.block_size = dims.block_size;
    a.num_kv_heads = dims.num_kv_heads;
    a.head_dim = dims.head_dim;
    a.group = dims.num_q_heads / dims.num_kv_heads;
    a.padded_dim = round_up_to_vec(dims.head_dim);
    a.scale = static_cast<float>(scale);
    a.causal = causal;
    paged_attention_impl(a, seqs, max_query_len);
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("paged_attention", &eecore::paged_attention_cpu); }
