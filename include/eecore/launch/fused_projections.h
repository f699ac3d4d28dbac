// CUDA launchers of the fused projections (csrc/fused_projections/fused_projections_kernels.cu):
// a decoder layer's four projections for a few rows, each with the elementwise work around it in
// the same launch. Torch-free.
//
// A decode step's layer is nine launches op by op (input norm, QKV, RoPE and cache write,
// attention, output projection, residual add and post norm, gate/up, activation, down), and on a
// GPU each costs ~2-4 us of mostly fixed time at 1-8 rows. With these it is five: the norm runs in
// the prologue of the projection that reads it (each block normalizes the few input rows itself,
// into shared memory), RoPE and the cache write, the activation and the residual add in the
// epilogue of the projection that produces their inputs. Every kernel writes what the ops it
// replaces write (the normed rows and the projection's output included) with the same bits as
// those ops over linear's gemv_mma kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/launch/linear_gemv.h"
#include "eecore/launch/reshape_and_cache.h"
#include "eecore/launch/rotary_embedding.h"

namespace eecore::cuda {

// rms_norm(input) into `normed`, the prologue of qkv_projection and gate_up_projection.
struct FusedNormParams {
  const void* weight;      // [in_features]
  float eps;
  void* normed;            // [rows, in_features], row stride normed_stride: written by block 0
  int64_t normed_stride;
};

// normed = rms_norm(hidden); qkv = normed weight^T (+ bias); then RoPE (NeoX halves over the whole
// head) on its query and key heads and the keys and values into their cache slots, as
// rotary_embedding_and_cache does. linear.input is hidden and linear.out is qkv
// [rows, (Hq + 2 Hkv) D]; rot.query/key and cache.key/value are qkv's views.
struct QkvProjectionParams {
  LinearGemvParams linear;
  FusedNormParams norm;
  RotaryEmbeddingParams rot;
  ReshapeAndCacheParams cache;
};

// normed = rms_norm(hidden); gate_up = normed weight^T; act = silu(gate) * up, as silu_and_mul
// computes it over the rounded gate_up. linear.out is gate_up [rows, 2 I].
struct GateUpProjectionParams {
  LinearGemvParams linear;
  FusedNormParams norm;
  void* act;               // [rows, I], row stride act_stride
  int64_t act_stride;
};

// out = input weight^T (+ bias); residual += out, rounded as the separate add rounds it (the
// attention output projection followed by the residual add). linear.accumulate must be false.
struct LinearResidualParams {
  LinearGemvParams linear;
  void* residual;          // [rows, out_features], row stride residual_stride
  int64_t residual_stride;
};

// Whether each kernel takes p: linear_gemv_mma_supported(p.linear), the norm's rows fitting the
// block's shared memory, and for qkv_projection whole-head NeoX RoPE with 16-byte cache rows.
bool qkv_projection_supported(const QkvProjectionParams& p);
bool gate_up_projection_supported(const GateUpProjectionParams& p);
bool linear_residual_supported(const LinearResidualParams& p);

cudaError_t launch_qkv_projection(const QkvProjectionParams& p, cudaStream_t stream);
cudaError_t launch_gate_up_projection(const GateUpProjectionParams& p, cudaStream_t stream);
cudaError_t launch_linear_residual(const LinearResidualParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
