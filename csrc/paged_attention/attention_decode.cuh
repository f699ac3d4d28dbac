// The decode paged-attention kernel (bf16/fp16): one CTA per (query row, KV head, context split)
// computing up to GROUP query heads of that KV head's group, built to stream the KV cache at
// memory bandwidth.
//
// Thread mapping: a "team" of kLanes = HEAD_DIM / 8 consecutive threads covers one key row, each
// lane 8 dims (one 16-byte vector). The CTA's kTeams teams take different keys, kKeysPerStage
// consecutive keys each per pipeline stage. Every thread keeps its lane of q for the whole group,
// plus its own online-softmax state (m, l and 8 dims of the output per head), in registers.
//
// Why this shape reads at bandwidth where the older "rows" kernel did not:
//  * Each thread copies (cp.async, 16 bytes) exactly the K/V vectors it later consumes, into
//    shared-memory slots of its own. Nothing is shared between threads inside the main loop, so
//    the pipeline needs no barrier at all: kStages - 1 stages stay in flight while one is
//    computed, and warps of the CTA drift freely.
//  * A stage's block-table lookups are all issued before its first copy (the copies' asm carries
//    a memory clobber, which would otherwise serialize lookup -> copy -> lookup -> ...).
//  * q.k partial sums are completed with xor-shuffles inside the team (log2(kLanes) steps), the
//    softmax runs per team on kKeysPerStage keys at a time (one rescale per stage), and the teams'
//    states are merged once at the end: shuffles within a warp, shared memory across warps.
// Absent keys (past the split or the causal limit, outside the token tree, or in an invalid block)
// are zero-filled and get probability 0.
#pragma once

#include "attention_common.cuh"
#include "eecore/cuda/async_copy.cuh"

namespace eecore::cuda::attention {

namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kStages = 3;        // pipeline depth: two stages in flight while one is computed
constexpr int kVec = 8;           // 2-byte elements per 16-byte vector
constexpr int kMaxGroup = 8;      // query heads per CTA; larger groups take several CTAs

template <int HEAD_DIM, int GROUP>
struct Shape {
  static_assert(HEAD_DIM % (kVec * 8) == 0 && HEAD_DIM <= 256, "HEAD_DIM: 64, 128 or 256");
  static_assert(GROUP >= 1 && GROUP <= kMaxGroup, "GROUP: 1..8");
  // Consecutive keys a team takes per stage: more keys amortize the softmax rescale, but their
  // scores take GROUP registers each.
  static constexpr int kKeysPerStage = GROUP >= 8 ? 2 : 4;
  static constexpr int kLanes = HEAD_DIM / kVec;           // threads per key row: 8, 16, 32
  static constexpr int kTeams = kThreads / kLanes;          // key rows taken at once
  static constexpr int kTileKeys = kTeams * kKeysPerStage;  // keys per stage
  // Per thread and stage: kKeysPerStage K vectors and as many V vectors, 16 bytes each.
  static constexpr int kPipelineBytes = kStages * kKeysPerStage * 2 * kThreads * 16;
  // The cross-warp merge at the end reuses the pipeline's memory: acc, then m and l.
  static constexpr int kMergeBytes = kWarps * GROUP * (HEAD_DIM + 2) * 4;
  static constexpr int kSmemBytes = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
  // Registers per thread grow with GROUP (q and acc are 16 floats a head). Resident CTAs per SM
  // that keep ptxas from spilling for sm_80 and sm_90: 4 (128 registers) up to GROUP 2, 3 (168)
  // at GROUP 4, 2 (255) at GROUP 8.
  static constexpr int kMinBlocks = GROUP <= 2 ? 4 : GROUP == 4 ? 3 : 2;
};

template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads, Shape<HEAD_DIM, GROUP>::kMinBlocks)
    paged_attention_decode_kernel(const PagedAttentionParams p, const int32_t splits, const int32_t split_tokens,
                                  float* __restrict__ workspace) {
  using S = Shape<HEAD_DIM, GROUP>;
  constexpr int kLanes = S::kLanes;
  constexpr int kKeysPerStage = S::kKeysPerStage;
  extern __shared__ __align__(16) unsigned char smem[];

  const int32_t row = blockIdx.x;
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const int32_t head_chunks = (group + GROUP - 1) / GROUP;
  const int32_t kv_head = blockIdx.y / head_chunks;
  const int32_t first_q_head = kv_head * group + (blockIdx.y % head_chunks) * GROUP;
  const int32_t heads = min(GROUP, kv_head * group + group - first_q_head);
  const int32_t split = blockIdx.z;

  RowInfo info;
  if (!locate_row(p, row, info)) return;  // uniform over the CTA, before any barrier
  const int64_t key_end = visible_keys(p, info.seq_len, info.q_pos);
  const int64_t k_begin = static_cast<int64_t>(split) * split_tokens;
  const int64_t k_stop = min(k_begin + split_tokens, key_end);
  const int32_t num_tiles =
      k_stop > k_begin ? static_cast<int32_t>((k_stop - k_begin + S::kTileKeys - 1) / S::kTileKeys) : 0;

  const int tid = threadIdx.x;
  const int lane = tid % kLanes;  // dims [8 lane, 8 lane + 8)
  const int team = tid / kLanes;
  const int32_t dim0 = lane * kVec;
  const bool dims_on = dim0 < p.head_dim;  // D % 8 == 0: a lane's 8 dims are all in or all out

  // q of every head in the group, pre-scaled so that scores come out in the log2 domain.
  float q[GROUP][kVec];
  {
    const T* q_row = static_cast<const T*>(p.query) + row * p.q_stride_token;
    const float q_scale = p.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      if (g < heads && dims_on) {
        vec_to_float(load_vec<T, kVec>(q_row + (first_q_head + g) * p.q_stride_head + dim0), q[g]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][e] = 0.f;
      }
    }
  }

  const int32_t* table = p.block_table + info.seq * p.block_table_stride;
  const PagedLayout k_layout{p.k_stride_block, p.k_stride_token, p.k_stride_head, p.block_size, p.num_blocks};
  const PagedLayout v_layout{p.v_stride_block, p.v_stride_token, p.v_stride_head, p.block_size, p.num_blocks};
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int64_t chunk_begin = info.q_pos - info.q_local;

  // Thread-private slots, [stage][key][K|V][thread] x 16 bytes: a warp's 16-byte accesses to one
  // slot are consecutive, so they are conflict-free.
  auto slot = [&](int stage, int j, int kv) -> unsigned char* {
    return smem + (((stage * kKeysPerStage + j) * 2 + kv) * kThreads + tid) * 16;
  };
  // Which of the thread's keys are present, kKeysPerStage bits per stage.
  uint32_t present_bits = 0;

  auto issue = [&](int32_t tile) {
    const int stage = tile % kStages;
    const int64_t first = k_begin + static_cast<int64_t>(tile) * S::kTileKeys + team * kKeysPerStage;
    bool present[kKeysPerStage];
    int32_t block[kKeysPerStage], offset[kKeysPerStage];
#pragma unroll
    for (int j = 0; j < kKeysPerStage; ++j) {  // every lookup before the first copy
      const int64_t pos = first + j;
      block[j] = 0;
      offset[j] = 0;
      present[j] = pos < k_stop && tree_sees(p, row, chunk_begin, pos) &&
                   paged_locate(k_layout, table, p.max_blocks, pos, block[j], offset[j]);
    }
    uint32_t bits = 0;
#pragma unroll
    for (int j = 0; j < kKeysPerStage; ++j) {
      unsigned char* k_dst = slot(stage, j, 0);
      unsigned char* v_dst = slot(stage, j, 1);
      if (present[j] && dims_on) {
        cp_async_16(k_dst, k_cache + paged_offset(k_layout, block[j], offset[j], kv_head) + dim0);
        cp_async_16(v_dst, v_cache + paged_offset(v_layout, block[j], offset[j], kv_head) + dim0);
      } else {
        zero_16(k_dst);
        zero_16(v_dst);
      }
      bits |= static_cast<uint32_t>(present[j]) << j;
    }
    constexpr uint32_t kMask = (1u << kKeysPerStage) - 1;
    present_bits = (present_bits & ~(kMask << (stage * kKeysPerStage))) | (bits << (stage * kKeysPerStage));
  };

  float m_run[GROUP], l_run[GROUP], acc[GROUP][kVec];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.f;
  }

#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < num_tiles) issue(t);
    cp_async_commit();  // possibly empty: keeps "wait for all but the newest kStages - 1" uniform
  }
  for (int32_t it = 0; it < num_tiles; ++it) {
    // The stage refilled here was consumed by this same thread in the previous iteration.
    if (it + kStages - 1 < num_tiles) issue(it + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this thread's copies of tile `it` have landed
    const int stage = it % kStages;
    const uint32_t bits = present_bits >> (stage * kKeysPerStage);
    const int64_t first = k_begin + static_cast<int64_t>(it) * S::kTileKeys + team * kKeysPerStage;

    // ---- scores: this lane's 8-dim partial dot products, completed across the team
    float s[kKeysPerStage][GROUP];
#pragma unroll
    for (int j = 0; j < kKeysPerStage; ++j) {
      float kf[kVec];
      vec_to_float(*reinterpret_cast<const Vec<T, kVec>*>(slot(stage, j, 0)), kf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot = fmaf(q[g][e], kf[e], dot);
        s[j][g] = dot;
      }
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1)
#pragma unroll
      for (int j = 0; j < kKeysPerStage; ++j)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) s[j][g] += __shfl_xor_sync(0xffffffffu, s[j][g], off);

    // ---- masks, position bias, and one online-softmax update per head for the stage's keys
    float m_use[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeysPerStage; ++j) {
        float x = -INFINITY;
        if ((bits >> j) & 1u) {
          x = s[j][g];
          if (p.position_bias != nullptr && g < heads)
            x += position_bias_log2(p, first_q_head + g, info.q_pos - (first + j));
        }
        s[j][g] = x;
        tile_max = fmaxf(tile_max, x);
      }
      const float m_new = fmaxf(m_run[g], tile_max);
      m_use[g] = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: every p is 0
      const float alpha = exp2f(m_run[g] - m_use[g]);
      m_run[g] = m_new;
      l_run[g] *= alpha;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] *= alpha;
    }

    // ---- values
#pragma unroll
    for (int j = 0; j < kKeysPerStage; ++j) {
      float vf[kVec];
      vec_to_float(*reinterpret_cast<const Vec<T, kVec>*>(slot(stage, j, 1)), vf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float prob = exp2f(s[j][g] - m_use[g]);
        l_run[g] += prob;
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(prob, vf[e], acc[g][e]);
      }
    }
  }
  cp_async_wait<0>();

  // ---- merge the teams of each warp (lanes with the same dims differ by multiples of kLanes)
#pragma unroll
  for (int off = kLanes; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m_run[g], off);
      const float l_other = __shfl_xor_sync(0xffffffffu, l_run[g], off);
      const float m_new = fmaxf(m_run[g], m_other);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float a = exp2f(m_run[g] - m_use), b = exp2f(m_other - m_use);
      l_run[g] = l_run[g] * a + l_other * b;
      m_run[g] = m_new;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], off) * b;
    }
  }

  // ---- then the warps, through shared memory (the pipeline's slots are free now)
  const int warp = tid / kWarpSize;
  float* acc_s = reinterpret_cast<float*>(smem);      // [kWarps][GROUP][HEAD_DIM]
  float* ml_s = acc_s + kWarps * GROUP * HEAD_DIM;    // [kWarps][GROUP][m, l]
  __syncthreads();
  if (tid % kWarpSize < kLanes) {  // the warp's first team holds the warp's merged state
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float4* dst = reinterpret_cast<float4*>(acc_s + (warp * GROUP + g) * HEAD_DIM + dim0);
      dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      if (lane == 0) {
        ml_s[(warp * GROUP + g) * 2] = m_run[g];
        ml_s[(warp * GROUP + g) * 2 + 1] = l_run[g];
      }
    }
  }
  __syncthreads();

  for (int32_t i = tid; i < heads * p.head_dim; i += kThreads) {
    const int32_t g = i / p.head_dim, d = i % p.head_dim;
    float m, l, o;
    merge_parts<kWarps, GROUP, HEAD_DIM>(ml_s, acc_s, g, d, m, l, o);
    store_output<T>(p, workspace, splits, split, row, first_q_head + g, d, m, l, o);
  }
}

}  // namespace decode
}  // namespace eecore::cuda::attention
