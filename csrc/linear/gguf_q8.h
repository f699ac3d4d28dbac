// GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with 8-bit activations, llama.cpp's
// arithmetic: the weight repacked once, at load, so that one vpdpbusd multiplies 4 weights of 16
// output rows by 4 activation bytes, and each input row quantized per call to int8 in blocks of 32
// with a scale of its own.
//
// Why: the exact kernels (gguf_simd.h) pay an fp32 multiply-add per weight and row, so 5 rows cost
// about 2x one row; here a row adds 16 integer dot instructions per 512 weights, so a verification
// pass or a batch costs little more than a decode step. The price is the activations' rounding: the
// results are not the dequantized model's (tests/test_op_linear_gguf_q8.py bounds the error;
// docs/gguf.md reports the greedy agreement).
//
// Packed layout: [G = ceil(N / 16) row groups][B = K / 32 blocks][kGroupBytes] bytes, each
//   d[16] float32 (the rows' block scales; 0 for rows past N), c[16] float32, then the quants:
//   Q4_0 / Q4_1 / Q4_K: 4 x 64 bytes; in chunk k, row r's 4 bytes at 4 r hold weights 4k..4k+3 in their
//                low nibbles and 16+4k..16+4k+3 in their high ones (integers 0..15);
//   Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0: 8 x 64 bytes; in chunk k, row r's 4 bytes hold weights 4k..4k+3 as unsigned
//                bytes: the 5- or 6-bit integers (0..63), or Q8_0's plus 128 (0..255).
//   Q6_K's blocks start with two (d[16], c[16]) pairs, for weights 0..15 and 16..31.
// With u the unsigned integers, qx the activation bytes, dx their scale and sx = dx * sum(qx):
//   row . x = sum over blocks of d * dx * sum(u * qx) + c * sx,
// where c = m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0), -128 d (Q8_0) folds each format's offset in;
// a K format's group of 32 is a block here, with d = d_super * scale and c = -dmin * min.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "linear/gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define EECORE_GGUF_Q8_VNNI 1
#else
#define EECORE_GGUF_Q8_VNNI 0
#endif

namespace eecore::gguf::q8 {

constexpr int64_t kRows = 16;         // output rows per group
constexpr int64_t kScaleBytes = 128;  // d[16], c[16] (Q6_K: twice, one pair for each half)

inline bool packable(int64_t type) {
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0: case QuantType::Q4_1: case QuantType::Q5_0: case QuantType::Q5_1: case QuantType::Q8_0:
    case QuantType::Q4_K: case QuantType::Q5_K: case QuantType::Q6_K:
      return true;
    default:
      return false;
  }
}

// The 4-bit formats keep two weights a byte; the others one (five bits, or Q8_0's eight).
inline bool nibble_packed(int64_t type) {
  return type == static_cast<int64_t>(QuantType::Q4_0) || type == static_cast<int64_t>(QuantType::Q4_1) ||
         type == static_cast<int64_t>(QuantType::Q4_K);
}

// Q6_K scales each 16 weights: its blocks carry (d, c) for weights 0..15 and again for 16..31.
inline bool two_scales(int64_t type) { return type == static_cast<int64_t>(QuantType::Q6_K); }

inline int64_t scale_bytes(int64_t type) { return two_scales(type) ? 2 * kScaleBytes : kScaleBytes; }
inline int64_t quant_bytes(int64_t type) { return nibble_packed(type) ? 256 : 512; }
inline int64_t group_bytes(int64_t type) { return scale_bytes(type) + quant_bytes(type); }

// Group b (32 weights) of one row as w = d * u + c (its scale, its offset, u[32] unsigned integers).
inline void group_values(int64_t type, const uint8_t* row, int64_t b, float& d, float& c, int* u) {
  const QuantType t = static_cast<QuantType>(type);
  if (t == QuantType::Q4_K || t == QuantType::Q5_K) {  // an eighth of a superblock, its own (scale, min)
    const uint8_t* block = row + (b / 8) * find_format(type)->bytes;
    const int k = static_cast<int>(b % 8);
    int scale, min;
    scale_min_k(block + 4, k, scale, min);
    d = half_at(block) * static_cast<float>(scale);
    c = -(half_at(block + 2) * static_cast<float>(min));
    const uint8_t* qs = block + (t == QuantType::Q4_K ? 16 : 48) + 32 * (k / 2);
    for (int l = 0; l < 32; ++l) {
      u[l] = (qs[l] >> (4 * (k % 2))) & 0x0F;
      if (t == QuantType::Q5_K) u[l] |= ((block[16 + l] >> k) & 1) << 4;
    }
    return;
  }
  const uint8_t* block = row + b * find_format(type)->bytes;
  d = half_at(block);
  switch (t) {
    case QuantType::Q8_0:
      c = -128.f * d;
      for (int j = 0; j < 32; ++j) u[j] = static_cast<int8_t>(block[2 + j]) + 128;
      return;
    case QuantType::Q5_0: case QuantType::Q5_1: {
      const bool has_min = t == QuantType::Q5_1;
      c = has_min ? half_at(block + 2) : -16.f * d;
      five_bit_quants(block + (has_min ? 4 : 2), block + (has_min ? 8 : 6), u);
      return;
    }
    default: {  // Q4_0, Q4_1
      const bool has_min = t == QuantType::Q4_1;
      c = has_min ? half_at(block + 2) : -8.f * d;
      const uint8_t* qs = block + (has_min ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        u[j] = qs[j] & 0x0F;
        u[j + 16] = qs[j] >> 4;
      }
    }
  }
}

// Block b of rows [16 g, 16 g + 16) of a GGUF weight (rows past N zero) into `dst`.
inline void pack_block(int64_t type, const uint8_t* weight, int64_t row_bytes, int64_t N, int64_t g, int64_t b,
                       uint8_t* dst) {
  float d[2][kRows] = {}, c[2][kRows] = {};  // [half][row]; one pair serves both halves but Q6_K's
  uint8_t* quants = dst + scale_bytes(type);
  std::memset(quants, 0, quant_bytes(type));
  for (int64_t r = 0; r < kRows && kRows * g + r < N; ++r) {
    int u[32];
    const uint8_t* row = weight + (kRows * g + r) * row_bytes;
    if (two_scales(type)) {  // Q6_K: w = (d scale_s) (q - 32) for the group's two sub-blocks s
      const uint8_t* block = row + (b / 8) * 210;
      const int k = static_cast<int>(b % 8), h = k / 4, j4 = k % 4;
      const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192 + 2 * k);
      const float super = half_at(block + 208);
      for (int half = 0; half < 2; ++half) {
        d[half][r] = super * static_cast<float>(scales[half]);
        c[half][r] = -32.f * d[half][r];
      }
      for (int l = 0; l < 32; ++l)
        u[l] = ((block[64 * h + 32 * (j4 % 2) + l] >> (4 * (j4 / 2))) & 0x0F) |
               (((block[128 + 32 * h + l] >> (2 * j4)) & 3) << 4);
    } else {
      group_values(type, row, b, d[0][r], c[0][r], u);
    }
    if (nibble_packed(type)) {  // weight j in the low nibble, weight 16 + j in the high one
      for (int j = 0; j < 16; ++j)
        quants[64 * (j / 4) + 4 * r + j % 4] = static_cast<uint8_t>(u[j] | (u[j + 16] << 4));
    } else {
      for (int j = 0; j < 32; ++j) quants[64 * (j / 4) + 4 * r + j % 4] = static_cast<uint8_t>(u[j]);
    }
  }
  std::memcpy(dst, d[0], sizeof(d[0]));
  std::memcpy(dst + sizeof(d[0]), c[0], sizeof(c[0]));
  if (two_scales(type)) {
    std::memcpy(dst + kScaleBytes, d[1], sizeof(d[1]));
    std::memcpy(dst + kScaleBytes + sizeof(d[1]), c[1], sizeof(c[1]));
  }
}

// One input row's blocks of 32 as int8 with a scale each: qx = round(x * 127 / amax) (nearest,
// ties to even), dx = amax / 127, and sx[2b + h] = dx * the sum of qx over half h of block b.
inline void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inverse));
      qx[32 * b + j] = static_cast<int8_t>(q);
      sums[j / 16] += q;
    }
    dx[b] = amax / 127.f;
    sx[2 * b] = dx[b] * static_cast<float>(sums[0]);
    sx[2 * b + 1] = dx[b] * static_cast<float>(sums[1]);
  }
}

// sums[i * 16 + r] = input row i . weight row 16 g + r, for MR rows of quantized activations.
template <int MR>
inline void group_dots(const uint8_t* packed, int64_t type, int64_t B, const int8_t* qx, int64_t K, const float* dx,
                       const float* sx, float* sums) {
  const int64_t stride = group_bytes(type);
  const bool bytes = !nibble_packed(type), two = two_scales(type);
#if EECORE_GGUF_Q8_VNNI
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = packed + b * stride;
    const float* scales = reinterpret_cast<const float*>(block);
    const __m512 d = _mm512_loadu_ps(scales), c = _mm512_loadu_ps(scales + kRows);
    const __m512 d_hi = two ? _mm512_loadu_ps(scales + 2 * kRows) : d;
    const __m512 c_hi = two ? _mm512_loadu_ps(scales + 3 * kRows) : c;
    const uint8_t* quants = block + scale_bytes(type);
    __m512i u[8];  // u[k] multiplies activation bytes 4k..4k+3
    if (bytes) {
      for (int k = 0; k < 8; ++k) u[k] = _mm512_loadu_si512(quants + 64 * k);
    } else {
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(quants + 64 * k);
        u[k] = _mm512_and_si512(v, nibble);
        u[4 + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    }
    for (int i = 0; i < MR; ++i) {
      int32_t x[8];
      std::memcpy(x, qx + i * K + 32 * b, sizeof(x));
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {  // two chains: the dot instructions' latency
        s0 = _mm512_dpbusd_epi32(s0, u[k], _mm512_set1_epi32(x[k]));
        s1 = _mm512_dpbusd_epi32(s1, u[4 + k], _mm512_set1_epi32(x[4 + k]));
      }
      // s0 holds weights 0..15, s1 16..31 (in both layouts)
      const __m512 scale = _mm512_set1_ps(dx[i * B + b]);
      const float* sums_x = sx + 2 * (i * B + b);
      if (two) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, scale), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d_hi, scale), acc[i]);
        acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sums_x[0]), acc[i]);
        acc[i] = _mm512_fmadd_ps(c_hi, _mm512_set1_ps(sums_x[1]), acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d, scale), acc[i]);
        acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sums_x[0] + sums_x[1]), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(sums + i * kRows, acc[i]);
#else
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kRows; ++r) sums[i * kRows + r] = 0.f;
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = packed + b * stride;
    float d[2][kRows], c[2][kRows];  // [half][row]
    for (int half = 0; half < 2; ++half) {
      const uint8_t* pair = block + (two ? half * kScaleBytes : 0);
      std::memcpy(d[half], pair, sizeof(d[half]));
      std::memcpy(c[half], pair + sizeof(d[half]), sizeof(c[half]));
    }
    const uint8_t* quants = block + scale_bytes(type);
    for (int i = 0; i < MR; ++i) {
      const int8_t* x = qx + i * K + 32 * b;
      const float* sums_x = sx + 2 * (i * B + b);
      for (int r = 0; r < kRows; ++r) {
        int32_t isum[2] = {0, 0};
        for (int j = 0; j < 32; ++j) {
          int u;
          if (bytes) {
            u = quants[64 * (j / 4) + 4 * r + j % 4];
          } else {
            const uint8_t byte = quants[64 * ((j % 16) / 4) + 4 * r + j % 4];
            u = j < 16 ? byte & 0x0F : byte >> 4;
          }
          isum[j / 16] += u * x[j];
        }
        float total = 0.f;
        for (int half = 0; half < 2; ++half)
          total += static_cast<float>(isum[half]) * (d[half][r] * dx[i * B + b]) + c[half][r] * sums_x[half];
        sums[i * kRows + r] += total;
      }
    }
  }
#endif
}

}  // namespace eecore::gguf::q8
