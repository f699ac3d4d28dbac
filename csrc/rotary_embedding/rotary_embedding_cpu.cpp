// rotary_embedding on the CPU: every (token, head) row of query and key is rotated in place by
// the shared eecore/rotary.h math, one parallel task per range of rows, fp32 arithmetic.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/cpu_vec.h"
#include "common/rotary_dispatch.h"
#include "eecore/rotary.h"
#include "rotary_embedding/rotary_embedding_checks.h"

namespace eecore {
namespace {

// A [T, H, D] operand seen as raw memory: rows at data + t * token_stride + h * head_stride.
template <typename scalar_t>
struct HeadRows {
  scalar_t* data;
  int64_t num_heads, token_stride, head_stride;

  static HeadRows of(at::Tensor& x) { return {x.data_ptr<scalar_t>(), x.size(1), x.stride(0), x.stride(1)}; }
  scalar_t* row(int64_t t, int64_t h) const { return data + t * token_stride + h * head_stride; }
};

// Rows per parallel task: ~16k pairs (like ATen's grain), so decode batches run inline: waking
// threads costs more than rotating a few hundred heads.
inline int64_t head_grain(int64_t half) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(half, 1)); }

// A NeoX head whose halves are whole vectors, 8 pairs at a time: the same fp32 rotation as
// rotary::rotate_head, which a compiler does not vectorize through bf16's conversions. At SmolLM2's
// batch-8 verify shapes (16-40 rows of 12 heads, 32 pairs) the scalar loop took ~3.5 ns a pair,
// 0.6-1.4 ms of a 16-27 ms pass.
template <typename scalar_t, typename cache_t>
inline void rotate_neox_head_vec(scalar_t* x, const cache_t* cos, const cache_t* sin, int64_t half) {
  using cpu::Vec8;
  for (int64_t i = 0; i < half; i += cpu::kVecWidth) {
    const Vec8 x1 = Vec8::load(x + i), x2 = Vec8::load(x + half + i);
    const Vec8 c = Vec8::load(cos + i), s = Vec8::load(sin + i);
    (x1 * c - x2 * s).store(x + i);
    (x2 * c + x1 * s).store(x + half + i);
  }
}

template <bool kNeox, typename scalar_t, typename cache_t>
void rotate_all_heads(const int64_t* positions, int64_t positions_stride, HeadRows<scalar_t> query,
                      HeadRows<scalar_t> key, const cache_t* cos_sin_cache, int64_t num_tokens, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  const int64_t heads_per_token = query.num_heads + key.num_heads;
  // Rows are numbered token-major, query heads before key heads, so one task touches few tokens
  // (one cos/sin row each) and walks memory forward.
  at::parallel_for(0, num_tokens * heads_per_token, head_grain(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads_per_token;
      const int64_t h = r % heads_per_token;
      const cache_t* cos = cos_sin_cache + positions[t * positions_stride] * rot_dim;
      scalar_t* x = h < query.num_heads ? query.row(t, h) : key.row(t, h - query.num_heads);
      if (kNeox && half % cpu::kVecWidth == 0)
        rotate_neox_head_vec(x, cos, cos + half, half);
      else
        rotary::rotate_head<kNeox>(x, x, cos, cos + half, static_cast<int>(half));
    }
  });
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  const RotaryShape shape = check_rotary_embedding_args(positions, query, key, cos_sin_cache);
  check_positions_in_range("rotary_embedding", positions, shape.max_pos);
  if (shape.num_tokens == 0) return;

  // The cache is fp32 or the activation dtype; both read as fp32.
  EECORE_DISPATCH_FLOAT(query.scalar_type(), "eecore::rotary_embedding", [&] {
    dispatch_rotary<scalar_t>(&cos_sin_cache, is_neox, [&](auto neox, const auto* cache) {
      rotate_all_heads<decltype(neox)::value>(positions.const_data_ptr<int64_t>(), positions.stride(0),
                                              HeadRows<scalar_t>::of(query), HeadRows<scalar_t>::of(key), cache,
                                              shape.num_tokens, shape.rot_dim);
    });
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("rotary_embedding", &eecore::rotary_embedding_cpu); }
