// Device basics shared by every eecore CUDA kernel: element conversions, 2-16 byte vector
// loads/stores, dtype dispatch for launchers, and launch-shape arithmetic. Torch-free.
//
// torch builds extensions with -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
// (and the *_OPERATORS__ variants), so __half / __nv_bfloat16 have no implicit conversions or
// arithmetic here: always go through to_float / from_float (__half2float, __float2bfloat16_rn, ...).
// The CMake kernel build sets the same macros so it catches any code that relies on them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "eecore/dtype.h"

namespace eecore::cuda {

constexpr int kWarpSize = 32;

// ---- element conversions (all arithmetic runs in fp32) -------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---- vectors of N elements moved with one 2/4/8/16-byte memory instruction ------------------

template <int BYTES>
struct RawWord;
template <>
struct RawWord<2> { using type = uint16_t; };
template <>
struct RawWord<4> { using type = uint32_t; };
template <>
struct RawWord<8> { using type = uint2; };
template <>
struct RawWord<16> { using type = uint4; };

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  static_assert((sizeof(T) * N & (sizeof(T) * N - 1)) == 0 && sizeof(T) * N <= 16, "2..16 bytes, a power of two");
  T v[N];
};

// Elements per 16-byte vector, the widest single load.
template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// `src` must be aligned to sizeof(T) * N bytes; for N == 1 that is just T's alignment.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* src) {
  using W = typename RawWord<sizeof(T) * N>::type;
  Vec<T, N> out;
  *reinterpret_cast<W*>(&out) = *reinterpret_cast<const W*>(src);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const Vec<T, N>& val) {
  using W = typename RawWord<sizeof(T) * N>::type;
  *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(&val);
}

template <typename T, int N>
__device__ __forceinline__ void vec_to_float(const Vec<T, N>& in, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(in.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> vec_from_float(const float (&in)[N]) {
  Vec<T, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out.v[i] = from_float<T>(in[i]);
  return out;
}

// ---- host side: dtype dispatch, alignment, launch shapes -------------------------------------

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the CUDA element type of `dtype`; returns what f returns.
template <typename F>
inline auto dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
    case DType::kFloat16:
      return f(TypeTag<__half>{});
    case DType::kFloat32:
    default:
      return f(TypeTag<float>{});
  }
}

inline bool is_aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// True when every pointer and every element stride (of elements of `elem_bytes`) keeps 16-byte
// alignment, i.e. rows starting at any of these offsets can be read with 16-byte vectors.
inline bool rows_aligned16(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> strides,
                           int64_t elem_bytes) {
  for (const void* p : ptrs)
    if (p != nullptr && !is_aligned(p, 16)) return false;
  for (int64_t s : strides)
    if ((s * elem_bytes) % 16 != 0) return false;
  return true;
}

// For a kernel that walks whole rows: calls f(TypeTag<T>{}, std::integral_constant<int, V>{}) with T
// the element type of `dtype` and V its 16-byte vector width where every pointer and row stride
// keeps 16-byte alignment (rows_aligned16), else 1 (a tail loop then covers any row length).
template <typename F>
inline cudaError_t dispatch_row_vectors(DType dtype, std::initializer_list<const void*> ptrs,
                                        std::initializer_list<int64_t> strides, F&& f) {
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if (rows_aligned16(ptrs, strides, sizeof(T))) return f(tag, std::integral_constant<int, kVec16<T>>{});
    return f(tag, std::integral_constant<int, 1>{});
  });
}

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Threads of a block that walks one row of `num_vecs` vectors: one a vector up to 1024, in whole
// warps (rms_norm, silu_and_mul).
inline int threads_for_row(int64_t num_vecs) {
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(kWarpSize, round_up(num_vecs, kWarpSize))));
}

// Streaming multiprocessors of the current device, cached per device (an attribute query, not a
// synchronization). Launchers size split-K grids with it.
inline int num_sms_of_current_device() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device >= 0 && device < kMaxDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 1;
  if (device >= 0 && device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Raise this kernel's dynamic shared memory limit when it needs more than the default 48 KiB.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace eecore::cuda
