// repack_gguf_q8 and linear_gguf_q8 on the CPU (gguf_q8.h): the repacking once per weight, then per
// call each input row quantized to int8 blocks and the dots taken 16 output rows at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "common/cpu_parallel.h"
#include "linear/gguf_q8.h"
#include "linear/linear_gguf_q8.h"

namespace eecore {
namespace {

// Input rows per group_dots call: each weight group is decoded once for up to 8 rows (a batch of 8,
// a verification pass), whose 8 accumulators and the 8 decoded vectors fit the 32 registers.
constexpr int64_t kTileRows = 8;

// group_dots for a tile of mr (1..kTileRows) input rows.
template <bool kFixedOffset>
void tile_dots(int64_t mr, const uint8_t* packed, int64_t type, const gguf::q8::RowBlocks& rows, float* sums) {
  switch (mr) {
    case 1: return gguf::q8::group_dots<1, kFixedOffset>(packed, type, rows, sums);
    case 2: return gguf::q8::group_dots<2, kFixedOffset>(packed, type, rows, sums);
    case 3: return gguf::q8::group_dots<3, kFixedOffset>(packed, type, rows, sums);
    case 4: return gguf::q8::group_dots<4, kFixedOffset>(packed, type, rows, sums);
    case 5: return gguf::q8::group_dots<5, kFixedOffset>(packed, type, rows, sums);
    case 6: return gguf::q8::group_dots<6, kFixedOffset>(packed, type, rows, sums);
    case 7: return gguf::q8::group_dots<7, kFixedOffset>(packed, type, rows, sums);
    default: return gguf::q8::group_dots<8, kFixedOffset>(packed, type, rows, sums);
  }
}

at::Tensor repack_gguf_q8_cpu(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  check_repack_gguf_q8_args(weight, quant_type, features);
  const int64_t N = weight.size(0), U = gguf::q8::units(quant_type, features);
  const int64_t G = (N + gguf::q8::kRows - 1) / gguf::q8::kRows, stride = gguf::q8::unit_bytes(quant_type);
  at::Tensor packed = at::empty({G, U, stride}, weight.options());
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  uint8_t* p = packed.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t unit = 0; unit < U; ++unit)
        gguf::q8::pack_unit(quant_type, w, weight.size(1), N, g, unit, p + (g * U + unit) * stride);
  });
  return packed;
}

void linear_gguf_q8_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed, int64_t quant_type,
                        const std::optional<at::Tensor>& bias, bool accumulate) {
  const int64_t N = check_linear_gguf_q8_args(out, input, packed, quant_type, bias);
  const int64_t M = input.size(0), K = input.size(1), B = K / 32, G = packed.size(0);
  if (M == 0 || N == 0) return;
  const at::Tensor x = input.scalar_type() == at::kFloat ? input : input.to(at::kFloat);
  // each input row's int8 blocks, scales and block sums (gguf_q8.h), reused across calls by this thread
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, sx;
  thread_local std::vector<int32_t> ox;
  qx.resize(M * K);
  dx.resize(M * B);
  sx.resize(M * gguf::q8::kSumsPerBlock * B);
  ox.resize(M * gguf::q8::kSumsPerBlock * B);
  const gguf::q8::RowBlocks rows{qx.data(), dx.data(), sx.data(), ox.data(), K};
  for (int64_t i = 0; i < M; ++i)
    gguf::q8::quantize_row(x.const_data_ptr<float>() + i * x.stride(0), quant_type, rows.from(i));
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  const int64_t stride = packed.size(1) * gguf::q8::unit_bytes(quant_type);
  const bool has_bias = bias.has_value() && bias->defined();
  const bool fixed = gguf::q8::fixed_offset(quant_type) != 0.f;
  EECORE_DISPATCH_FLOAT(out.scalar_type(), "eecore::linear_gguf_q8", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* bs = has_bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    const int64_t ldo = out.stride(0);
    // threads take the next grab of row groups as they free up (as linear_streaming does)
    const int64_t grain = std::max<int64_t>(1, cpu::kMinMacsPerThread / (gguf::q8::kRows * K * M));
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), (G + grain - 1) / grain);
    const int64_t grab = std::max(grain, (G + workers * cpu::kGrabsPerThread - 1) / (workers * cpu::kGrabsPerThread));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      float sums[kTileRows * gguf::q8::kRows];
      for (int64_t g0 = next.fetch_add(grab); g0 < G; g0 = next.fetch_add(grab)) {
        for (int64_t g = g0; g < std::min(G, g0 + grab); ++g) {
          for (int64_t i0 = 0; i0 < M; i0 += kTileRows) {
            const int64_t mr = std::min(kTileRows, M - i0);
            const gguf::q8::RowBlocks tile = rows.from(i0);
            const uint8_t* pg = p + g * stride;
            if (fixed) {
              tile_dots<true>(mr, pg, quant_type, tile, sums);
            } else {
              tile_dots<false>(mr, pg, quant_type, tile, sums);
            }
            const int64_t valid = std::min(gguf::q8::kRows, N - g * gguf::q8::kRows);
            for (int64_t a = 0; a < mr; ++a) {
              scalar_t* dst = o + (i0 + a) * ldo + g * gguf::q8::kRows;
              for (int64_t r = 0; r < valid; ++r) {
                float v = sums[a * gguf::q8::kRows + r];
                if (bs != nullptr) v += static_cast<float>(bs[g * gguf::q8::kRows + r]);
                if (accumulate) v += static_cast<float>(dst[r]);
                dst[r] = static_cast<scalar_t>(v);
              }
            }
          }
        }
      }
    });
  });
}

}  // namespace

bool gguf_q8_vectorized() { return EECORE_GGUF_Q8_VNNI != 0; }
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) {
  m.impl("repack_gguf_q8", &eecore::repack_gguf_q8_cpu);
  m.impl("linear_gguf_q8", &eecore::linear_gguf_q8_cpu);
}
