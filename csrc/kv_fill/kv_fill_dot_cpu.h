// The small-batch projection micro-kernel of kv_fill on the CPU: the dot products of one weight
// row with up to kMaxTileTokens activation rows, reading the weight row exactly once.
//
// Why not a BLAS call: at decode sizes (a handful of tokens) the projection is a matrix-vector
// product bound by reading the weights, and a GEMM library's small-M path is often far from the
// memory bandwidth (MKL on AMD CPUs is ~10x off here). Streaming each weight row once against
// every token, in fp32 registers, runs at the speed the weights can be read for 1-4 tokens and
// within ~2x of it for 8 tokens at d = 2048 (their 64 KiB of fp32 activations no longer fit L1).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace eecore {
namespace kv_fill_dot {

constexpr int kLanes = 8;          // fp32 lanes per step: one AVX2 register, two NEON ones
constexpr int kMaxTileTokens = 8;  // accumulators: kMaxTileTokens registers of kLanes fp32

// GCC/Clang vector extensions: portable SIMD that lowers to AVX2 here, NEON or SSE elsewhere.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Lanes32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Lanes16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// kLanes consecutive elements, widened to fp32.
inline Lanes load_lanes(const float* in) {
  Lanes v;
  std::memcpy(&v, in, sizeof(v));
  return v;
}

inline Lanes load_lanes(const c10::BFloat16* in) {
  // bf16 is the upper half of an fp32: widen and shift.
  Lanes16 bits;
  std::memcpy(&bits, in, sizeof(bits));
  return reinterpret_cast<Lanes>(__builtin_convertvector(bits, Lanes32) << 16);
}

inline Lanes load_lanes(const c10::Half* in) {
#if defined(__F16C__) && defined(__AVX__)
  return reinterpret_cast<Lanes>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
#else
  Lanes v;
  for (int u = 0; u < kLanes; ++u) v[u] = static_cast<float>(in[u]);
  return v;
#endif
}

template <typename scalar_t>  // any other type the dispatch instantiates (double): plain casts
inline Lanes load_lanes(const scalar_t* in) {
  Lanes v;
  for (int u = 0; u < kLanes; ++u) v[u] = static_cast<float>(in[u]);
  return v;
}

// acc + a * b, fused where the ISA has it (ISO C++ modes do not contract a * b + c on their own).
inline Lanes multiply_add(Lanes a, Lanes b, Lanes acc) {
#if defined(__FMA__) && defined(__AVX__)
  return reinterpret_cast<Lanes>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(acc)));
#else
  return acc + a * b;
#endif
}

// dots[t] = sum_j w[j] * x[t * d + j] for t < kTokens, accumulated in fp32: each chunk of the
// weight row is loaded once and multiplied into every token's accumulator.
template <int kTokens, typename scalar_t>
inline void dot_tile(const scalar_t* w, const float* x, int64_t d, float* dots) {
  Lanes acc[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = Lanes{};
  const int64_t body = d - d % kLanes;
  for (int64_t j = 0; j < body; j += kLanes) {
    const Lanes wv = load_lanes(w + j);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) acc[t] = multiply_add(wv, load_lanes(x + t * d + j), acc[t]);
  }
  for (int t = 0; t < kTokens; ++t) {
    float sum = 0.f;
    for (int u = 0; u < kLanes; ++u) sum += acc[t][u];
    for (int64_t j = body; j < d; ++j) sum += static_cast<float>(w[j]) * x[t * d + j];
    dots[t] = sum;
  }
}

// out[t * out_stride + r] = <w[r], x[t]> for rows r < num_rows of w (row stride d) and tokens
// t < num_tokens <= kMaxTileTokens.
template <int kTokens, typename scalar_t>
inline void project_rows(const scalar_t* w, int64_t num_rows, const float* x, int64_t d, float* out,
                         int64_t out_stride) {
  float dots[kTokens];
  for (int64_t r = 0; r < num_rows; ++r) {
    dot_tile<kTokens>(w + r * d, x, d, dots);
    for (int t = 0; t < kTokens; ++t) out[t * out_stride + r] = dots[t];
  }
}

template <typename scalar_t>
inline void project_rows(int num_tokens, const scalar_t* w, int64_t num_rows, const float* x, int64_t d, float* out,
                         int64_t out_stride) {
  switch (num_tokens) {
    case 1: return project_rows<1>(w, num_rows, x, d, out, out_stride);
    case 2: return project_rows<2>(w, num_rows, x, d, out, out_stride);
    case 3: return project_rows<3>(w, num_rows, x, d, out, out_stride);
    case 4: return project_rows<4>(w, num_rows, x, d, out, out_stride);
    case 5: return project_rows<5>(w, num_rows, x, d, out, out_stride);
    case 6: return project_rows<6>(w, num_rows, x, d, out, out_stride);
    case 7: return project_rows<7>(w, num_rows, x, d, out, out_stride);
    default: return project_rows<8>(w, num_rows, x, d, out, out_stride);
  }
}

}  // namespace kv_fill_dot
}  // namespace eecore
