// The element types eecore's kernels know, without torch: the glue maps at::ScalarType onto this,
// and every CUDA launcher dispatches on it. Host and device code may include this header.
#pragma once

#include <cstdint>

namespace eecore {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

inline constexpr int64_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

inline constexpr const char* dtype_name(DType t) {
  return t == DType::kFloat32 ? "float32" : (t == DType::kBFloat16 ? "bfloat16" : "float16");
}

}  // namespace eecore
