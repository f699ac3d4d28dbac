// Rotary position embedding (RoPE) of one attention head: the math every eecore op that rotates
// shares (rotary_embedding, and the K side of kv_fill), on the CPU today and in CUDA kernels later.
//
// Torch-free on purpose: it includes only eecore/macros.h, so a .cu file compiles it in seconds.
// Functions are marked EECORE_HOST_DEVICE, which becomes `__host__ __device__` under nvcc.
//
// Layouts (vLLM's): a head of D dims rotates its first rot_dim dims (rot_dim even, <= D; the rest
// passes through), as rot_dim / 2 pairs. Pair i is rotated by the angle whose cosine and sine are
// cos[i] and sin[i], read from one row of a cos_sin_cache [max_pos, rot_dim] = cat(cos, sin).
//   NeoX / Llama (is_neox):  pair i = (x[i], x[i + rot_dim / 2])   the two halves
//   GPT-J (!is_neox):        pair i = (x[2 i], x[2 i + 1])          interleaved neighbours
#pragma once

#include "eecore/macros.h"

namespace eecore {
namespace rotary {

// Where the two elements of pair `i` live in a head whose rotated part has `half` pairs.
template <bool kNeox>
EECORE_HOST_DEVICE inline int first_of_pair(int i, int half) {
  (void)half;
  return kNeox ? i : 2 * i;
}
template <bool kNeox>
EECORE_HOST_DEVICE inline int second_of_pair(int i, int half) {
  return kNeox ? i + half : 2 * i + 1;
}

// The rotation itself, in fp32: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
EECORE_HOST_DEVICE inline void rotate_pair(float& x1, float& x2, float cos, float sin) {
  const float r1 = x1 * cos - x2 * sin;
  const float r2 = x2 * cos + x1 * sin;
  x1 = r1;
  x2 = r2;
}

// Rotates the first 2 * half dims of one head: out[...] = rotate(in[...]). `out` may alias `in`
// (in-place rotation): every pair is read before it is written, and pairs are disjoint. Dims past
// 2 * half are neither read nor written. cos and sin point at `half` values each.
//
// Element types convert with static_cast to and from float, which covers float and torch's
// c10::Half / c10::BFloat16 on the host. Device code with __half / __nv_bfloat16 (whose implicit
// conversions torch disables) uses rotate_pair and the pair indices above with its own loads.
template <bool kNeox, typename out_t, typename in_t, typename cs_t>
EECORE_HOST_DEVICE inline void rotate_head(out_t* out, const in_t* in, const cs_t* cos, const cs_t* sin,
                                           int half) {
  EECORE_OMP_SIMD
  for (int i = 0; i < half; ++i) {
    const int i1 = first_of_pair<kNeox>(i, half);
    const int i2 = second_of_pair<kNeox>(i, half);
    float x1 = static_cast<float>(in[i1]);
    float x2 = static_cast<float>(in[i2]);
    rotate_pair(x1, x2, static_cast<float>(cos[i]), static_cast<float>(sin[i]));
    out[i1] = static_cast<out_t>(x1);
    out[i2] = static_cast<out_t>(x2);
  }
}

}  // namespace rotary
}  // namespace eecore
