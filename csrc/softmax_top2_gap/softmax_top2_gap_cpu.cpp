// softmax_top2_gap on the CPU: one streaming pass per row (top2_online.h), no softmax buffer.
//
// Work is cut into (row, vocab segment) tasks of a fixed size, so a decode batch of one to a few
// rows over a 128K vocab still keeps every core busy; the segment states of a row are then merged
// in vocab order. The cut depends only on the shape, never on the thread count, so results are
// bitwise reproducible on any machine size.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "softmax_top2_gap/softmax_top2_gap_checks.h"
#include "softmax_top2_gap/top2_online.h"

namespace eecore {
namespace {

using cpu::Top2State;

// Logits handled per top2_update call: 8 KiB of fp32, so both passes over it hit L1.
constexpr int64_t kChunk = 2048;
// Vocab entries per task: large enough to amortise a task, small enough that a 128K vocab makes
// ~16 tasks per row to spread over the cores.
constexpr int64_t kSegment = 4 * kChunk;
// Logits per thread below which another thread is not worth waking.
constexpr int64_t kMinWorkPerThread = 32768;

// Fold x[0..n) (vocab indices base..) into st, converting bf16/fp16 chunk by chunk.
template <typename scalar_t>
void fold_span(Top2State& st, const scalar_t* x, int64_t n, int64_t base) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int64_t c = 0; c < n; c += kChunk) cpu::top2_update(st, x + c, std::min(kChunk, n - c), base + c);
  } else {
    float buf[kChunk];
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t len = std::min(kChunk, n - c);
      cpu::convert_to_float(x + c, buf, len);
      cpu::top2_update(st, buf, len, base + c);
    }
  }
}

template <typename scalar_t>
void softmax_top2_gap_rows(const scalar_t* logits, int64_t row_stride, int64_t rows, int64_t vocab, float* gap,
                           int64_t* top1) {
  const int64_t segments = (vocab + kSegment - 1) / kSegment;
  const int64_t seg_len = (vocab + segments - 1) / segments;
  const int64_t tasks = rows * segments;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / seg_len);
  std::vector<Top2State> states(tasks);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / segments, seg = t % segments;
      const int64_t lo = seg * seg_len, hi = std::min(vocab, lo + seg_len);
      fold_span(states[t], logits + row * row_stride + lo, hi - lo, lo);
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    Top2State st = states[row * segments];
    for (int64_t seg = 1; seg < segments; ++seg) st = cpu::top2_merge(st, states[row * segments + seg]);
    cpu::top2_finish(st, gap + row, top1 + row);
  }
}

std::tuple<at::Tensor, at::Tensor> softmax_top2_gap_cpu(const at::Tensor& logits) {
  check_softmax_top2_gap_args(logits);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor gap = at::empty({rows}, logits.options().dtype(at::kFloat));
  at::Tensor top1 = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return {gap, top1};
  EECORE_DISPATCH_FLOAT(logits.scalar_type(), "eecore::softmax_top2_gap", [&] {
    softmax_top2_gap_rows(logits.const_data_ptr<scalar_t>(), logits.stride(0), rows, vocab, gap.data_ptr<float>(),
                          top1.data_ptr<int64_t>());
  });
  return {gap, top1};
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("softmax_top2_gap", &eecore::softmax_top2_gap_cpu); }
