// One work item of the CPU paged_attention: some query rows of one sequence, for some of its KV
// heads, attended over that sequence's paged keys and values with an online softmax.
//
// The item walks the keys it needs in tiles of kKeyTile tokens, located through the block table.
// For each tile it computes the scores of all its query vectors, folds them into the running max
// and sum of each vector (rescaling that vector's fp32 accumulator when the max grows), and adds
// p . V to the accumulators. At the end, out = acc / sum. The KV is never gathered into a
// contiguous copy and no [q_len, seq_len] score matrix exists.
//
// Two loop orders over a tile, for two different bottlenecks:
//  - token-major (few query vectors per KV head: decode, speculative verification): memory
//    bound. A slot holds all KV heads of a token side by side, so the tile is read token by token
//    across all the item's heads, in address order within each block, prefetching as it goes.
//  - head-major (a tile of query rows of one KV head: prefill): compute bound. The tile's rows of
//    the head are (optionally) converted once to fp32 and reused by all the item's query vectors.
#pragma once

#include <algorithm>
#include <vector>

#include "paged_attention/attention_tile_cpu.h"

namespace eecore::cpu {

// Keys per tile: long enough to amortise the per-tile softmax bookkeeping, short enough that the
// tile's K and V rows (all heads of a slot: 32 x 2 KiB in bf16 at Hkv x D = 512) stay in L2.
constexpr int64_t kKeyTile = 32;
// The token-major order reads K and V in chunks of this many tokens per KV head. 8 keys fill the
// score kernel's blocks whatever the group: 4 x 2 for four query vectors, 2 x 4 and 1 x 4 for
// three (SmolLM2's G = 3; with chunks of 2, those fell to one key at a time, a horizontal sum per
// score): SmolLM2's decode attention ran 1.15-1.36x faster than with chunks of 2 (1 and 8
// sequences, 128-1,024 keys, Zen 4, bench/attention_rows.py alternated). 8 values amortise the
// accumulator loads/stores of a value chunk over more keys.
constexpr int64_t kTokenMajorKeyChunk = 8;
constexpr int64_t kTokenMajorValueChunk = 8;

// One sequence of the batch, as read from the index tensors.
struct SeqSpan {
  int64_t q_begin;  // first query row in `query`
  int64_t q_len;    // query rows: the last q_len of the seq_len cached tokens
  int64_t seq_len;  // cached tokens, the new ones included
};

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
  // [Tq] or null: row i of a chunk sees chunk key j iff bit j of its entry is set (token trees)
  const int64_t* tree_mask;
  int64_t block_size, num_kv_heads, head_dim;
  int64_t group;       // query heads per KV head (G)
  int64_t padded_dim;  // head_dim rounded up to a multiple of the vector width
  float scale;
  bool causal;
};

// How an item walks its key tiles.
enum class TileOrder {
  kTokenMajor,        // token_major_tile: cache rows read in place, token by token across heads
  kHeadMajorInPlace,  // head_major_tile, cache rows read in place
  kHeadMajorPacked,   // head_major_tile, rows converted to padded fp32 first
};

// A unit of parallel work: query rows [row_begin, row_end) of sequence `seq` (counted from its
// first query row) for the KV heads [head_begin, head_end) and all their query heads.
//
// Its query vectors are numbered head-major: vector m belongs to KV head
// head_begin + m / (rows x G), and within it to row (m % (rows x G)) / G and query head
// G x kv_head + m % G.
struct WorkItem {
  int64_t seq, head_begin, head_end, row_begin, row_end;
  TileOrder order;
  int64_t cost;  // ~ query vectors x keys they see; for scheduling only

  int64_t num_rows() const { return row_end - row_begin; }
  int64_t num_heads() const { return head_end - head_begin; }
};

// Per-thread buffers, sized once for the largest item.
template <typename scalar_t>
struct TileScratch {
  std::vector<float> q, acc, scores, row_max, row_sum, k_packed, v_packed;
  std::vector<int64_t> slot_offsets;                       // this key tile's slots, then the next's
  std::vector<const scalar_t*> k_rows, v_rows;             // one KV head's rows of this tile
  std::vector<const float*> k_packed_rows, v_packed_rows;  // rows of k_packed / v_packed

  TileScratch(int64_t max_vectors, int64_t padded_dim)
      : q(max_vectors * padded_dim),
        acc(max_vectors * padded_dim),
        scores(max_vectors * kKeyTile),
        row_max(max_vectors),
        row_sum(max_vectors),
        k_packed(kKeyTile * padded_dim, 0.f),
        v_packed(kKeyTile * padded_dim, 0.f),
        slot_offsets(2 * kKeyTile),
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

// Where an item's query vectors and keys sit in their sequence.
struct ItemGeometry {
  int64_t vectors_per_head;  // rows x G
  int64_t num_vectors;       // x the item's KV heads
  int64_t first_q_pos;       // position of the item's first query row in its sequence
  int64_t kv_end;            // keys the item needs: [0, kv_end)
  int64_t chunk_begin;       // position of the sequence's first query row (its chunk's first key)
  const int64_t* tree_mask;  // the tree_mask entry of the item's first row, or null

  template <typename scalar_t>
  ItemGeometry(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item)
      : vectors_per_head(item.num_rows() * a.group),
        num_vectors(item.num_heads() * item.num_rows() * a.group),
        first_q_pos(seq.seq_len - seq.q_len + item.row_begin),
        // a causal item needs no key past its last row
        kv_end(a.causal ? seq.seq_len - seq.q_len + item.row_end : seq.seq_len),
        chunk_begin(seq.seq_len - seq.q_len),
        tree_mask(a.tree_mask != nullptr ? a.tree_mask + seq.q_begin + item.row_begin : nullptr) {}
};

// Loads the item's query vectors into fp32, pre-multiplied by the softmax scale, zero-padded.
template <typename scalar_t>
void load_query_vectors(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item, float* q) {
  for (int64_t h = item.head_begin; h < item.head_end; ++h) {
    for (int64_t r = 0; r < item.num_rows(); ++r) {
      const scalar_t* row = a.query + (seq.q_begin + item.row_begin + r) * a.q_stride_token;
      for (int64_t g = 0; g < a.group; ++g) {
        const scalar_t* src = row + (h * a.group + g) * a.q_stride_head;
        float* dst = q + (((h - item.head_begin) * item.num_rows() + r) * a.group + g) * a.padded_dim;
        for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
        std::fill(dst + a.head_dim, dst + a.padded_dim, 0.f);
      }
    }
  }
}

// Element offsets (into either cache) of the slots of tokens [first, first + count) of sequence
// `seq`, following its block table block by block (no division per token).
template <typename scalar_t>
void locate_slots(const AttentionArgs<scalar_t>& a, int64_t seq, int64_t first, int64_t count, int64_t* offsets) {
  const int32_t* blocks = a.block_table + seq * a.max_blocks;
  const int64_t slot_elems = a.num_kv_heads * a.head_dim;
  int64_t block_index = first / a.block_size;
  int64_t offset = first % a.block_size;
  for (int64_t n = 0; n < count; ++block_index, offset = 0) {
    const int64_t block_start = int64_t{blocks[block_index]} * a.block_size;
    for (; offset < a.block_size && n < count; ++offset, ++n) offsets[n] = (block_start + offset) * slot_elems;
  }
}

// Asks for the cache lines of elements [begin, end) of `count` slots (the item's KV heads), so
// that their misses overlap with the arithmetic in between: the slots of a sequence lie in
// blocks in random order, which the hardware prefetchers cannot anticipate.
template <typename scalar_t>
inline void prefetch_slots(const scalar_t* cache, const int64_t* offsets, int64_t count, int64_t begin, int64_t end) {
  constexpr int64_t kLine = 64;
  for (int64_t n = 0; n < count; ++n) {
    const char* first = reinterpret_cast<const char*>(cache + offsets[n] + begin);
    const char* last = reinterpret_cast<const char*>(cache + offsets[n] + end);
    for (const char* line = first; line < last; line += kLine) __builtin_prefetch(line);
  }
}

// Converts `count` rows to fp32 rows of padded_dim (the padding stays zero from construction).
template <typename scalar_t>
void pack_rows(const scalar_t* const* rows, int64_t count, int64_t head_dim, int64_t padded_dim, float* packed) {
  const int64_t vector_part = head_dim / kVecWidth * kVecWidth;
  for (int64_t n = 0; n < count; ++n) {
    const scalar_t* src = rows[n];
    float* dst = packed + n * padded_dim;
    for (int64_t d = 0; d < vector_part; d += kVecWidth) Vec8::load(src + d).store(dst + d);
    for (int64_t d = vector_part; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// Adds the position bias and applies the causal mask to the scores of one query vector against
// keys [first_key, first_key + count). `q_pos` is the query row's position in its sequence.
// With a tree mask (`tree_bits` non-null: the row's tree_mask entry; its chunk starts at key
// `chunk_begin`), chunk keys off the row's path in the token tree are masked too.
inline void bias_and_mask_row(float* s, int64_t count, int64_t first_key, int64_t q_pos, const float* bias_row,
                              int64_t max_distance, bool causal, const int64_t* tree_bits,
                              int64_t chunk_begin) {
  if (bias_row != nullptr) {
    for (int64_t n = 0; n < count; ++n) {
      const int64_t distance = std::clamp<int64_t>(q_pos - (first_key + n), 0, max_distance - 1);
      s[n] += bias_row[distance];
    }
  }
  if (causal) {
    // Keys after the query's own position are in its future.
    for (int64_t n = std::max<int64_t>(0, q_pos + 1 - first_key); n < count; ++n)
      s[n] = kNegInf;
  }
  if (tree_bits != nullptr) {
    // Sibling branches of a token tree sit in consecutive slots of one chunk but are not each
    // other's context: chunk key j (before the row's own, later ones are masked above) counts
    // only when bit j is set, i.e. when it is an ancestor of this row. The row's bits stop at
    // its own index (checked up front), so j < 64 and the shift is defined.
    const uint64_t bits = static_cast<uint64_t>(*tree_bits);
    const int64_t begin = std::max<int64_t>(0, chunk_begin - first_key);
    const int64_t end = std::min<int64_t>(count, q_pos - first_key);
    for (int64_t n = begin; n < end; ++n)
      if (((bits >> (first_key + n - chunk_begin)) & 1u) == 0) s[n] = kNegInf;
  }
}

// Bias, mask and online softmax of vectors [m_begin, m_end) of the item for one key tile: their
// scores become probabilities p (unnormalised, relative to the running max) and their
// accumulators are rescaled to the new max.
template <typename scalar_t>
void softmax_tile(const AttentionArgs<scalar_t>& a, const WorkItem& item, const ItemGeometry& geo,
                  TileScratch<scalar_t>& scratch, int64_t m_begin, int64_t m_end, int64_t first_key, int64_t count) {
  const int64_t padded_count = round_up_to_vec(count);
  const bool needs_mask = a.causal && first_key + count - 1 > geo.first_q_pos;
  // A tree mask touches only tiles that reach into the chunk (the keys of the query rows).
  const bool needs_tree = geo.tree_mask != nullptr && first_key + count > geo.chunk_begin;
  for (int64_t m = m_begin; m < m_end; ++m) {
    float* s = scratch.scores.data() + m * kKeyTile;
    std::fill(s + count, s + padded_count, kNegInf);
    const int64_t kv_head = item.head_begin + m / geo.vectors_per_head;
    const int64_t row = (m % geo.vectors_per_head) / a.group;
    const int64_t q_head = kv_head * a.group + m % a.group;
    const float* bias_row = a.position_bias ? a.position_bias + q_head * a.max_distance : nullptr;
    if (bias_row != nullptr || needs_mask || needs_tree)
      bias_and_mask_row(s, count, first_key, geo.first_q_pos + row, bias_row, a.max_distance, needs_mask,
                        needs_tree ? geo.tree_mask + row : nullptr, geo.chunk_begin);
    const float correction = online_softmax_row(s, padded_count, scratch.row_max[m], scratch.row_sum[m]);
    if (correction != 1.f) scale_row(scratch.acc.data() + m * a.padded_dim, a.padded_dim, correction);
  }
}

// One key tile of an item, read in address order: for each chunk of tokens, every KV head of the
// item. While the scores of a chunk are computed, its value rows are prefetched; while the values
// of a chunk are accumulated, the next tile's key rows are. Needs head_dim % 8 == 0 (the cache
// rows are read in place).
template <typename scalar_t>
void token_major_tile(const AttentionArgs<scalar_t>& a, const WorkItem& item, const ItemGeometry& geo,
                      TileScratch<scalar_t>& scratch, const int64_t* slots, int64_t first_key, int64_t count,
                      const int64_t* next_slots, int64_t next_count) {
  const int64_t dim = a.padded_dim, per_head = geo.vectors_per_head;
  const int64_t heads_begin = item.head_begin * a.head_dim, heads_end = item.head_end * a.head_dim;
  float* scores = scratch.scores.data();
  const scalar_t* rows[kTokenMajorValueChunk];

  for (int64_t n = 0; n < count; n += kTokenMajorKeyChunk) {
    const int64_t chunk = std::min(kTokenMajorKeyChunk, count - n);
    prefetch_slots(a.v_cache, slots + n, chunk, heads_begin, heads_end);
    for (int64_t h = item.head_begin; h < item.head_end; ++h) {
      const int64_t m0 = (h - item.head_begin) * per_head;
      for (int64_t j = 0; j < chunk; ++j) rows[j] = a.k_cache + slots[n + j] + h * a.head_dim;
      tile_scores(scratch.q.data() + m0 * dim, dim, per_head, rows, chunk, dim, scores + m0 * kKeyTile + n, kKeyTile);
    }
  }

  softmax_tile(a, item, geo, scratch, 0, geo.num_vectors, first_key, count);

  for (int64_t n = 0; n < count; n += kTokenMajorValueChunk) {
    const int64_t chunk = std::min(kTokenMajorValueChunk, count - n);
    if (n < next_count)
      prefetch_slots(a.k_cache, next_slots + n, std::min(chunk, next_count - n), heads_begin, heads_end);
    for (int64_t h = item.head_begin; h < item.head_end; ++h) {
      const int64_t m0 = (h - item.head_begin) * per_head;
      for (int64_t j = 0; j < chunk; ++j) rows[j] = a.v_cache + slots[n + j] + h * a.head_dim;
      tile_accumulate(scores + m0 * kKeyTile + n, kKeyTile, per_head, rows, chunk, dim,
                      scratch.acc.data() + m0 * dim, dim);
    }
  }
}

// One key tile of one KV head of an item, for all the head's query vectors. kPackKV: convert the
// tile's rows to padded fp32 first (needed when head_dim is not a multiple of 8; worth it when
// many query vectors reuse each row).
template <bool kPackKV, typename scalar_t>
void head_major_tile(const AttentionArgs<scalar_t>& a, const WorkItem& item, const ItemGeometry& geo,
               TileScratch<scalar_t>& scratch, int64_t kv_head, const int64_t* slots, int64_t first_key,
               int64_t count) {
  const int64_t dim = a.padded_dim;
  const int64_t m0 = (kv_head - item.head_begin) * geo.vectors_per_head;
  const float* q = scratch.q.data() + m0 * dim;
  float* acc = scratch.acc.data() + m0 * dim;
  float* scores = scratch.scores.data() + m0 * kKeyTile;
  for (int64_t n = 0; n < count; ++n) {
    scratch.k_rows[n] = a.k_cache + slots[n] + kv_head * a.head_dim;
    scratch.v_rows[n] = a.v_cache + slots[n] + kv_head * a.head_dim;
  }
  if constexpr (kPackKV) {
    pack_rows(scratch.k_rows.data(), count, a.head_dim, dim, scratch.k_packed.data());
    pack_rows(scratch.v_rows.data(), count, a.head_dim, dim, scratch.v_packed.data());
    tile_scores(q, dim, geo.vectors_per_head, scratch.k_packed_rows.data(), count, dim, scores, kKeyTile);
  } else {
    tile_scores(q, dim, geo.vectors_per_head, scratch.k_rows.data(), count, dim, scores, kKeyTile);
  }
  softmax_tile(a, item, geo, scratch, m0, m0 + geo.vectors_per_head, first_key, count);
  if constexpr (kPackKV) {
    tile_accumulate(scores, kKeyTile, geo.vectors_per_head, scratch.v_packed_rows.data(), count, dim, acc, dim);
  } else {
    tile_accumulate(scores, kKeyTile, geo.vectors_per_head, scratch.v_rows.data(), count, dim, acc, dim);
  }
}

// The attention of one work item, written to `out`.
template <TileOrder kOrder, typename scalar_t>
void attend_item_in_order(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item,
                 TileScratch<scalar_t>& scratch) {
  const ItemGeometry geo(a, seq, item);
  const int64_t dim = a.padded_dim;
  load_query_vectors(a, seq, item, scratch.q.data());
  std::fill_n(scratch.acc.data(), geo.num_vectors * dim, 0.f);
  std::fill_n(scratch.row_max.data(), geo.num_vectors, kNegInf);
  std::fill_n(scratch.row_sum.data(), geo.num_vectors, 0.f);

  // Slot offsets of the current tile and the next (located one tile ahead, for prefetching).
  int64_t* slots = scratch.slot_offsets.data();
  int64_t* next_slots = slots + kKeyTile;
  const int64_t heads_begin = item.head_begin * a.head_dim, heads_end = item.head_end * a.head_dim;
  locate_slots(a, item.seq, 0, std::min(kKeyTile, geo.kv_end), slots);
  for (int64_t first_key = 0; first_key < geo.kv_end; first_key += kKeyTile) {
    const int64_t count = std::min(kKeyTile, geo.kv_end - first_key);
    const int64_t next_count = std::clamp<int64_t>(geo.kv_end - first_key - kKeyTile, 0, kKeyTile);
    locate_slots(a, item.seq, first_key + kKeyTile, next_count, next_slots);
    if constexpr (kOrder == TileOrder::kTokenMajor) {
      token_major_tile(a, item, geo, scratch, slots, first_key, count, next_slots, next_count);
    } else {
      // Compute bound: a bulk prefetch of the next tile (this item's heads only) is enough.
      prefetch_slots(a.k_cache, next_slots, next_count, heads_begin, heads_end);
      prefetch_slots(a.v_cache, next_slots, next_count, heads_begin, heads_end);
      for (int64_t h = item.head_begin; h < item.head_end; ++h)
        head_major_tile<kOrder == TileOrder::kHeadMajorPacked>(a, item, geo, scratch, h, slots, first_key, count);
    }
    std::swap(slots, next_slots);
  }

  // out = acc / sum, rounded once to the output dtype.
  for (int64_t m = 0; m < geo.num_vectors; ++m) {
    const int64_t kv_head = item.head_begin + m / geo.vectors_per_head;
    const int64_t row = seq.q_begin + item.row_begin + (m % geo.vectors_per_head) / a.group;
    scalar_t* dst = a.out + row * a.o_stride_token + (kv_head * a.group + m % a.group) * a.o_stride_head;
    const float inv_sum = 1.f / scratch.row_sum[m];
    const float* src = scratch.acc.data() + m * dim;
    for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv_sum);
  }
}

// The attention of one work item, in the item's tile order.
template <typename scalar_t>
void attend_item(const AttentionArgs<scalar_t>& a, const SeqSpan& seq, const WorkItem& item,
                 TileScratch<scalar_t>& scratch) {
  switch (item.order) {
    case TileOrder::kTokenMajor:
      return attend_item_in_order<TileOrder::kTokenMajor>(a, seq, item, scratch);
    case TileOrder::kHeadMajorInPlace:
      return attend_item_in_order<TileOrder::kHeadMajorInPlace>(a, seq, item, scratch);
    case TileOrder::kHeadMajorPacked:
      return attend_item_in_order<TileOrder::kHeadMajorPacked>(a, seq, item, scratch);
  }
}

}  // namespace eecore::cpu
