// The three steps of one flash-attention tile on the CPU, for M query vectors (query rows x the
// query heads of one KV group) against N keys:
//
//   tile_scores       s[m, n]  = q[m] . k[n]                        (q is pre-scaled, fp32)
//   online_softmax    p[m, n]  = exp(s[m, n] - max_m); rescale the running sums of row m
//   tile_accumulate   acc[m]  += sum_n p[m, n] * v[n]
//
// Keys and values arrive as an array of row pointers, one per token: a paged cache scatters a
// sequence's tokens over its blocks, and the pointers let one tile span several blocks (or part
// of one) without copying. The rows are the cache's own rows (T = the cache dtype) or rows packed
// into an fp32 buffer (T = float) when that pays; the kernels are the same either way.
//
// Register blocking: each kernel computes a small R x C block of outputs in registers so that a
// loaded key or value vector serves several query rows (and a query vector several keys).
// All lengths in D are multiples of 8 (kVecWidth): head dims that are not get packed, padded.
//
// Vector width: the dot products and the value accumulation run 16 lanes at a time (AVX-512) where
// the CPU has them and the padded head dim is a multiple of 16, else 8 (Vec8). The choice depends
// on the head dim alone, so every pass of a model (decode, a verify pass, a prefill) sums in the
// same order: a score is accumulated in 16 lanes, folded to 8 (lane i + lane i + 8) and reduced as
// Vec8 reduces, and a value row is added to each output element in key order either way (those
// bits do not depend on the width). Decode attention is bound by this arithmetic on a CPU: SmolLM2
// at batch 8 (9 query heads over 3 KV heads, 64 dims, 1,024 keys) ran at ~25 G multiply-adds/s in
// Vec8 on 2 Intel Xeon cores.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/cpu_vec.h"

namespace eecore::cpu {

// Vec8's lanes for the kernels below; Vec16 (where built) has the same interface, 16 lanes.
template <typename V>
constexpr int64_t lanes_of = kVecWidth;

inline Vec8 fold_to_vec8(Vec8 a) { return a; }

#if defined(__AVX512F__) && EECORE_VEC8_AVX2
#define EECORE_ATTENTION_VEC16 1
struct Vec16 {
  __m512 v;

  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const c10::BFloat16* p) { return {load_bf16x16(p)}; }
  static Vec16 load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
template <>
constexpr int64_t lanes_of<Vec16> = 16;

inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// lanes i + (i + 8): the 8 partial sums Vec8's reductions take
inline Vec8 fold_to_vec8(Vec16 a) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return {_mm256_add_ps(_mm512_castps512_ps256(a.v), hi)};
}
#else
#define EECORE_ATTENTION_VEC16 0
#endif

// f(V{}) with the widest vector type of the kernels below that this build has and `dim` fills.
template <typename F>
inline void with_widest_lanes(int64_t dim, F&& f) {
#if EECORE_ATTENTION_VEC16
  if (dim % 16 == 0) return f(Vec16{});
#endif
  f(Vec8{});
}

// s[r * lds + c] = sum_d q[r * ldq + d] * k_rows[c][d] for R query rows and C keys, in lanes of V.
template <int R, int C, typename V, typename T>
inline void score_block(const float* q, int64_t ldq, const T* const* k_rows, int64_t dim, float* s, int64_t lds) {
  V wide[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) wide[r][c] = V::zero();
  for (int64_t d = 0; d < dim; d += lanes_of<V>) {
    V k[C];
    for (int c = 0; c < C; ++c) k[c] = V::load(k_rows[c] + d);
    for (int r = 0; r < R; ++r) {
      const V qv = V::load(q + r * ldq + d);
      for (int c = 0; c < C; ++c) wide[r][c] = fma(qv, k[c], wide[r][c]);
    }
  }
  Vec8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = fold_to_vec8(wide[r][c]);
  // Horizontal sums four at a time: along the keys of a row, or down the rows of a key.
  if constexpr (C == 4) {
    for (int r = 0; r < R; ++r) reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s + r * lds);
  } else if constexpr (R == 4) {
    for (int c = 0; c < C; ++c) {
      float sums[4];
      reduce_add4(acc[0][c], acc[1][c], acc[2][c], acc[3][c], sums);
      for (int r = 0; r < 4; ++r) s[r * lds + c] = sums[r];
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r * lds + c] = reduce_add(acc[r][c]);
  }
}

// All N keys for R query rows: blocks of `C` keys, then single keys.
template <int R, int C, typename V, typename T>
inline void score_rows(const float* q, int64_t ldq, const T* const* k_rows, int64_t num_keys, int64_t dim, float* s,
                       int64_t lds) {
  int64_t n = 0;
  for (; n + C <= num_keys; n += C) score_block<R, C, V>(q, ldq, k_rows + n, dim, s + n, lds);
  for (; n < num_keys; ++n) score_block<R, 1, V>(q, ldq, k_rows + n, dim, s + n, lds);
}

// s [M, lds] = q [M, ldq] . k^T for the first num_keys columns. Blocks of 4 rows x 2 keys (8
// accumulators, 2 key vectors): each key vector is loaded (and converted) once per 4 query
// vectors, which in decode is once per KV group of 4. Leftover rows go 2 x 4 and 1 x 4.
// Rows in blocks of 4, then of 2 and 1: f(std::integral_constant<int, R>, first row) for each.
template <typename F>
inline void in_row_blocks(int64_t num_rows, F&& f) {
  int64_t m = 0;
  for (; m + 4 <= num_rows; m += 4) f(std::integral_constant<int, 4>{}, m);
  if (m + 2 <= num_rows) {
    f(std::integral_constant<int, 2>{}, m);
    m += 2;
  }
  if (m < num_rows) f(std::integral_constant<int, 1>{}, m);
}

template <typename V, typename T>
inline void tile_scores_in(const float* q, int64_t ldq, int64_t num_rows, const T* const* k_rows, int64_t num_keys,
                           int64_t dim, float* s, int64_t lds) {
  in_row_blocks(num_rows, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    score_rows<R, R == 4 ? 2 : 4, V>(q + m * ldq, ldq, k_rows, num_keys, dim, s + m * lds, lds);
  });
}

template <typename T>
inline void tile_scores(const float* q, int64_t ldq, int64_t num_rows, const T* const* k_rows, int64_t num_keys,
                        int64_t dim, float* s, int64_t lds) {
  with_widest_lanes(dim, [&](auto lanes) {
    tile_scores_in<decltype(lanes)>(q, ldq, num_rows, k_rows, num_keys, dim, s, lds);
  });
}

// One row of the online softmax. `s` holds the row's scores for this tile (masked ones -inf),
// padded with -inf up to a multiple of 8; they are replaced by p = exp(s - new_max). Returns the
// factor exp(old_max - new_max) by which the row's earlier accumulator must be scaled; updates
// the running max and the running sum of p.
inline float online_softmax_row(float* s, int64_t padded_len, float& running_max, float& running_sum) {
  Vec8 vmax = Vec8::broadcast(kNegInf);
  for (int64_t n = 0; n < padded_len; n += kVecWidth) vmax = max(vmax, Vec8::load(s + n));
  const float new_max = std::max(running_max, reduce_max(vmax));
  if (new_max == kNegInf) {
    // Every key so far is masked for this row: nothing to add yet (p = 0 everywhere).
    for (int64_t n = 0; n < padded_len; ++n) s[n] = 0.f;
    return 1.f;
  }
  const Vec8 shift = Vec8::broadcast(new_max);
  Vec8 vsum = Vec8::zero();
  for (int64_t n = 0; n < padded_len; n += kVecWidth) {
    const Vec8 p = exp(Vec8::load(s + n) - shift);
    p.store(s + n);
    vsum = vsum + p;
  }
  const float correction = std::exp(running_max - new_max);  // exp(-inf) = 0 on the first tile
  running_sum = running_sum * correction + reduce_add(vsum);
  running_max = new_max;
  return correction;
}

// acc[r * ldacc + d] += sum_n p[r * ldp + n] * v_rows[n][d] for R rows and the DV vectors of V
// lanes starting at dim `d0`.
template <int R, int DV, typename V, typename T>
inline void accumulate_block(const float* p, int64_t ldp, const T* const* v_rows, int64_t num_keys, int64_t d0,
                             float* acc, int64_t ldacc) {
  constexpr int64_t W = lanes_of<V>;
  V a[R][DV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r][j] = V::load(acc + r * ldacc + d0 + j * W);
  for (int64_t n = 0; n < num_keys; ++n) {
    V v[DV];
    for (int j = 0; j < DV; ++j) v[j] = V::load(v_rows[n] + d0 + j * W);
    for (int r = 0; r < R; ++r) {
      const V pr = V::broadcast(p[r * ldp + n]);
      for (int j = 0; j < DV; ++j) a[r][j] = fma(pr, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r][j].store(acc + r * ldacc + d0 + j * W);
}

template <int R, typename V, typename T>
inline void accumulate_rows(const float* p, int64_t ldp, const T* const* v_rows, int64_t num_keys, int64_t dim,
                            float* acc, int64_t ldacc) {
  constexpr int64_t W = lanes_of<V>;
  int64_t d = 0;
  for (; d + 2 * W <= dim; d += 2 * W) accumulate_block<R, 2, V>(p, ldp, v_rows, num_keys, d, acc, ldacc);
  if (d < dim) accumulate_block<R, 1, V>(p, ldp, v_rows, num_keys, d, acc, ldacc);
}

template <typename V, typename T>
inline void tile_accumulate_in(const float* p, int64_t ldp, int64_t num_rows, const T* const* v_rows,
                               int64_t num_keys, int64_t dim, float* acc, int64_t ldacc) {
  in_row_blocks(num_rows, [&](auto rows, int64_t m) {
    accumulate_rows<decltype(rows)::value, V>(p + m * ldp, ldp, v_rows, num_keys, dim, acc + m * ldacc, ldacc);
  });
}

// acc [M, ldacc] += p [M, ldp] . v for the first num_keys keys. Rows go in blocks of 4 against
// 2 vectors of dims: 8 accumulators, and each value vector loaded (and converted) once per 4 rows.
// Each output element gets p[n] * v[n][d] added in key order, so its bits are the same in 8 or 16
// lanes.
template <typename T>
inline void tile_accumulate(const float* p, int64_t ldp, int64_t num_rows, const T* const* v_rows, int64_t num_keys,
                            int64_t dim, float* acc, int64_t ldacc) {
  with_widest_lanes(dim, [&](auto lanes) {
    tile_accumulate_in<decltype(lanes)>(p, ldp, num_rows, v_rows, num_keys, dim, acc, ldacc);
  });
}

// acc[0:dim] *= factor.
inline void scale_row(float* acc, int64_t dim, float factor) {
  const Vec8 f = Vec8::broadcast(factor);
  for (int64_t d = 0; d < dim; d += kVecWidth) (Vec8::load(acc + d) * f).store(acc + d);
}

}  // namespace eecore::cpu
