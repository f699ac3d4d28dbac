// Activation functions as eecore's kernels evaluate them, shared so that fused kernels keep the
// bits of the ops they replace.
#pragma once

namespace eecore::cuda {

// g / (1 + e^-g) with the accurate expf (no fast math), the expression ATen's silu evaluates.
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

}  // namespace eecore::cuda
