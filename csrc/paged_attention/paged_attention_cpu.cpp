// paged_attention on the CPU: flash-style attention straight out of the paged KV cache.
//
// This file checks the index tensors, splits the batch into work items and runs them on
// at::parallel_for's threads; paged_attention_item_cpu.h computes one item (online softmax over
// key tiles read through the block table) and attention_tile_cpu.h holds the vectorised tile
// kernels.
//
// An item computes all the query heads of its KV heads together, so each key/value row read from
// the cache serves G = Hq / Hkv query heads (and, in prefill, every query row of the item).
//  - Decode (max_query_len == 1): an item is one sequence and all (or, for small batches, a
//    share of) its KV heads, read token by token in address order: decode is memory bound.
//  - Prefill / varlen: an item is one KV head and a tile of query rows; each key tile is
//    converted once to fp32 and reused by all the tile's query vectors: prefill is compute bound.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention/paged_attention_checks.h"
#include "paged_attention/paged_attention_item_cpu.h"

namespace eecore {
namespace {

using cpu::AttentionArgs;
using cpu::kVecWidth;
using cpu::round_up_to_vec;
using cpu::SeqSpan;
using cpu::TileOrder;
using cpu::TileScratch;
using cpu::WorkItem;

constexpr const char* kOp = "paged_attention";

// fp32 / bf16 / fp16 only: EECORE_DISPATCH_FLOAT would also instantiate double, which the
// argument checks reject and the vector loads do not support.
#define EECORE_DISPATCH_ATTENTION_DTYPE(TYPE, NAME, ...)                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                      \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)               \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Query vectors (rows x the query heads of a KV head) per prefill item: each packed key row is
// reused this many times. 32 keeps the fp32 accumulators of a 128-dim head at 16 KiB.
constexpr int64_t kQueryVectorsPerTile = 32;

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

// Splits the batch into work items of at most `rows_per_item` query rows and `heads_per_item` KV
// heads, most expensive first so that the dynamic schedule below ends on small items.
std::vector<WorkItem> plan_work(const std::vector<SeqSpan>& seqs, int64_t num_kv_heads, int64_t rows_per_item,
                                int64_t heads_per_item, bool causal) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const SeqSpan& seq = seqs[b];
    for (int64_t r0 = 0; r0 < seq.q_len; r0 += rows_per_item) {
      const int64_t r1 = std::min(seq.q_len, r0 + rows_per_item);
      const int64_t keys = causal ? seq.seq_len - seq.q_len + r1 : seq.seq_len;
      for (int64_t h0 = 0; h0 < num_kv_heads; h0 += heads_per_item) {
        const int64_t h1 = std::min(num_kv_heads, h0 + heads_per_item);
        items.push_back({b, h0, h1, r0, r1, (h1 - h0) * (r1 - r0) * keys});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

// Runs every item on at::parallel_for's threads, each thread taking the next item when it is
// free: items differ in cost (causal tiles, varlen batches), so a static split would idle threads.
template <TileOrder kOrder, typename scalar_t>
void run_items(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, const std::vector<WorkItem>& items,
               int64_t max_vectors) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch<scalar_t> scratch(max_vectors, a.padded_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
      cpu::attend_item<kOrder>(a, seqs[items[i].seq], items[i], scratch);
  });
}

template <typename scalar_t>
void paged_attention_impl(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, int64_t max_query_len) {
  const bool rows_readable_in_place = a.head_dim % kVecWidth == 0;
  if (max_query_len == 1) {
    // Decode: an item takes all the KV heads of a sequence, so that it streams through each
    // slot (all heads side by side) once; sequences are split by heads only when there are too
    // few of them to keep every thread busy.
    const int64_t num_seqs = std::max<int64_t>(1, static_cast<int64_t>(seqs.size()));
    const int64_t splits = std::clamp<int64_t>((2 * at::get_num_threads() + num_seqs - 1) / num_seqs, 1,
                                               a.num_kv_heads);
    const int64_t heads_per_item = (a.num_kv_heads + splits - 1) / splits;
    const auto items = plan_work(seqs, a.num_kv_heads, /*rows_per_item=*/1, heads_per_item, a.causal);
    if (rows_readable_in_place) {
      run_items<TileOrder::kDecode>(a, seqs, items, heads_per_item * a.group);
    } else {
      run_items<TileOrder::kHeadsPacked>(a, seqs, items, heads_per_item * a.group);
    }
    return;
  }
  // Prefill / varlen: items of one KV head and a tile of query rows. Every key tile is converted
  // once to fp32 for all the item's query vectors; fp32 caches with a head dim that is a multiple
  // of the vector width are already in that form.
  const int64_t rows_per_item = std::max<int64_t>(1, kQueryVectorsPerTile / a.group);
  const auto items = plan_work(seqs, a.num_kv_heads, rows_per_item, /*heads_per_item=*/1, a.causal);
  if (rows_readable_in_place && std::is_same_v<scalar_t, float>) {
    run_items<TileOrder::kHeadsInPlace>(a, seqs, items, rows_per_item * a.group);
  } else {
    run_items<TileOrder::kHeadsPacked>(a, seqs, items, rows_per_item * a.group);
  }
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
