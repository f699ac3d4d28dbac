// paged_attention on CUDA: planning (which kernel, how many context splits) and launching.
// The kernels themselves live in attention_decode.cuh (bf16/fp16 decode at memory bandwidth),
// attention_mma.cuh (tensor cores, prefill and verification), attention_rows.cuh (SIMT fallback:
// fp32, odd head dims, unaligned views) and attention_common.cuh (split combine).
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_decode.cuh"
#include "attention_decode_mma.cuh"
#include "attention_mma.cuh"
#include "attention_rows.cuh"
#include "eecore/batch_invariant.h"

namespace eecore::cuda {
namespace {

using attention::split_workspace_floats;

// Head dims the tensor-core kernel is instantiated for; D is zero-padded up to the next one.
inline int mma_head_dim(int32_t d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }

inline int mma_block_n(int32_t d) {
  switch (mma_head_dim(d)) {
    case 32:
      return attention::mma_tiles::Shape<32>::kBlockN;
    case 64:
      return attention::mma_tiles::Shape<64>::kBlockN;
    case 128:
      return attention::mma_tiles::Shape<128>::kBlockN;
    default:
      return attention::mma_tiles::Shape<256>::kBlockN;
  }
}

inline bool kv_rows_aligned16(const PagedAttentionParams& p) {
  return rows_aligned16({p.query, p.k_cache, p.v_cache},
                        {p.q_stride_token, p.q_stride_head, p.k_stride_block, p.k_stride_token, p.k_stride_head,
                         p.v_stride_block, p.v_stride_token, p.v_stride_head},
                        dtype_size(p.dtype));
}

inline int64_t mma_m_tiles(const PagedAttentionParams& p) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  return ceil_div(static_cast<int64_t>(p.max_query_len) * group, attention::mma_tiles::kBlockM);
}

template <typename T, int HEAD_DIM>
cudaError_t launch_mma(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* ws, cudaStream_t stream) {
  using Shape = attention::mma_tiles::Shape<HEAD_DIM>;
  auto kernel = attention::mma_tiles::paged_attention_mma_kernel<T, HEAD_DIM>;
  const size_t smem = Shape::kSmemBytes;
  if (cudaError_t err = allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_seqs * plan.num_splits), static_cast<unsigned>(mma_m_tiles(p)),
                  static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, attention::mma_tiles::kThreads, smem, stream>>>(p, plan.num_splits, plan.split_tokens, ws);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* ws, cudaStream_t stream) {
  using namespace attention::rows;
  const Layout layout = attention::rows::layout(p.head_dim, sizeof(T));
  const bool vec16 = p.head_dim % kVec16<T> == 0 && kv_rows_aligned16(p);
  auto kernel = vec16 ? paged_attention_rows_kernel<T, true> : paged_attention_rows_kernel<T, false>;
  if (cudaError_t err = allow_dynamic_smem(kernel, layout.bytes); err != cudaSuccess) return err;
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const int32_t head_chunks = (group + kMaxGroup - 1) / kMaxGroup;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads * head_chunks),
                  static_cast<unsigned>(plan.num_splits));
  kernel<<<grid, kThreads, layout.bytes, stream>>>(p, plan.num_splits, plan.split_tokens, ws);
  return cudaGetLastError();
}

// ---- the decode kernel: instantiated for head dims 64/128/256 and groups 1/2/4/8 ---------------

inline int decode_head_dim(int32_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }
inline int decode_group(int32_t group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

// Calls f(std::integral_constant<int, HEAD_DIM>, std::integral_constant<int, GROUP>) for p's shape.
template <typename F>
cudaError_t dispatch_decode_shape(const PagedAttentionParams& p, F&& f) {
  auto with_group = [&](auto head_dim) -> cudaError_t {
    switch (decode_group(p.num_q_heads / p.num_kv_heads)) {
      case 1:
        return f(head_dim, std::integral_constant<int, 1>{});
      case 2:
        return f(head_dim, std::integral_constant<int, 2>{});
      case 4:
        return f(head_dim, std::integral_constant<int, 4>{});
      default:
        return f(head_dim, std::integral_constant<int, 8>{});
    }
  };
  switch (decode_head_dim(p.head_dim)) {
    case 64:
      return with_group(std::integral_constant<int, 64>{});
    case 128:
      return with_group(std::integral_constant<int, 128>{});
    default:
      return with_group(std::integral_constant<int, 256>{});
  }
}

// CTAs per query row and KV head (groups above 8 take several) and keys per stage.
inline int64_t decode_head_chunks(const PagedAttentionParams& p) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  return ceil_div(group, decode_group(static_cast<int32_t>(group)));
}

struct DecodeShape {
  int64_t tile_keys;   // keys per pipeline stage
  int64_t min_blocks;  // CTAs per SM the launch bounds guarantee
};

inline DecodeShape decode_shape(const PagedAttentionParams& p) {
  DecodeShape shape{};
  dispatch_decode_shape(p, [&](auto head_dim, auto group) -> cudaError_t {
    using Shape = attention::decode::Shape<decltype(head_dim)::value, decltype(group)::value>;
    shape = DecodeShape{Shape::kTileKeys, Shape::kMinBlocks};
    return cudaSuccess;
  });
  return shape;
}

template <typename T>
cudaError_t launch_decode(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* ws,
                          cudaStream_t stream) {
  return dispatch_decode_shape(p, [&](auto head_dim, auto group) -> cudaError_t {
    constexpr int kHeadDim = decltype(head_dim)::value;
    constexpr int kGroup = decltype(group)::value;
    using Shape = attention::decode::Shape<kHeadDim, kGroup>;
    auto kernel = attention::decode::paged_attention_decode_kernel<T, kHeadDim, kGroup>;
    if (cudaError_t err = allow_dynamic_smem(kernel, Shape::kSmemBytes); err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads * decode_head_chunks(p)),
                    static_cast<unsigned>(plan.num_splits));
    kernel<<<grid, attention::decode::kThreads, Shape::kSmemBytes, stream>>>(p, plan.num_splits, plan.split_tokens,
                                                                              ws);
    return cudaGetLastError();
  });
}

// ---- the tensor-core decode kernel: head dims 64/128/256, 16 or 32 packed rows per CTA -------------

inline int decode_mma_head_dim(int32_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }
inline int decode_mma_m_tiles(const PagedAttentionParams& p) {
  const int64_t rows = static_cast<int64_t>(p.max_query_len) * (p.num_q_heads / p.num_kv_heads);
  return rows > 16 && decode_mma_head_dim(p.head_dim) <= 128 ? 2 : 1;
}

// Calls f(std::integral_constant<int, HEAD_DIM>, std::integral_constant<int, M_TILES>) for p's shape.
template <typename F>
cudaError_t dispatch_decode_mma_shape(const PagedAttentionParams& p, F&& f) {
  const bool two = decode_mma_m_tiles(p) == 2;
  switch (decode_mma_head_dim(p.head_dim)) {
    case 64:
      return two ? f(std::integral_constant<int, 64>{}, std::integral_constant<int, 2>{})
                 : f(std::integral_constant<int, 64>{}, std::integral_constant<int, 1>{});
    case 128:
      return two ? f(std::integral_constant<int, 128>{}, std::integral_constant<int, 2>{})
                 : f(std::integral_constant<int, 128>{}, std::integral_constant<int, 1>{});
    default:
      return f(std::integral_constant<int, 256>{}, std::integral_constant<int, 1>{});
  }
}

inline int64_t decode_mma_row_blocks(const PagedAttentionParams& p) {
  const int64_t rows = static_cast<int64_t>(p.max_query_len) * (p.num_q_heads / p.num_kv_heads);
  return ceil_div(rows, 16 * decode_mma_m_tiles(p));
}

// EECORE_DECODE_MMA_STAGES=2 / 4: the pipeline's depth, for timing against the default 3. Two
// stages, one tile in flight per warp but 3 CTAs per SM (D <= 128, 16 rows); or four, three tiles in
// flight per warp (D <= 64, where two such CTAs still fit an SM's shared memory: 50% more bytes in
// flight per SM than three stages).
inline int decode_mma_stages(const PagedAttentionParams& p) {
  const int stages = p.choices.decode_mma_stages;
  if (stages == 2 && decode_mma_m_tiles(p) == 1 && decode_mma_head_dim(p.head_dim) <= 128) return 2;
  if (stages == 4 && decode_mma_head_dim(p.head_dim) == 64) return 4;
  return attention::decode_mma::kDefaultStages;
}

// EECORE_DECODE_MMA_LDMATRIX=1 / 0: decode_mma v2 (ldmatrix fragments and the changes
// EECORE_DECODE_MMA_V2_FLAGS selects) or its first version (unset: attention::decode_mma::kDefaultLdmatrix).
inline bool decode_mma_ldmatrix(const PagedAttentionParams& p) {
  const int32_t version = p.choices.decode_mma_version;
  return version == 0 ? attention::decode_mma::kDefaultLdmatrix : version == 2;
}

// EECORE_DECODE_MMA_V2_FLAGS: which of v2's changes run (attention::decode_mma::kWholeTileCopy | ...;
// default kDefaultV2Flags), so that each can be timed alone.
inline int32_t decode_mma_v2_flags(const PagedAttentionParams& p) {
  namespace dm = attention::decode_mma;
  const int32_t flags = p.choices.decode_mma_v2_flags;
  return (flags < 0 ? dm::kDefaultV2Flags : flags) & dm::kKnownV2Flags;
}

inline int64_t decode_mma_ctas_per_sm(const PagedAttentionParams& p) {
  int64_t ctas = 1;
  dispatch_decode_mma_shape(p, [&](auto head_dim, auto m_tiles) -> cudaError_t {
    constexpr int kHeadDim = decltype(head_dim)::value;
    constexpr int kMTiles = decltype(m_tiles)::value;
    ctas = attention::decode_mma::Shape<kHeadDim, kMTiles>::kCtasPerSm;
    const int stages = decode_mma_stages(p);
    if constexpr (kMTiles == 1 && kHeadDim <= 128) {
      if (stages == 2) ctas = attention::decode_mma::Shape<kHeadDim, kMTiles, 2>::kCtasPerSm;
    }
    if constexpr (kHeadDim == 64) {
      if (stages == 4) ctas = attention::decode_mma::Shape<kHeadDim, kMTiles, 4>::kCtasPerSm;
    }
    return cudaSuccess;
  });
  return ctas;
}

template <typename T, int kHeadDim, int kMTiles, int kStages>
cudaError_t launch_decode_mma_shape(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* ws,
                                    cudaStream_t stream) {
  using Shape = attention::decode_mma::Shape<kHeadDim, kMTiles, kStages>;
  namespace dm = attention::decode_mma;
  const int32_t flags = decode_mma_v2_flags(p);
  // v2 with the default flags runs the kernel compiled for them (a third smaller); other flags, for
  // timing each change alone, the one that reads them at run time
  auto kernel = !decode_mma_ldmatrix(p) ? dm::paged_attention_decode_mma_kernel<T, kHeadDim, kMTiles, kStages, false>
                : flags == dm::kDefaultV2Flags
                    ? dm::paged_attention_decode_mma_kernel<T, kHeadDim, kMTiles, kStages, true, dm::kDefaultV2Flags>
                    : dm::paged_attention_decode_mma_kernel<T, kHeadDim, kMTiles, kStages, true>;
  if (cudaError_t err = allow_dynamic_smem(kernel, Shape::kSmemBytes); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_seqs * plan.num_splits),
                  static_cast<unsigned>(decode_mma_row_blocks(p)), static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, attention::decode_mma::kThreads, Shape::kSmemBytes, stream>>>(p, plan.num_splits,
                                                                                plan.split_tokens, ws, flags);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode_mma(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* ws,
                              cudaStream_t stream) {
  return dispatch_decode_mma_shape(p, [&](auto head_dim, auto m_tiles) -> cudaError_t {
    constexpr int kHeadDim = decltype(head_dim)::value;
    constexpr int kMTiles = decltype(m_tiles)::value;
    const int stages = decode_mma_stages(p);
    if constexpr (kMTiles == 1 && kHeadDim <= 128) {
      if (stages == 2) return launch_decode_mma_shape<T, kHeadDim, kMTiles, 2>(p, plan, ws, stream);
    }
    if constexpr (kHeadDim == 64) {
      if (stages == 4) return launch_decode_mma_shape<T, kHeadDim, kMTiles, 4>(p, plan, ws, stream);
    }
    return launch_decode_mma_shape<T, kHeadDim, kMTiles, attention::decode_mma::kDefaultStages>(p, plan, ws, stream);
  });
}

// ---- planning ----------------------------------------------------------------------------------

// Context splits for a kernel whose natural grid has `ctas` CTAs, `slots` of which fit on the GPU
// at once, each covering up to `max_context` keys. Models the time as waves of CTAs, each CTA
// costing its keys plus a fixed overhead worth kOverheadKeys (q load, merge, the combine pass),
// and takes the cheapest split count: more splits fill the GPU and even out the last wave. No split
// is shorter than `min_split` keys (PagedAttentionChoices: 256, or EECORE_DECODE_MIN_SPLIT_TOKENS for
// timing shorter ones): a small grid's CTA is slow on its own keys (at B = 1, 8 KV heads and 256 keys
// an H200 ran decode_mma's 8 CTAs for 17-19 us, one warp a scheduler issuing every 10 cycles, against
// SDPA's 7 us), and shorter splits spread those keys over more CTAs, for a combine pass after them.
inline int64_t choose_splits(int64_t ctas, int64_t slots, int64_t max_context, int64_t tile, int64_t min_split) {
  constexpr int64_t kOverheadKeys = 256;
  constexpr int64_t kMaxSplits = 64;
  const int64_t limit = std::min(kMaxSplits, std::max<int64_t>(1, ceil_div(max_context, std::max<int64_t>(min_split, 1))));
  int64_t best = 1;
  double best_cost = 0.0;
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t keys = round_up(ceil_div(std::max<int64_t>(max_context, 1), s), tile);
    const double waves = static_cast<double>(ceil_div(ctas * s, slots));
    const double cost = waves * static_cast<double>(keys + kOverheadKeys);
    if (s == 1 || cost < best_cost * 0.97) {  // a split must win clearly: the model is rough
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p) {
  PagedAttentionPlan plan{PagedAttentionKernel::kRows, 1, 1, 0};
  if (p.num_tokens <= 0 || p.num_seqs <= 0 || p.max_query_len <= 0 || p.num_kv_heads <= 0) return plan;

  const bool vec_ok = p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 && p.head_dim <= kPagedAttentionMaxHeadDim &&
                      kv_rows_aligned16(p);
  const bool mma_ok = vec_ok && mma_m_tiles(p) <= 65535;
  const bool decode_ok = vec_ok;
  const bool decode_mma_ok = vec_ok && decode_mma_row_blocks(p) <= 65535;
  // Measured on an H200: decode and short verification queries (up to 32 packed rows, 16 at
  // D = 256: one CTA's worth) take the tensor-core decode kernel, with GQA (up to 2.7x the SIMT
  // decode kernel at G = 4 and 8, 2.5-3x the prefill tiles on 2-8 verify rows;
  // nvidia-h200-decode-sweep-2026-11-26-b.md) and without it since its v2 (G = 1: 1.27-2.0x the
  // SIMT kernel over the sweep's 21 cells, 96% of copy bandwidth at B = 64, context 4096, D = 128
  // against 71%; nvidia-h200-decode-sweep-2026-11-27-g1.md). The SIMT kernel stays for v1
  // (EECORE_DECODE_MMA_LDMATRIX=0), which it beat without GQA. Longer queries take the prefill tiles.
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t packed_rows = static_cast<int64_t>(p.max_query_len) * group;
  PagedAttentionKernel kernel = PagedAttentionKernel::kRows;
  if (decode_ok && p.max_query_len == 1 && group == 1 && !decode_mma_ldmatrix(p)) kernel = PagedAttentionKernel::kDecode;
  else if (decode_mma_ok && packed_rows <= 16 * decode_mma_m_tiles(p)) kernel = PagedAttentionKernel::kDecodeMma;
  else if (mma_ok && p.max_query_len > 1) kernel = PagedAttentionKernel::kMma;
  // Batch invariance: one kernel for a sequence's decode step and its verify pass (its grid has a
  // row block per 16 or 32 packed rows, each row computed alone).
  const bool invariant = p.choices.batch_invariant;
  if (invariant && decode_mma_ok && p.max_query_len <= kBatchInvariantMaxQueryLen)
    kernel = PagedAttentionKernel::kDecodeMma;
  const int forced = p.choices.forced_kernel;
  if (forced == static_cast<int>(PagedAttentionKernel::kRows) ||
      (forced == static_cast<int>(PagedAttentionKernel::kMma) && mma_ok) ||
      (forced == static_cast<int>(PagedAttentionKernel::kDecode) && decode_ok) ||
      (forced == static_cast<int>(PagedAttentionKernel::kDecodeMma) && decode_mma_ok))
    kernel = static_cast<PagedAttentionKernel>(forced);
  plan.kernel = kernel;

  const int64_t max_context = static_cast<int64_t>(p.max_blocks) * p.block_size;
  const int64_t sms = num_sms_of_current_device();
  int64_t splits = 1;
  int64_t tile = 1;
  if (kernel == PagedAttentionKernel::kDecode) {
    const DecodeShape shape = decode_shape(p);
    tile = shape.tile_keys;
    const int64_t ctas = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * decode_head_chunks(p);
    splits = choose_splits(ctas, sms * shape.min_blocks, max_context, tile, p.choices.min_split_tokens);
  } else if (kernel == PagedAttentionKernel::kDecodeMma) {
    tile = attention::decode_mma::kWarpKeys * attention::decode_mma::kWarps;
    const int64_t ctas = static_cast<int64_t>(p.num_seqs) * decode_mma_row_blocks(p) * p.num_kv_heads;
    splits = choose_splits(ctas, sms * decode_mma_ctas_per_sm(p), max_context, tile, p.choices.min_split_tokens);
  } else {
    // Split the context (flash-decoding) only when the natural grid leaves the GPU underfilled, and
    // never into splits shorter than a few tiles: the combine pass is not free.
    const bool mma = kernel == PagedAttentionKernel::kMma;
    tile = mma ? mma_block_n(p.head_dim)
               : attention::rows::layout(p.head_dim, static_cast<int32_t>(dtype_size(p.dtype))).tile_n;
    const int64_t group = p.num_q_heads / p.num_kv_heads;
    const int64_t ctas = mma ? p.num_seqs * mma_m_tiles(p) * p.num_kv_heads
                             : static_cast<int64_t>(p.num_tokens) * p.num_kv_heads *
                                   ceil_div(group, attention::rows::kMaxGroup);
    const int64_t target_ctas = 8 * sms;
    constexpr int64_t kMinSplitTokens = 256;
    constexpr int64_t kMaxSplits = 64;
    if (ctas < target_ctas && max_context > kMinSplitTokens)
      splits = std::min({ceil_div(target_ctas, ctas), ceil_div(max_context, kMinSplitTokens), kMaxSplits});
  }
  // With splits, each sequence is one CTA column per split (mma) or a grid z (decode, rows, at
  // most 65535): keep the grid within range.
  if (kernel == PagedAttentionKernel::kMma || kernel == PagedAttentionKernel::kDecodeMma)
    splits = std::min<int64_t>(splits, INT32_MAX / std::max<int64_t>(p.num_seqs, 1));
  splits = std::min<int64_t>(splits, 65535);
  int64_t split_tokens =
      std::max<int64_t>(round_up(ceil_div(std::max<int64_t>(max_context, 1), splits), tile), tile);
  splits = std::max<int64_t>(1, ceil_div(max_context, split_tokens));
  const int64_t fixed_tokens = round_up(kBatchInvariantSplitTokens, tile);
  const int64_t fixed_splits = std::max<int64_t>(2, ceil_div(max_context, fixed_tokens));
  if (invariant && kernel != PagedAttentionKernel::kMma && fixed_splits <= 65535 &&
      fixed_splits <= INT32_MAX / std::max<int64_t>(p.num_seqs, 1)) {
    // Splits at the same key positions for every batch and table width, and at least two, so that
    // every row goes through the combine (one split's row would be normalized in the kernel, with
    // other rounding); an empty split's m = -inf is skipped exactly by the combine.
    split_tokens = fixed_tokens;
    splits = fixed_splits;
  }
  plan.num_splits = static_cast<int32_t>(splits);
  plan.split_tokens = static_cast<int32_t>(std::min<int64_t>(split_tokens, INT32_MAX));
  plan.workspace_floats = splits > 1 ? split_workspace_floats(p, plan.num_splits) : 0;
  return plan;
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan, float* workspace,
                                   cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_seqs <= 0 || p.max_query_len <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.head_dim <= 0 || p.head_dim > kPagedAttentionMaxHeadDim) return cudaErrorInvalidValue;
  if (plan.num_splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    cudaError_t err = cudaSuccess;
    if (plan.kernel != PagedAttentionKernel::kRows) {
      if constexpr (std::is_same_v<T, float>) {
        return cudaErrorInvalidValue;  // the planner picks the others for bf16/fp16 only
      } else if (plan.kernel == PagedAttentionKernel::kDecode) {
        err = launch_decode<T>(p, plan, workspace, stream);
      } else if (plan.kernel == PagedAttentionKernel::kDecodeMma) {
        err = launch_decode_mma<T>(p, plan, workspace, stream);
      } else {
        switch (mma_head_dim(p.head_dim)) {
          case 32:
            err = launch_mma<T, 32>(p, plan, workspace, stream);
            break;
          case 64:
            err = launch_mma<T, 64>(p, plan, workspace, stream);
            break;
          case 128:
            err = launch_mma<T, 128>(p, plan, workspace, stream);
            break;
          default:
            err = launch_mma<T, 256>(p, plan, workspace, stream);
            break;
        }
      }
    } else {
      err = launch_rows<T>(p, plan, workspace, stream);
    }
    if (err != cudaSuccess || plan.num_splits == 1) return err;
    const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_q_heads));
    const int threads = static_cast<int>(std::min<int64_t>(256, round_up(p.head_dim, kWarpSize)));
    attention::combine_splits_kernel<T><<<grid, threads, 0, stream>>>(p, plan.num_splits, workspace);
    return cudaGetLastError();
  });
}

}  // namespace eecore::cuda
