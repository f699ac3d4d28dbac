// The 32 weights of a GGUF group (gguf_blocks.h) decoded into vector registers, for kernels that
// multiply them where they are decoded: `Simd::kPerGroup` vectors of `Simd::kLanes` fp32 weights,
// in order. Each decoder takes a row of blocks and a group index g (32 weights each) and gives the
// dequantize_* functions' values for that group (up to a multiply-add the compiler may fuse, which
// only the dot products see).
#pragma once

#include "linear/gguf_blocks.h"

namespace eecore::gguf {

#if EECORE_VEC8_AVX2
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 32 nibbles of a 16-byte block: weights 0..15 (low nibbles), then 16..31 (high).
inline __m256i block_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// 32 bytes' nibbles at `shift` (0: low, 4: high), as bytes.
inline __m256i nibbles_at(const uint8_t* p, int shift) {
  return _mm256_and_si256(_mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x0F));
}

// Byte l = 16 where bit l of `bits` is set, else 0 (Q5_0 / Q5_1's fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// 32 bytes' bit pairs (or single bits) at `shift`, masked by `mask` and moved up by 4 bits.
inline __m256i high_bits_at(const uint8_t* p, int shift, int mask) {
  const __m256i shifted = _mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(shift));
  const __m256i bits = _mm256_and_si256(shifted, _mm256_set1_epi8(static_cast<char>(mask)));
  return _mm256_slli_epi16(bits, 4);  // at most 0x30 per byte: nothing crosses into the next byte
}
#endif

#if defined(__AVX512F__) && EECORE_VEC8_AVX2
struct Simd {
  using V = __m512;
  static constexpr int kLanes = 16, kPerGroup = 2;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // out[0..3] = the lane sums of a[0..3], in one order for every vector whichever the other three
  // are: within each 128-bit lane (x0 + x2) + (x1 + x3), then lanes (l0 + l2) + (l1 + l3). Four at
  // once take 13 instructions where one at a time take 32 (a register tile's last step).
  static void sum4(const V* a, float* out) {
    const V ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const V cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const V lanes = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
  }
  static float sum(V a) {
    const V four[4] = {a, a, a, a};
    float out[4];
    sum4(four, out);
    return out[0];
  }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  // 16 unsigned / signed bytes as fp32 lanes
  static V from_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
  static V from_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
  static void u8x32(__m256i q, V* w) {
    w[0] = from_u8(_mm256_castsi256_si128(q));
    w[1] = from_u8(_mm256_extracti128_si256(q, 1));
  }
  static void i8x32(__m256i q, V* w) {
    w[0] = from_i8(_mm256_castsi256_si128(q));
    w[1] = from_i8(_mm256_extracti128_si256(q, 1));
  }
  // weights 0..15 times a, 16..31 times b
  static void scale_halves(V* w, float a, float b) {
    w[0] = mul(set1(a), w[0]);
    w[1] = mul(set1(b), w[1]);
  }
  // A 4-bit group's 32 weights as table[q]: the 16 values a block's scale (and minimum) give the
  // 16 integers are computed once (as dequantize_* does, so exactly its values), and each weight
  // is one lane of a permute, which reads only the low 4 bits of its index.
  static V lookup(__m128i bytes, int shift, V table) {
    return _mm512_permutexvar_ps(_mm512_srl_epi32(_mm512_cvtepu8_epi32(bytes), _mm_cvtsi32_si128(shift)), table);
  }
  // a 32-weight block's 16 bytes: weights 0..15 in the low nibbles, 16..31 in the high ones
  static void lookup_block(const uint8_t* qs, V table, V* w) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w[0] = _mm512_permutexvar_ps(q, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
  // a K group's 32 bytes, the nibbles at `shift` (0 or 4)
  static void lookup_group(const uint8_t* qs, int shift, V table, V* w) {
    w[0] = lookup(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), shift, table);
    w[1] = lookup(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)), shift, table);
  }
  // a 5-bit block (Q5_0, Q5_1): 16 bytes of nibbles and 32 fifth bits, from a 32-entry table in
  // two vectors (a two-table permute reads an index's low 5 bits)
  static void lookup_block5(const uint8_t* qs, uint32_t fifth, V table_lo, V table_hi, V* w) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(q, 4);
    w[0] = _mm512_permutex2var_ps(table_lo, _mm512_mask_or_epi32(lo, static_cast<__mmask16>(fifth), lo, sixteen), table_hi);
    w[1] = _mm512_permutex2var_ps(table_lo, _mm512_mask_or_epi32(hi, static_cast<__mmask16>(fifth >> 16), hi, sixteen),
                                  table_hi);
  }
  static V iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
};
#define EECORE_GGUF_SIMD 1
#define EECORE_GGUF_LOOKUP 1
#elif EECORE_VEC8_AVX2
struct Simd {
  using V = __m256;
  static constexpr int kLanes = 8, kPerGroup = 4;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void sum4(const V* a, float* out) {
    for (int t = 0; t < 4; ++t) out[t] = sum(a[t]);
  }
  static float sum(V a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  // the low 8 bytes of q as fp32 lanes
  static V from_u8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
  static V from_i8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
  static void u8x32(__m256i q, V* w) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = from_u8(lo), w[1] = from_u8(_mm_srli_si128(lo, 8)), w[2] = from_u8(hi), w[3] = from_u8(_mm_srli_si128(hi, 8));
  }
  static void i8x32(__m256i q, V* w) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = from_i8(lo), w[1] = from_i8(_mm_srli_si128(lo, 8)), w[2] = from_i8(hi), w[3] = from_i8(_mm_srli_si128(hi, 8));
  }
  static void scale_halves(V* w, float a, float b) {
    const V va = set1(a), vb = set1(b);
    w[0] = mul(va, w[0]), w[1] = mul(va, w[1]), w[2] = mul(vb, w[2]), w[3] = mul(vb, w[3]);
  }
};
#define EECORE_GGUF_SIMD 1
#define EECORE_GGUF_LOOKUP 0
#else
#define EECORE_GGUF_SIMD 0
#define EECORE_GGUF_LOOKUP 0
#endif

#if EECORE_GGUF_SIMD
// The decoders, one struct per format. A kernel calls prepare(row, b, p) at the first group of each
// block b of kGroups groups (the K formats' superblock: its 8 or 16 scales computed once into p,
// not once per group), then decode(row, g, p, w), which fills w with group g of the row.
namespace decode {
using S = Simd;
using V = S::V;
constexpr int kPrepFloats = 16;

inline void times(V* w, float d) {
  for (int p = 0; p < S::kPerGroup; ++p) w[p] = S::mul(S::set1(d), w[p]);
}
inline void times_plus(V* w, float d, float m) {
  for (int p = 0; p < S::kPerGroup; ++p) w[p] = S::add(S::mul(S::set1(d), w[p]), S::set1(m));
}
inline void times_minus(V* w, float d, float m) {
  for (int p = 0; p < S::kPerGroup; ++p) w[p] = S::sub(S::mul(S::set1(d), w[p]), S::set1(m));
}

// A 32-weight format: one group a block, nothing to prepare.
struct Plain {
  static constexpr int kGroups = 1;
  static void prepare(const uint8_t*, int64_t, float*) {}
};

struct Q4_0 : Plain {
  static void decode(const uint8_t* row, int64_t g, const float*, V* w) {
    const uint8_t* block = row + g * 18;
#if EECORE_GGUF_LOOKUP
    S::lookup_block(block + 2, S::mul(S::set1(half_at(block)), S::sub(S::iota16(), S::set1(8.f))), w);
#else
    S::i8x32(_mm256_sub_epi8(block_nibbles(block + 2), _mm256_set1_epi8(8)), w);
    times(w, half_at(block));
#endif
  }
};

struct Q4_1 : Plain {
  static void decode(const uint8_t* row, int64_t g, const float*, V* w) {
    const uint8_t* block = row + g * 20;
#if EECORE_GGUF_LOOKUP
    S::lookup_block(block + 4, S::add(S::mul(S::set1(half_at(block)), S::iota16()), S::set1(half_at(block + 2))), w);
#else
    S::u8x32(block_nibbles(block + 4), w);
    times_plus(w, half_at(block), half_at(block + 2));
#endif
  }
};

struct Q5_0 : Plain {
  static void decode(const uint8_t* row, int64_t g, const float*, V* w) {
    const uint8_t* block = row + g * 22;
#if EECORE_GGUF_LOOKUP
    const V d = S::set1(half_at(block)), iota = S::iota16();
    S::lookup_block5(block + 6, u32_at(block + 2), S::mul(d, S::sub(iota, S::set1(16.f))), S::mul(d, iota), w);
#else
    const __m256i q = _mm256_or_si256(block_nibbles(block + 6), fifth_bits(u32_at(block + 2)));
    S::i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w);
    times(w, half_at(block));
#endif
  }
};

struct Q5_1 : Plain {
  static void decode(const uint8_t* row, int64_t g, const float*, V* w) {
    const uint8_t* block = row + g * 24;
#if EECORE_GGUF_LOOKUP
    const V d = S::set1(half_at(block)), m = S::set1(half_at(block + 2)), iota = S::iota16();
    S::lookup_block5(block + 8, u32_at(block + 4), S::add(S::mul(d, iota), m),
                     S::add(S::mul(d, S::add(iota, S::set1(16.f))), m), w);
#else
    S::u8x32(_mm256_or_si256(block_nibbles(block + 8), fifth_bits(u32_at(block + 4))), w);
    times_plus(w, half_at(block), half_at(block + 2));
#endif
  }
};

struct Q8_0 : Plain {
  static void decode(const uint8_t* row, int64_t g, const float*, V* w) {
    const uint8_t* block = row + g * 34;
    S::i8x32(load32(block + 2), w);
    times(w, half_at(block));
  }
};

// Q4_K and Q5_K: p[k] = d * scale_k, p[8 + k] = dmin * min_k for the superblock's 8 groups
template <int kBytes>
struct KScaled {
  static constexpr int kGroups = 8;
  static void prepare(const uint8_t* row, int64_t b, float* p) {
    const uint8_t* block = row + b * kBytes;
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int k = 0; k < 8; ++k) {
      int scale, min;
      scale_min_k(block + 4, k, scale, min);
      p[k] = d * static_cast<float>(scale);
      p[8 + k] = dmin * static_cast<float>(min);
    }
  }
};

struct Q4_K : KScaled<144> {
  static void decode(const uint8_t* row, int64_t g, const float* p, V* w) {
    const uint8_t* block = row + (g >> 3) * 144;
    const int k = static_cast<int>(g & 7);
#if EECORE_GGUF_LOOKUP
    const V table = S::sub(S::mul(S::set1(p[k]), S::iota16()), S::set1(p[8 + k]));
    S::lookup_group(block + 16 + 32 * (k >> 1), 4 * (k & 1), table, w);
#else
    S::u8x32(nibbles_at(block + 16 + 32 * (k >> 1), 4 * (k & 1)), w);
    times_minus(w, p[k], p[8 + k]);
#endif
  }
};

struct Q5_K : KScaled<176> {
  static void decode(const uint8_t* row, int64_t g, const float* p, V* w) {
    const uint8_t* block = row + (g >> 3) * 176;
    const int k = static_cast<int>(g & 7);
    S::u8x32(_mm256_or_si256(nibbles_at(block + 48 + 32 * (k >> 1), 4 * (k & 1)), high_bits_at(block + 16, k, 1)), w);
    times_minus(w, p[k], p[8 + k]);
  }
};

// Q6_K: p[j] = d * scale_j for the superblock's 16 sub-blocks of 16 weights
struct Q6_K {
  static constexpr int kGroups = 8;
  static void prepare(const uint8_t* row, int64_t b, float* p) {
    const uint8_t* block = row + b * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int j = 0; j < 16; ++j) p[j] = d * static_cast<float>(scales[j]);
  }
  static void decode(const uint8_t* row, int64_t g, const float* p, V* w) {
    const uint8_t* block = row + (g >> 3) * 210;
    const int k = static_cast<int>(g & 7), h = k >> 2, j = k & 3;
    const __m256i q = _mm256_or_si256(nibbles_at(block + 64 * h + 32 * (j & 1), 4 * (j >> 1)),
                                      high_bits_at(block + 128 + 32 * h, 2 * j, 3));
    S::i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), w);
    S::scale_halves(w, p[2 * k], p[2 * k + 1]);
  }
};
}  // namespace decode
#endif

}  // namespace eecore::gguf
