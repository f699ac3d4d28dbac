// Eight fp32 lanes for the CPU attention kernels: AVX2+FMA+F16C when the build targets them, a
// plain array otherwise (correct everywhere, and still auto-vectorised by the compiler).
//
// Why not at::vec::Vectorized? Its AVX2 path is only enabled inside ATen's own per-capability
// kernels (CPU_CAPABILITY_AVX2); an extension sees the scalar fallback. Why not rely on
// `#pragma omp simd` alone? The kernels need a vector exp, bf16/fp16 -> fp32 loads and a
// four-way horizontal sum, which compilers do not derive from scalar code.
//
// Every load reads exactly 8 elements: callers guarantee that 8 elements are readable (the head
// dim is a multiple of 8, or the row was packed into a padded fp32 buffer).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EECORE_VEC8_AVX2 1
#else
#define EECORE_VEC8_AVX2 0
#endif

namespace eecore::cpu {

constexpr int64_t kVecWidth = 8;

inline int64_t round_up_to_vec(int64_t n) { return (n + kVecWidth - 1) / kVecWidth * kVecWidth; }

#if EECORE_VEC8_AVX2

struct Vec8 {
  __m256 v;

  static Vec8 zero() { return {_mm256_setzero_ps()}; }
  static Vec8 broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec8 load(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen to 32 bits and shift into place.
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec8 load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};

inline Vec8 operator+(Vec8 a, Vec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec8 operator-(Vec8 a, Vec8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec8 operator*(Vec8 a, Vec8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec8 max(Vec8 a, Vec8 b) { return {_mm256_max_ps(a.v, b.v)}; }
// a * b + c with one rounding.
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }

inline float reduce_add(Vec8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline float reduce_max(Vec8 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The four sums of a, b, c, d into out[0..3]: one transpose-and-add instead of four reductions,
// which is what makes short dot products (head dim 64) cheap.
inline void reduce_add4(Vec8 a, Vec8 b, Vec8 c, Vec8 d, float* out) {
  const __m256 ab = _mm256_hadd_ps(a.v, b.v);  // a01 a23 b01 b23 | a45 a67 b45 b67
  const __m256 cd = _mm256_hadd_ps(c.v, d.v);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

// e^x to about 1 ulp (Cephes' expf polynomial): x = n ln2 + r with |r| <= ln2/2, e^r by a
// degree-6 polynomial, 2^n by building the exponent bits. Inputs below ln(FLT_MIN) give exactly
// 0, so a masked (-inf) score contributes nothing.
inline Vec8 exp(Vec8 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 underflow = _mm256_set1_ps(-87.3365447504f);
  const __m256 is_zero = _mm256_cmp_ps(x.v, underflow, _CMP_LT_OQ);
  __m256 t = _mm256_min_ps(_mm256_max_ps(x.v, underflow), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
  t = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), t);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(t, t), _mm256_add_ps(t, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
  return {_mm256_andnot_ps(is_zero, result)};
}

#else  // portable fallback

struct Vec8 {
  float v[8];

  static Vec8 zero() { return broadcast(0.f); }
  static Vec8 broadcast(float x) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static Vec8 load(const T* p) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < 8; ++i) p[i] = v[i];
  }
};

template <typename F>
inline Vec8 lanewise(Vec8 a, Vec8 b, F f) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = f(a.v[i], b.v[i]);
  return r;
}
inline Vec8 operator+(Vec8 a, Vec8 b) { return lanewise(a, b, [](float x, float y) { return x + y; }); }
inline Vec8 operator-(Vec8 a, Vec8 b) { return lanewise(a, b, [](float x, float y) { return x - y; }); }
inline Vec8 operator*(Vec8 a, Vec8 b) { return lanewise(a, b, [](float x, float y) { return x * y; }); }
inline Vec8 max(Vec8 a, Vec8 b) { return lanewise(a, b, [](float x, float y) { return std::max(x, y); }); }
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float reduce_add(Vec8 a) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a.v[i];
  return s;
}
inline float reduce_max(Vec8 a) {
  float m = a.v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a.v[i]);
  return m;
}
inline void reduce_add4(Vec8 a, Vec8 b, Vec8 c, Vec8 d, float* out) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}
inline Vec8 exp(Vec8 x) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

#endif  // EECORE_VEC8_AVX2

}  // namespace eecore::cpu
