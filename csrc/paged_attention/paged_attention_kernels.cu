// paged_attention on CUDA: planning (which kernel, how many context splits) and launching.
// The kernels themselves live in attention_rows.cuh (SIMT, decode and fp32), attention_mma.cuh
// (tensor cores, prefill and verification) and attention_common.cuh (split combine).
#include <type_traits>

#include "attention_common.cuh"
#include "attention_mma.cuh"
#include "attention_rows.cuh"

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

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p) {
  PagedAttentionPlan plan{PagedAttentionKernel::kRows, 1, 1, 0};
  if (p.num_tokens <= 0 || p.num_seqs <= 0 || p.max_query_len <= 0 || p.num_kv_heads <= 0) return plan;

  const bool mma = p.dtype != DType::kFloat32 && p.max_query_len > 1 && p.head_dim % 8 == 0 &&
                   p.head_dim <= kPagedAttentionMaxHeadDim && kv_rows_aligned16(p) && mma_m_tiles(p) <= 65535;
  plan.kernel = mma ? PagedAttentionKernel::kMma : PagedAttentionKernel::kRows;
  const int64_t tile = mma ? mma_block_n(p.head_dim)
                           : attention::rows::layout(p.head_dim, static_cast<int32_t>(dtype_size(p.dtype))).tile_n;

  // Split the context (flash-decoding) only when the natural grid leaves the GPU underfilled, and
  // never into splits shorter than a few tiles: the combine pass is not free.
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t ctas = mma ? p.num_seqs * mma_m_tiles(p) * p.num_kv_heads
                           : static_cast<int64_t>(p.num_tokens) * p.num_kv_heads *
                                 ceil_div(group, attention::rows::kMaxGroup);
  const int64_t target_ctas = 8 * static_cast<int64_t>(num_sms_of_current_device());
  const int64_t max_context = static_cast<int64_t>(p.max_blocks) * p.block_size;
  constexpr int64_t kMinSplitTokens = 256;
  constexpr int64_t kMaxSplits = 64;
  int64_t splits = 1;
  if (ctas < target_ctas && max_context > kMinSplitTokens) {
    splits = std::min({ceil_div(target_ctas, ctas), ceil_div(max_context, kMinSplitTokens), kMaxSplits});
    // With splits, each sequence is one CTA column per split: keep the grid's x within range.
    if (mma) splits = std::min<int64_t>(splits, INT32_MAX / std::max<int64_t>(p.num_seqs, 1));
  }
  const int64_t split_tokens = std::max<int64_t>(round_up(ceil_div(std::max<int64_t>(max_context, 1), splits), tile), tile);
  splits = std::max<int64_t>(1, ceil_div(max_context, split_tokens));
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
    if (plan.kernel == PagedAttentionKernel::kMma) {
      if constexpr (std::is_same_v<T, float>) {
        return cudaErrorInvalidValue;  // the planner never picks tensor cores for fp32
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
