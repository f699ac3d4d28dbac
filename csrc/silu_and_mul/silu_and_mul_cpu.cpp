// silu_and_mul on the CPU: the gated activation of a SwiGLU MLP, out = silu(gate) * up for each
// row [gate | up] of a fused gate/up projection, computed in fp32 and rounded once.
//
// Why an op of its own: unfused it is two torch ops (silu in place, then a multiply into the act
// buffer), each with its dispatch and its pass over memory; at decode sizes that overhead is the
// cost. On a Zen 3 (2 threads) F.silu + torch.mul took 13 + 7 us a layer in a batch-1 step of
// SmolLM2, 0.5 ms of a 21 ms step.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common/cpu_vec.h"
#include "silu_and_mul/silu_and_mul_checks.h"

namespace eecore {
namespace {

using cpu::kVecWidth;
using cpu::Vec8;

// silu(g) = g / (1 + e^-g), as torch computes it (and so with its special values: -0 below
// about -88, where e^-g overflows, NaN at -inf).
inline float silu_scalar(float g) { return g / (1.f + std::exp(-g)); }

template <typename scalar_t>
void silu_and_mul_row(scalar_t* out, const scalar_t* gate, const scalar_t* up, int64_t d) {
  const Vec8 zero = Vec8::zero(), one = Vec8::broadcast(1.f);
  const Vec8 low = Vec8::broadcast(-cpu::kExpOverflow), steep = Vec8::broadcast(1048576.f);
  int64_t i = 0;
  for (; i + kVecWidth <= d; i += kVecWidth) {
    const Vec8 g = Vec8::load(gate + i);
    // cpu::exp saturates at FLT_MAX instead of overflowing to inf, which would leave g / FLT_MAX
    // below -88 (and -inf at -inf) where torch gives -0 (and NaN). `keep` is 1 above -88 and 0
    // below (a ramp 1e-6 wide between), so the product restores torch's values there.
    const Vec8 keep = min(max((g - low) * steep, zero), one);
    const Vec8 silu = g / (one + cpu::exp(zero - g)) * keep;
    (silu * Vec8::load(up + i)).store(out + i);
  }
  for (; i < d; ++i)
    out[i] = static_cast<scalar_t>(silu_scalar(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  const int64_t rows = check_silu_and_mul_args(out, input);
  const int64_t d = out.size(-1);
  if (rows == 0) return;
  // Rows per task: enough elements that waking a thread pays (a decode row runs inline). 8192:
  // a batch-8 step of SmolLM2 (8 x 1536) splits over 2 threads, which in bf16 took 8.5 against 12.5
  // us (16 rows: 14.5 against 24), where 32768 kept up to 21 such rows on one thread.
  const int64_t grain = std::max<int64_t>(1, 8192 / d);
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::silu_and_mul", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(o + r * d, in + r * 2 * d, in + r * 2 * d + d, d);
    });
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("silu_and_mul", &eecore::silu_and_mul_cpu); }
