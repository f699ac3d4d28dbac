// prefetch_l2 on the CPU: the checks only. A CPU's hardware prefetchers already follow the
// sequential weight streams of a projection, and there is no side stream to hide a fetch behind.
#include <torch/library.h>

#include "prefetch_l2/prefetch_l2_checks.h"

namespace eecore {
namespace {

void prefetch_l2_cpu(const at::Tensor& weight, int64_t max_bytes) { check_prefetch_l2_args(weight, max_bytes); }

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("prefetch_l2", &eecore::prefetch_l2_cpu); }
