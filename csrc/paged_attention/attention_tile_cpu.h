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
#pragma once

#include <algorithm>
#include <cmath>

#include "common/cpu_vec.h"

namespace eecore::cpu {

// s[r * lds + c] = sum_d q[r * ldq + d] * k_rows[c][d] for R query rows and C keys.
template <int R, int C, typename T>
inline void score_block(const float* q, int64_t ldq, const T* const* k_rows, int64_t dim, float* s, int64_t lds) {
  Vec8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec8::zero();
  for (int64_t d = 0; d < dim; d += kVecWidth) {
    Vec8 k[C];
    for (int c = 0; c < C; ++c) k[c] = Vec8::load(k_rows[c] + d);
    for (int r = 0; r < R; ++r) {
      const Vec8 qv = Vec8::load(q + r * ldq + d);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(qv, k[c], acc[r][c]);
    }
  }
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
template <int R, int C, typename T>
inline void score_rows(const float* q, int64_t ldq, const T* const* k_rows, int64_t num_keys, int64_t dim, float* s,
                       int64_t lds) {
  int64_t n = 0;
  for (; n + C <= num_keys; n += C) score_block<R, C>(q, ldq, k_rows + n, dim, s + n, lds);
  for (; n < num_keys; ++n) score_block<R, 1>(q, ldq, k_rows + n, dim, s + n, lds);
}

// s [M, lds] = q [M, ldq] . k^T for the first num_keys columns. Blocks of 4 rows x 2 keys (8
// accumulators, 2 key vectors): each key vector is loaded (and converted) once per 4 query
// vectors, which in decode is once per KV group of 4. Leftover rows go 2 x 4 and 1 x 4.
template <typename T>
inline void tile_scores(const float* q, int64_t ldq, int64_t num_rows, const T* const* k_rows, int64_t num_keys,
                        int64_t dim, float* s, int64_t lds) {
  int64_t m = 0;
  for (; m + 4 <= num_rows; m += 4) score_rows<4, 2>(q + m * ldq, ldq, k_rows, num_keys, dim, s + m * lds, lds);
  if (m + 2 <= num_rows) {
    score_rows<2, 4>(q + m * ldq, ldq, k_rows, num_keys, dim, s + m * lds, lds);
    m += 2;
  }
  if (m < num_rows) score_rows<1, 4>(q + m * ldq, ldq, k_rows, num_keys, dim, s + m * lds, lds);
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

// acc[r * ldacc + d] += sum_n p[r * ldp + n] * v_rows[n][d] for R rows and the 8 * DV dims
// starting at `d0`.
template <int R, int DV, typename T>
inline void accumulate_block(const float* p, int64_t ldp, const T* const* v_rows, int64_t num_keys, int64_t d0,
                             float* acc, int64_t ldacc) {
  Vec8 a[R][DV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r][j] = Vec8::load(acc + r * ldacc + d0 + j * kVecWidth);
  for (int64_t n = 0; n < num_keys; ++n) {
    Vec8 v[DV];
    for (int j = 0; j < DV; ++j) v[j] = Vec8::load(v_rows[n] + d0 + j * kVecWidth);
    for (int r = 0; r < R; ++r) {
      const Vec8 pr = Vec8::broadcast(p[r * ldp + n]);
      for (int j = 0; j < DV; ++j) a[r][j] = fma(pr, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r][j].store(acc + r * ldacc + d0 + j * kVecWidth);
}

template <int R, typename T>
inline void accumulate_rows(const float* p, int64_t ldp, const T* const* v_rows, int64_t num_keys, int64_t dim,
                            float* acc, int64_t ldacc) {
  int64_t d = 0;
  for (; d + 2 * kVecWidth <= dim; d += 2 * kVecWidth) accumulate_block<R, 2>(p, ldp, v_rows, num_keys, d, acc, ldacc);
  if (d < dim) accumulate_block<R, 1>(p, ldp, v_rows, num_keys, d, acc, ldacc);
}

// acc [M, ldacc] += p [M, ldp] . v for the first num_keys keys. Rows go in blocks of 4 against
// 16 dims: 8 accumulators, and each value vector loaded (and converted) once per 4 rows.
template <typename T>
inline void tile_accumulate(const float* p, int64_t ldp, int64_t num_rows, const T* const* v_rows, int64_t num_keys,
                            int64_t dim, float* acc, int64_t ldacc) {
  int64_t m = 0;
  for (; m + 4 <= num_rows; m += 4)
    accumulate_rows<4>(p + m * ldp, ldp, v_rows, num_keys, dim, acc + m * ldacc, ldacc);
  if (m + 2 <= num_rows) {
    accumulate_rows<2>(p + m * ldp, ldp, v_rows, num_keys, dim, acc + m * ldacc, ldacc);
    m += 2;
  }
  if (m < num_rows) accumulate_rows<1>(p + m * ldp, ldp, v_rows, num_keys, dim, acc + m * ldacc, ldacc);
}

// acc[0:dim] *= factor.
inline void scale_row(float* acc, int64_t dim, float factor) {
  const Vec8 f = Vec8::broadcast(factor);
  for (int64_t d = 0; d < dim; d += kVecWidth) (Vec8::load(acc + d) * f).store(acc + d);
}

}  // namespace eecore::cpu
