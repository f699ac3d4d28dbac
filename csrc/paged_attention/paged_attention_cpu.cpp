// paged_attention on the CPU: flash-style attention straight out of the paged KV cache.
//
// This file checks the index tensors, splits the batch into work items and runs them on
// at::parallel_for's threads; paged_attention_item_cpu.h computes one item (online softmax over
// key tiles read through the block table) and attention_tile_cpu.h holds the vectorised tile
// kernels.
//
// An item computes all the query heads of its KV heads together, so each key/value row read from
// the cache serves G = Hq / Hkv query heads (and, in prefill, every query row of the item).
//  - Decode (max_query_len == 1), and any sequence with few query rows (a speculative
//    verification): memory bound. An item is the sequence with all (or, for small batches, a
//    share of) its KV heads, and reads the cache token by token in address order.
//  - Prefill, chunked prefill: compute bound. An item is one KV head and a tile of query rows;
//    each key tile is converted once to fp32 and reused by all the item's query vectors.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
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

// Query vectors (rows x the query heads of a KV head) per head-major item: each packed key row
// is reused this many times. 32 keeps the fp32 accumulators of a 128-dim head at 16 KiB.
constexpr int64_t kHeadMajorVectors = 32;
// A sequence with at most this many query vectors per KV head (q_len x G) does too little
// arithmetic per cache byte to hide memory latency: it is streamed token-major over all its heads.
// That covers decode (q_len 1) and the verification of a few speculated tokens.
constexpr int64_t kTokenMajorMaxVectors = 16;

// Reads query_start_loc / seq_lens / block_table and checks every value the kernel will use, so
// that nothing is written (or read) out of bounds. These are the checks that need tensor data.
// `tree_mask` (contiguous [Tq], or null): every row's bits must lie inside its causal triangle.
std::vector<SeqSpan> read_batch_layout(const PagedAttentionDims& dims, const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                       int64_t max_query_len, bool causal, const int64_t* tree_mask) {
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
    if (tree_mask != nullptr) {
      // Row i sees itself and some of the rows before it: bit i set, every bit above i clear (the
      // kernel keeps its causal key bound, and q_len <= 64 keeps every shift in range).
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t row = starts[b] + i;
        const uint64_t bits = static_cast<uint64_t>(tree_mask[row]);
        EECORE_CHECK_ARG(kOp, "tree_mask", ((bits >> i) & 1u) != 0, "row ", row, " (row ", i, " of sequence ", b,
                         ") is ", tree_mask[row], ", expected bit ", i, " set (a row sees itself)");
        EECORE_CHECK_ARG(kOp, "tree_mask", i == 63 || (bits >> (i + 1)) == 0, "row ", row, " (row ", i,
                         " of sequence ", b, ") is ", tree_mask[row], ", expected no bit above ", i,
                         " set (a row sees no later row of its chunk)");
      }
    }
    seqs[b] = {starts[b], q_len, seq_len};
  }
  return seqs;
}

// The work items of a batch, most expensive first (so that the dynamic schedule ends on small
// items), and the most query vectors any of them holds (to size the scratch buffers).
struct WorkPlan {
  std::vector<WorkItem> items;
  int64_t max_vectors = 0;
};

template <typename scalar_t>
WorkPlan plan_work(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, int64_t max_query_len) {
  const int64_t group = a.group, num_heads = a.num_kv_heads;
  const bool rows_readable_in_place = a.head_dim % kVecWidth == 0;
  // Head-major items read the cache rows in place only when they are already fp32 vectors.
  const TileOrder head_major = rows_readable_in_place && std::is_same_v<scalar_t, float>
                                   ? TileOrder::kHeadMajorInPlace
                                   : TileOrder::kHeadMajorPacked;
  // Token-major items take all the KV heads of a sequence, so that each slot is read once and
  // whole; a sequence is split by heads only when there are too few to keep every thread busy.
  int64_t active = 0;
  for (const SeqSpan& seq : seqs) active += seq.q_len > 0;
  const int64_t splits =
      std::clamp<int64_t>((2 * at::get_num_threads() + active - 1) / std::max<int64_t>(active, 1), 1, num_heads);
  const int64_t token_major_heads = (num_heads + splits - 1) / splits;

  WorkPlan plan;
  auto add = [&](int64_t b, const SeqSpan& seq, int64_t h0, int64_t h1, int64_t r0, int64_t r1, TileOrder order) {
    const int64_t keys = a.causal ? seq.seq_len - seq.q_len + r1 : seq.seq_len;
    const int64_t vectors = (h1 - h0) * (r1 - r0) * group;
    plan.items.push_back({b, h0, h1, r0, r1, order, vectors * keys});
    plan.max_vectors = std::max(plan.max_vectors, vectors);
  };
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const SeqSpan& seq = seqs[b];
    if (seq.q_len == 0) continue;
    const bool token_major = rows_readable_in_place && (max_query_len == 1 || seq.q_len * group <= kTokenMajorMaxVectors);
    if (token_major) {
      for (int64_t h0 = 0; h0 < num_heads; h0 += token_major_heads)
        add(b, seq, h0, std::min(num_heads, h0 + token_major_heads), 0, seq.q_len, TileOrder::kTokenMajor);
      continue;
    }
    const int64_t rows_per_item = std::max<int64_t>(1, kHeadMajorVectors / group);
    for (int64_t r0 = 0; r0 < seq.q_len; r0 += rows_per_item)
      for (int64_t h = 0; h < num_heads; ++h)
        add(b, seq, h, h + 1, r0, std::min(seq.q_len, r0 + rows_per_item), head_major);
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return plan;
}

// Multiply-adds (query vectors x keys x head dim) that make a second thread worth waking. At
// 1 << 18 a batch of 8 decoding SmolLM2 sequences at 100 tokens of context (465k) ran on one
// thread, at 180 us a layer: a fifth of the step. At 1 << 14 (2 Zen 4 threads, alternated, medians
// of 15) that step ran 1.095x faster, one sequence's 1.02x, and sizes that used both threads
// already did not move.
constexpr int64_t kMinMacsPerWorker = 1 << 14;

// Runs every item on at::parallel_for's threads, each thread taking the next item when it is
// free: items differ in cost (causal tiles, varlen batches), so a static split would idle threads.
template <typename scalar_t>
void run_items(const AttentionArgs<scalar_t>& a, const std::vector<SeqSpan>& seqs, const WorkPlan& plan) {
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  if (num_items == 0) return;
  // Waking the thread pool costs more than a small batch's attention (and, on a loaded machine,
  // a parallel region can stall for milliseconds): run small work inline on the calling thread.
  int64_t total_cost = 0;
  for (const WorkItem& item : plan.items) total_cost += item.cost;
  const int64_t worth = std::max<int64_t>(1, total_cost * a.head_dim / kMinMacsPerWorker);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>({at::get_num_threads(), num_items, worth});
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    TileScratch<scalar_t> scratch(plan.max_vectors, a.padded_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const WorkItem& item = plan.items[i];
      cpu::attend_item(a, seqs[item.seq], item, scratch);
    }
  });
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t max_query_len, double scale, bool causal,
                         const std::optional<at::Tensor>& position_bias,
                         const std::optional<at::Tensor>& tree_mask) {
  const PagedAttentionDims dims = check_paged_attention_args(out, query, k_cache, v_cache, block_table, seq_lens,
                                                             query_start_loc, max_query_len, position_bias, causal,
                                                             tree_mask);
  const at::Tensor table = block_table.contiguous();
  const bool has_tree = tree_mask.has_value() && tree_mask->defined();
  const at::Tensor tree = has_tree ? tree_mask->contiguous() : at::Tensor();
  const int64_t* tree_bits = has_tree ? tree.const_data_ptr<int64_t>() : nullptr;
  const std::vector<SeqSpan> seqs =
      read_batch_layout(dims, table, seq_lens, query_start_loc, max_query_len, causal, tree_bits);
  if (dims.num_tokens == 0) return;
  const bool has_bias = position_bias.has_value() && position_bias->defined();

  EECORE_DISPATCH_FLOAT(query.scalar_type(), "eecore::paged_attention", [&] {
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
    a.tree_mask = tree_bits;
    a.block_size = dims.block_size;
    a.num_kv_heads = dims.num_kv_heads;
    a.head_dim = dims.head_dim;
    a.group = dims.num_q_heads / dims.num_kv_heads;
    a.padded_dim = round_up_to_vec(dims.head_dim);
    a.scale = static_cast<float>(scale);
    a.causal = causal;
    run_items(a, seqs, plan_work(a, seqs, max_query_len));
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("paged_attention", &eecore::paged_attention_cpu); }
