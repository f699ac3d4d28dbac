// out[i][j] = sum_k h[i][k] * w[j][k]: the dot products of a few fp32 rows (hidden states, a
// decode batch) with many weight rows in their storage dtype (fp32, bf16, fp16). The one
// "few rows x many weight rows" kernel of the CPU ops: lm_head_top2_gap (a vocab tile of
// logits), mlp_confidence (the classifier's first layer) and kv_fill (a K/V head's projection).
//
// Why not a GEMM library: at decode sizes this is a matrix-vector product bound by reading the
// weight, and a BLAS small-M path is often far from the memory bandwidth (and widens bf16/fp16
// weights through a copy). Here the weight is read exactly once, in its own dtype, converted to
// fp32 in registers, and the kernel keeps MR x NR independent fp32 accumulators (enough FMAs in
// flight to cover their latency), converting each weight vector once for MR hidden rows.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/cpu_vec.h"

namespace eecore::cpu {

// How far ahead of the loads each weight row is prefetched. The weight comes from DRAM, and on
// its own the hardware prefetcher lets memory idle while a slice is reused from L1 by the later
// hidden rows: at B = 8 this runs 1.3-1.5x faster than no software prefetch (1 KiB ahead gets
// only half of that). Prefetches never fault, so running past the end of the weight is harmless.
constexpr int64_t kPrefetchBytes = 8192;

// One MR x NR block: h rows i < MR (stride ldh), w rows j < NR (stride ldw), length d.
template <int MR, int NR, typename w_t>
inline void dot_block(const float* h, int64_t ldh, const w_t* w, int64_t ldw, int64_t d, float* out, int64_t ldo) {
  Vec8 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec8::zero();
  int64_t k = 0;
  for (; k + kVecWidth <= d; k += kVecWidth) {
    Vec8 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      __builtin_prefetch(w + j * ldw + k + kPrefetchBytes / static_cast<int64_t>(sizeof(w_t)));
      wv[j] = Vec8::load(w + j * ldw + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec8 hv = Vec8::load(h + i * ldh + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = fma(hv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = reduce_add(acc[i][j]);
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

// out[i * ldo + j] = <h[i], w[j]> for i < m hidden rows (fp32, row stride ldh) and j < n weight
// rows (row stride ldw), each of length d.
//
// The weight block is the outer loop: each slice of w is read from memory once, by the first
// group of hidden rows, and from L1 by the others. Hidden rows go in groups of up to four, each
// against four weight rows at a time: a 4 x 4 block loads 8 vectors per 16 FMAs (4 x 2 needed 6
// per 8, and at B = 8 ran the layer's projections 1.25x and the LM head 1.4x slower). The hidden
// rows should fit in L2 (callers sweep larger batches in parts).
template <typename w_t>
void dot_rows(const float* h, int64_t ldh, int64_t m, const w_t* w, int64_t ldw, int64_t n, int64_t d, float* out,
              int64_t ldo) {
  // Weight rows per slice: about 16 KiB, so the slice stays in L1 while every hidden row passes.
  const int64_t cols = std::max<int64_t>(4, (16384 / (d * static_cast<int64_t>(sizeof(w_t)))) & ~int64_t{3});
  for (int64_t j0 = 0; j0 < n; j0 += cols) {
    const int64_t nj = std::min(cols, n - j0);
    const w_t* wj = w + j0 * ldw;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) dot_rows_mr<4, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo);
    switch (m - i) {
      case 3: dot_rows_mr<3, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      case 2: dot_rows_mr<2, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      case 1: dot_rows_mr<1, 4>(h + i * ldh, ldh, wj, ldw, nj, d, out + i * ldo + j0, ldo); break;
      default: break;
    }
  }
}

}  // namespace eecore::cpu
