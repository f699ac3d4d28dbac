"""The CPU's arithmetic ceiling for the linear kernels: 512-bit integer dot instructions (vpdpbusd,
64 int8 multiply-adds each: linear_gguf_q8) and fp32 fused multiply-adds (16 each: the exact
kernels) per second, on one thread and on every thread at once, from independent chains that
nothing but the issue rate limits. Against it, a kernel's multiply-adds per second say how much of
its time goes to the other instructions it issues (docs/gguf.md: where linear_gguf_q8 stops).

Needs AVX512-VNNI and a C++ compiler (the loop is built here with torch's load_inline).

    python bench/ops_vector_peak.py [--threads 2] [--seconds 1]
"""
from __future__ import annotations

import argparse

from torch.utils.cpp_extension import load_inline

from common import cpu_model, save_results

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

// `iterations` rounds of 12 independent chains of `step` (latency 4-5 cycles, so 12 chains keep two
// pipes busy), chain i starting from seed(i) (distinct, or the compiler would compute one chain);
// returns the chains added up, so that nothing is optimised away.
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

template <typename V, typename Seed, typename Step, typename Add>
V chains(int64_t iterations, Seed seed, V operand, Step step, Add add) {
#define DECLARE(i) V a##i = seed(i);
  CHAINS(DECLARE)
  for (int64_t k = 0; k < iterations; ++k) {
#define STEP(i) a##i = step(a##i, operand);
    CHAINS(STEP)
    asm volatile("" : "+v"(operand));
  }
  V total = a0;
#define ADD(i) total = add(total, a##i);
  CHAINS(ADD)
  return total;
}

int64_t dpbusd_loop(int64_t iterations) {  // 64 int8 multiply-adds an instruction
  const __m512i total = chains(
      iterations, [](int i) { return _mm512_set1_epi32(i); }, _mm512_set1_epi8(3),
      [](__m512i a, __m512i u) { return _mm512_dpbusd_epi32(a, u, u); },
      [](__m512i a, __m512i b) { return _mm512_add_epi32(a, b); });
  return _mm512_reduce_add_epi32(total);
}

double fma_loop(int64_t iterations) {  // 16 fp32 multiply-adds an instruction
  const __m512 total = chains(
      iterations, [](int i) { return _mm512_set1_ps(i * 1e-3f); }, _mm512_set1_ps(0.5f),
      [](__m512 a, __m512 g) { return _mm512_fmadd_ps(a, g, g); },
      [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  return _mm512_reduce_add_ps(total);
}

// Instructions per second of loop `kind` (0: vpdpbusd, 1: fma) on `threads` threads at once.
double peak(int64_t kind, int64_t iterations, int64_t threads) {
  std::vector<std::thread> workers;
  std::vector<double> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < threads; ++t)
    workers.emplace_back([&, t] { sink[t] = kind == 0 ? dpbusd_loop(iterations) : fma_loop(iterations); });
  for (auto& w : workers) w.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 12.0 * iterations * threads / seconds + 0 * sink[0];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="about how long each measurement runs")
    args = ap.parse_args()
    module = load_inline("eecore_vector_peak", cpp_sources=SOURCE, functions=["peak"],
                         extra_cflags=["-O2", "-march=native"], verbose=False)
    print(f"CPU: {cpu_model()}")
    rows = []
    for kind, (name, macs) in enumerate((("vpdpbusd zmm", 64), ("vfmadd fp32 zmm", 16))):
        iterations = int(module.peak(kind, 1_000_000, 1) * args.seconds / 12)  # calibrated on one thread
        for threads in sorted({1, args.threads}):
            per_s = max(module.peak(kind, iterations, threads) for _ in range(3))
            print(f"{name:>16}, {threads} thread(s): {per_s / 1e9:5.2f} G/s, {per_s * macs / 1e9:6.1f} G multiply-adds/s")
            rows.append(dict(instruction=name, threads=threads, per_s=per_s, macs_per_s=per_s * macs))
    print(f"results: {save_results('vector-peak', dict(rows=rows))}")


if __name__ == "__main__":
    main()
