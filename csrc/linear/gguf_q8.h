// GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with 8-bit activations, llama.cpp's
// arithmetic: the weight repacked once, at load, so that one vpdpbusd multiplies 4 weights of 16
// output rows by 4 activation bytes, and each input row quantized per call to int8 in blocks of 32
// with a scale of its own.
//
// Why: the exact kernels (gguf_simd.h) pay an fp32 multiply-add per weight and row, so 5 rows cost
// about 2x one row; here a row adds 8 integer dot instructions per 512 weights, so a verification
// pass or a batch costs little more than a decode step. The price is the activations' rounding: the
// results are not the dequantized model's (tests/test_op_linear_gguf_q8.py bounds the error;
// docs/gguf.md reports the greedy agreement).
//
// Packed layout: [G = ceil(N / 16) row groups][U units][unit bytes], a unit being one block of 32
// weights (a K format: one superblock of 8 such blocks) of 16 rows (rows past N all zero):
//   header (K formats only): the rows' superblock scales as the file has them, fp16 d[16] and
//                (Q4_K, Q5_K) dmin[16];
//   then for each block of the unit, its scales, then its quants:
//     scales: Q4_0 / Q5_0 / Q8_0: fp16 d[16];  Q4_1 / Q5_1: fp16 d[16], m[16];
//             Q4_K / Q5_K: uint8 scale[16], min[16] (the 6-bit fields);
//             Q6_K: int8 scale[16] for weights 0..15, then [16] for weights 16..31;
//     quants: Q8_0: 8 x 64 bytes; in chunk k, row r's 4 bytes at 4 r hold weights 4k..4k+3 plus 128
//             (0..255);
//             the others: 4 x 64 bytes of low 4 bits; in chunk k, row r's 4 bytes at 4 r hold weights
//             4k..4k+3 in their low nibbles and 16+4k..16+4k+3 in their high ones; then the 5-bit
//             formats' fifth bits (Q6_K: fifth, then sixth) as 64-byte planes: bit k of byte 4 r + m is
//             that bit of weight 4k + m (k < 4) or 16 + 4 (k - 4) + m, the weights the kernel's k-th
//             vector of 64 bytes holds.
// So the packed weight reads the file's bytes: the scales in the file's precision, the integers in
// as many bits as the file gives them (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 exactly the file's size; the
// K formats' 6-bit sub-scales take a byte each).
// The kernel widens them to fp32 per block; the products are exact, so every (d, c) below is the
// value the exact kernels use.
//
// With u the unsigned integers, qx the activation bytes, dx their scale and sx = dx * sum(qx):
//   row . x = sum over blocks of d * dx * sum(u * qx) + c * sx,
// where c = m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0), -128 d (Q8_0), -32 d (Q6_K) folds each format's
// offset in; a K format's group of 32 is a block with d = d_super * scale and c = -dmin * min.
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

constexpr int64_t kRows = 16;  // output rows per group

inline bool packable(int64_t type) {
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0: case QuantType::Q4_1: case QuantType::Q5_0: case QuantType::Q5_1: case QuantType::Q8_0:
    case QuantType::Q4_K: case QuantType::Q5_K: case QuantType::Q6_K:
      return true;
    default:
      return false;
  }
}

inline bool is(int64_t type, QuantType t) { return type == static_cast<int64_t>(t); }

// Q8_0 keeps a byte a weight; the others their low 4 bits two a byte, and their higher bits in planes.
inline bool byte_quants(int64_t type) { return is(type, QuantType::Q8_0); }
inline int high_bit_planes(int64_t type) {
  return is(type, QuantType::Q6_K) ? 2 : is(type, QuantType::Q5_0) || is(type, QuantType::Q5_1) || is(type, QuantType::Q5_K) ? 1 : 0;
}

// Q6_K scales each 16 weights: its blocks carry a scale for weights 0..15 and one for 16..31.
inline bool two_scales(int64_t type) { return is(type, QuantType::Q6_K); }

inline bool k_format(int64_t type) {
  return is(type, QuantType::Q4_K) || is(type, QuantType::Q5_K) || is(type, QuantType::Q6_K);
}

// The formats whose offset is a fixed multiple of the scale: c = -offset * d.
inline float fixed_offset(int64_t type) {
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0: return 8.f;
    case QuantType::Q5_0: return 16.f;
    case QuantType::Q8_0: return 128.f;
    case QuantType::Q6_K: return 32.f;
    default: return 0.f;
  }
}

inline int64_t blocks_per_unit(int64_t type) { return k_format(type) ? 8 : 1; }
inline int64_t header_bytes(int64_t type) {
  return two_scales(type) ? 2 * kRows : k_format(type) ? 4 * kRows : 0;
}
// Q4_1 and Q5_1 blocks carry a minimum of their own (fp16 m beside d).
inline bool has_min(int64_t type) { return is(type, QuantType::Q4_1) || is(type, QuantType::Q5_1); }
inline int64_t scale_bytes(int64_t type) { return has_min(type) ? 4 * kRows : 2 * kRows; }
inline int64_t quant_bytes(int64_t type) { return byte_quants(type) ? 512 : 256 + 64 * high_bit_planes(type); }

// Weight j (0..31) of row r in a block's packed quants.
inline int packed_quant(int64_t type, const uint8_t* quants, int r, int j) {
  const int at = 64 * ((j % 16) / 4) + 4 * r + j % 4;  // chunk and byte of the low bits
  if (byte_quants(type)) return quants[64 * (j / 4) + 4 * r + j % 4];
  int u = j < 16 ? quants[at] & 0x0F : quants[at] >> 4;
  for (int p = 0; p < high_bit_planes(type); ++p) u |= ((quants[256 + 64 * p + 4 * r + j % 4] >> (j / 4)) & 1) << (4 + p);
  return u;
}
inline int64_t block_bytes(int64_t type) { return scale_bytes(type) + quant_bytes(type); }
inline int64_t unit_bytes(int64_t type) { return header_bytes(type) + blocks_per_unit(type) * block_bytes(type); }
// The units of a row of K weights.
inline int64_t units(int64_t type, int64_t K) { return K / (32 * blocks_per_unit(type)); }

// Block k of a packed unit as fp32 (d, c) for its 16 rows: [half][row], the halves equal but Q6_K's.
inline void block_scales(int64_t type, const uint8_t* unit, int64_t k, float d[2][kRows], float c[2][kRows]) {
  const uint8_t* header = unit;
  const uint8_t* scales = unit + header_bytes(type) + k * block_bytes(type);
  for (int r = 0; r < kRows; ++r) {
    if (two_scales(type)) {
      const float super = half_at(header + 2 * r);
      for (int half = 0; half < 2; ++half) {
        d[half][r] = super * static_cast<float>(static_cast<int8_t>(scales[kRows * half + r]));
        c[half][r] = -fixed_offset(type) * d[half][r];
      }
      continue;
    }
    if (k_format(type)) {
      d[0][r] = half_at(header + 2 * r) * static_cast<float>(scales[r]);
      c[0][r] = -(half_at(header + 2 * kRows + 2 * r) * static_cast<float>(scales[kRows + r]));
    } else {
      d[0][r] = half_at(scales + 2 * r);
      c[0][r] = has_min(type) ? half_at(scales + 2 * kRows + 2 * r) : -fixed_offset(type) * d[0][r];
    }
    d[1][r] = d[0][r];
    c[1][r] = c[0][r];
  }
}

// Group b (32 weights) of one row as its unsigned integers u[32].
inline void group_quants(int64_t type, const uint8_t* row, int64_t b, int* u) {
  const QuantType t = static_cast<QuantType>(type);
  if (t == QuantType::Q6_K) {  // w = (d scale_s) (q - 32) for the group's two sub-blocks s
    const uint8_t* block = row + (b / 8) * find_format(type)->bytes;
    const int k = static_cast<int>(b % 8), h = k / 4, j4 = k % 4;
    for (int l = 0; l < 32; ++l)
      u[l] = ((block[64 * h + 32 * (j4 % 2) + l] >> (4 * (j4 / 2))) & 0x0F) |
             (((block[128 + 32 * h + l] >> (2 * j4)) & 3) << 4);
    return;
  }
  if (t == QuantType::Q4_K || t == QuantType::Q5_K) {  // an eighth of a superblock
    const uint8_t* block = row + (b / 8) * find_format(type)->bytes;
    const int k = static_cast<int>(b % 8);
    const uint8_t* qs = block + (t == QuantType::Q4_K ? 16 : 48) + 32 * (k / 2);
    for (int l = 0; l < 32; ++l) {
      u[l] = (qs[l] >> (4 * (k % 2))) & 0x0F;
      if (t == QuantType::Q5_K) u[l] |= ((block[16 + l] >> k) & 1) << 4;
    }
    return;
  }
  const uint8_t* block = row + b * find_format(type)->bytes;
  switch (t) {
    case QuantType::Q8_0:
      for (int j = 0; j < 32; ++j) u[j] = static_cast<int8_t>(block[2 + j]) + 128;
      return;
    case QuantType::Q5_0: case QuantType::Q5_1: {
      const int64_t scales = has_min(type) ? 4 : 2;  // d, and m where the block has one
      five_bit_quants(block + scales, block + scales + 4, u);
      return;
    }
    default: {  // Q4_0, Q4_1
      const uint8_t* qs = block + (has_min(type) ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        u[j] = qs[j] & 0x0F;
        u[j + 16] = qs[j] >> 4;
      }
    }
  }
}

// Unit `unit` of rows [16 g, 16 g + 16) of a GGUF weight (rows past N zero) into `dst`.
inline void pack_unit(int64_t type, const uint8_t* weight, int64_t row_bytes, int64_t N, int64_t g, int64_t unit,
                      uint8_t* dst) {
  std::memset(dst, 0, unit_bytes(type));
  const int64_t block_size = find_format(type)->bytes;
  for (int64_t r = 0; r < kRows && kRows * g + r < N; ++r) {
    const uint8_t* row = weight + (kRows * g + r) * row_bytes;
    if (k_format(type)) {  // the superblock's fp16 d (Q4_K / Q5_K: and dmin) as they are
      const uint8_t* super = row + unit * block_size;
      if (two_scales(type)) {
        std::memcpy(dst + 2 * r, super + 208, 2);
      } else {
        std::memcpy(dst + 2 * r, super, 2);
        std::memcpy(dst + 2 * kRows + 2 * r, super + 2, 2);
      }
    }
    for (int64_t k = 0; k < blocks_per_unit(type); ++k) {
      const int64_t b = unit * blocks_per_unit(type) + k;
      uint8_t* scales = dst + header_bytes(type) + k * block_bytes(type);
      if (two_scales(type)) {
        const uint8_t* super_scales = row + unit * block_size + 192 + 2 * k;
        scales[r] = super_scales[0];
        scales[kRows + r] = super_scales[1];
      } else if (k_format(type)) {
        int scale, min;
        scale_min_k(row + unit * block_size + 4, static_cast<int>(k), scale, min);
        scales[r] = static_cast<uint8_t>(scale);
        scales[kRows + r] = static_cast<uint8_t>(min);
      } else {  // fp16 d, and m after it where the format has one
        std::memcpy(scales + 2 * r, row + b * block_size, 2);
        if (has_min(type)) std::memcpy(scales + 2 * kRows + 2 * r, row + b * block_size + 2, 2);
      }
      int u[32];
      group_quants(type, row, b, u);
      uint8_t* quants = scales + scale_bytes(type);
      if (byte_quants(type)) {
        for (int j = 0; j < 32; ++j) quants[64 * (j / 4) + 4 * r + j % 4] = static_cast<uint8_t>(u[j]);
      } else {  // low 4 bits: weight j in the low nibble, weight 16 + j in the high one; then the planes
        for (int j = 0; j < 16; ++j)
          quants[64 * (j / 4) + 4 * r + j % 4] = static_cast<uint8_t>((u[j] & 0x0F) | ((u[j + 16] & 0x0F) << 4));
        for (int p = 0; p < high_bit_planes(type); ++p)
          for (int j = 0; j < 32; ++j)
            quants[256 + 64 * p + 4 * r + j % 4] |= static_cast<uint8_t>(((u[j] >> (4 + p)) & 1) << (j / 4));
      }
    }
  }
}

// Input rows as the kernel reads them (a view from one row on): each row's blocks of 32 as int8
// with a scale each, qx = round(x * 127 / amax) (nearest, ties to even), dx = amax / 127, and per
// block three sums of qx (over weights 0..15, 16..31 and all 32), each one value the kernel
// broadcasts: sx = dx * the sum, for the formats whose offset is a float of its own, and
// ox = -offset * the sum, for those whose offset is a fixed multiple of the scale (their integer
// dot sums start from it, so that the offset costs no float instruction).
constexpr int64_t kSumsPerBlock = 3;
struct RowBlocks {
  int8_t* qx;   // [rows][K]
  float* dx;    // [rows][K / 32]
  float* sx;    // [rows][K / 32][3]
  int32_t* ox;  // [rows][K / 32][3]
  int64_t K;

  RowBlocks from(int64_t row) const {
    const int64_t B = K / 32;
    return {qx + row * K, dx + row * B, sx + row * kSumsPerBlock * B, ox + row * kSumsPerBlock * B, K};
  }
};

// One input row of K features into `out`'s row 0, for weights of `type`.
inline void quantize_row(const float* x, int64_t type, const RowBlocks& out) {
  const int64_t K = out.K;
  const int offset = static_cast<int>(fixed_offset(type));
  int8_t* qx = out.qx;
  float *dx = out.dx, *sx = out.sx;
  int32_t* ox = out.ox;
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    int sums[2] = {0, 0};
#if EECORE_GGUF_Q8_VNNI  // the same arithmetic 16 lanes at a time (cvtps2dq rounds to nearest even)
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + 32 * b), _mm512_cvtsepi32_epi8(q_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + 32 * b + 16), _mm512_cvtsepi32_epi8(q_hi));
    sums[0] = _mm512_reduce_add_epi32(q_lo);
    sums[1] = _mm512_reduce_add_epi32(q_hi);
#else
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inverse));
      qx[32 * b + j] = static_cast<int8_t>(q);
      sums[j / 16] += q;
    }
#endif
    dx[b] = amax / 127.f;
    const int whole[kSumsPerBlock] = {sums[0], sums[1], sums[0] + sums[1]};
    for (int h = 0; h < kSumsPerBlock; ++h) {
      sx[kSumsPerBlock * b + h] = dx[b] * static_cast<float>(whole[h]);
      ox[kSumsPerBlock * b + h] = -offset * whole[h];
    }
  }
}

#if EECORE_GGUF_Q8_VNNI
// Four activation bytes (one int32) in every lane: the compiler folds it into vpdpbusd's memory operand.
inline __m512i broadcast_int32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}
#endif

#if EECORE_GGUF_Q8_VNNI
inline __m512 widen_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen_uint8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 widen_int8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// sums[i * 16 + r] = input row i . weight row 16 g + r, for the first MR rows of `x`; `packed` is
// the row group's units. kFixedOffset: `type`'s offset is a fixed multiple of its scale (a template
// argument: tested per block and row at run time, it cost a one-row pass about a third more).
template <int MR, bool kFixedOffset>
inline void group_dots(const uint8_t* packed, int64_t type, const RowBlocks& x_rows, float* sums) {
  const int64_t K = x_rows.K, B = K / 32, U = units(type, K), per_unit = blocks_per_unit(type);
  const int8_t* qx = x_rows.qx;
  const float *dx = x_rows.dx, *sx = x_rows.sx;
  [[maybe_unused]] const int32_t* ox = x_rows.ox;
  constexpr bool fixed = kFixedOffset;
  const int64_t header = header_bytes(type), stride = block_bytes(type), scales_size = scale_bytes(type);
  [[maybe_unused]] const bool bytes = byte_quants(type), two = two_scales(type), kq = k_format(type);
  [[maybe_unused]] const int planes = high_bit_planes(type);
  const bool own_min = has_min(type);
#if EECORE_GGUF_Q8_VNNI
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t unit = 0; unit < U; ++unit) {
    const uint8_t* base = packed + unit * unit_bytes(type);
    const __m512 super = kq ? widen_halves(base) : _mm512_setzero_ps();
    const __m512 minus_super_min = kq && !two ? _mm512_sub_ps(_mm512_setzero_ps(), widen_halves(base + 2 * kRows))
                                              : _mm512_setzero_ps();
    for (int64_t k = 0; k < per_unit; ++k) {
      const int64_t b = unit * per_unit + k;
      const uint8_t* scales = base + header + k * stride;
      // the weight ahead (kStreamAheadBytes), a block's lines (5-7) at a time: a K format's unit of 8
      // blocks asked for at once ran Q6_K's 2 rows 1.3x slower. Past the weight's end harmless:
      // prefetches never fault
      for (int64_t line = 0; line < stride; line += 64) __builtin_prefetch(scales + kStreamAheadBytes + line, 0, 2);
      // the rows' scales, and the offsets that are floats of their own (the fixed ones are in ox)
      __m512 d, c = _mm512_setzero_ps(), d_hi = _mm512_setzero_ps();
      if (two) {  // Q6_K
        d = _mm512_mul_ps(super, widen_int8(scales));
        d_hi = _mm512_mul_ps(super, widen_int8(scales + kRows));
      } else if (kq) {  // Q4_K, Q5_K
        d = _mm512_mul_ps(super, widen_uint8(scales));
        c = _mm512_mul_ps(minus_super_min, widen_uint8(scales + kRows));
      } else {
        d = widen_halves(scales);
        if (own_min) c = widen_halves(scales + 2 * kRows);
      }
      const uint8_t* quants = scales + scales_size;
      __m512i u[8];  // u[k] multiplies activation bytes 4k..4k+3 of the block
      if (bytes) {
        for (int j = 0; j < 8; ++j) u[j] = _mm512_loadu_si512(quants + 64 * j);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(quants + 64 * j);
          u[j] = _mm512_and_si512(v, nibble);
          u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        for (int p = 0; p < planes; ++p) {  // bit k of each byte of a plane: bit 4 + p of u[k]'s byte
          const __m512i plane = _mm512_loadu_si512(quants + 256 + 64 * p);
          const __m512i value = _mm512_set1_epi8(static_cast<char>(16 << p));
          for (int j = 0; j < 8; ++j)
            u[j] = _mm512_mask_add_epi8(u[j], _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << j))),
                                        u[j], value);
        }
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = qx + i * K + 32 * b;
        const __m512 x_scale = _mm512_set1_ps(dx[i * B + b]);
        [[maybe_unused]] const float* sums_x = sx + kSumsPerBlock * (i * B + b);
        const int32_t* offset_sums = ox + kSumsPerBlock * (i * B + b);
        if (two) {  // Q6_K: weights 0..15 and 16..31 have scales of their own: a dot sum for each half,
                    // each starting from its half's offset term
          __m512i s0 = _mm512_set1_epi32(offset_sums[0]), s1 = _mm512_set1_epi32(offset_sums[1]);
          for (int j = 0; j < 4; ++j) {
            s0 = _mm512_dpbusd_epi32(s0, u[j], broadcast_int32(x + 4 * j));
            s1 = _mm512_dpbusd_epi32(s1, u[4 + j], broadcast_int32(x + 16 + 4 * j));
          }
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, x_scale), acc[i]);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d_hi, x_scale), acc[i]);
        } else {
          // One row: two chains of 4 dots, as one chain's latency would bind. Several rows: one chain
          // each, the rows' chains overlapping. A fixed offset starts the sum.
          __m512i s = fixed ? _mm512_set1_epi32(offset_sums[2]) : _mm512_setzero_si512();
          __m512i s1 = _mm512_setzero_si512();
          for (int j = 0; j < 4; ++j) {
            s = _mm512_dpbusd_epi32(s, u[j], broadcast_int32(x + 4 * j));
            if (MR == 1) {
              s1 = _mm512_dpbusd_epi32(s1, u[4 + j], broadcast_int32(x + 16 + 4 * j));
            } else {
              s = _mm512_dpbusd_epi32(s, u[4 + j], broadcast_int32(x + 16 + 4 * j));
            }
          }
          if (MR == 1) s = _mm512_add_epi32(s, s1);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, x_scale), acc[i]);
          if (!fixed) acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(sums_x[2]), acc[i]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(sums + i * kRows, acc[i]);
#else
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kRows; ++r) sums[i * kRows + r] = 0.f;
  for (int64_t unit = 0; unit < U; ++unit) {
    const uint8_t* base = packed + unit * unit_bytes(type);
    for (int64_t k = 0; k < per_unit; ++k) {
      const int64_t b = unit * per_unit + k;
      float d[2][kRows], c[2][kRows];  // [half][row]
      block_scales(type, base, k, d, c);
      const uint8_t* quants = base + header + k * stride + scales_size;
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = qx + i * K + 32 * b;
        const float* sums_x = sx + kSumsPerBlock * (i * B + b);
        for (int r = 0; r < kRows; ++r) {
          int32_t isum[2] = {0, 0};
          for (int j = 0; j < 32; ++j) isum[j / 16] += packed_quant(type, quants, r, j) * x[j];
          float total = 0.f;
          for (int half = 0; half < 2; ++half)
            total += static_cast<float>(isum[half]) * (d[half][r] * dx[i * B + b]) + c[half][r] * sums_x[half];
          sums[i * kRows + r] += total;
        }
      }
    }
  }
#endif
}

}  // namespace eecore::gguf::q8
