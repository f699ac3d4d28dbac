// Argument checks shared by every op's CPU and CUDA glue.
//
// Every failure raises c10::Error (a RuntimeError in Python) whose message starts with the op
// and the argument name, then says what was expected and what arrived, e.g.
//   eecore::paged_attention: argument 'block_table' expected dtype int32, got Long
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>

namespace eecore {

#define EECORE_CHECK_ARG(op, arg, cond, ...) \
  TORCH_CHECK((cond), "eecore::", op, ": argument '", arg, "' ", __VA_ARGS__)

inline void check_defined(const char* op, const char* arg, const at::Tensor& t) {
  EECORE_CHECK_ARG(op, arg, t.defined(), "must be a tensor, got None");
}

inline void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  check_defined(op, arg, t);
  EECORE_CHECK_ARG(op, arg, t.dim() == dim, "expected ", dim, "-D tensor, got shape ", t.sizes());
}

inline void check_dtype(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  EECORE_CHECK_ARG(op, arg, t.scalar_type() == dtype, "expected dtype ", dtype, ", got ", t.scalar_type());
}

inline void check_dtype_in(const char* op, const char* arg, const at::Tensor& t,
                           std::initializer_list<at::ScalarType> allowed) {
  for (auto d : allowed)
    if (t.scalar_type() == d) return;
  std::string names;
  for (auto d : allowed) names += std::string(names.empty() ? "" : " or ") + c10::toString(d);
  EECORE_CHECK_ARG(op, arg, false, "expected dtype ", names, ", got ", t.scalar_type());
}

// fp32, bf16 or fp16: the activation dtypes every op accepts.
inline void check_float_dtype(const char* op, const char* arg, const at::Tensor& t) {
  check_dtype_in(op, arg, t, {at::kFloat, at::kBFloat16, at::kHalf});
}

// int32 or int64, for index tensors where both are natural.
inline void check_index_dtype(const char* op, const char* arg, const at::Tensor& t) {
  check_dtype_in(op, arg, t, {at::kInt, at::kLong});
}

inline void check_same_dtype(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                             const at::Tensor& ref) {
  EECORE_CHECK_ARG(op, arg, t.scalar_type() == ref.scalar_type(), "expected the dtype of '", ref_arg, "' (",
                   ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_size(const char* op, const char* arg, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  EECORE_CHECK_ARG(op, arg, t.size(dim) == expected, "expected size ", expected, " (", what, ") at dim ", dim,
                   ", got shape ", t.sizes());
}

inline void check_contiguous(const char* op, const char* arg, const at::Tensor& t) {
  EECORE_CHECK_ARG(op, arg, t.is_contiguous(), "must be contiguous, got strides ", t.strides());
}

inline void check_last_dim_contiguous(const char* op, const char* arg, const at::Tensor& t) {
  EECORE_CHECK_ARG(op, arg, t.stride(-1) == 1, "must have unit stride in its last dim, got strides ", t.strides());
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                              const at::Tensor& ref) {
  EECORE_CHECK_ARG(op, arg, t.device() == ref.device(), "expected the device of '", ref_arg, "' (", ref.device(),
                   "), got ", t.device());
}

// `t` with the shape, dtype and device of `ref`: an output, or an operand that mirrors another
// (a residual, the value cache); its strides are the caller's to check.
inline void check_like(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                       const at::Tensor& ref) {
  check_defined(op, arg, t);
  EECORE_CHECK_ARG(op, arg, t.sizes() == ref.sizes(), "expected the shape of '", ref_arg, "' ", ref.sizes(),
                   ", got ", t.sizes());
  check_same_dtype(op, arg, t, ref_arg, ref);
  check_same_device(op, arg, t, ref_arg, ref);
}

}  // namespace eecore

// Dispatch over exactly the three activation dtypes, fp32 / bf16 / fp16 (what
// check_float_dtype accepts), with the element type bound to scalar_t. Not double: no op takes
// it, and the CPU vector kernels (common/cpu_vec.h) load and store only these three.
#define EECORE_DISPATCH_FLOAT(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// int32 / int64 dispatch with the index type bound to index_t.
#define EECORE_DISPATCH_INDEX(TYPE, NAME, ...)                                                   \
  [&] {                                                                                         \
    if ((TYPE) == at::kInt) {                                                                   \
      using index_t = int32_t;                                                                  \
      return __VA_ARGS__();                                                                     \
    }                                                                                           \
    TORCH_CHECK((TYPE) == at::kLong, NAME, ": expected an int32 or int64 index, got ", (TYPE)); \
    using index_t = int64_t;                                                                    \
    return __VA_ARGS__();                                                                       \
  }()
