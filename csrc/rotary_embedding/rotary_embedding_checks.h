// Argument checks of rotary_embedding, shared by the CPU and CUDA glue; kv_fill reuses the
// cos_sin_cache check. Nothing here reads tensor data, except check_positions_in_range, which the
// CPU kernels call (CUDA kernels guard positions on the device instead).
#pragma once

#include <utility>

#include "common/checks.h"

namespace eecore {

// cos_sin_cache [max_pos, rot_dim] = cat(cos, sin), contiguous, fp32 or the activation dtype;
// rot_dim even and at most the head dim. Returns rot_dim.
inline int64_t check_cos_sin_cache(const char* op, const at::Tensor& cache, int64_t head_dim,
                                   const char* act_arg, const at::Tensor& act) {
  const char* arg = "cos_sin_cache";
  check_dim(op, arg, cache, 2);
  const int64_t rot_dim = cache.size(1);
  EECORE_CHECK_ARG(op, arg, rot_dim > 0 && rot_dim % 2 == 0,
                   "expected an even, positive rot_dim (its last dim, cat(cos, sin)), got shape ", cache.sizes());
  EECORE_CHECK_ARG(op, arg, rot_dim <= head_dim, "expected rot_dim (its last dim) <= the head dim ", head_dim,
                   ", got shape ", cache.sizes());
  EECORE_CHECK_ARG(op, arg, cache.scalar_type() == at::kFloat || cache.scalar_type() == act.scalar_type(),
                   "expected dtype Float or the dtype of '", act_arg, "' (", act.scalar_type(), "), got ",
                   cache.scalar_type());
  check_contiguous(op, arg, cache);
  check_same_device(op, arg, cache, act_arg, act);
  return rot_dim;
}

// positions int64 [T].
inline void check_positions(const char* op, const at::Tensor& positions, int64_t num_tokens, const char* ref_arg,
                            const at::Tensor& ref) {
  check_dim(op, "positions", positions, 1);
  check_dtype(op, "positions", positions, at::kLong);
  check_size(op, "positions", positions, 0, num_tokens, "the number of tokens T");
  check_same_device(op, "positions", positions, ref_arg, ref);
}

// Reads the data (host memory only): every position indexes a row of the cos/sin cache.
inline void check_positions_in_range(const char* op, const at::Tensor& positions, int64_t max_pos) {
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t stride = positions.stride(0);
  for (int64_t t = 0; t < positions.size(0); ++t) {
    const int64_t p = pos[t * stride];
    EECORE_CHECK_ARG(op, "positions", p >= 0 && p < max_pos, "expected values in [0, ", max_pos,
                     ") (the rows of 'cos_sin_cache'), got ", p, " at token ", t);
  }
}

// True when the D-long rows of a [T, H, D] tensor with unit stride in D never share memory,
// whatever the strides of T and H (a permuted [H, T, D] buffer is fine, a stride of 0 is not).
// Sufficient, like torch's own overlap test: with the stepping dims sorted by stride, each must
// step past the span of everything inside it.
inline bool rows_do_not_overlap(const at::Tensor& x) {
  std::pair<int64_t, int64_t> steps[2];  // (stride, size) of the dims that step, innermost first
  int n = 0;
  for (int64_t dim : {0, 1})
    if (x.size(dim) > 1) steps[n++] = {x.stride(dim), x.size(dim)};
  if (n == 2 && steps[1].first < steps[0].first) std::swap(steps[0], steps[1]);
  int64_t span = x.size(2);  // elements covered by one row
  for (int i = 0; i < n; ++i) {
    if (steps[i].first < span) return false;
    span = steps[i].first * (steps[i].second - 1) + span;
  }
  return true;
}

// A [T, H, D] head tensor that is rotated in place: float dtype, unit stride in D, any strides in
// T and H (views into a fused qkv buffer are fine) as long as no two rows share memory.
inline void check_rotary_operand(const char* op, const char* arg, const at::Tensor& x) {
  check_dim(op, arg, x, 3);
  check_float_dtype(op, arg, x);
  check_last_dim_contiguous(op, arg, x);
  EECORE_CHECK_ARG(op, arg, rows_do_not_overlap(x),
                   "must not have overlapping heads or tokens, got shape ", x.sizes(), " and strides ",
                   x.strides());
}

struct RotaryShape {
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, rot_dim, max_pos;
};

inline RotaryShape check_rotary_embedding_args(const at::Tensor& positions, const at::Tensor& query,
                                               const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                               const char* op = "rotary_embedding") {
  check_rotary_operand(op, "query", query);
  check_rotary_operand(op, "key", key);
  check_same_dtype(op, "key", key, "query", query);
  check_same_device(op, "key", key, "query", query);
  check_size(op, "key", key, 0, query.size(0), "the number of tokens T of 'query'");
  check_size(op, "key", key, 2, query.size(2), "the head dim D of 'query'");
  check_positions(op, positions, query.size(0), "query", query);
  const int64_t rot_dim = check_cos_sin_cache(op, cos_sin_cache, query.size(2), "query", query);
  return {query.size(0), query.size(1), key.size(1), query.size(2), rot_dim, cos_sin_cache.size(0)};
}

}  // namespace eecore
