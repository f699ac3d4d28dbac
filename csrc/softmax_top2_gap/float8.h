// Float8: eight fp32 lanes, the one vector type of the confidence-op CPU kernels.
//
// With AVX2 + FMA + F16C (what -march=native gives on any x86-64 from the last decade) it is a
// thin wrapper over __m256; elsewhere it is a plain float[8] that the compiler vectorises as it
// can. The kernels are written once against this interface, so both builds run the same
// algorithm and only the speed differs.
//
// Semantics both builds share:
//   max8/min8  a > b ? a : b / a < b ? a : b, so a NaN in `a` never wins (the running value in
//              `b` is kept). Callers pass the new data as `a` to keep NaN out of a running max.
//   exp8       exp with a relative error of a few ulp; NaN in, NaN out; -inf in, 0 out.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EECORE_FLOAT8_AVX2 1
#endif

namespace eecore::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef EECORE_FLOAT8_AVX2

struct Float8 {
  __m256 v;
};

inline Float8 broadcast8(float x) { return {_mm256_set1_ps(x)}; }
inline Float8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Float8 load8(const c10::BFloat16* p) {
  // bf16 is the high half of an fp32: widen each 16-bit lane and shift it into place.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline Float8 load8(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline void store8(float* p, Float8 a) { _mm256_storeu_ps(p, a.v); }

inline Float8 operator+(Float8 a, Float8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Float8 operator-(Float8 a, Float8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Float8 operator*(Float8 a, Float8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Float8 fma8(Float8 a, Float8 b, Float8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
// vmaxps/vminps return their second operand when either is NaN, which is exactly a > b ? a : b.
inline Float8 max8(Float8 a, Float8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Float8 min8(Float8 a, Float8 b) { return {_mm256_min_ps(a.v, b.v)}; }

inline float hsum8(Float8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void to_array8(Float8 a, float* out) { _mm256_storeu_ps(out, a.v); }

// exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
// polynomial (truncation error < 2e-7 relative on that interval). x is clamped to the range
// where 2^n is a normal float, so very negative inputs give ~1e-38 rather than 0; callers only
// add such terms to sums of at least 1.
inline Float8 exp8(Float8 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, x.v));  // clamps; NaN passes through (second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = v - n * ln2, with ln2 split in two so the product is exact to fp32 precision.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068202862268e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n through the exponent bits; a NaN lane gives garbage here, but p is already NaN.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(bits))};
}

#else  // portable fallback: same interface, plain loops

struct Float8 {
  float v[8];
};

inline Float8 broadcast8(float x) {
  Float8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = x;
  return r;
}
template <typename T>
inline Float8 load8(const T* p) {
  Float8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void store8(float* p, Float8 a) {
  for (int i = 0; i < 8; ++i) p[i] = a.v[i];
}

#define EECORE_FLOAT8_LANEWISE(expr) \
  Float8 r;                          \
  for (int i = 0; i < 8; ++i) r.v[i] = (expr); \
  return r

inline Float8 operator+(Float8 a, Float8 b) { EECORE_FLOAT8_LANEWISE(a.v[i] + b.v[i]); }
inline Float8 operator-(Float8 a, Float8 b) { EECORE_FLOAT8_LANEWISE(a.v[i] - b.v[i]); }
inline Float8 operator*(Float8 a, Float8 b) { EECORE_FLOAT8_LANEWISE(a.v[i] * b.v[i]); }
inline Float8 fma8(Float8 a, Float8 b, Float8 c) { EECORE_FLOAT8_LANEWISE(a.v[i] * b.v[i] + c.v[i]); }
inline Float8 max8(Float8 a, Float8 b) { EECORE_FLOAT8_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline Float8 min8(Float8 a, Float8 b) { EECORE_FLOAT8_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline Float8 exp8(Float8 x) { EECORE_FLOAT8_LANEWISE(std::exp(x.v[i])); }

#undef EECORE_FLOAT8_LANEWISE

inline float hsum8(Float8 a) {
  return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7]));
}

inline void to_array8(Float8 a, float* out) { store8(out, a); }

#endif  // EECORE_FLOAT8_AVX2

inline Float8 zero8() { return broadcast8(0.f); }

// n values of any activation dtype -> fp32 (n may be anything; the tail is scalar).
template <typename T>
inline void convert_to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void convert_to_float<float>(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

}  // namespace eecore::cpu
