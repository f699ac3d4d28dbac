// The SIMT paged-attention kernel: one CTA per (query row, KV head, context split).
//
// The CTA computes every query head of its KV head's group (up to kMaxGroup of them), so each K/V
// tile is fetched once per KV head however many query heads share it (GQA). Tiles of keys are
// prefetched into shared memory with 16-byte cp.async, double-buffered, while the previous tile is
// processed in three phases:
//   scores   thread -> (key, slice of D): partial q.k for every head, summed over slices in smem
//   softmax  warp   -> head: online softmax (fp32, log2 domain), probabilities into smem
//   values   thread -> (4 dims, some heads): acc = acc * alpha + sum_k p_k v_k
// K/V rows sit in shared memory at a pitch of an odd number of 16-byte units, so a warp reading
// 32 different rows at the same column hits 32 different banks.
#pragma once

#include "attention_common.cuh"
#include "eecore/cuda/async_copy.cuh"
#include "eecore/cuda/reduce.cuh"

namespace eecore::cuda::attention {

namespace rows {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kMaxGroup = 8;            // query heads per CTA; larger groups take several CTAs
constexpr int kMaxHeadsPerThread = 4;   // values phase: D <= 256 leaves >= 2 threads per 4 dims

// Shared-memory carve-up, computed identically on the host (launch size) and the device.
struct Layout {
  int32_t units;   // 16-byte units holding one K/V row (D rounded up)
  int32_t d_pad;   // D rounded up to whole units
  int32_t pitch;   // elements per K/V row in shared memory (an odd number of units)
  int32_t tile_n;  // keys per tile: 64, 32 or 16 (divides kThreads)
  int32_t q, k, v, part, prob, alpha, stats, valid, bytes;  // byte offsets and total
};

__host__ __device__ inline Layout layout(int32_t head_dim, int32_t elem_bytes) {
  Layout s{};
  const int32_t per_unit = 16 / elem_bytes;
  s.units = (head_dim + per_unit - 1) / per_unit;
  s.d_pad = s.units * per_unit;
  const int32_t pitch_units = s.units % 2 == 1 ? s.units : s.units + 1;
  s.pitch = pitch_units * per_unit;
  // Keys per tile, so that the double-buffered K/V tiles stay near 64 KiB and the whole layout
  // under the 99 KiB an sm_86/sm_89 block may have (fp32 with D = 256 is the largest case).
  s.tile_n = pitch_units * 16 <= 272 ? 64 : (pitch_units * 16 <= 528 ? 32 : 16);
  int32_t off = 0;
  s.q = off;
  off += kMaxGroup * s.d_pad * 4;                   // q * scale * log2(e), fp32 [kMaxGroup][d_pad]
  s.k = off;
  off += 2 * s.tile_n * s.pitch * elem_bytes;       // K tiles [2][tile_n][pitch]
  s.v = off;
  off += 2 * s.tile_n * s.pitch * elem_bytes;       // V tiles [2][tile_n][pitch]
  s.part = off;
  off += kThreads * kMaxGroup * 4;                  // partial scores [kThreads / tile_n][kMaxGroup][tile_n]
  s.prob = off;
  off += kMaxGroup * s.tile_n * 4;                  // probabilities [kMaxGroup][tile_n]
  s.alpha = off;
  off += kMaxGroup * 4;                             // per-head rescale of the accumulators
  s.stats = off;
  off += 2 * kMaxGroup * 4;                         // final m and l per head
  s.valid = off;
  off += 2 * s.tile_n * 4;                          // key present? [2][tile_n]
  s.bytes = off;
  return s;
}

// Two CTAs per SM are what shared memory allows anyway: let ptxas use up to 255 registers.
template <typename T, bool kVec16>
__global__ void __launch_bounds__(kThreads, 2)
    paged_attention_rows_kernel(const PagedAttentionParams p, const int32_t splits, const int32_t split_tokens,
                                float* __restrict__ workspace) {
  constexpr int kPerUnit = 16 / static_cast<int>(sizeof(T));
  extern __shared__ __align__(16) unsigned char smem[];
  const Layout L = layout(p.head_dim, sizeof(T));
  float* q_s = reinterpret_cast<float*>(smem + L.q);
  T* k_s = reinterpret_cast<T*>(smem + L.k);
  T* v_s = reinterpret_cast<T*>(smem + L.v);
  float* part_s = reinterpret_cast<float*>(smem + L.part);
  float* prob_s = reinterpret_cast<float*>(smem + L.prob);
  float* alpha_s = reinterpret_cast<float*>(smem + L.alpha);
  float* stats_s = reinterpret_cast<float*>(smem + L.stats);
  int32_t* valid_s = reinterpret_cast<int32_t*>(smem + L.valid);

  const int32_t row = blockIdx.x;
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const int32_t head_chunks = (group + kMaxGroup - 1) / kMaxGroup;
  const int32_t kv_head = blockIdx.y / head_chunks;
  const int32_t first_q_head = kv_head * group + (blockIdx.y % head_chunks) * kMaxGroup;
  const int32_t heads = min(kMaxGroup, kv_head * group + group - first_q_head);
  const int32_t split = blockIdx.z;

  RowInfo info;
  if (!locate_row(p, row, info)) return;  // uniform over the CTA, before any barrier
  const int64_t key_end = visible_keys(p, info.seq_len, info.q_pos);
  const int64_t k_begin = static_cast<int64_t>(split) * split_tokens;
  const int64_t k_stop = min(k_begin + split_tokens, key_end);
  const int32_t num_tiles = k_stop > k_begin ? static_cast<int32_t>((k_stop - k_begin + L.tile_n - 1) / L.tile_n) : 0;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;

  // q, pre-scaled so that scores come out in the log2 domain; padded dims are zero.
  {
    const float q_scale = p.scale * kLog2e;
    const T* q_row = static_cast<const T*>(p.query) + row * p.q_stride_token;
    for (int32_t i = tid; i < heads * L.d_pad; i += kThreads) {
      const int32_t g = i / L.d_pad, d = i % L.d_pad;
      q_s[i] = d < p.head_dim ? to_float(q_row[(first_q_head + g) * p.q_stride_head + d]) * q_scale : 0.f;
    }
  }

  const int32_t* table = p.block_table + info.seq * p.block_table_stride;
  const PagedLayout k_layout{p.k_stride_block, p.k_stride_token, p.k_stride_head, p.block_size, p.num_blocks};
  const PagedLayout v_layout{p.v_stride_block, p.v_stride_token, p.v_stride_head, p.block_size, p.num_blocks};
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);

  // Stage keys [tile_start, tile_start + tile_n) of this split. Absent keys (past the split, past
  // the causal limit, or in an invalid block) are zero-filled and flagged, so they get p = 0 and
  // contribute 0 * 0 instead of 0 * garbage.
  // Thread -> (16-byte unit, first key): the unit never changes, so the divisions happen once.
  const int32_t keys_per_pass = kThreads / L.units;  // units <= 64, so >= 2
  const int32_t load_unit = tid % L.units;
  const int32_t load_key = tid / L.units;  // >= keys_per_pass: this thread loads nothing
  auto load_tile = [&](int64_t tile_start, int stage) {
    T* ks = k_s + stage * L.tile_n * L.pitch;
    T* vs = v_s + stage * L.tile_n * L.pitch;
    if (load_key >= keys_per_pass) return;
    for (int32_t n = load_key; n < L.tile_n; n += keys_per_pass) {
      const int64_t pos = tile_start + n;
      int32_t block = 0, offset = 0;
      const bool present = pos < k_stop && tree_sees(p, row, info.q_pos - info.q_local, pos) &&
                           paged_locate(k_layout, table, p.max_blocks, pos, block, offset);
      if (load_unit == 0) valid_s[stage * L.tile_n + n] = present;
      const int32_t u = load_unit;
      T* k_dst = ks + n * L.pitch + u * kPerUnit;
      T* v_dst = vs + n * L.pitch + u * kPerUnit;
      const int64_t k_off = present ? paged_offset(k_layout, block, offset, kv_head) : 0;
      const int64_t v_off = present ? paged_offset(v_layout, block, offset, kv_head) : 0;
      if constexpr (kVec16) {
        if (present) {
          cp_async_16(k_dst, k_cache + k_off + u * kPerUnit);
          cp_async_16(v_dst, v_cache + v_off + u * kPerUnit);
        } else {
          zero_16(k_dst);
          zero_16(v_dst);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kPerUnit; ++e) {
          const int32_t d = u * kPerUnit + e;
          const bool in = present && d < p.head_dim;
          k_dst[e] = in ? k_cache[k_off + d] : from_float<T>(0.f);
          v_dst[e] = in ? v_cache[v_off + d] : from_float<T>(0.f);
        }
      }
    }
  };

  // Scores phase mapping: warps of one `part` share the q slice they read (a broadcast).
  const int32_t parts = kThreads / L.tile_n;
  const int32_t score_key = tid % L.tile_n;
  const int32_t part = tid / L.tile_n;
  // Values phase mapping: 4 dims per thread, heads strided over head_lanes.
  const int32_t quads = L.d_pad / 4;
  const int32_t head_lanes = kThreads / quads;
  const int32_t quad = tid % quads;
  const int32_t head_lane = tid / quads;
  const bool values_thread = head_lane < head_lanes;

  float m_run[2] = {-INFINITY, -INFINITY};  // of heads warp and warp + kWarps (log2 domain)
  float l_run[2] = {0.f, 0.f};
  float acc[kMaxHeadsPerThread][4] = {};

  if (num_tiles > 0) load_tile(k_begin, 0);
  cp_async_commit();
  for (int32_t it = 0; it < num_tiles; ++it) {
    const int stage = it & 1;
    const int64_t tile_start = k_begin + static_cast<int64_t>(it) * L.tile_n;
    if (it + 1 < num_tiles) load_tile(tile_start + L.tile_n, stage ^ 1);
    cp_async_commit();  // possibly empty: keeps "wait for all but the newest group" uniform
    cp_async_wait<1>();
    __syncthreads();

    // ---- scores: partial dot products of one key against every head's q over a slice of D
    {
      const T* k_row = k_s + (stage * L.tile_n + score_key) * L.pitch;
      float s[kMaxGroup] = {};
      for (int32_t u = part; u < L.units; u += parts) {
        float kf[kPerUnit];
        vec_to_float(load_vec<T, kPerUnit>(k_row + u * kPerUnit), kf);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < heads) {
            const float4* q4 = reinterpret_cast<const float4*>(q_s + g * L.d_pad + u * kPerUnit);
#pragma unroll
            for (int e4 = 0; e4 < kPerUnit / 4; ++e4) {
              const float4 q = q4[e4];
              s[g] += q.x * kf[4 * e4] + q.y * kf[4 * e4 + 1] + q.z * kf[4 * e4 + 2] + q.w * kf[4 * e4 + 3];
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g)
        if (g < heads) part_s[(part * kMaxGroup + g) * L.tile_n + score_key] = s[g];
    }
    __syncthreads();

    // ---- online softmax: warp w owns heads w and w + kWarps
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int g = warp + j * kWarps;
      if (g >= heads) continue;  // warp-uniform
      float sv[2];
      float tile_max = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int32_t n = lane + jj * kWarpSize;
        float s = -INFINITY;
        if (n < L.tile_n && valid_s[stage * L.tile_n + n]) {
          s = 0.f;
          for (int32_t pp = 0; pp < parts; ++pp) s += part_s[(pp * kMaxGroup + g) * L.tile_n + n];
          if (p.position_bias != nullptr) s += position_bias_log2(p, first_q_head + g, info.q_pos - (tile_start + n));
        }
        sv[jj] = s;
        tile_max = fmaxf(tile_max, s);
      }
      tile_max = warp_max(tile_max);
      const float m_new = fmaxf(m_run[j], tile_max);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: every p is 0
      const float alpha = exp2f(m_run[j] - m_use);
      float p_sum = 0.f;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int32_t n = lane + jj * kWarpSize;
        if (n < L.tile_n) {
          const float prob = exp2f(sv[jj] - m_use);
          prob_s[g * L.tile_n + n] = prob;
          p_sum += prob;
        }
      }
      p_sum = warp_sum(p_sum);
      l_run[j] = l_run[j] * alpha + p_sum;
      m_run[j] = m_new;
      if (lane == 0) alpha_s[g] = alpha;
    }
    __syncthreads();

    // ---- values: rescale, then accumulate p_k * v_k over the tile
    if (values_thread) {
      const T* v_col = v_s + stage * L.tile_n * L.pitch + quad * 4;
#pragma unroll
      for (int j = 0; j < kMaxHeadsPerThread; ++j) {
        const int g = head_lane + j * head_lanes;
        if (g < heads) {
          const float alpha = alpha_s[g];
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] *= alpha;
        }
      }
      for (int32_t n = 0; n < L.tile_n; ++n) {
        float vf[4];
        vec_to_float(load_vec<T, 4>(v_col + n * L.pitch), vf);
#pragma unroll
        for (int j = 0; j < kMaxHeadsPerThread; ++j) {
          const int g = head_lane + j * head_lanes;
          if (g < heads) {
            const float prob = prob_s[g * L.tile_n + n];
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] += prob * vf[e];
          }
        }
      }
    }
    __syncthreads();  // the next iteration prefetches into the stage just read
  }
  cp_async_wait<0>();

  // ---- epilogue: publish (m, l) per head, then normalize (or store the split's partial result)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int g = warp + j * kWarps;
    if (g < heads && lane == 0) {
      stats_s[g] = m_run[j];
      stats_s[kMaxGroup + g] = l_run[j];
    }
  }
  __syncthreads();
  if (!values_thread) return;
#pragma unroll
  for (int j = 0; j < kMaxHeadsPerThread; ++j) {
    const int g = head_lane + j * head_lanes;
    if (g >= heads) continue;
    const int32_t q_head = first_q_head + g;
    const float m = stats_s[g];
    const float l = stats_s[kMaxGroup + g];
    if (splits == 1) {
      const float inv_l = l > 0.f ? 1.f / l : 0.f;  // no visible key: the output is 0
      T* out = static_cast<T*>(p.out) + row * p.o_stride_token + q_head * p.o_stride_head;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t d = quad * 4 + e;
        if (d < p.head_dim) out[d] = from_float<T>(acc[j][e] * inv_l);
      }
    } else {
      const SplitWorkspace ws = split_workspace(workspace, p, splits);
      const int64_t idx = split_index(p, row, q_head, splits, split);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t d = quad * 4 + e;
        if (d < p.head_dim) ws.out[idx * p.head_dim + d] = acc[j][e];
      }
      if (quad == 0) {
        ws.m[idx] = m;
        ws.l[idx] = l;
      }
    }
  }
}

}  // namespace rows
}  // namespace eecore::cuda::attention
