// Every environment variable the C++ code reads, in one place; python/eecore/envs.py documents
// each of them beside the Python ones (docs/configuration.md prints that table).
//
// They are the kernel selectors benchmarks and tests flip within one process, so each is read at
// every call (a getenv is cheap next to a launch). An unknown value means the default here: the
// Python side checks every set EECORE_* value when an engine is built (eecore.envs.check_all), so a
// typo fails there with the variable's name instead of silently selecting the default.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace eecore::switches {

constexpr const char* kBatchInvariant = "EECORE_BATCH_INVARIANT";
constexpr const char* kPagedAttentionKernel = "EECORE_PAGED_ATTENTION_KERNEL";
constexpr const char* kDecodeMinSplitTokens = "EECORE_DECODE_MIN_SPLIT_TOKENS";
constexpr const char* kDecodeMmaStages = "EECORE_DECODE_MMA_STAGES";
constexpr const char* kDecodeMmaLdmatrix = "EECORE_DECODE_MMA_LDMATRIX";
constexpr const char* kDecodeMmaV2Flags = "EECORE_DECODE_MMA_V2_FLAGS";
constexpr const char* kLinearKernel = "EECORE_LINEAR_KERNEL";
constexpr const char* kSiluAndMulKernel = "EECORE_SILU_AND_MUL_KERNEL";
constexpr const char* kRotaryAndCacheKernel = "EECORE_ROTARY_AND_CACHE_KERNEL";
constexpr const char* kPdl = "EECORE_PDL";

// The variable's value, or nullptr where it is unset or empty.
inline const char* value(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// Whether the variable is set to `expected`.
inline bool is(const char* name, const char* expected) {
  const char* v = value(name);
  return v != nullptr && std::strcmp(v, expected) == 0;
}

// The variable as an integer in [lo, hi], else `fallback` (unset, not a number, or out of range).
inline long integer(const char* name, long fallback, long lo, long hi) {
  const char* v = value(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && n >= lo && n <= hi ? n : fallback;
}

// Batch invariance, which LLM(batch_invariant=True) sets for the whole process (eecore._C.
// set_batch_invariant: cuBLAS's own switch that it needs is process-wide too); -1 defers to the
// environment.
inline std::atomic<int>& batch_invariant_override() {
  static std::atomic<int> override_value{-1};
  return override_value;
}

inline bool batch_invariant() {
  const int forced = batch_invariant_override().load(std::memory_order_relaxed);
  return forced >= 0 ? forced == 1 : is(kBatchInvariant, "1");
}

}  // namespace eecore::switches
