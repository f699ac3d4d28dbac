// lm_head_top2_gap on the CPU: logits = hidden @ weight.T computed one vocab tile at a time into
// a small per-thread buffer, each tile folded straight into the online top-2 / log-sum-exp state
// of every row (softmax_top2_gap/top2_online.h). The [B, V] logits never exist.
//
// At decode sizes the op is bound by streaming the [V, d] weight from memory, so the weight is
// read exactly once, in its own dtype (bf16/fp16 halve the traffic), and converted to fp32 in
// registers (common/cpu_dots.h). Tiles are spread over the threads; every tile leaves
// one partial state per row, merged in vocab order afterwards, so the result does not depend on
// the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/cpu_dots.h"
#include "lm_head_top2_gap/lm_head_top2_gap_checks.h"
#include "softmax_top2_gap/top2_online.h"

namespace eecore {
namespace {

using cpu::Top2State;

// Vocab rows per tile: a [B, 512] fp32 logits buffer (16 KiB at B = 8), and ~100-250 tiles for
// real vocabularies, plenty to balance the threads.
constexpr int64_t kTile = 512;
// fp32 hidden rows kept resident per sweep over the weight (L2-sized); larger batches take
// several sweeps.
constexpr int64_t kHiddenBytesPerSweep = 256 * 1024;
// Multiply-adds per thread below which another thread is not worth waking.
constexpr int64_t kMinWorkPerThread = 1 << 18;

template <typename scalar_t>
void lm_head_top2_gap_rows(const scalar_t* hidden, int64_t ldh, int64_t rows, const scalar_t* weight, int64_t ldw,
                           int64_t vocab, int64_t d, float* gap, int64_t* top1) {
  const cpu::DotInput<scalar_t, scalar_t> h(hidden, ldh, rows, d);

  const int64_t tiles = (vocab + kTile - 1) / kTile;
  std::vector<Top2State> states(tiles * rows);  // [tile][row]
  const int64_t sweep_rows = std::max<int64_t>(4, kHiddenBytesPerSweep / (d * 4));
  for (int64_t r0 = 0; r0 < rows; r0 += sweep_rows) {
    const int64_t nr = std::min(sweep_rows, rows - r0);
    const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / (kTile * d * nr));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> logits(nr * kTile);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t v0 = t * kTile, n = std::min(kTile, vocab - v0);
        cpu::dot_rows(h.row(r0), h.ld(), nr, weight + v0 * ldw, ldw, n, d, logits.data(), kTile);
        for (int64_t i = 0; i < nr; ++i) cpu::top2_update(states[t * rows + r0 + i], logits.data() + i * kTile, n, v0);
      }
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    Top2State st = states[r];
    for (int64_t t = 1; t < tiles; ++t) st = cpu::top2_merge(st, states[t * rows + r]);
    cpu::top2_finish(st, gap + r, top1 + r);
  }
}

std::tuple<at::Tensor, at::Tensor> lm_head_top2_gap_cpu(const at::Tensor& hidden, const at::Tensor& weight) {
  check_lm_head_top2_gap_args(hidden, weight);
  const int64_t rows = hidden.size(0), d = hidden.size(1), vocab = weight.size(0);
  at::Tensor gap = at::empty({rows}, hidden.options().dtype(at::kFloat));
  at::Tensor top1 = at::empty({rows}, hidden.options().dtype(at::kLong));
  if (rows == 0) return {gap, top1};
  EECORE_DISPATCH_FLOAT(hidden.scalar_type(), "eecore::lm_head_top2_gap", [&] {
    lm_head_top2_gap_rows(hidden.const_data_ptr<scalar_t>(), hidden.stride(0), rows, weight.const_data_ptr<scalar_t>(),
                          weight.stride(0), vocab, d, gap.data_ptr<float>(), top1.data_ptr<int64_t>());
  });
  return {gap, top1};
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("lm_head_top2_gap", &eecore::lm_head_top2_gap_cpu); }
