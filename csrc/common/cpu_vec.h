// Vec8: eight fp32 lanes, the one vector type of every eecore CPU kernel.
//
// With AVX2 + FMA + F16C (what -march=native gives on any x86-64 of the last decade) it is a thin
// wrapper over __m256. Elsewhere (EECORE_CPU_NATIVE=0, aarch64, ...) it is a GCC/Clang vector of
// eight floats, which the compiler lowers to SSE, NEON or scalar code. The kernels are written
// once against this interface, so both builds run the same algorithm and only the speed differs.
//
// Why not at::vec::Vectorized? Its AVX2 path is only enabled inside ATen's own per-capability
// kernels (CPU_CAPABILITY_AVX2); an extension sees the scalar fallback. Why not rely on
// `#pragma omp simd` alone? The kernels need a vector exp, bf16/fp16 <-> fp32 conversions and
// cheap horizontal sums, which compilers do not derive well from scalar code.
//
// Semantics both builds share:
//   load / store   exactly 8 elements of fp32, bf16 or fp16 (the caller makes them addressable).
//                  Stores round to nearest even, like c10::BFloat16(float) / c10::Half(float).
//                  load also widens 8 int8 or int16 values exactly (weight-only int8 dot
//                  products; no store).
//   max / min      a > b ? a : b and a < b ? a : b (what vmaxps / vminps do), so a NaN in `a`
//                  never wins: pass the new data as `a` to keep NaN out of a running max.
//   exp            within ~1 ulp for the x <= 0 the kernels pass (x - running max); NaN in, NaN
//                  out; below ln(FLT_MIN) (-inf included) exactly 0, so a masked score adds 0.
//   reduce_add     the same pairwise order in both builds: ((0+4)+(2+6)) + ((1+5)+(3+7)).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EECORE_VEC8_AVX2 1
#else
#define EECORE_VEC8_AVX2 0
#endif

namespace eecore::cpu {

constexpr int64_t kVecWidth = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up_to_vec(int64_t n) { return (n + kVecWidth - 1) / kVecWidth * kVecWidth; }

// The range exp is computed on: below kExpUnderflow the result would be subnormal and is 0.
constexpr float kExpUnderflow = -87.3365447504f;  // ln(FLT_MIN)
constexpr float kExpOverflow = 88.3762626647949f;  // ln(FLT_MAX)

#if EECORE_VEC8_AVX2

struct Vec8 {
  __m256 v;

  static Vec8 zero() { return {_mm256_setzero_ps()}; }
  static Vec8 broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec8 load(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen each 16-bit lane and shift it into place.
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec8 load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static Vec8 load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  static Vec8 load(const int16_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }

  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {
    // Round to nearest even on the bits (add 0x7fff plus the lowest kept bit, drop the low half),
    // NaN to the canonical 0x7fc0: exactly c10::BFloat16(float).
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    // Every lane now fits 16 bits: pack the two 128-bit halves, in order.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  void store(c10::Half* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

inline Vec8 operator+(Vec8 a, Vec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec8 operator-(Vec8 a, Vec8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec8 operator*(Vec8 a, Vec8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec8 operator/(Vec8 a, Vec8 b) { return {_mm256_div_ps(a.v, b.v)}; }
// a * b + c with one rounding.
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
// vmaxps / vminps return their second operand when either is NaN: exactly a > b ? a : b.
inline Vec8 max(Vec8 a, Vec8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec8 min(Vec8 a, Vec8 b) { return {_mm256_min_ps(a.v, b.v)}; }

inline float reduce_add(Vec8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max(Vec8 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The four sums of a, b, c, d into out[0..3], each added in reduce_add's order (a transpose and
// three vector adds instead of four reductions, which is what makes short dot products, head dim
// 64, cheap). The same order matters: attention scores are reduced four at a time or one at a time
// depending on how many query rows and keys an item holds, and a verify pass of d + 1 rows must give
// each row the bits of a one-row decode step (self-speculation's greedy outputs are then exactly
// full depth's, in bf16 too).
inline void reduce_add4(Vec8 a, Vec8 b, Vec8 c, Vec8 d, float* out) {
  // lanes i + (i + 4) of a | of c, and of b | of d
  const __m256 ac = _mm256_add_ps(_mm256_permute2f128_ps(a.v, c.v, 0x20), _mm256_permute2f128_ps(a.v, c.v, 0x31));
  const __m256 bd = _mm256_add_ps(_mm256_permute2f128_ps(b.v, d.v, 0x20), _mm256_permute2f128_ps(b.v, d.v, 0x31));
  // (0+4)+(2+6) and (1+5)+(3+7) of a, b | of c, d
  const __m256 half = _mm256_add_ps(_mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_hadd_ps(half, half);  // a b a b | c d c d
  const __m128d lo = _mm_castps_pd(_mm256_castps256_ps128(sums)), hi = _mm_castps_pd(_mm256_extractf128_ps(sums, 1));
  _mm_storeu_ps(out, _mm_castpd_ps(_mm_unpacklo_pd(lo, hi)));
}

// e^x as 2^n e^r: n = round(x / ln2), r = x - n ln2 (ln2 split in two so that n ln2 is exact to
// fp32 precision, |r| <= ln2 / 2), e^r = 1 + r + r^2 p(r) with Cephes' degree-5 expf polynomial,
// 2^n built in the exponent bits.
inline Vec8 exp(Vec8 x) {
  const __m256 underflows = _mm256_cmp_ps(x.v, _mm256_set1_ps(kExpUnderflow), _CMP_LT_OQ);  // false for NaN
  // Clamp to where 2^n is a normal float; the clamp value is the second operand of max/min, so
  // a NaN passes through.
  const __m256 t = _mm256_min_ps(_mm256_set1_ps(kExpOverflow), _mm256_max_ps(_mm256_set1_ps(kExpUnderflow), x.v));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n; a NaN lane builds garbage here, but p is already NaN.
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_andnot_ps(underflows, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)))};
}

#else  // portable: GCC / Clang vector extensions, lowered to whatever SIMD the target has

struct Vec8 {
  typedef float Lanes __attribute__((vector_size(8 * sizeof(float))));
  Lanes v;

  static Vec8 zero() { return {Lanes{}}; }
  static Vec8 broadcast(float x) { return {Lanes{} + x}; }
  static Vec8 load(const float* p) {
    Vec8 r;
    std::memcpy(&r.v, p, sizeof(r.v));
    return r;
  }
  static Vec8 load(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen each 16-bit lane and shift it into place.
    typedef uint16_t Bits16 __attribute__((vector_size(8 * sizeof(uint16_t))));
    typedef uint32_t Bits32 __attribute__((vector_size(8 * sizeof(uint32_t))));
    Bits16 raw;
    std::memcpy(&raw, p, sizeof(raw));
    const Bits32 bits = __builtin_convertvector(raw, Bits32) << 16;
    Vec8 r;
    std::memcpy(&r.v, &bits, sizeof(r.v));
    return r;
  }
  static Vec8 load(const c10::Half* p) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  template <typename T>  // int8, int16: exact
  static Vec8 load(const T* p) {
    static_assert(std::is_integral_v<T>);
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }

  void store(float* p) const { std::memcpy(p, &v, sizeof(v)); }
  template <typename T>  // bf16, fp16: c10's own rounding conversions
  void store(T* p) const {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<T>(v[i]);
  }
};

inline Vec8 operator+(Vec8 a, Vec8 b) { return {a.v + b.v}; }
inline Vec8 operator-(Vec8 a, Vec8 b) { return {a.v - b.v}; }
inline Vec8 operator*(Vec8 a, Vec8 b) { return {a.v * b.v}; }
inline Vec8 operator/(Vec8 a, Vec8 b) { return {a.v / b.v}; }
inline Vec8 fma(Vec8 a, Vec8 b, Vec8 c) {
#ifdef __FP_FAST_FMAF  // a hardware fma: one rounding, as in the AVX2 build
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
#else  // without one, std::fma is a slow software routine: round twice instead
  return {a.v * b.v + c.v};
#endif
}
inline Vec8 max(Vec8 a, Vec8 b) { return {a.v > b.v ? a.v : b.v}; }
inline Vec8 min(Vec8 a, Vec8 b) { return {a.v < b.v ? a.v : b.v}; }

inline float reduce_add(Vec8 a) {
  const Vec8::Lanes& l = a.v;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

inline float reduce_max(Vec8 a) {
  auto larger = [](float x, float y) { return x > y ? x : y; };
  const Vec8::Lanes& l = a.v;
  return larger(larger(larger(l[0], l[4]), larger(l[2], l[6])), larger(larger(l[1], l[5]), larger(l[3], l[7])));
}

inline void reduce_add4(Vec8 a, Vec8 b, Vec8 c, Vec8 d, float* out) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

inline Vec8 exp(Vec8 x) {
  Vec8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = x.v[i] < kExpUnderflow ? 0.f : std::exp(x.v[i]);
  return r;
}

#endif  // EECORE_VEC8_AVX2

#if defined(__AVX512F__) && EECORE_VEC8_AVX2
// 16 bf16 values as fp32 lanes (bf16 is the top half of an fp32): the one widening every AVX-512
// kernel uses (attention's Vec16, the int16 rounding of rows, the AMX epilogues).
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// n values of any activation dtype -> fp32 (n may be anything; the tail is scalar).
template <typename T>
inline void convert_to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVecWidth <= n; i += kVecWidth) Vec8::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace eecore::cpu
