// EECORE_BATCH_INVARIANT=1: GPU kernels whose result for a row does not depend on how many other
// rows share the call, so a verify pass of d + 1 rows a sequence gives each row the bits a one-row
// decode step gives it, at any batch size, and self-speculation's greedy outputs are exactly full
// depth's (on the CPU every kernel is built that way already). What it changes, at some cost:
//   paged_attention  decode steps and verify passes of up to kBatchInvariantMaxQueryLen query rows
//                    take the tensor-core decode kernel, with context splits at fixed key positions
//                    (every kBatchInvariantSplitTokens keys, whatever the batch) and always through
//                    the split combine (a trailing empty split where the context fits in one);
//   linear           cuBLAS only (the few-row kernels are row-count invariant only up to 8 rows),
//                    on cuBLASLt with split-K turned off (eecore.device.apply_batch_invariance sets
//                    torch's switches: it refuses split-K off on the cuBLAS backend).
// Read on every call, like the other selectors: tests switch it within one process; LLM(batch_invariant=
// True) sets it for the process (eecore/switches.h).
#pragma once

#include "eecore/switches.h"

namespace eecore {

constexpr int kBatchInvariantSplitTokens = 512;
constexpr int kBatchInvariantMaxQueryLen = 16;

inline bool batch_invariant_enabled() { return switches::batch_invariant(); }

}  // namespace eecore
