// The tensor-core paged-attention kernel (bf16/fp16, sm_80+), flash-attention-2 style.
//
// A CTA owns up to kBlockM "packed rows" of one sequence and one KV head: packed row
// m = q_local * group + g is query token q_local under query head kv_head * group + g. Packing the
// GQA group into the M dimension lets short queries (d+1 draft tokens being verified, chunked
// prefill tails) fill 16-row MMA tiles, and every K/V tile is read once for the whole group.
// Each of the 4 warps owns 16 packed rows; per key tile (double-buffered with cp.async):
//   S = Q K^T on mma.m16n8k16 (fp32 accumulators), then scale, position bias and masks,
//   online softmax on the accumulators in registers (rows split over the 4 lanes of a quad),
//   P converted in registers straight into A fragments, O += P V on mma.m16n8k16.
// D is padded up to HEAD_DIM in shared memory with zeros (D % 8 == 0 is required for the 16-byte
// copies), so one instantiation serves every D up to HEAD_DIM.
#pragma once

#include "attention_common.cuh"
#include "eecore/cuda/async_copy.cuh"
#include "eecore/cuda/mma.cuh"

namespace eecore::cuda::attention {

namespace mma_tiles {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlockM = 16 * kWarps;

template <int HEAD_DIM>
struct Shape {
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= kPagedAttentionMaxHeadDim, "HEAD_DIM: a multiple of 16, <= 256");
  // Keys per tile: shared memory stays under 99 KiB, the most an sm_86/sm_89 block may have.
  static constexpr int kBlockN = HEAD_DIM <= 128 ? 64 : 16;
  static constexpr int kPitch = HEAD_DIM + 8;  // elements per smem row: conflict-free 32-bit fragment loads
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  static constexpr int kSmemBytes = (kBlockM + 4 * kBlockN) * kPitch * 2 + 2 * kBlockN * 4;
  static_assert(kSmemBytes <= 99 * 1024, "must fit an sm_86/sm_89 block");
};

// At least two CTAs per SM is all shared memory allows at HEAD_DIM 128: up to 255 registers.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads, 2)
    paged_attention_mma_kernel(const PagedAttentionParams p, const int32_t splits, const int32_t split_tokens,
                               float* __restrict__ workspace) {
  using S = Shape<HEAD_DIM>;
  constexpr int kBlockN = S::kBlockN;
  constexpr int kPitch = S::kPitch;
  constexpr int kKeyTiles = kBlockN / 8;   // n-tiles of S
  constexpr int kDimTiles = HEAD_DIM / 8;  // n-tiles of O

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);       // [kBlockM][kPitch]
  T* k_s = q_s + kBlockM * kPitch;           // [2][kBlockN][kPitch]
  T* v_s = k_s + 2 * kBlockN * kPitch;       // [2][kBlockN][kPitch]
  int32_t* valid_s = reinterpret_cast<int32_t*>(v_s + 2 * kBlockN * kPitch);  // [2][kBlockN]

  const int32_t seq = blockIdx.x / splits;
  const int32_t split = blockIdx.x % splits;
  const int32_t m_begin = blockIdx.y * kBlockM;
  const int32_t kv_head = blockIdx.z;
  const int32_t group = p.num_q_heads / p.num_kv_heads;

  PackedRows pr;
  if (!packed_rows(p, seq, m_begin, kBlockM, split, split_tokens, pr)) return;  // uniform over the CTA
  const int32_t q_begin = pr.q_begin;
  const int64_t rows = pr.rows, first_pos = pr.first_pos, k_begin = pr.k_begin, k_stop = pr.k_stop;
  const int32_t num_tiles = k_stop > k_begin ? static_cast<int32_t>((k_stop - k_begin + kBlockN - 1) / kBlockN) : 0;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int quad_row = lane / 4;  // "group" in the PTX fragment tables
  const int quad_lane = lane % 4;  // "threadID_in_group"

  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);

  load_packed_q<T, kBlockM, HEAD_DIM, kPitch, kThreads>(p, pr, m_begin, kv_head, q_s);

  const int32_t* table = p.block_table + seq * p.block_table_stride;
  const PagedLayout k_layout{p.k_stride_block, p.k_stride_token, p.k_stride_head, p.block_size, p.num_blocks};
  const PagedLayout v_layout{p.v_stride_block, p.v_stride_token, p.v_stride_head, p.block_size, p.num_blocks};
  // Thread -> (16-byte chunk, first key); kChunks divides kThreads, so every thread has work.
  static_assert(kThreads % S::kChunks == 0, "chunks per row must divide the block");
  constexpr int kKeysPerPass = kThreads / S::kChunks;
  const int32_t load_chunk = tid % S::kChunks;
  const int32_t load_key = tid / S::kChunks;
  static_assert(kBlockN % kKeysPerPass == 0, "every thread loads the same number of keys");
  constexpr int kKeysPerThread = kBlockN / kKeysPerPass;
  auto load_tile = [&](int64_t tile_start, int stage) {
    T* ks = k_s + stage * kBlockN * kPitch;
    T* vs = v_s + stage * kBlockN * kPitch;
    // Every block-table lookup first, then the copies: the copies' asm carries a memory clobber,
    // which would otherwise serialize lookup -> copy -> lookup and leave one lookup in flight.
    bool present[kKeysPerThread];
    int32_t block[kKeysPerThread], offset[kKeysPerThread];
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) {
      const int64_t pos = tile_start + load_key + i * kKeysPerPass;
      block[i] = 0;
      offset[i] = 0;
      present[i] = pos < k_stop && paged_locate(k_layout, table, p.max_blocks, pos, block[i], offset[i]);
    }
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) {
      const int32_t n = load_key + i * kKeysPerPass;
      if (load_chunk == 0) valid_s[stage * kBlockN + n] = present[i];
      T* k_dst = ks + n * kPitch + load_chunk * 8;
      T* v_dst = vs + n * kPitch + load_chunk * 8;
      if (present[i] && load_chunk * 8 < p.head_dim) {
        cp_async_16(k_dst, k_cache + paged_offset(k_layout, block[i], offset[i], kv_head) + load_chunk * 8);
        cp_async_16(v_dst, v_cache + paged_offset(v_layout, block[i], offset[i], kv_head) + load_chunk * 8);
      } else {
        zero_16(k_dst);
        zero_16(v_dst);
      }
    }
  };

  // The two packed rows this thread holds accumulators for: quad_row and quad_row + 8 of its warp.
  bool row_ok[2];
  int64_t row_pos[2];      // query position (for the causal mask and the bias distance)
  int32_t row_head[2];     // query head
  int32_t row_token[2];    // query row in the [Tq, Hq, D] tensors
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t m = m_begin + warp * 16 + quad_row + 8 * r;
    row_ok[r] = m < rows;
    const int32_t q_local = static_cast<int32_t>(min(m, rows - 1) / group);
    row_pos[r] = first_pos + q_local;
    row_head[r] = kv_head * group + static_cast<int32_t>(min(m, rows - 1) % group);
    row_token[r] = q_begin + q_local;
  }

  const float qk_scale = p.scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this lane's share of the row sums; the quad adds them up at the end
  float o[kDimTiles][4] = {};

  if (num_tiles > 0) load_tile(k_begin, 0);
  cp_async_commit();  // with the Q tile
  for (int32_t it = 0; it < num_tiles; ++it) {
    const int stage = it & 1;
    const int64_t tile_start = k_begin + static_cast<int64_t>(it) * kBlockN;
    if (it + 1 < num_tiles) load_tile(tile_start + kBlockN, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const T* k_tile = k_s + stage * kBlockN * kPitch;
    const T* v_tile = v_s + stage * kBlockN * kPitch;

    // ---- S = Q K^T for this warp's 16 rows and the tile's kBlockN keys
    float s[kKeyTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      const T* qa = q_s + (warp * 16 + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
      const uint32_t a[4] = {load_pair(qa), load_pair(qa + 8 * kPitch), load_pair(qa + 8),
                             load_pair(qa + 8 * kPitch + 8)};
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        const T* kb = k_tile + (8 * j + quad_row) * kPitch + kk * 16 + 2 * quad_lane;
        const uint32_t b[2] = {load_pair(kb), load_pair(kb + 8)};
        mma<T>(s[j], a, b);
      }
    }

    // ---- scale, bias, masks; row maxima over the quad
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int32_t n = 8 * j + 2 * quad_lane + (e % 2);
        const int64_t pos = tile_start + n;
        float x = -INFINITY;
        if (row_ok[r] && valid_s[stage * kBlockN + n] && (!p.causal || pos <= row_pos[r]) &&
            tree_sees(p, row_token[r], first_pos, pos)) {
          x = s[j][e] * qk_scale;
          if (p.position_bias != nullptr) x += position_bias_log2(p, row_head[r], row_pos[r] - pos);
        }
        s[j][e] = x;
        tile_max[r] = fmaxf(tile_max[r], x);
      }
    }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(m_run[r], tile_max[r]);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: every p is 0
      alpha[r] = exp2f(m_run[r] - m_use[r]);
      m_run[r] = m_new;
      l_run[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float prob = exp2f(s[j][e] - m_use[e / 2]);
        s[j][e] = prob;
        l_run[e / 2] += prob;
      }
    }
#pragma unroll
    for (int jd = 0; jd < kDimTiles; ++jd) {
      o[jd][0] *= alpha[0];
      o[jd][1] *= alpha[0];
      o[jd][2] *= alpha[1];
      o[jd][3] *= alpha[1];
    }

    // ---- O += P V: the S accumulators of key tiles 2kk and 2kk+1 are exactly the A fragment of
    // the k-slice kk (same rows, columns 2*quad_lane (+1) and 8 + 2*quad_lane (+1)).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack_floats<T>(s[2 * kk][0], s[2 * kk][1]), pack_floats<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack_floats<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_floats<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const T* vb = v_tile + (16 * kk + 2 * quad_lane) * kPitch + quad_row;
#pragma unroll
      for (int jd = 0; jd < kDimTiles; ++jd) {
        const T* vp = vb + 8 * jd;  // B[k][n] = V[key 16kk + k][dim 8jd + n]
        const uint32_t b[2] = {pack_pair(vp[0], vp[kPitch]), pack_pair(vp[8 * kPitch], vp[9 * kPitch])};
        mma<T>(o[jd], a, b);
      }
    }
    __syncthreads();  // the next iteration prefetches into the stage just read
  }
  cp_async_wait<0>();

  // ---- epilogue: complete the row sums over the quad, normalize or store the split's partial
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_ok[r]) continue;
    if (splits == 1) {
      const float inv_l = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
      T* out = static_cast<T*>(p.out) + row_token[r] * p.o_stride_token + row_head[r] * p.o_stride_head;
#pragma unroll
      for (int jd = 0; jd < kDimTiles; ++jd) {
        const int32_t d = 8 * jd + 2 * quad_lane;  // D % 8 == 0: d < D implies d + 1 < D
        if (d < p.head_dim) {
          out[d] = from_float<T>(o[jd][2 * r] * inv_l);
          out[d + 1] = from_float<T>(o[jd][2 * r + 1] * inv_l);
        }
      }
    } else {
      const SplitWorkspace ws = split_workspace(workspace, p, splits);
      const int64_t idx = split_index(p, row_token[r], row_head[r], splits, split);
#pragma unroll
      for (int jd = 0; jd < kDimTiles; ++jd) {
        const int32_t d = 8 * jd + 2 * quad_lane;
        if (d < p.head_dim) {
          ws.out[idx * p.head_dim + d] = o[jd][2 * r];
          ws.out[idx * p.head_dim + d + 1] = o[jd][2 * r + 1];
        }
      }
      if (quad_lane == 0) {
        ws.m[idx] = m_run[r];
        ws.l[idx] = l_run[r];
      }
    }
  }
}

}  // namespace mma_tiles
}  // namespace eecore::cuda::attention
