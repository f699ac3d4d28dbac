// What the AMX linear kernels share (linear_amx_bf16.h, linear_amx_int8.h): whether this build and
// this process may use the tile engine, its configuration record, and the bf16 <-> fp32 lanes of
// their epilogues.
//
// Both kernels store a weight as 16-row tiles of 64 bytes, each tile 1 KiB of its own
// ([N/16, K/depth, 16, depth], depth 32 for bf16 and 64 for int8), so the weight streams in address
// order; both make the weight the tile product's A operand and the input rows its B operand, so each
// output is accumulated from its own weight row and input row only, and an input row's outputs keep
// their bits whatever the number of rows beside it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "common/cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define EECORE_CPU_AMX_TILE 1
#else
#define EECORE_CPU_AMX_TILE 0
#endif
#if EECORE_CPU_AMX_TILE && defined(__AMX_BF16__)
#define EECORE_CPU_AMX_BF16 1
#else
#define EECORE_CPU_AMX_BF16 0
#endif
#if EECORE_CPU_AMX_TILE && defined(__AMX_INT8__)
#define EECORE_CPU_AMX_INT8 1
#else
#define EECORE_CPU_AMX_INT8 0
#endif

namespace eecore::amx {

constexpr int64_t kTileRows = 16;   // output features per weight tile, and sums per C tile row
constexpr int64_t kTileBytes = 64;  // bytes of a tile row: 32 bf16 or 64 int8 input features
constexpr int64_t kChunkRows = 16;  // input rows per tile product (a B tile's 16 words a row)

#if EECORE_CPU_AMX_TILE
// Linux hands out the tile registers' state (8 KiB a thread) on request only.
inline bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

using cpu::load_bf16x16;

// 16 fp32 lanes rounded to bf16 as c10::BFloat16(float) rounds one: to nearest even on the bits,
// NaN to the canonical 0x7fc0 (vcvtneps2bf16 would treat denormal inputs as zero).
inline void store_bf16x16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_x16(const c10::BFloat16* p) { return load_bf16x16(p); }
inline void store_x16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_x16(c10::BFloat16* p, __m512 v) { store_bf16x16(p, v); }

// Gather offsets of one input row's 16 sums in a C tile stored [16 outputs][rows]: a column apart.
inline __m512i sum_columns(int64_t rows) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(rows)));
}
#else
inline bool tiles_granted() { return false; }
#endif

}  // namespace eecore::amx
