// linear on the CPU. Decode-sized inputs (a few rows) stream the weight once through the shared
// "few rows x many weight rows" dot kernel, in parallel over weight-row tiles, with the bias and
// the residual accumulation fused into the store; prompt-sized inputs stream it once per block of
// rows; large inputs are a GEMM, where BLAS is good. A weight-only int8 weight (one fp32 scale per
// output row) is streamed as int8 against input rows rounded to int16 (exact integer dot products
// with AVX512-VNNI), so a decode step reads a quarter of an fp32 weight's bytes, and in row blocks
// at every size, or, at prompt sizes on CPUs with AMX-INT8, as int8 GEMMs of the rows' high and
// low bytes (linear_int8_split.h).
//
// Why a kernel of our own for few rows: a decode step of a small model is a chain of
// matrix-vector-like products bound by reading the weights, and BLAS small-M paths on many CPUs
// stay well below the memory bandwidth (and widen 16-bit weights through a copy).
#include <atomic>
#include <type_traits>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/cpu_dots.h"
#include "common/cpu_parallel.h"
#include "linear/linear_amx_bf16.h"
#include "linear/linear_amx_int8.h"
#include "linear/linear_checks.h"
#include "linear/linear_gemm.h"
#include "linear/linear_int8_split.h"

namespace eecore {
namespace {

// Up to this many rows the weight-streaming kernel beats a GEMM (measured on AVX2 machines,
// bench/test_bench_linear.py): it keeps every hidden row in registers/L1 per weight slice. On a
// Zen 3 with SmolLM2's weights streaming from DRAM (1 thread), at 17-24 rows (a decode batch plus
// the prompt chunk of a mixed step) it ran 42-48 GFLOP/s against BLAS's 26-45. Past it, one pass
// holds too many rows for the hidden chunk (kHiddenChunkBytes) and L2: the rows go in blocks.
constexpr int64_t kStreamingMaxRows = 24;
// Up to this many rows (a batch of verification rows, a short prompt or chunk) the input is cut
// into blocks of at most kRowBlock rows, near-equal and a whole number of the kernel's row groups
// where possible, and each block streams the weight as above. BLAS's small-M GEMM stays below the
// blocks there: on a Zen 3 (SmolLM2's projections, weights from DRAM, runs alternated) blocks ran
// 1.55x / 1.33x / 1.20x BLAS's speed at 25 / 32 / 48 rows on 2 threads and 1.22x / 1.10x / 0.97x
// on 1; at 85 rows they tie on 2 threads and BLAS wins on 1, and from 128 rows BLAS wins
// (136 GFLOP/s against 120 on 2 threads).
constexpr int64_t kBlockedMaxRows = 48;
// The int8 split GEMM's int32 sums stay exact below this many input features (linear_int8_split.h).
constexpr int64_t kInt8SplitMaxFeatures = 131072;
constexpr int64_t kRowBlock = 21;
// Output columns per parallel task.
constexpr int64_t kTileCols = 64;
// fp32 partial results a thread keeps on its stack (64 KiB): it hands dot_rows as many of its
// columns at once as fit, so the weight streams in long runs (dot_rows reads a call's rows as four
// sequential streams; one 64-column tile per call would cut them to 16 rows each).
constexpr int64_t kAccFloats = 16384;
using cpu::kGrabsPerThread;
using cpu::kMinMacsPerThread;

// Rows [r0, r0 + M) of `input` into the same rows of `out`. `w_t` is the weight's storage type:
// the input's, or int8 with one fp32 scale per weight row (`scale`): the input rows are then rounded
// to int16 with a scale each (cpu_dots.h), and both scales multiply each finished sum.
template <typename scalar_t, typename w_t>
void linear_streaming(at::Tensor& out, const at::Tensor& input, const w_t* w, const float* scale,
                      const scalar_t* bias, bool accumulate, int64_t r0, int64_t M, const LinearDims& dims) {
  constexpr bool kScaled = std::is_same_v<w_t, int8_t>;
  const int64_t K = dims.in, N = dims.out;
  const cpu::DotInput<scalar_t, w_t> h(input.const_data_ptr<scalar_t>() + r0 * input.stride(0), input.stride(0), M, K);
  const int64_t ldo = out.stride(0);
  scalar_t* o = out.data_ptr<scalar_t>() + r0 * ldo;
  const int64_t tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, M * K * kTileCols));
  const int64_t run = kAccFloats / M / kTileCols * kTileCols;  // columns per dot_rows call (M <= 24: >= 640)
  // Threads take the next grab of tiles when they are free instead of a fixed share: a thread the
  // OS preempts (a server's event loop, a client on the same cores, a noisy VM host) then delays
  // only its own grab, and shapes with few tiles (SmolLM2's 576 outputs are 9) balance. On a Zen 3
  // with 2 threads, eecore serve at 32 clients ran 131-132 tok/s against 117 with fixed shares
  // (alternated runs, bench/serve_load.py); single-stream decode was unchanged.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain);
  const int64_t grab = std::max<int64_t>(grain, (tiles + workers * kGrabsPerThread - 1) / (workers * kGrabsPerThread));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    float acc[kAccFloats];  // on the stack: no allocation per call
    for (int64_t begin = next.fetch_add(grab); begin < tiles; begin = next.fetch_add(grab)) {
      const int64_t last = std::min(N, (begin + grab) * kTileCols);
      for (int64_t j0 = begin * kTileCols; j0 < last; j0 += run) {
        const int64_t nj = std::min(run, last - j0);
        cpu::dot_rows(h.row(0), h.ld(), M, w + j0 * K, K, nj, K, acc, nj);
        for (int64_t i = 0; i < M; ++i) {
          scalar_t* dst = o + i * ldo + j0;
          const float* src = acc + i * nj;
          const float row_scale = h.row_scale(i);  // int8 weights: the int16 row's scale
          for (int64_t j = 0; j < nj; ++j) {
            float v = src[j];
            if constexpr (kScaled) v = v * row_scale * scale[j0 + j];
            if (bias != nullptr) v += static_cast<float>(bias[j0 + j]);
            if (accumulate) v += static_cast<float>(dst[j]);
            dst[j] = static_cast<scalar_t>(v);
          }
        }
      }
    }
  });
}

void linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, bool accumulate, const std::optional<at::Tensor>& weight_scale) {
  const LinearDims dims = check_linear_args(out, input, weight, bias, weight_scale);
  if (is_tiled_weight(weight) && is_int8_weight(weight)) {
    EECORE_CHECK_ARG("linear", "weight", amx::int8_usable(), "is tiled for AMX-INT8 [N/16, K/64, 16, 64], which this "
                     "CPU (or this build, or the OS) does not offer; pass the [N, K] weight (eecore.models.amx_weights)");
    if (dims.rows == 0 || dims.out == 0) return;
    const bool has_bias = bias.has_value() && bias->defined();
    const float* scale = weight_scale->const_data_ptr<float>();
    if (input.scalar_type() == at::kFloat)
      return amx::linear_tiled_int8<float>(out, input, weight, scale, has_bias ? bias->const_data_ptr<float>() : nullptr,
                                           accumulate, dims);
    return amx::linear_tiled_int8<c10::BFloat16>(out, input, weight, scale,
                                                 has_bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                                                 accumulate, dims);
  }
  if (is_tiled_weight(weight)) {
    EECORE_CHECK_ARG("linear", "weight", amx::usable(), "is tiled for AMX-BF16 [N/16, K/32, 16, 32], which this CPU "
                     "(or this build, or the OS) does not offer; pass the [N, K] weight (eecore.models.amx_weights)");
    if (dims.rows == 0 || dims.out == 0) return;
    const bool has_bias = bias.has_value() && bias->defined();
    return amx::linear_tiled(out, input, weight, has_bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                             accumulate, dims);
  }
  if (dims.rows == 0 || dims.out == 0) return;
  // Weight-only int8 streams in row blocks at every size, except on CPUs with AMX-INT8 (below):
  // widening the weight for one fp32 GEMM ran SmolLM2's projections at 49-600 rows 1.2-2.7x slower
  // than fp32 weights did, the int16 x int8 blocks (AVX512-VNNI) 0.4-0.7x (Zen 4, 2 threads; a
  // draft copy catching up on a prompt).
  if ((dims.rows > kBlockedMaxRows && !is_int8_weight(weight)) || dims.in == 0)
    return linear_with_gemm(out, input, weight, bias, accumulate, weight_scale);
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t M = dims.rows;
  // Weight-only int8 at prompt sizes, where the CPU has AMX-INT8: int8 GEMMs of the rows' bytes
  // (linear_int8_split.h). Decode-sized inputs stay on the streaming kernel below, whose bits do not
  // depend on the number of rows.
  if (kInt8SplitGemm && is_int8_weight(weight) && M > kBlockedMaxRows && dims.in < kInt8SplitMaxFeatures) {
    EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::linear", [&] {
      linear_int8_split_gemm<scalar_t>(out, input, weight, *weight_scale,
                                       has_bias ? bias->const_data_ptr<scalar_t>() : nullptr, accumulate, dims);
    });
    return;
  }
  int64_t block = M;
  if (M > kStreamingMaxRows) {
    const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
    const int64_t even = (M + blocks - 1) / blocks;
    const int64_t grouped = (even + cpu::kGroupRows - 1) / cpu::kGroupRows * cpu::kGroupRows;
    block = std::min(grouped, kStreamingMaxRows);
  }
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::linear", [&] {
    const scalar_t* b = has_bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    const auto stream_rows = [&](const auto* w, const float* scale) {
      for (int64_t r0 = 0; r0 < M; r0 += block)
        linear_streaming<scalar_t>(out, input, w, scale, b, accumulate, r0, std::min(block, M - r0), dims);
    };
    if (is_int8_weight(weight))
      stream_rows(weight.const_data_ptr<int8_t>(), weight_scale->const_data_ptr<float>());
    else
      stream_rows(weight.const_data_ptr<scalar_t>(), nullptr);
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("linear", &eecore::linear_cpu); }

namespace eecore {
// Whether `linear` takes AMX-tiled bf16 weights here: the CPU has AMX-BF16, the build targets it
// and the OS grants the tile state.
bool amx_bf16_available() { return amx::usable(); }
// Whether `linear` takes AMX-tiled int8 weights here (AMX-INT8, as above).
bool amx_int8_available() { return amx::int8_usable(); }
}  // namespace eecore
