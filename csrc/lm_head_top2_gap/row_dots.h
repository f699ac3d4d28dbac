// out[i][j] = sum_k h[i][k] * w[j][k]: dot products of a few fp32 rows (hidden states) with a
// block of weight rows in their storage dtype, for a decode-sized batch (a handful of rows).
//
// At decode sizes the cost is streaming the weight from memory once; the kernel therefore keeps
// MR x NR independent fp32 accumulators (enough FMAs in flight to cover their latency), converts
// each weight vector once for MR hidden rows, and leaves a block of NR weight rows in L1 while
// the next hidden rows go past it. Used by lm_head_top2_gap (a vocab tile of logits) and
// mlp_confidence (the classifier's first layer).
#pragma once

#include <algorithm>
#include <cstdint>

#include "softmax_top2_gap/float8.h"

namespace eecore::cpu {

// How far ahead of the loads each weight row is prefetched. The weight comes from DRAM, and on
// its own the hardware prefetcher lets memory idle while a slice is reused from L1 by the later
// hidden rows: at B = 8 this runs 1.3-1.5x faster than no software prefetch (1 KiB ahead gets
// only half of that). Prefetches never fault, so running past the end of the weight is harmless.
constexpr int64_t kPrefetchBytes = 8192;

// One MR x NR block: h rows i < MR (stride ldh), w rows j < NR (stride ldw), length d.
template <int MR, int NR, typename w_t>
inline void dot_block(const float* h, int64_t ldh, const w_t* w, int64_t ldw, int64_t d, float* out, int64_t ldo) {
  Float8 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = zero8();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    Float8 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      __builtin_prefetch(w + j * ldw + k + kPrefetchBytes / static_cast<int64_t>(sizeof(w_t)));
      wv[j] = load8(w + j * ldw + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Float8 hv = load8(h + i * ldh + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = fma8(hv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t kk = k; kk < d; ++kk) s += h[i * ldh + kk] * static_cast<float>(w[j * ldw + kk]);
      out[i * ldo + j] = s;
    }
  }
}

// MR hidden rows against n weight rows: NR-wide column blocks, then single rows for the rest.
template <int MR, int NR, typename w_t>
inline void dot_rows_mr(const float* h, int64_t ldh, const w_t* w, int64_t ldw, int64_t n, int64_t d, float* out,
                        int64_t ldo) {
  int64_t j = 0;
  for (; j + NR <= n; j += NR) dot_block<MR, NR>(h, ldh, w + j * ldw, ldw, d, out + j, ldo);
  for (; j < n; ++j) dot_block<MR, 1>(h, ldh, w + j * ldw, ldw, d, out + j, ldo);
}

// out[i][j] (row stride ldo) for i < m hidden rows and j < n weight rows.
//
// The weight block is the outer loop: each NR-row slice of w is read from memory once, by the
// first group of hidden rows, and from L1 by the others. With one or two hidden rows (B = 1, 2)
// four weight rows are taken at a time instead of two, so there are still enough accumulators.
template <typename w_t>
void dot_rows(const float* h, int64_t ldh, int64_t m, const w_t* w, int64_t ldw, int64_t n, int64_t d, float* out,
              int64_t ldo) {
  // Weight rows per slice: about 16 KiB, so the slice stays in L1 while every hidden row passes.
  const int64_t cols = std::max<int64_t>(4, (16384 / (d * static_cast<int64_t>(sizeof(w_t)))) & ~int64_t{3});
  for (int64_t j0 = 0; j0 < n; j0 += cols) {
    const int64_t nj = std::min(cols, n - j0);
    const w_t* wj = w + j0 * ldw;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) dot_rows_mr<4, 2>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo);
    switch (m - i) {
      case 3: dot_rows_mr<3, 2>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      case 2: dot_rows_mr<2, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      case 1: dot_rows_mr<1, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      default: break;
    }
  }
}

}  // namespace eecore::cpu
