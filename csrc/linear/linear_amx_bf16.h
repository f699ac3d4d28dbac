// linear with a bf16 weight pre-tiled for AMX-BF16 (Intel Sapphire Rapids and newer): the tile
// engine's TDPBF16PS multiplies a 16 x 32 bf16 tile of the weight by 32 input features of up to 16
// input rows in one instruction (16 x 16 x 32 products summed into fp32), so the rows a decode batch
// or a verify pass adds cost almost nothing beside reading the weight.
//
// Why pre-tiled: a tile load reads 16 rows of 64 bytes. From a row-major weight those are 16 lines
// one row apart, a scattered pattern the prefetchers stream 0.8x as fast as the plain kernel's
// sequential reads; with each 16 x 32 tile stored as 1 KiB of its own (weight [N/16, K/32, 16, 32],
// a block of 16 output rows contiguous, tile after tile) the weight streams in address order. On an
// Intel Xeon (2 threads, SmolLM2-shaped projections, 531 MB of bf16 weights in huge pages from
// DRAM) 1 / 8 / 16 rows ran in 18.6 / 20.3 / 20.9 ms, against 17.3 / 26.9 / 48.3 ms with the
// AVX512-BF16 dot kernel (cpu_dots.h).
//
// The weight is the tile product's A operand (16 output rows x 32 features) and the input its B
// operand (16 feature pairs x up to 16 input rows, VNNI layout: each 32-bit word holds a row's two
// consecutive features), so each output is accumulated by the hardware from its own weight row and
// input row only, 32 features at a time in k order: an input row's outputs have the same bits
// whether it runs alone or in a batch of 48 (tested), which self-speculation's verify passes need.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear/linear_checks.h"

#include "linear/amx_tiles.h"

namespace eecore::amx {

constexpr int64_t kTileDepth = kTileBytes / 2;  // bf16 input features per tile
constexpr int kBlocksInFlight = 4;  // 16-row weight blocks sharing each loaded input tile

#if EECORE_CPU_AMX_BF16
inline bool usable() { return tiles_granted(); }

// Tiles 0-3: fp32 sums (16 outputs x input rows): of up to 4 weight blocks against one chunk of
// `rows0` input rows, or of 2 blocks against 2 chunks (tiles 0-1: the first chunk, 2-3: the second,
// of `rows1`); 4-5: weight tiles; 6-7: the chunks' input pairs (16 feature pairs x rows).
inline void configure_tiles(int64_t rows0, int64_t rows1) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = static_cast<uint16_t>(4 * (t < 2 ? rows0 : rows1));
  }
  cfg.rows[4] = cfg.rows[5] = kTileRows;
  cfg.colsb[4] = cfg.colsb[5] = 2 * kTileDepth;
  cfg.rows[6] = cfg.rows[7] = kTileDepth / 2;
  cfg.colsb[6] = static_cast<uint16_t>(4 * rows0);
  cfg.colsb[7] = static_cast<uint16_t>(4 * rows1);
  _tile_loadconfig(&cfg);
}

// NB consecutive weight blocks (tiles `steps` apart) against one chunk of input rows: their sums
// into c [NB][16][rows]. Every block accumulates its tiles in k order in its own tile register,
// whatever NB and the number of rows.
template <int NB>
inline void blocks_times_chunk(const c10::BFloat16* w, int64_t steps, const uint32_t* pairs, int64_t rows, float* c) {
  const int64_t block = steps * kTileRows * kTileDepth;  // elements of one weight block
  const int64_t tile = kTileRows * kTileDepth;
  const int64_t pair_stride = 4 * rows;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, pairs + s * (kTileDepth / 2) * rows, pair_stride);
    _tile_loadd(4, w + s * tile, 64);
    if constexpr (NB > 1) _tile_loadd(5, w + block + s * tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 5, 6);
    if constexpr (NB > 2) _tile_loadd(4, w + 2 * block + s * tile, 64);
    if constexpr (NB > 3) _tile_loadd(5, w + 3 * block + s * tile, 64);
    if constexpr (NB > 2) _tile_dpbf16ps(2, 4, 6);
    if constexpr (NB > 3) _tile_dpbf16ps(3, 5, 6);
  }
  const int64_t sums = kTileRows * rows;
  _tile_stored(0, c, pair_stride);
  if constexpr (NB > 1) _tile_stored(1, c + sums, pair_stride);
  if constexpr (NB > 2) _tile_stored(2, c + 2 * sums, pair_stride);
  if constexpr (NB > 3) _tile_stored(3, c + 3 * sums, pair_stride);
}

// Two weight blocks against two chunks of input rows (prompt-sized inputs): each weight tile loaded
// serves 2 chunks, where blocks_times_chunk reloads it (from L2) for every chunk; sums into
// c0 [2][16][rows0] and c1 [2][16][rows1], each block and chunk in its own tile register, k order.
inline void two_blocks_times_two_chunks(const c10::BFloat16* w, int64_t steps, const uint32_t* pairs0, int64_t rows0,
                                        const uint32_t* pairs1, int64_t rows1, float* c0, float* c1) {
  const int64_t block = steps * kTileRows * kTileDepth;
  const int64_t tile = kTileRows * kTileDepth;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, pairs0 + s * (kTileDepth / 2) * rows0, 4 * rows0);
    _tile_loadd(7, pairs1 + s * (kTileDepth / 2) * rows1, 4 * rows1);
    _tile_loadd(4, w + s * tile, 64);
    _tile_loadd(5, w + block + s * tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, 4 * rows0);
  _tile_stored(1, c0 + kTileRows * rows0, 4 * rows0);
  _tile_stored(2, c1, 4 * rows1);
  _tile_stored(3, c1 + kTileRows * rows1, 4 * rows1);
}

// One weight block's sums c [16 outputs][rows] into out rows j < rows (stride ldo), 16 outputs
// each: + bias, + out with `accumulate`, rounded once; in that order, as the dot kernel's epilogue.
// A gather takes output row j's 16 sums, which the tile holds a column apart.
inline void store_sums(const float* c, int64_t rows, const c10::BFloat16* bias, bool accumulate, c10::BFloat16* out,
                       int64_t ldo) {
  const __m512i column = sum_columns(rows);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : load_bf16x16(bias);
  for (int64_t j = 0; j < rows; ++j) {
    c10::BFloat16* dst = out + j * ldo;
    __m512 v = _mm512_i32gather_ps(column, c + j, 4);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    if (accumulate) v = _mm512_add_ps(v, load_bf16x16(dst));
    store_bf16x16(dst, v);
  }
}

// The input rows as tile products read them: chunk by chunk of 16 rows (m0 = 0, 16, ...), step by
// step of 32 features, 16 pair rows of `rows` words: pairs[m0 * K/2 + (s * 16 + p) * rows + j] holds
// features 32 s + 2 p and 32 s + 2 p + 1 of input row m0 + j.
inline void pack_pairs(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, uint32_t* pairs) {
  const int64_t words = K / 2;
  at::parallel_for(0, (M + kChunkRows - 1) / kChunkRows, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t m0 = ch * kChunkRows, rows = std::min(kChunkRows, M - m0);
      uint32_t* dst = pairs + m0 * words;
      for (int64_t j = 0; j < rows; ++j) {
        const c10::BFloat16* row = x + (m0 + j) * ldx;
        for (int64_t q = 0; q < words; ++q) std::memcpy(dst + q * rows + j, row + 2 * q, 4);
      }
    }
  });
}

// out [M, N] (bf16, row stride ldo) = input [M, K] . W^T (+ bias) (+ out with `accumulate`), W the
// tiled weight [N/16, K/32, 16, 32]. Each sum is rounded to bf16 once, as the dot kernel's are.
inline void linear_tiled(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                         const c10::BFloat16* bias, bool accumulate, const LinearDims& dims) {
  const int64_t M = dims.rows, K = dims.in, N = dims.out;
  const int64_t steps = K / kTileDepth, blocks = N / kTileRows;
  thread_local std::vector<uint32_t> pairs;  // reused: no allocation per step once grown
  pairs.resize(static_cast<size_t>(M * K / 2));
  pack_pairs(input.const_data_ptr<c10::BFloat16>(), input.stride(0), M, K, pairs.data());
  const uint32_t* packed = pairs.data();
  const c10::BFloat16* w = weight.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0);
  // at least ~64k multiply-adds a task; at::parallel_for then splits the blocks evenly (a larger
  // minimum left SmolLM2's 36-block o_proj at one row as 28 + 8 blocks on 2 threads)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * kTileRows));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float c[kBlocksInFlight * kTileRows * kChunkRows];
    int64_t configured0 = -1, configured1 = -1;
    const auto configure = [&](int64_t rows0, int64_t rows1) {
      if (rows0 != configured0 || rows1 != configured1) configure_tiles(rows0, rows1);
      configured0 = rows0;
      configured1 = rows1;
    };
    const auto store = [&](const float* sums, int64_t block, int64_t m0, int64_t rows) {
      const int64_t n0 = block * kTileRows;
      store_sums(sums, rows, bias == nullptr ? nullptr : bias + n0, accumulate, o + m0 * ldo + n0, ldo);
    };
    // Prompt-sized inputs: pairs of blocks against pairs of chunks (a last odd chunk below).
    const int blocks_in_flight = M > kChunkRows ? 2 : kBlocksInFlight;
    for (int64_t b = b0; b < b1; b += blocks_in_flight) {
      const int nb = static_cast<int>(std::min<int64_t>(blocks_in_flight, b1 - b));
      const c10::BFloat16* wb = w + b * steps * kTileRows * kTileDepth;
      for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, M - m0);
        const uint32_t* chunk = packed + m0 * (K / 2);
        if (nb == 2 && M - m0 > kChunkRows) {
          const int64_t rows1 = std::min(kChunkRows, M - m0 - kChunkRows);
          float* c1 = c + 2 * kTileRows * rows;
          configure(rows, rows1);
          two_blocks_times_two_chunks(wb, steps, chunk, rows, chunk + kChunkRows * (K / 2), rows1, c, c1);
          for (int t = 0; t < 2; ++t) {
            store(c + t * kTileRows * rows, b + t, m0, rows);
            store(c1 + t * kTileRows * rows1, b + t, m0 + kChunkRows, rows1);
          }
          m0 += kChunkRows;  // two chunks done
          continue;
        }
        configure(rows, rows);
        switch (nb) {
          case 4: blocks_times_chunk<4>(wb, steps, chunk, rows, c); break;
          case 3: blocks_times_chunk<3>(wb, steps, chunk, rows, c); break;
          case 2: blocks_times_chunk<2>(wb, steps, chunk, rows, c); break;
          default: blocks_times_chunk<1>(wb, steps, chunk, rows, c); break;
        }
        for (int t = 0; t < nb; ++t) store(c + t * kTileRows * rows, b + t, m0, rows);
      }
    }
    _tile_release();
  });
}
#else
inline bool usable() { return false; }
inline void linear_tiled(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::BFloat16*, bool,
                         const LinearDims&) {}
#endif

}  // namespace eecore::amx
