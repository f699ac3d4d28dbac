// The few macros that let one piece of eecore code compile as host C++ and under nvcc.
//
// Torch-free and dependency-free on purpose: the headers that include it (eecore/rotary.h, the
// CPU kernels, later the CUDA kernels) must stay cheap to compile in a .cu file.
#pragma once

// A function callable from host code and, under nvcc / hipcc, from device code too.
#ifndef EECORE_HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define EECORE_HOST_DEVICE __host__ __device__
#else
#define EECORE_HOST_DEVICE
#endif
#endif

// `#pragma omp simd` on a host loop of shared host/device code; nvcc would only warn about it,
// so it expands to nothing there. Host-only files write the pragma directly.
#ifndef EECORE_OMP_SIMD
#if defined(__CUDACC__) || defined(__HIPCC__)
#define EECORE_OMP_SIMD
#else
#define EECORE_OMP_SIMD _Pragma("omp simd")
#endif
#endif
