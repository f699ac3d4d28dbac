// How the CPU matrix-product kernels (linear, linear_gguf, linear_gguf_q8) split their output rows
// over threads.
#pragma once

#include <cstdint>

namespace eecore::cpu {

// The multiply-adds below which one thread does all the work: waking another costs more than it saves.
constexpr int64_t kMinMacsPerThread = 1 << 18;
// Grabs of output rows per thread, each taken when the thread frees up (threads run at different
// speeds): 4 measured as fast as 8 and faster than 2.
constexpr int64_t kGrabsPerThread = 4;

}  // namespace eecore::cpu
