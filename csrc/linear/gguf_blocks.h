// GGUF (llama.cpp) weight block formats, and the dequantization of a row of blocks into fp32.
//
// A quantized GGUF matrix [N, K] is stored row by row, each row K / 32 blocks of 32 weights:
//   Q4_0 (type 2)  18 bytes: fp16 d, 16 bytes of nibbles    w = d * (q - 8)
//   Q4_1 (type 3)  20 bytes: fp16 d, fp16 m, 16 bytes        w = d * q + m
//   Q8_0 (type 8)  34 bytes: fp16 d, 32 int8                  w = d * q
// In a nibble block, byte j holds weight j in its low nibble and weight j + 16 in its high one.
//
// The values are exactly the `gguf` package's dequantizer's (gguf.quants): every product above is
// exact in fp32 (an 11-bit fp16 significand times a 4- or 8-bit integer), and Q4_1's `+ m` is one
// fp32 rounding after it, never fused into a multiply-add (so the decoders below keep the multiply
// and the add apart, and are compiled without contraction).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "common/cpu_vec.h"

namespace eecore::gguf {

constexpr int64_t kBlockWeights = 32;

enum class QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

// Bytes of one block of `type`, or 0 for a type these kernels do not take.
inline int64_t block_bytes(int64_t type) {
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0: return 18;
    case QuantType::Q4_1: return 20;
    case QuantType::Q8_0: return 34;
  }
  return 0;
}

inline const char* type_name(int64_t type) {
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0: return "Q4_0";
    case QuantType::Q4_1: return "Q4_1";
    case QuantType::Q8_0: return "Q8_0";
  }
  return "unsupported";
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__GNUC__) && !defined(__clang__)
#define EECORE_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define EECORE_NO_FP_CONTRACT
#endif

#if EECORE_VEC8_AVX2
// 8 weights w = d * q (+ m) from 8 integers already widened to int32 lanes.
inline void store_scaled(float* dst, __m256i q, __m256 d) { _mm256_storeu_ps(dst, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q))); }
inline void store_scaled(float* dst, __m256i q, __m256 d, __m256 m) {
  _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m));
}

// The 32 nibbles of a block as two 16-byte vectors: weights 0..15 (low nibbles), 16..31 (high).
inline void split_nibbles(const uint8_t* qs, __m128i& low, __m128i& high) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  low = _mm_and_si128(raw, mask);
  high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
}
#endif

EECORE_NO_FP_CONTRACT inline void dequantize_q4_0(const uint8_t* block, float* dst) {
  const float d = half_at(block);
  const uint8_t* qs = block + 2;
#if EECORE_VEC8_AVX2
  __m128i low, high;
  split_nibbles(qs, low, high);
  const __m256 vd = _mm256_set1_ps(d);
  const __m256i eight = _mm256_set1_epi32(8);
  store_scaled(dst, _mm256_sub_epi32(_mm256_cvtepu8_epi32(low), eight), vd);
  store_scaled(dst + 8, _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)), eight), vd);
  store_scaled(dst + 16, _mm256_sub_epi32(_mm256_cvtepu8_epi32(high), eight), vd);
  store_scaled(dst + 24, _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)), eight), vd);
#else
  for (int j = 0; j < 16; ++j) {
    dst[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
    dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
#endif
}

EECORE_NO_FP_CONTRACT inline void dequantize_q4_1(const uint8_t* block, float* dst) {
  const float d = half_at(block), m = half_at(block + 2);
  const uint8_t* qs = block + 4;
#if EECORE_VEC8_AVX2
  __m128i low, high;
  split_nibbles(qs, low, high);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  store_scaled(dst, _mm256_cvtepu8_epi32(low), vd, vm);
  store_scaled(dst + 8, _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)), vd, vm);
  store_scaled(dst + 16, _mm256_cvtepu8_epi32(high), vd, vm);
  store_scaled(dst + 24, _mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)), vd, vm);
#else
  for (int j = 0; j < 16; ++j) {
    const float lo = d * static_cast<float>(qs[j] & 0x0F), hi = d * static_cast<float>(qs[j] >> 4);
    dst[j] = lo + m;
    dst[j + 16] = hi + m;
  }
#endif
}

EECORE_NO_FP_CONTRACT inline void dequantize_q8_0(const uint8_t* block, float* dst) {
  const float d = half_at(block);
  const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
#if EECORE_VEC8_AVX2
  const __m256 vd = _mm256_set1_ps(d);
  for (int g = 0; g < 4; ++g) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g));
    store_scaled(dst + 8 * g, _mm256_cvtepi8_epi32(q), vd);
  }
#else
  for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(qs[j]);
#endif
}

// The 32 weights of a block in vector registers, for kernels that multiply them where they are
// decoded: `Simd::kPerBlock` vectors of `Simd::kLanes` fp32 weights, in order. Q8_0, Q4_0, Q4_1
// below give, per block, the same values as the dequantize_* functions above.
#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int kLanes = 16, kPerBlock = 2;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  // 16 unsigned bytes / 16 signed bytes as fp32 lanes
  static V from_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
  static V from_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }

  static void q4_0(const uint8_t* block, V* w) {
    __m128i low, high;
    split_nibbles(block + 2, low, high);
    const V d = set1(half_at(block)), eight = set1(8.f);  // q - 8 is exact in fp32
    w[0] = mul(d, _mm512_sub_ps(from_u8(low), eight));
    w[1] = mul(d, _mm512_sub_ps(from_u8(high), eight));
  }
  static void q4_1(const uint8_t* block, V* w) {
    __m128i low, high;
    split_nibbles(block + 4, low, high);
    const V d = set1(half_at(block)), m = set1(half_at(block + 2));
    w[0] = add(mul(d, from_u8(low)), m);
    w[1] = add(mul(d, from_u8(high)), m);
  }
  static void q8_0(const uint8_t* block, V* w) {
    const V d = set1(half_at(block));
    w[0] = mul(d, from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))));
    w[1] = mul(d, from_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))));
  }
};
#define EECORE_GGUF_SIMD 1
#elif EECORE_VEC8_AVX2
struct Simd {
  using V = __m256;
  static constexpr int kLanes = 8, kPerBlock = 4;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  // the low 8 bytes of q as fp32 lanes
  static V from_u8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
  static V from_i8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }

  static void q4_0(const uint8_t* block, V* w) {
    __m128i low, high;
    split_nibbles(block + 2, low, high);
    const V d = set1(half_at(block)), eight = set1(8.f);
    w[0] = mul(d, _mm256_sub_ps(from_u8(low), eight));
    w[1] = mul(d, _mm256_sub_ps(from_u8(_mm_srli_si128(low, 8)), eight));
    w[2] = mul(d, _mm256_sub_ps(from_u8(high), eight));
    w[3] = mul(d, _mm256_sub_ps(from_u8(_mm_srli_si128(high, 8)), eight));
  }
  static void q4_1(const uint8_t* block, V* w) {
    __m128i low, high;
    split_nibbles(block + 4, low, high);
    const V d = set1(half_at(block)), m = set1(half_at(block + 2));
    w[0] = add(mul(d, from_u8(low)), m);
    w[1] = add(mul(d, from_u8(_mm_srli_si128(low, 8))), m);
    w[2] = add(mul(d, from_u8(high)), m);
    w[3] = add(mul(d, from_u8(_mm_srli_si128(high, 8))), m);
  }
  static void q8_0(const uint8_t* block, V* w) {
    const V d = set1(half_at(block));
    for (int g = 0; g < 4; ++g) w[g] = mul(d, from_i8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * g))));
  }
};
#define EECORE_GGUF_SIMD 1
#else
#define EECORE_GGUF_SIMD 0
#endif

// One row of K weights (K / 32 blocks of `type`) into `dst` [K] fp32.
inline void dequantize_row(int64_t type, const uint8_t* row, int64_t K, float* dst) {
  const int64_t blocks = K / kBlockWeights;
  switch (static_cast<QuantType>(type)) {
    case QuantType::Q4_0:
      for (int64_t b = 0; b < blocks; ++b) dequantize_q4_0(row + b * 18, dst + b * kBlockWeights);
      return;
    case QuantType::Q4_1:
      for (int64_t b = 0; b < blocks; ++b) dequantize_q4_1(row + b * 20, dst + b * kBlockWeights);
      return;
    case QuantType::Q8_0:
      for (int64_t b = 0; b < blocks; ++b) dequantize_q8_0(row + b * 34, dst + b * kBlockWeights);
      return;
  }
}

}  // namespace eecore::gguf
