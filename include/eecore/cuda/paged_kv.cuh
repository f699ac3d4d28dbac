// Paged-KV addressing on the device. A cache [NB, BS, Hkv, D] is described by its element strides;
// a sequence's token `pos` lives in block block_table[pos / BS] at offset pos % BS. Block ids and
// slots come from device memory and cannot be validated on the host without a synchronization, so
// every lookup here checks its range and reports "no such token" instead of reading out of bounds.
#pragma once

#include "eecore/cuda/common.cuh"

namespace eecore::cuda {

struct PagedLayout {
  int64_t block_stride;  // elements between consecutive blocks
  int64_t token_stride;  // elements between consecutive tokens of a block
  int64_t head_stride;   // elements between consecutive KV heads of a token
  int32_t block_size;    // tokens per block (BS)
  int32_t num_blocks;    // NB: valid block ids are [0, NB)
};

// Block id and in-block offset of a sequence's token `pos` through its block-table row `table`
// (`table_len` entries); false when the token is past the table or its block id is out of range
// (the token is then treated as absent). 32-bit division on the hot path: 64-bit integer division
// is a long software sequence on the GPU.
__device__ __forceinline__ bool paged_locate(const PagedLayout& layout, const int32_t* table, int32_t table_len,
                                             int64_t pos, int32_t& block, int32_t& offset) {
  if (pos < 0) return false;
  int64_t index;
  if (pos <= INT32_MAX) {
    const int32_t p32 = static_cast<int32_t>(pos);
    index = p32 / layout.block_size;
    offset = p32 - static_cast<int32_t>(index) * layout.block_size;
  } else {
    index = pos / layout.block_size;
    offset = static_cast<int32_t>(pos - index * layout.block_size);
  }
  if (index >= table_len) return false;
  block = table[index];
  return block >= 0 && block < layout.num_blocks;
}

// Element offset of a located token's head `head`.
__device__ __forceinline__ int64_t paged_offset(const PagedLayout& layout, int32_t block, int32_t offset,
                                                int32_t head) {
  return block * layout.block_stride + offset * layout.token_stride + head * layout.head_stride;
}

// Element offset of `slot` (block * BS + offset) for head 0, or -1 when the slot is negative (the
// "skip this token" marker) or beyond the cache.
__device__ __forceinline__ int64_t paged_slot_offset(const PagedLayout& layout, int64_t slot) {
  if (slot < 0) return -1;
  const int64_t block = slot / layout.block_size;
  if (block >= layout.num_blocks) return -1;
  return block * layout.block_stride + (slot - block * layout.block_size) * layout.token_stride;
}

}  // namespace eecore::cuda
