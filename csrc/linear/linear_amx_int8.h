// Weight-only int8 linear with the weight pre-tiled for AMX-INT8 (Intel Sapphire Rapids and newer):
// the same integers as the streaming kernel (each input row rounded to int16 with a scale of its
// own, eecore/int8_linear.h), multiplied on the tile engine, where the rows of a batch cost almost
// nothing beside reading the weight. The draft copy of separate draft layers runs here: its passes
// carry one row per sequence, or a round's catch-up rows, and the streaming kernel's int16 x int8
// products (vpdpwssd, 32 an instruction) made a batch-8 pass of its 8 layers compute-bound.
//
// How: an int16 q splits exactly into a signed high byte h = q >> 8 and an unsigned low byte
// l = q & 255, q = 256 h + l, so
//     sum_k q[k] w[k] = 256 sum_k h[k] w[k] + sum_k l[k] w[k]:
// one TDPBSSD (signed x signed bytes) and one TDPBSUD (signed weight x unsigned input bytes) per
// 64 input features, each into int32 sums that cannot wrap below 65,536 input features
// (|h w| <= 16,384, l w in [-32,385, 32,385]), combined in double, which holds the total exactly,
// and rounded to fp32 once: the bits of linear_int8_split.h's path, whose int64 total rounds the
// same way. Weight [N/16, K/64, 16, 64] (tile [b, s]: output rows 16 b.. x input features 64 s..),
// A operand; the input's bytes, 4 features a 32-bit word, B operand.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cpu_dots.h"
#include "eecore/int8_linear.h"
#include "linear/amx_tiles.h"
#include "linear/linear_checks.h"

namespace eecore::amx {

constexpr int64_t kInt8TileDepth = kTileBytes;  // int8 input features per tile
constexpr int64_t kInt8MaxFeatures = 65536;     // the int32 tile sums stay exact below this K

#if EECORE_CPU_AMX_INT8
inline bool int8_usable() { return tiles_granted(); }

// Tiles 0-3: int32 sums (16 outputs x input rows) of weight block 0 against the high bytes (0) and
// the low bytes (1), and of block 1 (2, 3); 4-5: the blocks' weight tiles; 6-7: the rows' high and
// low bytes (16 words of 4 features x rows).
inline void configure_int8_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows;
  for (int t : {0, 1, 2, 3, 6, 7}) cfg.colsb[t] = static_cast<uint16_t>(4 * rows);
  cfg.colsb[4] = cfg.colsb[5] = kTileBytes;
  _tile_loadconfig(&cfg);
}

// NB (1 or 2) consecutive weight blocks (tiles `steps` apart) against one chunk of input rows: sums
// into c [NB][2 (high, low)][16][rows], each accumulated in its own tile register in k order.
template <int NB>
inline void int8_blocks_times_chunk(const int8_t* w, int64_t steps, const uint32_t* high, const uint32_t* low,
                                    int64_t rows, int32_t* c) {
  const int64_t tile = kTileRows * kInt8TileDepth;
  const int64_t block = steps * tile;
  const int64_t stride = 4 * rows;
  const int64_t words_per_step = (kInt8TileDepth / 4) * rows;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NB > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, high + s * words_per_step, stride);
    _tile_loadd(7, low + s * words_per_step, stride);
    _tile_loadd(4, w + s * tile, kTileBytes);
    if constexpr (NB > 1) _tile_loadd(5, w + block + s * tile, kTileBytes);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    if constexpr (NB > 1) {
      _tile_dpbssd(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
  }
  const int64_t sums = kTileRows * rows;
  _tile_stored(0, c, stride);
  _tile_stored(1, c + sums, stride);
  if constexpr (NB > 1) {
    _tile_stored(2, c + 2 * sums, stride);
    _tile_stored(3, c + 3 * sums, stride);
  }
}

// 8 int32 lanes as doubles.
inline __m512d to_double(__m256i v) { return _mm512_cvtepi32_pd(v); }

// One weight block's sums (high c_high, low c_low, each [16 outputs][rows]) into out rows j < rows
// (stride ldo), 16 outputs each: the exact total 256 high + low rounded to fp32, times the row's
// scale, times the weight rows' scales, + bias, + out with `accumulate`, rounded once to scalar_t:
// linear_int8_split.h's epilogue, in its order.
template <typename scalar_t>
inline void store_int8_sums(const int32_t* c_high, const int32_t* c_low, int64_t rows, const float* row_scale,
                            const float* scale, const scalar_t* bias, bool accumulate, scalar_t* out, int64_t ldo) {
  const __m512i column = sum_columns(rows);
  const __m512 w_scale = _mm512_loadu_ps(scale);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : load_x16(bias);
  const __m512d by_256 = _mm512_set1_pd(256.0);
  for (int64_t j = 0; j < rows; ++j) {
    scalar_t* dst = out + j * ldo;
    const __m512i high = _mm512_i32gather_epi32(column, c_high + j, 4);
    const __m512i low = _mm512_i32gather_epi32(column, c_low + j, 4);
    const __m512d lo8 = _mm512_add_pd(_mm512_mul_pd(to_double(_mm512_castsi512_si256(high)), by_256),
                                      to_double(_mm512_castsi512_si256(low)));
    const __m512d hi8 = _mm512_add_pd(_mm512_mul_pd(to_double(_mm512_extracti64x4_epi64(high, 1)), by_256),
                                      to_double(_mm512_extracti64x4_epi64(low, 1)));
    const __m512 total = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo8)), _mm512_cvtpd_ps(hi8), 1);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(total, _mm512_set1_ps(row_scale[j])), w_scale);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    if (accumulate) v = _mm512_add_ps(v, load_x16(dst));
    store_x16(dst, v);
  }
}

// Each input row rounded to int16 with its scale (int8_linear.h), as tile products read its bytes:
// chunk by chunk of 16 rows (m0 = 0, 16, ...), word q of row m0 + j (features 4q..4q+3) at
// [m0 * K/4 + q * rows + j] of `high` (the signed high bytes) and of `low` (the unsigned low bytes).
template <typename scalar_t>
inline void pack_int16_bytes(const scalar_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* high, uint32_t* low,
                             float* row_scale) {
  const int64_t words = K / 4;
  const int32_t range = int16_row_range(K);
  at::parallel_for(0, (M + kChunkRows - 1) / kChunkRows, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<int16_t> q;
    q.resize(static_cast<size_t>(K));
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t m0 = ch * kChunkRows, rows = std::min(kChunkRows, M - m0);
      uint32_t* hi = high + m0 * words;
      uint32_t* lo = low + m0 * words;
      for (int64_t j = 0; j < rows; ++j) {
        row_scale[m0 + j] = cpu::round_row_to_int16(x + (m0 + j) * ldx, K, range, q.data());
        for (int64_t k = 0; k < K; k += 32) {  // 32 features: 8 words of each byte
          const __m512i v = _mm512_loadu_si512(q.data() + k);
          alignas(32) uint32_t hw[8], lw[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(hw), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(lw), _mm512_cvtepi16_epi8(v));
          for (int w = 0; w < 8; ++w) {
            hi[(k / 4 + w) * rows + j] = hw[w];
            lo[(k / 4 + w) * rows + j] = lw[w];
          }
        }
      }
    }
  });
}

// out [M, N] (row stride ldo) = the weight-only int8 linear of input [M, K] with the tiled weight
// [N/16, K/64, 16, 64] and its scales [N] (+ bias) (+ out with `accumulate`).
template <typename scalar_t>
inline void linear_tiled_int8(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                              const float* scale, const scalar_t* bias, bool accumulate, const LinearDims& dims) {
  const int64_t M = dims.rows, K = dims.in, N = dims.out;
  const int64_t steps = K / kInt8TileDepth, blocks = N / kTileRows;
  thread_local std::vector<uint32_t> high, low;  // reused: no allocation per step once grown
  thread_local std::vector<float> row_scale;
  high.resize(static_cast<size_t>(M * K / 4));
  low.resize(static_cast<size_t>(M * K / 4));
  row_scale.resize(static_cast<size_t>(M));
  pack_int16_bytes(input.const_data_ptr<scalar_t>(), input.stride(0), M, K, high.data(), low.data(), row_scale.data());
  const uint32_t* hi = high.data();
  const uint32_t* lo = low.data();
  const float* rs = row_scale.data();
  const int8_t* w = weight.const_data_ptr<int8_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t ldo = out.stride(0);
  // at least ~64k multiply-adds a task, in whole pairs of blocks
  const int64_t grain = std::max<int64_t>(2, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * kTileRows));
  at::parallel_for(0, (blocks + 1) / 2, (grain + 1) / 2, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t c[2 * 2 * kTileRows * kChunkRows];
    int64_t configured = -1;
    for (int64_t b = 2 * p0; b < std::min(blocks, 2 * p1); b += 2) {
      const int nb = static_cast<int>(std::min<int64_t>(2, blocks - b));
      const int8_t* wb = w + b * steps * kTileRows * kInt8TileDepth;
      for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, M - m0);
        if (rows != configured) configure_int8_tiles(rows);
        configured = rows;
        const uint32_t* chunk_hi = hi + m0 * (K / 4);
        const uint32_t* chunk_lo = lo + m0 * (K / 4);
        if (nb == 2)
          int8_blocks_times_chunk<2>(wb, steps, chunk_hi, chunk_lo, rows, c);
        else
          int8_blocks_times_chunk<1>(wb, steps, chunk_hi, chunk_lo, rows, c);
        const int64_t sums = kTileRows * rows;
        for (int t = 0; t < nb; ++t) {
          const int64_t n0 = (b + t) * kTileRows;
          store_int8_sums(c + 2 * t * sums, c + (2 * t + 1) * sums, rows, rs + m0, scale + n0,
                          bias == nullptr ? nullptr : bias + n0, accumulate, o + m0 * ldo + n0, ldo);
        }
      }
    }
    _tile_release();
  });
}
#else
inline bool int8_usable() { return false; }
template <typename scalar_t>
inline void linear_tiled_int8(at::Tensor&, const at::Tensor&, const at::Tensor&, const float*, const scalar_t*, bool,
                              const LinearDims&) {}
#endif

}  // namespace eecore::amx
