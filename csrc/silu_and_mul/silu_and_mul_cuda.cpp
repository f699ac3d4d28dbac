// silu_and_mul on CUDA: the one-launch kernel (silu_and_mul_kernels.cu), or with
// EECORE_SILU_AND_MUL_KERNEL=aten, ATen's silu and multiply on the two halves in fp32, rounded
// once: four launches (a widening copy, silu, multiply, a narrowing copy) that cost SmolLM2 18% of
// a decode step's GPU time on an H200. Both give the CPU kernel's bits. The fused kernel made
// whole decode steps 1.08-1.32x faster on an H200 with fused RoPE and cache write (bench/results/
// nvidia-h200/nvidia-h200-2026-11-27-row-kernels.md); ATen's path stays as the reference.
#include <ATen/ATen.h>
#include <torch/library.h>


#include "common/cuda_glue.h"
#include "eecore/switches.h"
#include "eecore/launch/silu_and_mul.h"
#include "silu_and_mul/silu_and_mul_checks.h"

namespace eecore {
namespace {

// Read on every call, as EECORE_PAGED_ATTENTION_KERNEL is: tests switch it within one process.
bool aten_selected() { return switches::is(switches::kSiluAndMulKernel, "aten"); }

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  const int64_t rows = check_silu_and_mul_args(out, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t d = out.size(-1);
  if (aten_selected()) {
    const at::Tensor x = input.to(at::kFloat);
    out.copy_(at::silu(x.narrow(-1, 0, d)).mul_(x.narrow(-1, d, d)));
    return;
  }
  checked_int32("silu_and_mul", "input", rows, "rows");
  cuda::SiluAndMulParams p{};
  p.out = out.data_ptr();
  p.input = input.const_data_ptr();
  p.rows = rows;
  p.d = d;
  p.dtype = to_dtype(input.scalar_type());
  check_launch("silu_and_mul", cuda::launch_silu_and_mul(p, current_stream(input.device())));
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CUDA, m) { m.impl("silu_and_mul", &eecore::silu_and_mul_cuda); }
