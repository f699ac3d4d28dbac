// The online state behind softmax_top2_gap and lm_head_top2_gap: one pass over a row of logits,
// in any number of pieces, gives the softmax's top-2 gap and argmax without a softmax buffer.
//
//   p1 - p2 = (exp(x1 - m) - exp(x2 - m)) / sum_i exp(x_i - m) = -expm1(x2 - x1) / sumexp,  m = x1
//
// so a row needs only its largest logit x1 (and its first index), its second largest x2 (equal
// to x1 on a tie: the gap is then 0), and sumexp taken relative to x1. Pieces of a row are folded
// in chunk by chunk (top2_update), and the states of different pieces combine exactly like
// flash-attention's partial softmaxes (top2_merge), so the vocab can be split across threads.
//
// Special values, matching softmax + topk + argmax in fp32 wherever torch defines them:
//   -inf entries take no probability; a row of only -inf gives gap NaN, top1 0.
//   +inf or NaN anywhere in a row gives gap NaN; top1 skips NaN entries (torch would return one).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/cpu_vec.h"

namespace eecore::cpu {

struct Top2State {
  float max = kNegInf;     // largest logit so far
  float second = kNegInf;  // second largest, counting repeats (== max on a tie)
  float sumexp = 0.f;      // sum of exp(x - max) so far; 0 while max is -inf
  int64_t argmax = -1;     // first index holding `max`; -1 until a logit above -inf is seen
};

// Insert one value into a (largest, second largest) pair. NaN compares false and is dropped.
inline void push_top2(float x, float& first, float& second) {
  if (x > first) {
    second = first;
    first = x;
  } else if (x > second) {
    second = x;
  }
}

// Largest and second largest of x[0..n), ignoring NaN. Two sets of eight lanes each keep their
// own top-2 (top2 of lane = max(top2, min(x, top1)), top1 = max(x, top1)); the true top-2 of the
// chunk is then among the 32 lane values.
inline void chunk_top2(const float* x, int64_t n, float& first, float& second) {
  Vec8 t1a = Vec8::broadcast(kNegInf), t2a = t1a, t1b = t1a, t2b = t1a;
  int64_t i = 0;
  for (; i + 2 * kVecWidth <= n; i += 2 * kVecWidth) {
    const Vec8 va = Vec8::load(x + i), vb = Vec8::load(x + i + kVecWidth);
    t2a = max(min(va, t1a), t2a);
    t1a = max(va, t1a);
    t2b = max(min(vb, t1b), t2b);
    t1b = max(vb, t1b);
  }
  for (; i + kVecWidth <= n; i += kVecWidth) {
    const Vec8 va = Vec8::load(x + i);
    t2a = max(min(va, t1a), t2a);
    t1a = max(va, t1a);
  }
  float lanes[4][kVecWidth];
  t1a.store(lanes[0]);
  t2a.store(lanes[1]);
  t1b.store(lanes[2]);
  t2b.store(lanes[3]);
  first = kNegInf;
  second = kNegInf;
  for (auto& set : lanes)
    for (float v : set) push_top2(v, first, second);
  for (; i < n; ++i) push_top2(x[i], first, second);
}

// sum_i exp(x[i] - m) over x[0..n).
inline float sum_exp_minus(const float* x, int64_t n, float m) {
  const Vec8 mv = Vec8::broadcast(m);
  Vec8 acc0 = Vec8::zero(), acc1 = Vec8::zero();
  int64_t i = 0;
  for (; i + 2 * kVecWidth <= n; i += 2 * kVecWidth) {
    acc0 = acc0 + exp(Vec8::load(x + i) - mv);
    acc1 = acc1 + exp(Vec8::load(x + i + kVecWidth) - mv);
  }
  for (; i + kVecWidth <= n; i += kVecWidth) acc0 = acc0 + exp(Vec8::load(x + i) - mv);
  float sum = reduce_add(acc0 + acc1);
  for (; i < n; ++i) sum += std::exp(x[i] - m);
  return sum;
}

// Fold logits x[0..n) (vocab indices base..base+n) into st. x should be small enough to stay in
// L1 between the two passes over it (top-2, then exp-sum): callers pass at most a few thousand.
inline void top2_update(Top2State& st, const float* x, int64_t n, int64_t base) {
  if (n <= 0) return;
  float first, second;
  chunk_top2(x, n, first, second);
  if (first > st.max) {
    int64_t at = 0;
    while (at < n - 1 && !(x[at] == first)) ++at;  // first occurrence: ties keep the lowest index
    st.sumexp *= std::exp(st.max - first);         // rescale; 0 * exp(-inf) stays 0
    st.second = std::fmax(st.max, second);
    st.max = first;
    st.argmax = base + at;
  } else {
    st.second = std::fmax(st.second, first);  // first <= st.max, and second <= first
  }
  if (st.max > kNegInf) st.sumexp += sum_exp_minus(x, n, st.max);
}

// Combine the states of two disjoint pieces of one row; `lo` must cover the lower indices, so on
// a tie of maxima its argmax (the earlier index) wins.
inline Top2State top2_merge(const Top2State& lo, const Top2State& hi) {
  Top2State out;
  const Top2State& win = hi.max > lo.max ? hi : lo;
  const Top2State& lose = hi.max > lo.max ? lo : hi;
  out.max = win.max;
  out.argmax = win.argmax;
  // The losing piece's sum is rescaled to the winner's max (no rescale on a tie: also keeps
  // -inf - -inf from turning an all -inf piece into NaN).
  out.sumexp = win.sumexp + (lose.max == win.max ? lose.sumexp : lose.sumexp * std::exp(lose.max - win.max));
  out.second = std::fmax(lose.max, std::fmax(win.second, lose.second));
  return out;
}

// The final (gap, top1) of a row's state.
inline void top2_finish(const Top2State& st, float* gap, int64_t* top1) {
  *top1 = st.argmax < 0 ? 0 : st.argmax;
  if (!(st.max > kNegInf)) {
    *gap = std::numeric_limits<float>::quiet_NaN();  // softmax of an all -inf row is NaN
    return;
  }
  // p1 - p2 = (1 - exp(x2 - x1)) / sumexp; expm1 keeps near-ties accurate. A NaN or +inf in the
  // row has made sumexp NaN, and so the gap.
  *gap = static_cast<float>(-std::expm1(static_cast<double>(st.second) - st.max) / st.sumexp);
}

}  // namespace eecore::cpu
