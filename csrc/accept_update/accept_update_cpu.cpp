// accept_update on the CPU: status |= (confidence > threshold) & active, and count what is left.
//
// A batch is a few hundred rows at most, so one thread does it in well under a microsecond;
// waking others would cost more. Acceptance is sticky (a confident row stays confident), and a
// NaN confidence is never above the threshold.
#include <torch/library.h>

#include "accept_update/accept_update_checks.h"

namespace eecore {
namespace {

at::Tensor accept_update_cpu(at::Tensor& status, const at::Tensor& confidence, const at::Tensor& threshold,
                             const at::Tensor& active) {
  check_accept_update_args(status, confidence, threshold, active);
  const int64_t rows = status.size(0);
  bool* done = status.data_ptr<bool>();
  const float* conf = confidence.const_data_ptr<float>();
  const float* thr = threshold.const_data_ptr<float>();
  const bool* live = active.const_data_ptr<bool>();
  const int64_t s_done = status.stride(0), s_conf = confidence.stride(0), s_live = active.stride(0);
  const int64_t s_thr = threshold.dim() == 0 ? 0 : threshold.stride(0);  // a scalar threshold: stride 0

  int32_t remaining = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bool& row_done = done[r * s_done];
    const bool row_live = live[r * s_live];
    row_done = row_done || (row_live && conf[r * s_conf] > thr[r * s_thr]);
    remaining += row_live && !row_done;
  }
  at::Tensor out = at::empty({}, confidence.options().dtype(at::kInt));
  *out.data_ptr<int32_t>() = remaining;
  return out;
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("accept_update", &eecore::accept_update_cpu); }
