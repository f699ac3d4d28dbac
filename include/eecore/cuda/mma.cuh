// Tensor-core matrix multiply-accumulate through mma.sync.m16n8k16 (sm_80+), bf16/fp16 inputs and
// fp32 accumulators, with the register layouts spelled out so callers can build fragments from
// shared memory with plain 32-bit loads and do softmax on the accumulators in place.
//
// Per warp, lane = 4 * group + tig (group = lane / 4 in 0..7, tig = lane % 4 in 0..3):
//   A (16x16, row-major)  a[0] = A[group   ][2tig, 2tig+1]     a[1] = A[group+8][2tig, 2tig+1]
//                         a[2] = A[group   ][2tig+8, 2tig+9]   a[3] = A[group+8][2tig+8, 2tig+9]
//   B (16x8, "col")       b[0] = B[2tig, 2tig+1][group]        b[1] = B[2tig+8, 2tig+9][group]
//   C/D (16x8, fp32)      c[0], c[1] = C[group][2tig, 2tig+1]  c[2], c[3] = C[group+8][2tig, 2tig+1]
// Each 32-bit register holds two elements, the lower column (or, for B, the lower row) in the
// low half. B[k][n] = K[n][k] for S = Q K^T, so b[0] is a 32-bit load from row n of K.
#pragma once

#include "eecore/cuda/common.cuh"

namespace eecore::cuda {

template <typename T>
struct MmaType;
template <>
struct MmaType<__half> {
  using pair = __half2;
};
template <>
struct MmaType<__nv_bfloat16> {
  using pair = __nv_bfloat162;
};

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                          __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a * b with the element type picked by T.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma_16816(c, a, b, T{});
}

// Two adjacent elements (lower index in the low half) as one 32-bit register.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  const uint16_t l = *reinterpret_cast<const uint16_t*>(&lo);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(&hi);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

template <typename T>
__device__ __forceinline__ uint32_t pack_floats(float lo, float hi) {
  return pack_pair<T>(from_float<T>(lo), from_float<T>(hi));
}

// Four 8x8 matrices of 16-bit elements from shared memory in one instruction. Lanes 8i..8i+7 give
// the addresses of matrix i's rows 0..7 (16 bytes each, 16-byte aligned); lane 4g + t receives in
// r[i] matrix i's row g, columns 2t and 2t+1: a row-major tile's A fragment, or a B fragment read
// from rows that hold B's columns (K's rows for S = Q K^T).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The same, each matrix transposed: lane 4g + t receives matrix i's rows 2t and 2t+1 of column g,
// the B fragment of a row-major [k][n] tile (V's rows for O += P V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

}  // namespace eecore::cuda
