// kv_fill on the CPU: fill the K/V cache of the layers a token skipped, from its exit hidden state.
//
//   1. normalise the hidden rows of the tokens that write anything (fp32 math, no gain: each
//      layer's gain is folded into its weight rows),
//   2. ONE GEMM against the stacked [K; V] projections of every layer from the lowest start layer
//      up: [T', d] x [L' * 2 * Hkv * D, d]^T,
//   3. ONE fused parallel epilogue over (token, layer): bias, RoPE on K (eecore/rotary.h), and the
//      scatter into the token's slot of every layer >= its start layer.
//
// Tokens are independent and so are layers, so the epilogue needs no synchronisation: each
// (token, layer) task owns one slot of one layer (slots are distinct per token by contract).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "eecore/rotary.h"
#include "kv_fill/kv_fill_checks.h"

namespace eecore {
namespace {

constexpr const char* kOp = "kv_fill";

// The tokens that write at least one layer, and the lowest layer any of them writes. Reads and
// range-checks the index tensors, so an invalid call raises before anything is written.
struct FillPlan {
  std::vector<int64_t> tokens;  // rows of `hidden` that take part, ascending
  int64_t first_layer = 0;
};

FillPlan plan_fill(const KvFillShape& s, const at::Tensor& positions, const at::Tensor& slot_mapping,
                   const at::Tensor& start_layer) {
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int32_t* starts = start_layer.const_data_ptr<int32_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0), start_stride = start_layer.stride(0),
                pos_stride = positions.stride(0);
  FillPlan plan;
  plan.first_layer = s.num_layers;
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    const int64_t start = starts[t * start_stride];
    EECORE_CHECK_ARG(kOp, "slot_mapping", slot < s.num_slots(), "expected slots < ", s.num_slots(),
                     " (num_blocks * block_size of 'kv_cache') or negative to skip, got ", slot, " at token ", t);
    EECORE_CHECK_ARG(kOp, "start_layer", start >= 0, "expected values >= 0, got ", start, " at token ", t);
    if (s.rot_dim > 0) {
      const int64_t p = pos[t * pos_stride];
      EECORE_CHECK_ARG(kOp, "positions", p >= 0 && p < s.max_pos, "expected values in [0, ", s.max_pos,
                       ") (the rows of 'cos_sin_cache'), got ", p, " at token ", t);
    }
    if (slot < 0 || start >= s.num_layers) continue;
    plan.tokens.push_back(t);
    plan.first_layer = std::min(plan.first_layer, start);
  }
  return plan;
}

// normed[i] = hidden[tokens[i]] * rsqrt(mean(hidden^2) + eps), rounded to the activation dtype
// (the GEMM's input dtype).
template <typename scalar_t>
void normalise_rows(scalar_t* normed, const scalar_t* hidden, int64_t row_stride, const std::vector<int64_t>& tokens,
                    int64_t d, float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / d);
  at::parallel_for(0, static_cast<int64_t>(tokens.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* x = hidden + tokens[i] * row_stride;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t j = 0; j < d; ++j) {
        const float v = static_cast<float>(x[j]);
        sum_sq += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
      scalar_t* out = normed + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) out[j] = static_cast<scalar_t>(static_cast<float>(x[j]) * inv_rms);
    }
  });
}

// out = src + bias (bias may be null), in fp32.
template <typename scalar_t>
inline void add_bias(float* out, const scalar_t* src, const scalar_t* bias, int64_t n) {
  if (bias == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]) + static_cast<float>(bias[i]);
  }
}

template <typename scalar_t>
inline void store_row(scalar_t* dst, const float* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

// Everything the epilogue reads, as raw pointers.
template <typename scalar_t, typename cache_t>
struct Epilogue {
  scalar_t* kv_cache;             // [L, 2, NB * BS, Hkv * D]
  const scalar_t* projected;      // [T', (L - first_layer) * 2 * Hkv * D], the GEMM result
  const scalar_t* bias;           // [L, 2 * Hkv * D] or null
  const cache_t* cos_sin_cache;   // [max_pos, rot_dim] or null
  const int64_t* positions;
  const int64_t* slots;
  const int32_t* starts;
  int64_t positions_stride, slots_stride, starts_stride;
};

template <bool kNeox, typename scalar_t, typename cache_t>
void scatter_layers(const Epilogue<scalar_t, cache_t>& e, const KvFillShape& s, const FillPlan& plan) {
  const int64_t kv_width = s.kv_width();
  const int64_t row_width = 2 * kv_width;  // one layer's [K; V] in a projected row
  const int64_t num_layers = s.num_layers - plan.first_layer;
  const int64_t projected_stride = num_layers * row_width;
  const int64_t layer_stride = 2 * s.num_slots() * kv_width;  // kv_cache[l] -> kv_cache[l + 1]
  const int64_t v_offset = s.num_slots() * kv_width;          // kv_cache[l, 0] -> kv_cache[l, 1]
  const int64_t half = s.rot_dim / 2;
  const int64_t num_tasks = static_cast<int64_t>(plan.tokens.size()) * num_layers;
  const int64_t grain = std::max<int64_t>(1, 8192 / row_width);

  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(kv_width);  // one of K or V of one layer, biased, in fp32
    for (int64_t task = begin; task < end; ++task) {
      // Token-major, so a task range walks each token's projected row forward.
      const int64_t i = task / num_layers;
      const int64_t layer = plan.first_layer + task % num_layers;
      const int64_t t = plan.tokens[i];
      if (layer < e.starts[t * e.starts_stride]) continue;
      const int64_t slot = e.slots[t * e.slots_stride];

      const scalar_t* k_src = e.projected + i * projected_stride + (layer - plan.first_layer) * row_width;
      const scalar_t* k_bias = e.bias == nullptr ? nullptr : e.bias + layer * row_width;
      scalar_t* k_dst = e.kv_cache + layer * layer_stride + slot * kv_width;

      add_bias(row.data(), k_src, k_bias, kv_width);
      if (half == 0) {
        store_row(k_dst, row.data(), kv_width);
      } else {
        const cache_t* cos = e.cos_sin_cache + e.positions[t * e.positions_stride] * s.rot_dim;
        for (int64_t h = 0; h < s.num_kv_heads; ++h) {
          const float* head = row.data() + h * s.head_dim;
          scalar_t* dst = k_dst + h * s.head_dim;
          rotary::rotate_head<kNeox>(dst, head, cos, cos + half, static_cast<int>(half));
          store_row(dst + s.rot_dim, head + s.rot_dim, s.head_dim - s.rot_dim);  // partial rotary: the rest
        }
      }

      add_bias(row.data(), k_src + kv_width, k_bias == nullptr ? nullptr : k_bias + kv_width, kv_width);
      store_row(k_dst + v_offset, row.data(), kv_width);
    }
  });
}

void kv_fill_cpu(at::Tensor& kv_cache, const at::Tensor& hidden, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cos_sin_cache,
                 const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& start_layer, double eps,
                 bool is_neox) {
  const KvFillShape s =
      check_kv_fill_args(kv_cache, hidden, weight, bias, cos_sin_cache, positions, slot_mapping, start_layer, eps);
  const FillPlan plan = plan_fill(s, positions, slot_mapping, start_layer);
  if (plan.tokens.empty()) return;

  const int64_t d = s.hidden_size;
  const int64_t row_width = 2 * s.kv_width();
  const int64_t num_layers = s.num_layers - plan.first_layer;
  const bool has_bias = bias.has_value() && bias->defined();

  at::Tensor normed = at::empty({static_cast<int64_t>(plan.tokens.size()), d}, hidden.options());
  // Only the layers some token writes: [L' * 2 * Hkv * D, d], a contiguous slice of the stack.
  const at::Tensor stacked = weight.view({s.num_layers * row_width, d}).narrow(0, plan.first_layer * row_width,
                                                                             num_layers * row_width);

  EECORE_DISPATCH_FLOAT(kv_cache.scalar_type(), "eecore::kv_fill", [&] {
    normalise_rows(normed.data_ptr<scalar_t>(), hidden.const_data_ptr<scalar_t>(), hidden.stride(0), plan.tokens, d,
                   static_cast<float>(eps));
    const at::Tensor projected = at::mm(normed, stacked.t());  // the one GEMM

    auto run = [&](auto neox, const auto* cache) {
      using cache_t = std::remove_cv_t<std::remove_pointer_t<decltype(cache)>>;
      Epilogue<scalar_t, cache_t> e{kv_cache.data_ptr<scalar_t>(),
                                    projected.const_data_ptr<scalar_t>(),
                                    has_bias ? bias->const_data_ptr<scalar_t>() : nullptr,
                                    cache,
                                    positions.const_data_ptr<int64_t>(),
                                    slot_mapping.const_data_ptr<int64_t>(),
                                    start_layer.const_data_ptr<int32_t>(),
                                    positions.stride(0),
                                    slot_mapping.stride(0),
                                    start_layer.stride(0)};
      scatter_layers<decltype(neox)::value>(e, s, plan);
    };
    auto run_with_cache = [&](auto neox) {
      if (s.rot_dim == 0)
        run(neox, static_cast<const float*>(nullptr));
      else if (cos_sin_cache->scalar_type() == at::kFloat)
        run(neox, cos_sin_cache->const_data_ptr<float>());
      else
        run(neox, cos_sin_cache->const_data_ptr<scalar_t>());
    };
    if (is_neox)
      run_with_cache(std::true_type{});
    else
      run_with_cache(std::false_type{});
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("kv_fill", &eecore::kv_fill_cpu); }
