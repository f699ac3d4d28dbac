// CUDA launcher of linear's few-row kernel (csrc/linear/linear_kernels.cu). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "eecore/dtype.h"

namespace eecore::cuda {

// Up to this many input rows take the few-row kernel: a decode step's and a small verify pass's.
constexpr int64_t kLinearGemvMaxRows = 8;

struct LinearGemvParams {
  void* out;                 // [rows, out_features], row stride out_stride, unit stride along N
  const void* input;         // [rows, in_features], row stride input_stride, unit stride along K
  const void* weight;        // [out_features, in_features], contiguous
  const void* bias;          // [out_features] or null
  int64_t rows, in_features, out_features;
  int64_t input_stride, out_stride;  // elements
  bool accumulate;           // out += input weight^T (+ bias), as out.addmm_ then out.add_(bias)
  DType dtype;               // of every tensor
};

// Whether p fits the kernel: 1..kLinearGemvMaxRows rows, and weight and input rows that can be
// read in 16-byte vectors.
bool linear_gemv_supported(const LinearGemvParams& p);

// out = input weight^T (+ bias), or out += ..., with one warp per output feature streaming its
// weight row once for every input row; each row's sum is taken in the same order whatever the
// number of rows, so a row's result does not depend on the rows beside it.
cudaError_t launch_linear_gemv(const LinearGemvParams& p, cudaStream_t stream);

// Whether p fits the tensor-core few-row kernel: linear_gemv_supported, bf16 or fp16, and
// in_features a multiple of 32.
bool linear_gemv_mma_supported(const LinearGemvParams& p);

// The same product on tensor cores: mma.m16n8k16 over 16 output features and the input rows
// zero-padded to 8, a block's 8 warps splitting the row length; one input load a lane for every
// two weight loads at any row count. A row's result does not depend on the rows beside it.
cudaError_t launch_linear_gemv_mma(const LinearGemvParams& p, cudaStream_t stream);

}  // namespace eecore::cuda
