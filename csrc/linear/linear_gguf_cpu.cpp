// linear_gguf on the CPU: `linear` with a weight in a GGUF block format (gguf_blocks.h), computed
// with the file's exact weight values and fp32 accumulation.
//
// Decode-sized inputs (up to kStreamMaxRows rows) stream the quantized weight: each thread takes a
// few output rows at a time and decodes each group of 32 weights into vector registers, where the
// input rows multiply it (gguf_simd.h); without AVX2 it dequantizes the rows into an fp32 buffer on
// its stack (about 32 KiB, so it stays in L1/L2) for the few-rows dot kernel of fp32 `linear`. A decode step
// so reads the file's bytes (Q4_1: 0.625 bytes a weight, a sixth of fp32's) and pays one
// conversion per weight, in registers and cache. Larger inputs (prompt chunks, large batches)
// decode the weight a slice at a time into a buffer each thread keeps, for one BLAS GEMM a slice,
// where the arithmetic dominates.
#include <atomic>
#include <vector>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_dots.h"
#include "common/cpu_parallel.h"
#include "linear/gguf_simd.h"
#include "linear/linear_gemm.h"
#include "linear/linear_gguf.h"

namespace eecore {
namespace {

// Past this many rows a GEMM per decoded slice of the weight (linear_gguf_sliced) wins. With the
// tiles prefetching, SmolLM2's 120 Q4_1 projections ran 49 / 64 / 80 rows in 67-73 / 87-89 /
// 109-115 ms through AVX-512's tiles against 82-85 / 97-98 / 116-124 sliced, 100 rows alike
// (137-142 and 141-146) and 128 rows 174-179 against 171-173 (Zen 4, 2 threads). AVX2's smaller
// tiles decode each group for at most 3 rows, so there slices win sooner: an AVX2 build on the same
// machine ran 8 / 10 / 12 / 16 rows in 25 / 30 / 37 / 47 ms through the tiles, 28 / 31 / 32 / 36
// sliced. Without SIMD (unmeasured) the bound stays where whole-weight dequantization put it.
#if EECORE_GGUF_SIMD
constexpr int64_t kStreamMaxRows = gguf::Simd::kLanes == 16 ? 96 : 10;
#else
constexpr int64_t kStreamMaxRows = 48;
#endif
// Weights a thread decodes at once for a slice's GEMM (256 KiB of fp32: in L2 beside the GEMM's
// own blocks).
constexpr int64_t kSliceFloats = 64 * 1024;
// fp32 weights a thread dequantizes at once: its buffer's size (32 KiB).
constexpr int64_t kDecodedFloats = 8192;
// The dot products of a chunk (M x output rows) a thread holds before writing them out.
constexpr int64_t kSumFloats = 1024;
using cpu::kGrabsPerThread;
using cpu::kMinMacsPerThread;

#if EECORE_GGUF_SIMD
// sums[t] = the lane sum of v[t], t < count: four at a time where they come in fours.
inline void lane_sums(const gguf::Simd::V* v, int64_t count, float* sums) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) gguf::Simd::sum4(v + t, sums + t);
  for (; t < count; ++t) sums[t] = gguf::Simd::sum(v[t]);
}

// How far ahead a register tile prefetches the weight, in tiles. A tile reads its NR weight rows
// side by side: NR short streams (a row of SmolLM2's projections is 360-960 bytes of Q4_1) that the
// hardware prefetcher does not pick up before they end, so every tile waited on DRAM. Prefetching
// the tile two on, spread over its groups (1-2 lines a group), ran SmolLM2's 120 projections at 2-5
// input rows 1.2-1.4x faster in Q4_1 and Q4_0 and 1.5-2.2x in Q8_0, and 8 rows 1.05-1.4x (Zen 4,
// 2 threads, builds alternated; docs/gguf.md); one tile on gained less, three or four less than two.
// An AVX2 build (-march=znver3) on the same machine gained 1.03-1.07x at 2-5 rows: its 8-lane
// tiles are bound by their arithmetic, and the prefetches cost it nothing. At the end of a call
// the prefetches run past the weight's rows, which is harmless: prefetches never fault.
constexpr int64_t kPrefetchTiles = 2;

// A register tile: MR input rows (fp32) x NR weight rows, every group of 32 weights decoded once
// into registers and multiplied by the MR rows there. sums[i * NR + r] = input row i . weight row r.
template <int MR, int NR, class F>
void gguf_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t groups, float* sums) {
  using S = gguf::Simd;
  S::V acc[MR][NR];
  float prep[NR][gguf::decode::kPrepFloats];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = S::zero();
  // the tile's weight rows lie one after another: each group prefetches its share of the tile
  // ahead's bytes (rounded up, so the last groups may reach past it), with no division per group
  const int64_t span = NR * row_bytes, share = (span + groups - 1) / groups;
  const uint8_t* ahead = w + kPrefetchTiles * span;
  for (int64_t g = 0, from = 0; g < groups; ++g, from += share) {
    for (int64_t p = from & ~int64_t{63}; p < from + share; p += 64) cpu::prefetch_to_l2(ahead + p);
    if (g % F::kGroups == 0)
      for (int r = 0; r < NR; ++r) F::prepare(w + r * row_bytes, g / F::kGroups, prep[r]);
    S::V wv[NR][S::kPerGroup];
    for (int r = 0; r < NR; ++r) F::decode(w + r * row_bytes, g, prep[r], wv[r]);
    for (int i = 0; i < MR; ++i) {
      const float* xg = x + i * ldx + g * gguf::kGroupWeights;
      for (int p = 0; p < S::kPerGroup; ++p) {
        const S::V xv = S::load(xg + p * S::kLanes);
        for (int r = 0; r < NR; ++r) acc[i][r] = S::fma(wv[r][p], xv, acc[i][r]);
      }
    }
  }
  lane_sums(&acc[0][0], MR * NR, sums);  // sums[i * NR + r] is accumulator i * NR + r
}

// One input row by one weight row, two groups at a time into separate accumulators: the tile
// above's single accumulator chain (one fma after another into the same register) would bound a
// decode step by the fma latency, not by decoding or memory.
template <class F>
gguf::Simd::V gguf_dot_one(const float* x, const uint8_t* w, int64_t groups) {
  using S = gguf::Simd;
  S::V acc[2][S::kPerGroup];
  float prep[gguf::decode::kPrepFloats];
  for (auto& a : acc)
    for (auto& v : a) v = S::zero();
  // kGroups is 1 or even, so a pair of groups never straddles two blocks' preparations
  auto step = [&](int64_t g, S::V* a) {
    if (g % F::kGroups == 0) F::prepare(w, g / F::kGroups, prep);
    S::V wv[S::kPerGroup];
    F::decode(w, g, prep, wv);
    const float* xg = x + g * gguf::kGroupWeights;
    for (int p = 0; p < S::kPerGroup; ++p) a[p] = S::fma(wv[p], S::load(xg + p * S::kLanes), a[p]);
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    step(g, acc[0]);
    step(g + 1, acc[1]);
  }
  if (g < groups) step(g, acc[0]);
  S::V total = S::add(acc[0][0], acc[1][0]);
  for (int p = 1; p < S::kPerGroup; ++p) total = S::add(total, S::add(acc[0][p], acc[1][p]));
  return total;  // its lanes' sum is the dot product
}

// Register tiles: AVX-512's 32 vectors hold 4 x 4 accumulators beside 4 weight rows' decoded
// groups (2 vectors each), and up to 5 x 4, or 8 x 2 (16 accumulators beside 2 rows' groups); AVX2's
// 16 hold 2 x 2 (a group is 4 vectors there), and up to 3 x 2. A pass of up to kMaxTileRows input
// rows is one tile (a verification of 5 rows decodes each group once, not twice); from
// kWideTileMinRows rows on, tiles of up to kWideTileRows rows by kWideTileCols weight rows decode
// each group for more input rows (8 rows: once instead of twice).
constexpr int kTileRows = gguf::Simd::kLanes == 16 ? 4 : 2;
constexpr int kMaxTileRows = gguf::Simd::kLanes == 16 ? 5 : 3;
constexpr int kTileCols = gguf::Simd::kLanes == 16 ? 4 : 2;
constexpr int kWideTileRows = gguf::Simd::kLanes == 16 ? 8 : kMaxTileRows;
constexpr int kWideTileMinRows = kMaxTileRows + 1;
constexpr int kWideTileCols = 2;

// One tile of mr (runtime, 2..kWideTileRows) input rows by NR weight rows.
template <int NR, class F>
void gguf_row_tile(int64_t mr, const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t groups,
                   float* sums) {
  switch (mr) {
    case 2: return gguf_tile<2, NR, F>(x, ldx, w, row_bytes, groups, sums);
    case 3: return gguf_tile<3, NR, F>(x, ldx, w, row_bytes, groups, sums);
  }
  if constexpr (kMaxTileRows >= 5) {
    switch (mr) {
      case 4: return gguf_tile<4, NR, F>(x, ldx, w, row_bytes, groups, sums);
      case 5: return gguf_tile<5, NR, F>(x, ldx, w, row_bytes, groups, sums);
    }
  }
  if constexpr (kWideTileRows >= 8 && NR <= kWideTileCols) {
    switch (mr) {
      case 6: return gguf_tile<6, NR, F>(x, ldx, w, row_bytes, groups, sums);
      case 7: return gguf_tile<7, NR, F>(x, ldx, w, row_bytes, groups, sums);
      case 8: return gguf_tile<8, NR, F>(x, ldx, w, row_bytes, groups, sums);
    }
  }
  TORCH_CHECK(false, "linear_gguf: no register tile of ", mr, " x ", NR, " rows");  // gguf_rows never asks
}

// Rows [i, i + mr) of x against the n weight rows from w, in tiles of `cols` weight rows (the last
// ones one at a time): out[(i + a) * n + j].
template <int NR, class F>
void gguf_row_strip(int64_t mr, const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t groups,
                    int64_t n, float* out) {
  float sums[kWideTileRows * NR];
  for (int64_t j = 0; j < n; j += NR) {
    const int64_t nr = std::min<int64_t>(NR, n - j);
    const uint8_t* wj = w + j * row_bytes;
    if (mr == 1) {  // a decode step's one row: one dot at a time (taking several weight rows at once
                    // for one input row ran slower: Zen 4, Q4_1 1.15x, Q8_0 2.2x the time)
      gguf::Simd::V dots[NR];
      for (int64_t c = 0; c < nr; ++c) {
        // the weight ahead, a row's lines at a time (gguf::kStreamAheadBytes; Q8_0 1.15x, Q4_1 and
        // the K formats 1.01-1.09x: the exact one-row dot is bound by its arithmetic more than by memory)
        const uint8_t* ahead = wj + c * row_bytes + gguf::kStreamAheadBytes;
        for (int64_t line = 0; line < row_bytes; line += 64) cpu::prefetch_to_l2(ahead + line);
        dots[c] = gguf_dot_one<F>(x, wj + c * row_bytes, groups);
      }
      lane_sums(dots, nr, out + j);
      continue;
    }
    if (nr == NR) {
      gguf_row_tile<NR, F>(mr, x, ldx, wj, row_bytes, groups, sums);
    } else {  // the last weight rows, one at a time for all mr input rows
      float column[kWideTileRows];
      for (int64_t c = 0; c < nr; ++c) {
        gguf_row_tile<1, F>(mr, x, ldx, wj + c * row_bytes, row_bytes, groups, column);
        for (int64_t a = 0; a < mr; ++a) sums[a * NR + c] = column[a];
      }
    }
    for (int64_t a = 0; a < mr; ++a)
      for (int64_t c = 0; c < nr; ++c) out[a * n + j + c] = sums[a * NR + c];
  }
}

template <class F>
void gguf_rows(const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t groups,
               int64_t n, float* out) {
  // out[i * n + j] for the n weight rows from w
  for (int64_t i = 0; i < M;) {
    const int64_t rest = M - i;
    if (rest >= kWideTileMinRows && kWideTileRows > kMaxTileRows) {
      // never leave one row alone: it would take gguf_dot_one's order, not a tile's
      const int64_t mr = rest == kWideTileRows + 1 ? kWideTileRows - 1 : std::min<int64_t>(kWideTileRows, rest);
      gguf_row_strip<kWideTileCols, F>(mr, x + i * ldx, ldx, w, row_bytes, groups, n, out + i * n);
      i += mr;
    } else {
      const int64_t mr = rest <= kMaxTileRows ? rest : kTileRows;
      gguf_row_strip<kTileCols, F>(mr, x + i * ldx, ldx, w, row_bytes, groups, n, out + i * n);
      i += mr;
    }
  }
}

// f(F{}) for the decoder F of quant_type's format.
template <class Fn>
void with_decoder(int64_t quant_type, Fn&& f) {
  namespace D = gguf::decode;
  switch (static_cast<gguf::QuantType>(quant_type)) {
    case gguf::QuantType::Q4_0: return f(D::Q4_0{});
    case gguf::QuantType::Q4_1: return f(D::Q4_1{});
    case gguf::QuantType::Q5_0: return f(D::Q5_0{});
    case gguf::QuantType::Q5_1: return f(D::Q5_1{});
    case gguf::QuantType::Q8_0: return f(D::Q8_0{});
    case gguf::QuantType::Q4_K: return f(D::Q4_K{});
    case gguf::QuantType::Q5_K: return f(D::Q5_K{});
    case gguf::QuantType::Q6_K: return f(D::Q6_K{});
  }
}

void gguf_dot(int64_t quant_type, const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t row_bytes,
              int64_t K, int64_t n, float* out) {
  with_decoder(quant_type, [&](auto format) {
    gguf_rows<decltype(format)>(x, ldx, M, w, row_bytes, K / gguf::kGroupWeights, n, out);
  });
}
#endif

// `rows` weight rows from w decoded to fp32 into dst ([rows, K], row-major): dequantize_row's values
// (the decoders' one product per weight is exact in fp32, so a fused multiply-add rounds as the
// separate one does).
void decode_rows(int64_t quant_type, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t rows, float* dst) {
#if EECORE_GGUF_SIMD
  with_decoder(quant_type, [&](auto format) {
    using F = decltype(format);
    using S = gguf::Simd;
    float prep[gguf::decode::kPrepFloats];
    const int64_t groups = K / gguf::kGroupWeights;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w + r * row_bytes;
      float* d = dst + r * K;
      for (int64_t g = 0; g < groups; ++g) {
        if (g % F::kGroups == 0) F::prepare(row, g / F::kGroups, prep);
        S::V wv[S::kPerGroup];
        F::decode(row, g, prep, wv);
        for (int p = 0; p < S::kPerGroup; ++p) S::store(d + g * gguf::kGroupWeights + p * S::kLanes, wv[p]);
      }
    }
  });
#else
  for (int64_t r = 0; r < rows; ++r) gguf::dequantize_row(quant_type, w + r * row_bytes, K, dst + r * K);
#endif
}

// Rows [0, M) of `input` into `out` past kStreamMaxRows rows (a prompt's chunk, a large batch): the
// weight decoded a slice of output rows at a time into a buffer each thread keeps (in its L2), and
// each slice one BLAS GEMM against all the input rows. Dequantizing the whole weight first (an
// fp32 copy of it on every call, 6.4x the bytes of Q4_1) ran SmolLM2's 120 Q4_1 projections at
// 100 / 128 rows in 153-158 / 185-190 ms, sliced 133-137 / 166-168 (Zen 4, 2 threads).
void linear_gguf_sliced(at::Tensor& out, const at::Tensor& input, const uint8_t* w, int64_t quant_type,
                        const std::optional<at::Tensor>& bias, bool accumulate, const GgufDims& dims) {
  const int64_t K = dims.in, N = dims.out;
  const int64_t slice = std::max<int64_t>(16, kSliceFloats / K / 16 * 16);
  const int64_t slices = (N + slice - 1) / slice;
  const bool has_bias = bias.has_value() && bias->defined();
  // The file's values and fp32 sums whatever the activations' dtype, as the tiles compute: a GEMM
  // in bf16 would round the weights too.
  const bool fp32 = input.scalar_type() == at::kFloat;
  const at::Tensor x = fp32 ? input : input.to(at::kFloat);
  at::parallel_for(0, slices, 1, [&](int64_t s0, int64_t s1) {
    thread_local std::vector<float> buffer;  // kept between calls: no allocation once warm
    buffer.resize(static_cast<size_t>(slice * K));
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t j0 = s * slice, nj = std::min(slice, N - j0);
      decode_rows(quant_type, w + j0 * dims.row_bytes, dims.row_bytes, K, nj, buffer.data());
      const at::Tensor dense = at::from_blob(buffer.data(), {nj, K}, at::TensorOptions().dtype(at::kFloat));
      at::Tensor part = out.narrow(1, j0, nj);
      if (fp32) {
        linear_with_gemm(part, x, dense, has_bias ? std::optional<at::Tensor>(bias->narrow(0, j0, nj)) : std::nullopt,
                         accumulate, std::nullopt);
        continue;
      }
      at::Tensor y = at::mm(x, dense.t());
      if (has_bias) y.add_(bias->narrow(0, j0, nj).to(at::kFloat));
      if (accumulate) y.add_(part.to(at::kFloat));
      part.copy_(y);
    }
  });
}

// Rows [0, M) of `input` into `out`, streaming the quantized weight.
template <typename scalar_t>
void linear_gguf_streaming(at::Tensor& out, const at::Tensor& input, const uint8_t* w, int64_t quant_type,
                           const scalar_t* bias, bool accumulate, const GgufDims& dims) {
  const int64_t M = dims.rows, K = dims.in, N = dims.out;
  const cpu::DotInput<scalar_t, float> h(input.const_data_ptr<scalar_t>(), input.stride(0), M, K);
  const int64_t ldo = out.stride(0);
  scalar_t* o = out.data_ptr<scalar_t>();
#if EECORE_GGUF_SIMD
  // output rows per gguf_dot call: whole register tiles, their sums within the scratch below
  constexpr int64_t kTile = kTileCols;
  const int64_t chunk = std::max<int64_t>(kTile, std::min<int64_t>(64, kSumFloats / M) / kTile * kTile);
  const int64_t grain = std::max<int64_t>(kTile, kMinMacsPerThread / std::max<int64_t>(1, M * K));
#else
  constexpr int64_t kTile = 1;
  const int64_t chunk = std::max<int64_t>(1, kDecodedFloats / K);  // output rows dequantized at once
  const int64_t grain = std::max<int64_t>(chunk, kMinMacsPerThread / std::max<int64_t>(1, M * K));
#endif
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain);
  // threads take the next grab of output rows when free (see linear_streaming in linear_cpu.cpp);
  // grabs of whole tiles, so that only the weight's last rows make an edge tile
  const int64_t grab = (std::max(grain, (N + workers * kGrabsPerThread - 1) / (workers * kGrabsPerThread)) + kTile - 1)
                       / kTile * kTile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if !EECORE_GGUF_SIMD
    cpu::ScratchBuffer<float, kDecodedFloats> decoded;
    float* wbuf = decoded.get(static_cast<size_t>(chunk * K));
#endif
    cpu::ScratchBuffer<float, kSumFloats> sums;
    float* acc = sums.get(static_cast<size_t>(M * chunk));
    for (int64_t begin = next.fetch_add(grab); begin < N; begin = next.fetch_add(grab)) {
      const int64_t end = std::min(N, begin + grab);
      for (int64_t j0 = begin; j0 < end; j0 += chunk) {
        const int64_t nj = std::min(chunk, end - j0);
#if EECORE_GGUF_SIMD
        // the blocks decoded in registers, straight from the stream
        gguf_dot(quant_type, h.row(0), h.ld(), M, w + j0 * dims.row_bytes, dims.row_bytes, K, nj, acc);
#else
        // elsewhere: a chunk of rows dequantized into cache, then the fp32 dot kernel
        for (int64_t j = 0; j < nj; ++j) gguf::dequantize_row(quant_type, w + (j0 + j) * dims.row_bytes, K, wbuf + j * K);
        cpu::dot_rows(h.row(0), h.ld(), M, wbuf, K, nj, K, acc, nj);
#endif
        for (int64_t i = 0; i < M; ++i) {
          scalar_t* dst = o + i * ldo + j0;
          const float* src = acc + i * nj;
          for (int64_t j = 0; j < nj; ++j) {
            float v = src[j];
            if (bias != nullptr) v += static_cast<float>(bias[j0 + j]);
            if (accumulate) v += static_cast<float>(dst[j]);
            dst[j] = static_cast<scalar_t>(v);
          }
        }
      }
    }
  });
}

void linear_gguf_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t quant_type,
                     const std::optional<at::Tensor>& bias, bool accumulate) {
  const GgufDims dims = check_linear_gguf_args(out, input, weight, quant_type, bias);
  if (dims.rows == 0 || dims.out == 0) return;
  if (dims.in == 0) {
    const at::Tensor dense = dequantize_weight(weight, quant_type, dims.in, input.scalar_type());
    return linear_with_gemm(out, input, dense, bias, accumulate, std::nullopt);
  }
  if (dims.rows > kStreamMaxRows)
    return linear_gguf_sliced(out, input, weight.const_data_ptr<uint8_t>(), quant_type, bias, accumulate, dims);
  const bool has_bias = bias.has_value() && bias->defined();
  EECORE_DISPATCH_FLOAT(input.scalar_type(), "eecore::linear_gguf", [&] {
    linear_gguf_streaming<scalar_t>(out, input, weight.const_data_ptr<uint8_t>(), quant_type,
                                    has_bias ? bias->const_data_ptr<scalar_t>() : nullptr, accumulate, dims);
  });
}

at::Tensor dequantize_gguf_cpu(const at::Tensor& weight, int64_t quant_type, int64_t features) {
  check_dequantize_gguf_args(weight, quant_type, features);
  return dequantize_weight(weight, quant_type, features, at::kFloat);
}

void embedding_gguf_cpu(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, int64_t quant_type) {
  const int64_t K = check_embedding_gguf_args(out, token_ids, weight, quant_type);
  check_token_ids_in_range(token_ids, weight.size(0));
  const int64_t T = token_ids.size(0), row_bytes = weight.size(1), ldo = out.stride(0);
  if (T == 0 || K == 0) return;
  const int64_t* ids = token_ids.const_data_ptr<int64_t>();
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  EECORE_DISPATCH_FLOAT(out.scalar_type(), "eecore::embedding_gguf", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, std::max<int64_t>(1, kMinMacsPerThread / K), [&](int64_t t0, int64_t t1) {
      cpu::ScratchBuffer<float, kDecodedFloats> decoded;
      float* row = decoded.get(static_cast<size_t>(K));
      for (int64_t t = t0; t < t1; ++t) {
        float* dst = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(o + t * ldo) : row;
        gguf::dequantize_row(quant_type, w + ids[t] * row_bytes, K, dst);
        if constexpr (!std::is_same_v<scalar_t, float>)
          for (int64_t k = 0; k < K; ++k) o[t * ldo + k] = static_cast<scalar_t>(row[k]);
      }
    });
  });
}

}  // namespace

int64_t gguf_stream_max_rows() { return kStreamMaxRows; }
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) {
  m.impl("linear_gguf", &eecore::linear_gguf_cpu);
  m.impl("dequantize_gguf", &eecore::dequantize_gguf_cpu);
  m.impl("embedding_gguf", &eecore::embedding_gguf_cpu);
}
