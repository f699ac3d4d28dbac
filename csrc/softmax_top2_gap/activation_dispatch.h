// Dispatch over exactly the three activation dtypes (fp32, bf16, fp16), scalar_t bound to each.
//
// Unlike EECORE_DISPATCH_FLOAT (which also instantiates double, harmless for scalar code) this
// one suits kernels written against Float8, which loads only these three types.
#pragma once

#include <ATen/Dispatch.h>

#define EECORE_DISPATCH_ACTIVATION(TYPE, NAME, ...)              \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
