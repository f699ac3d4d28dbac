// The tensor-core decode kernel (bf16/fp16): decode and short verification queries with GQA, at
// memory bandwidth.
//
// Why it exists: with G query heads per KV head, every K/V element read costs 2G multiply-adds.
// On an H200, SIMT fp32 at G = 4 would need more than half the chip's FMA rate just to keep up
// with HBM (the SIMT "decode" kernel tops out near 40% of bandwidth there, 23% at G = 8), so the
// group's arithmetic goes to the tensor cores and the kernel is left with moving bytes.
//
// A CTA owns up to kRows = 16 * M_TILES packed rows (row m = q_local * G + g: query token q_local
// under query head kv_head * G + g, as in the "mma" kernel) of one sequence and one KV head, over
// one context split. Unlike the "mma" kernel, its 4 warps split the keys, not the rows: warp w
// takes the split's 16-key tiles w, w + 4, w + 8, ... through a cp.async pipeline of its own
// (kStages deep, in its own shared memory), so the main loop synchronizes only within a warp, and
// computes S = Q K^T (mma.m16n8k16), the online softmax on the accumulators, and O += P V for all
// its rows. The 4 warps' (m, l, O) are merged through shared memory at the end. Fragment layouts
// follow eecore/cuda/mma.cuh and are the "mma" kernel's.
#pragma once

#include "attention_common.cuh"
#include "eecore/cuda/async_copy.cuh"
#include "eecore/cuda/mma.cuh"
#include "eecore/cuda/pdl.cuh"

namespace eecore::cuda::attention {

namespace decode_mma {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kWarpKeys = 16;  // keys per warp tile: one k-slice of P V, two n-tiles of S
// Per-warp pipeline depth: 3 keeps two tiles in flight while one is computed. 2 (one in flight)
// halves the shared memory so that 3 CTAs (12 warps) fit an SM: an experiment for the latency the
// profile shows (docs/cuda.md), chosen with EECORE_DECODE_MMA_STAGES=2 (D <= 128, 16 rows); 4
// (three in flight) with EECORE_DECODE_MMA_STAGES=4 where two CTAs still fit (D = 64).
constexpr int kDefaultStages = 3;
// LDMATRIX = true ("v2"): fragments come from shared memory by ldmatrix (K and Q as they lie, V
// transposed): 4 + 2 instructions per 16 dims of a tile instead of 16 32-bit and 32 16-bit loads;
// and, as `v2_flags` (EECORE_DECODE_MMA_V2_FLAGS, default kDefaultV2Flags) selects, so that each can be timed
// alone:
//   kWholeTileCopy  a tile whose 16 keys lie in one block (block sizes that are multiples of 16)
//                   is copied from one table lookup and one base address, instead of a lookup and
//                   a 64-bit address per key and lane;
//   kWholeTileMask  such a tile, entirely before the first query and with no bias or tree mask,
//                   skips the per-key masks;
//   kLazyRescale    O is rescaled only when some row's running max moved (alpha == 1 otherwise:
//                   skipping the multiply is exact);
//   kQOverlap       the first tiles' copies are issued before the CTA waits for its Q tile (on an
//                   H200 a wash with GQA, 1.007x over 47 cells; it was on in the G = 1 timings
//                   that made this kernel the planner's choice there);
//   kEarlyLookups   whole tiles' block ids are read a pipeline round ahead of their copies.
//                   Otherwise each stage reads its tile's id after the stage before issued its
//                   copies (their asm's memory clobber keeps the compiler from hoisting the read),
//                   and the copies need the id: the prologue's stages start a memory latency
//                   apart, which short contexts pay in full. Not yet run on a GPU: off by default
//                   (EECORE_DECODE_MMA_V2_FLAGS=31).
// The first version's profile (docs/cuda.md) showed a latency-bound warp issuing few instructions
// per cycle, most of them per-key addressing. On an H200 at B = 64, context 4096, 32/8 heads,
// D = 128 (bench/results/nvidia-h200/nvidia-h200-decode-kernels-2026-11-27.md): the first version
// 401 us (65% of the copy bandwidth), ldmatrix alone 392, whole-tile copies alone 287, masks or
// rescaling alone ~395, all of them 279 us (94%). The default; EECORE_DECODE_MMA_LDMATRIX=0 runs
// the first version for side-by-side timing.
constexpr bool kDefaultLdmatrix = true;
constexpr int32_t kWholeTileCopy = 1, kWholeTileMask = 2, kLazyRescale = 4, kQOverlap = 8, kEarlyLookups = 16;
constexpr int32_t kDefaultV2Flags = kWholeTileCopy | kWholeTileMask | kLazyRescale | kQOverlap;
constexpr int32_t kKnownV2Flags = kDefaultV2Flags | kEarlyLookups;
constexpr int32_t kLookUpNow = INT32_MIN;  // a whole tile whose block id was not looked up ahead
// FIXED_FLAGS >= 0 compiles the kernel for those v2 flags only (the launcher takes it for the
// default flags): with `v2_flags` a runtime value every flag's path and test stays in the code,
// 12,448 SASS instructions (194 KiB) for bf16 at D = 128 against 7,280 with the defaults fixed.
// An H200 found the kernel at B = 1 waiting 40% of its cycles for instruction fetches, its few
// warps running a body too large for the instruction caches a handful of times each.
constexpr int kRuntimeV2Flags = -1;

template <int HEAD_DIM, int M_TILES, int STAGES = kDefaultStages>
struct Shape {
  static constexpr int kStages = STAGES;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM: 64, 128 or 256");
  static_assert(M_TILES == 1 || (M_TILES == 2 && HEAD_DIM <= 128), "M_TILES: 1, or 2 up to D = 128");
  static constexpr int kRows = 16 * M_TILES;
  static constexpr int kPitch = HEAD_DIM + 8;  // elements per smem row: conflict-free fragment loads
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  static constexpr int kKeysPerPass = kWarpSize / kChunks;        // keys a warp copies per pass
  static constexpr int kCopiesPerLane = kWarpKeys / kKeysPerPass;  // keys each lane copies per tile
  static constexpr int kTileBytes = 2 * kWarpKeys * kPitch * 2;    // K then V of one warp tile
  static constexpr int kWarpBytes = kStages * (kTileBytes + kWarpKeys * 4);  // + "key present" flags
  static constexpr int kQBytes = kRows * kPitch * 2;
  static constexpr int kPipelineBytes = kQBytes + kWarps * kWarpBytes;
  static constexpr int kMergeBytes = kWarps * kRows * (HEAD_DIM + 2) * 4;  // O, then m and l, per warp
  static constexpr int kSmemBytes = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
  // 228 KiB of shared memory per SM on sm_90, 1 KiB of it reserved per CTA; 3 CTAs only for the
  // 2-stage variant (registers: the 3-stage kernels use more than 3 CTAs' share)
  static constexpr int kCtasPerSm = STAGES == 2 && kSmemBytes <= 75 * 1024 ? 3 : kSmemBytes <= 110 * 1024 ? 2 : 1;
};

// Block id and in-block offset of a sequence's key `pos`; false when absent. Block sizes are
// usually powers of two: a shift and a mask then replace paged_locate's division.
__device__ __forceinline__ bool locate_key(const PagedLayout& layout, const int32_t* table, int32_t table_len,
                                           int32_t block_shift, int64_t pos, int32_t& block, int32_t& offset) {
  if (block_shift < 0 || pos > INT32_MAX) return paged_locate(layout, table, table_len, pos, block, offset);
  const int32_t p32 = static_cast<int32_t>(pos);
  const int32_t index = p32 >> block_shift;
  offset = p32 & (layout.block_size - 1);
  if (p32 < 0 || index >= table_len) return false;
  block = table[index];
  return block >= 0 && block < layout.num_blocks;
}

template <typename T, int HEAD_DIM, int M_TILES, int STAGES = kDefaultStages, bool LDMATRIX = kDefaultLdmatrix,
          int FIXED_FLAGS = kRuntimeV2Flags>
__global__ void __launch_bounds__(kThreads, Shape<HEAD_DIM, M_TILES, STAGES>::kCtasPerSm)
    paged_attention_decode_mma_kernel(const PagedAttentionParams p, const int32_t splits, const int32_t split_tokens,
                                      float* __restrict__ workspace, const int32_t runtime_v2_flags) {
  const int32_t v2_flags = FIXED_FLAGS >= 0 ? FIXED_FLAGS : runtime_v2_flags;
  using S = Shape<HEAD_DIM, M_TILES, STAGES>;
  constexpr int kStages = STAGES;
  constexpr int kRows = S::kRows;
  constexpr int kPitch = S::kPitch;
  constexpr int kDimTiles = HEAD_DIM / 8;  // n-tiles of O
  extern __shared__ __align__(16) unsigned char smem[];
  // Lets a kernel launched after this one with PDL (EECORE_PDL=1: the output projection) be
  // scheduled now: it asks L2 for its weights while attention runs, then waits for it in pdl_wait.
  // This kernel itself is launched without PDL, so the kernels before it have finished.
  pdl_launch_dependents();

  const int32_t seq = blockIdx.x / splits;
  const int32_t split = blockIdx.x % splits;
  const int32_t m_begin = blockIdx.y * kRows;
  const int32_t kv_head = blockIdx.z;
  const int32_t group = p.num_q_heads / p.num_kv_heads;

  PackedRows pr;
  if (!packed_rows(p, seq, m_begin, kRows, split, split_tokens, pr)) return;  // uniform over the CTA
  const int32_t q_begin = pr.q_begin;
  const int64_t rows = pr.rows, first_pos = pr.first_pos, k_begin = pr.k_begin, k_stop = pr.k_stop;
  const int32_t num_tiles =
      k_stop > k_begin ? static_cast<int32_t>((k_stop - k_begin + kWarpKeys - 1) / kWarpKeys) : 0;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int quad_row = lane / 4;   // "group" in the PTX fragment tables
  const int quad_lane = lane % 4;  // "threadID_in_group"

  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);

  // ---- the Q tile, shared by the 4 warps
  T* q_s = reinterpret_cast<T*>(smem);  // [kRows][kPitch]
  load_packed_q<T, kRows, HEAD_DIM, kPitch, kThreads>(p, pr, m_begin, kv_head, q_s);
  cp_async_commit();
  const bool q_overlap = LDMATRIX && (v2_flags & kQOverlap);  // uniform over the grid
  if (!q_overlap) {
    cp_async_wait<0>();
    __syncthreads();
  }

  // ---- this warp's pipeline: tiles warp, warp + kWarps, ... of the split
  unsigned char* warp_smem = smem + S::kQBytes + warp * S::kWarpBytes;
  auto k_tile = [&](int stage) { return reinterpret_cast<T*>(warp_smem + stage * S::kTileBytes); };
  auto v_tile = [&](int stage) { return k_tile(stage) + kWarpKeys * kPitch; };
  // [kStages][kWarpKeys]: 0 key absent, 1 present, kWholeTile: every key of the tile present (a
  // whole-tile copy's flags)
  int32_t* present_s = reinterpret_cast<int32_t*>(warp_smem + kStages * S::kTileBytes);
  constexpr int32_t kWholeTile = 2;
  const int32_t my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;

  const int32_t* table = p.block_table + seq * p.block_table_stride;
  const PagedLayout k_layout{p.k_stride_block, p.k_stride_token, p.k_stride_head, p.block_size, p.num_blocks};
  const PagedLayout v_layout{p.v_stride_block, p.v_stride_token, p.v_stride_head, p.block_size, p.num_blocks};
  const int32_t block_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  const int32_t copy_chunk = lane % S::kChunks;
  const int32_t copy_key = lane / S::kChunks;
  auto tile_start = [&](int32_t t) { return k_begin + static_cast<int64_t>(warp + t * kWarps) * kWarpKeys; };

  // Whether tile t's 16 keys lie in one block (block sizes that are multiples of 16), so that one
  // table lookup and one base address serve the whole tile (kWholeTileCopy).
  auto whole_tile = [&](int32_t t) {
    const int64_t first = tile_start(t);
    return LDMATRIX && (v2_flags & kWholeTileCopy) && block_shift >= 4 && (first & (kWarpKeys - 1)) == 0 &&
           first + kWarpKeys <= k_stop && first <= INT32_MAX - kWarpKeys;
  };
  // A whole tile's block id (-1: past the table).
  auto tile_block = [&](int32_t t) {
    const int32_t index = static_cast<int32_t>(tile_start(t)) >> block_shift;
    return index < p.max_blocks ? table[index] : -1;
  };
  // Copies this warp's tile t into stage t % kStages: every block-table lookup first (the copies'
  // asm has a memory clobber that would serialize them), then the copies. `block_ahead`: a whole
  // tile's block id, looked up a round ahead (kEarlyLookups), or kLookUpNow.
  auto issue = [&](int32_t t, int32_t block_ahead) {
    const int stage = t % kStages;
    const int64_t first = tile_start(t);
    if (whole_tile(t)) {
      const int32_t block = block_ahead != kLookUpNow ? block_ahead : tile_block(t);
      const bool present = block >= 0 && block < p.num_blocks;
      const int32_t offset = (static_cast<int32_t>(first) & (p.block_size - 1)) + copy_key;
      const T* k_src = k_cache + (present ? paged_offset(k_layout, block, offset, kv_head) : 0) + copy_chunk * 8;
      const T* v_src = v_cache + (present ? paged_offset(v_layout, block, offset, kv_head) : 0) + copy_chunk * 8;
      T* ks = k_tile(stage);
      T* vs = v_tile(stage);
#pragma unroll
      for (int i = 0; i < S::kCopiesPerLane; ++i) {
        const int32_t n = copy_key + i * S::kKeysPerPass;
        if (copy_chunk == 0) present_s[stage * kWarpKeys + n] = present ? kWholeTile : 0;
        T* k_dst = ks + n * kPitch + copy_chunk * 8;
        T* v_dst = vs + n * kPitch + copy_chunk * 8;
        if (present && copy_chunk * 8 < p.head_dim) {
          cp_async_16(k_dst, k_src + i * S::kKeysPerPass * p.k_stride_token);
          cp_async_16(v_dst, v_src + i * S::kKeysPerPass * p.v_stride_token);
        } else {
          zero_16(k_dst);
          zero_16(v_dst);
        }
      }
      return;
    }
    bool present[S::kCopiesPerLane];
    int32_t block[S::kCopiesPerLane], offset[S::kCopiesPerLane];
#pragma unroll
    for (int i = 0; i < S::kCopiesPerLane; ++i) {
      const int64_t pos = first + copy_key + i * S::kKeysPerPass;
      block[i] = 0;
      offset[i] = 0;
      present[i] = pos < k_stop && locate_key(k_layout, table, p.max_blocks, block_shift, pos, block[i], offset[i]);
    }
    T* ks = k_tile(stage);
    T* vs = v_tile(stage);
#pragma unroll
    for (int i = 0; i < S::kCopiesPerLane; ++i) {
      const int32_t n = copy_key + i * S::kKeysPerPass;
      if (copy_chunk == 0) present_s[stage * kWarpKeys + n] = present[i];
      T* k_dst = ks + n * kPitch + copy_chunk * 8;
      T* v_dst = vs + n * kPitch + copy_chunk * 8;
      if (present[i] && copy_chunk * 8 < p.head_dim) {
        cp_async_16(k_dst, k_cache + paged_offset(k_layout, block[i], offset[i], kv_head) + copy_chunk * 8);
        cp_async_16(v_dst, v_cache + paged_offset(v_layout, block[i], offset[i], kv_head) + copy_chunk * 8);
      } else {  // absent: zeros, so that p = 0 meets v = 0 and never 0 * garbage
        zero_16(k_dst);
        zero_16(v_dst);
      }
    }
  };

  // The two packed rows of each m-tile this thread holds accumulators for: quad_row and quad_row + 8.
  bool row_ok[M_TILES][2];
  int64_t row_pos[M_TILES][2];   // query position (causal mask, bias distance)
  int32_t row_head[M_TILES][2];  // query head
  int32_t row_token[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m_begin + mt * 16 + quad_row + 8 * h;
      row_ok[mt][h] = m < rows;
      const int64_t mm = min(m, rows - 1);
      const int32_t q_local = static_cast<int32_t>(mm / group);
      row_pos[mt][h] = first_pos + q_local;
      row_head[mt][h] = kv_head * group + static_cast<int32_t>(mm % group);
      row_token[mt][h] = q_begin + q_local;
    }
  }

  const float qk_scale = p.scale * kLog2e;
  float m_run[M_TILES][2], l_run[M_TILES][2];  // l: this lane's share; the quad adds them up at the end
  float o[M_TILES][kDimTiles][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[mt][h] = -INFINITY;
      l_run[mt][h] = 0.f;
    }
#pragma unroll
    for (int jd = 0; jd < kDimTiles; ++jd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][jd][e] = 0.f;
  }

  // kEarlyLookups: the whole tiles' block ids are read a pipeline round before their copies, so a
  // copy never waits for its table lookup: the prologue reads all its tiles' ids at once (one
  // memory latency, not one a tile), and each iteration reads the id of the tile it copies next.
  const bool early_lookups = LDMATRIX && (v2_flags & kEarlyLookups);  // uniform over the grid
  auto look_up_ahead = [&](int32_t t) { return t < my_tiles && whole_tile(t) ? tile_block(t) : kLookUpNow; };
  int32_t pending = kLookUpNow;  // tile it + kStages - 1's block id, looked up ahead
  if (early_lookups) {
    int32_t blocks[kStages];
#pragma unroll
    for (int t = 0; t < kStages; ++t) blocks[t] = look_up_ahead(t);
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) {
      if (t < my_tiles) issue(t, blocks[t]);
      cp_async_commit();
    }
    pending = blocks[kStages - 1];
  } else {
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) {
      if (t < my_tiles) issue(t, kLookUpNow);
      cp_async_commit();  // possibly empty: keeps "all but the newest kStages - 1" uniform
    }
  }
  if (q_overlap) {
    // Q's group is the oldest: it lands while the first tiles' copies are in flight, so a CTA pays
    // one memory latency before its first tile instead of two (short contexts are latency-bound).
    cp_async_wait<kStages - 1>();
    __syncthreads();
  }
  // A whole tile before the first query row needs no per-key mask (padding rows, never stored, may
  // then see keys: their values do not matter and stay finite).
  const bool unmasked_before_first_query =
      LDMATRIX && (v2_flags & kWholeTileMask) && p.position_bias == nullptr;
  for (int32_t it = 0; it < my_tiles; ++it) {
    if (early_lookups) {
      const int32_t next = look_up_ahead(it + kStages);
      if (it + kStages - 1 < my_tiles) issue(it + kStages - 1, pending);
      pending = next;
    } else if (it + kStages - 1 < my_tiles) {
      issue(it + kStages - 1, kLookUpNow);  // the stage the warp finished last iteration
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();  // every lane's copies of tile `it` are visible to the whole warp
    const int stage = it % kStages;
    const T* ks = k_tile(stage);
    const T* vs = v_tile(stage);
    const int64_t first = tile_start(it);

    // ---- S = Q K^T: kRows rows x 16 keys (two n-tiles of 8)
    float s[M_TILES][2][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      uint32_t b[2][2];
      if constexpr (LDMATRIX) {
        // matrix i = lane / 8: keys 8 (i / 2) + 0..7, dims 16 kk + 8 (i % 2) + 0..7 -> b[i / 2][i % 2]
        uint32_t r[4];
        ldmatrix_x4(r, ks + (8 * (lane / 16) + lane % 8) * kPitch + kk * 16 + 8 * ((lane / 8) % 2));
        b[0][0] = r[0];
        b[0][1] = r[1];
        b[1][0] = r[2];
        b[1][1] = r[3];
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const T* kb = ks + (8 * j + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
          b[j][0] = load_pair(kb);
          b[j][1] = load_pair(kb + 8);
        }
      }
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        uint32_t a[4];
        if constexpr (LDMATRIX) {
          // matrix i: rows 16 mt + 8 (i % 2) + 0..7, dims 16 kk + 8 (i / 2) + 0..7 -> a[i]
          ldmatrix_x4(a, q_s + (mt * 16 + 8 * ((lane / 8) % 2) + lane % 8) * kPitch + kk * 16 + 8 * (lane / 16));
        } else {
          const T* qa = q_s + (mt * 16 + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
          a[0] = load_pair(qa);
          a[1] = load_pair(qa + 8 * kPitch);
          a[2] = load_pair(qa + 8);
          a[3] = load_pair(qa + 8 * kPitch + 8);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) mma<T>(s[mt][j], a, b[j]);
      }
    }

    // ---- scale, bias, masks, online softmax per row (rows split over the 4 lanes of a quad)
    const bool unmasked = unmasked_before_first_query && present_s[stage * kWarpKeys] == kWholeTile &&
                          (first + kWarpKeys <= first_pos || (!p.causal && p.tree_mask == nullptr));
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (unmasked) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][j][e] *= qk_scale;
            tile_max[e / 2] = fmaxf(tile_max[e / 2], s[mt][j][e]);
          }
          continue;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2;
          const int32_t n = 8 * j + 2 * quad_lane + (e % 2);
          const int64_t pos = first + n;
          float x = -INFINITY;
          if (row_ok[mt][h] && present_s[stage * kWarpKeys + n] && (!p.causal || pos <= row_pos[mt][h]) &&
              tree_sees(p, row_token[mt][h], first_pos, pos)) {
            x = s[mt][j][e] * qk_scale;
            if (p.position_bias != nullptr) x += position_bias_log2(p, row_head[mt][h], row_pos[mt][h] - pos);
          }
          s[mt][j][e] = x;
          tile_max[h] = fmaxf(tile_max[h], x);
        }
      }
      float m_use[2], alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float m_new = fmaxf(m_run[mt][h], tile_max[h]);
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: every p is 0
        alpha[h] = exp2f(m_run[mt][h] - m_use[h]);
        m_run[mt][h] = m_new;
        l_run[mt][h] *= alpha[h];
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float prob = exp2f(s[mt][j][e] - m_use[e / 2]);
          s[mt][j][e] = prob;
          l_run[mt][e / 2] += prob;
        }
      }
      // The warp's rows mostly keep their max from tile to tile; multiplying by alpha == 1 is a no-op.
      if (!LDMATRIX || !(v2_flags & kLazyRescale) || !__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
        for (int jd = 0; jd < kDimTiles; ++jd) {
          o[mt][jd][0] *= alpha[0];
          o[mt][jd][1] *= alpha[0];
          o[mt][jd][2] *= alpha[1];
          o[mt][jd][3] *= alpha[1];
        }
      }

      // ---- O += P V: S's two n-tiles are exactly the A fragment of the tile's 16 keys
      const uint32_t a[4] = {pack_floats<T>(s[mt][0][0], s[mt][0][1]), pack_floats<T>(s[mt][0][2], s[mt][0][3]),
                             pack_floats<T>(s[mt][1][0], s[mt][1][1]), pack_floats<T>(s[mt][1][2], s[mt][1][3])};
      if constexpr (LDMATRIX) {
        // matrix i: keys 8 (i % 2) + 0..7, dims 8 (jd + i / 2) + 0..7, transposed -> b of n-tiles jd, jd + 1
        const T* vb = vs + (lane % 16) * kPitch + 8 * (lane / 16);
#pragma unroll
        for (int jd = 0; jd < kDimTiles; jd += 2) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, vb + 8 * jd);
          const uint32_t b0[2] = {r[0], r[1]};
          const uint32_t b1[2] = {r[2], r[3]};
          mma<T>(o[mt][jd], a, b0);
          mma<T>(o[mt][jd + 1], a, b1);
        }
      } else {
        const T* vb = vs + (2 * quad_lane) * kPitch + quad_row;
#pragma unroll
        for (int jd = 0; jd < kDimTiles; ++jd) {
          const T* vp = vb + 8 * jd;  // B[k][n] = V[key k][dim 8jd + n]
          const uint32_t b[2] = {pack_pair(vp[0], vp[kPitch]), pack_pair(vp[8 * kPitch], vp[9 * kPitch])};
          mma<T>(o[mt][jd], a, b);
        }
      }
    }
    __syncwarp();  // the whole warp has read this stage before a lane refills it
  }
  cp_async_wait<0>();

  // ---- complete the row sums over the quad, then merge the 4 warps through shared memory
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 1);
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 2);
    }
  }
  float* o_s = reinterpret_cast<float*>(smem);         // [kWarps][kRows][HEAD_DIM]
  float* ml_s = o_s + kWarps * kRows * HEAD_DIM;       // [kWarps][kRows][m, l]
  __syncthreads();  // every warp is done with Q and its pipeline
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + quad_row + 8 * h;
      float* dst = o_s + (warp * kRows + r) * HEAD_DIM + 2 * quad_lane;
#pragma unroll
      for (int jd = 0; jd < kDimTiles; ++jd)
        *reinterpret_cast<float2*>(dst + 8 * jd) = make_float2(o[mt][jd][2 * h], o[mt][jd][2 * h + 1]);
      if (quad_lane == 0) {
        ml_s[(warp * kRows + r) * 2] = m_run[mt][h];
        ml_s[(warp * kRows + r) * 2 + 1] = l_run[mt][h];
      }
    }
  }
  __syncthreads();

  const int32_t live_rows = static_cast<int32_t>(min(static_cast<int64_t>(kRows), rows - m_begin));
  for (int32_t i = tid; i < live_rows * p.head_dim; i += kThreads) {
    const int32_t r = i / p.head_dim, d = i % p.head_dim;
    float m, l, o;
    merge_parts<kWarps, kRows, HEAD_DIM>(ml_s, o_s, r, d, m, l, o);
    const int64_t mrow = m_begin + r;
    store_output<T>(p, workspace, splits, split, q_begin + static_cast<int32_t>(mrow / group),
                    kv_head * group + static_cast<int32_t>(mrow % group), d, m, l, o);
  }
}

}  // namespace decode_mma
}  // namespace eecore::cuda::attention
