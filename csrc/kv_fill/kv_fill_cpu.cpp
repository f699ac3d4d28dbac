// kv_fill on the CPU: fill the K/V cache of the layers a token skipped, from its exit hidden state.
//
//   1. plan: range-check the index data, keep the tokens that write at least one layer, and sort
//      them by start layer, so the tokens that need layer l are always a prefix of the list;
//   2. normalise those rows once (fp32 math, no gain: each layer's gain is folded into its rows);
//   3. project onto the stacked [K; V] rows of every layer from the lowest start layer up and, in
//      the same parallel pass, add the bias, rotate K (eecore/rotary.h) and scatter each head into
//      the token's slot of every layer >= its start layer.
//
// Step 3 has two strategies. Decode-sized batches (the common case: a few exited tokens) stream
// each weight row once against all tokens in fp32 accumulators (common/cpu_dots.h), fused with the
// epilogue, one task per (layer, K/V head): bound by reading the weights. Larger batches make it a compute problem and
// call ONE GEMM (at::mm) over all the needed layers, then run the same epilogue (see prefer_gemm).
//
// Every (token, layer) writes its own slot of its own layer, so the tasks never synchronise.
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "common/cpu_dots.h"
#include "common/cpu_rms.h"
#include "common/rotary_dispatch.h"
#include "eecore/rotary.h"
#include "kv_fill/kv_fill_checks.h"

namespace eecore {
namespace {

constexpr const char* kOp = "kv_fill";

// Up to this many writing tokens the fused streaming projection is at least as fast as a GEMM
// library (measured: MKL fp32 on a 2-core AVX2 EPYC catches up between 64 and 128 tokens).
constexpr int64_t kMaxStreamingTokens = 64;
// Tokens projected together by the streaming path: their fp32 rows (64 KiB at d = 2048) stay in
// L2 while a head's weight rows stream past them once.
constexpr int64_t kStreamingTile = 8;

bool cpu_has(std::initializer_list<const char*> features) {
  const auto capabilities = at::cpu::get_cpu_capabilities();
  for (const char* feature : features) {
    const auto it = capabilities.find(feature);
    if (it != capabilities.end() && it->second.isBool() && it->second.toBool()) return true;
  }
  return false;
}

// Whether one GEMM beats streaming the weights. Past kMaxStreamingTokens the projection is compute
// bound and a blocked GEMM wins, except for 16-bit weights on CPUs without native bf16/fp16 matrix
// instructions, where oneDNN widens on the fly and stays several times slower than streaming.
bool prefer_gemm(int64_t num_tokens, at::ScalarType dtype) {
  if (num_tokens <= kMaxStreamingTokens) return false;
  static const bool native_bf16 = cpu_has({"avx512_bf16", "amx_bf16"});
  static const bool native_fp16 = cpu_has({"avx512_fp16", "amx_fp16"});
  if (dtype == at::kBFloat16) return native_bf16;
  if (dtype == at::kHalf) return native_fp16;
  return true;
}

// The tokens that write at least one layer, by ascending start layer (ties by token index).
struct FillPlan {
  std::vector<int64_t> tokens;
  std::vector<int64_t> starts;  // start layer of tokens[i], ascending
  int64_t first_layer = 0;      // starts.front()

  // How many of the leading tokens write layer `layer`.
  int64_t tokens_in_layer(int64_t layer) const {
    return std::upper_bound(starts.begin(), starts.end(), layer) - starts.begin();
  }
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
};

// Reads and range-checks the index tensors, so an invalid call raises before anything is written.
FillPlan plan_fill(const KvFillShape& s, const at::Tensor& positions, const at::Tensor& slot_mapping,
                   const at::Tensor& start_layer) {
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int32_t* starts = start_layer.const_data_ptr<int32_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> order;  // (start layer, token)
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int64_t slot = slots[t * slot_mapping.stride(0)];
    const int64_t start = starts[t * start_layer.stride(0)];
    EECORE_CHECK_ARG(kOp, "slot_mapping", slot < s.num_slots(), "expected slots < ", s.num_slots(),
                     " (num_blocks * block_size of 'kv_cache') or negative to skip, got ", slot, " at token ", t);
    EECORE_CHECK_ARG(kOp, "start_layer", start >= 0, "expected values >= 0, got ", start, " at token ", t);
    if (s.rot_dim > 0) {
      const int64_t p = pos[t * positions.stride(0)];
      EECORE_CHECK_ARG(kOp, "positions", p >= 0 && p < s.max_pos, "expected values in [0, ", s.max_pos,
                       ") (the rows of 'cos_sin_cache'), got ", p, " at token ", t);
    }
    if (slot >= 0 && start < s.num_layers) order.emplace_back(start, t);
  }
  std::sort(order.begin(), order.end());
  FillPlan plan;
  for (const auto& [start, t] : order) {
    plan.starts.push_back(start);
    plan.tokens.push_back(t);
  }
  plan.first_layer = plan.starts.empty() ? s.num_layers : plan.starts.front();
  return plan;
}

// normed[i] = hidden[tokens[i]] * rsqrt(mean(hidden^2) + eps), stored as out_t.
template <typename out_t, typename scalar_t>
void normalise_rows(out_t* normed, const scalar_t* hidden, int64_t row_stride, const std::vector<int64_t>& tokens,
                    int64_t d, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / d);
  at::parallel_for(0, static_cast<int64_t>(tokens.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* x = hidden + tokens[i] * row_stride;
      cpu::scale_row(normed + i * d, x, cpu::inverse_rms(x, d, eps), static_cast<const scalar_t*>(nullptr), d);
    }
  });
}

// Where the epilogue writes, and what it rotates with.
template <typename scalar_t, typename cache_t>
struct Epilogue {
  scalar_t* kv_cache;            // [L, 2, NB * BS, Hkv, D]
  const scalar_t* bias;          // [L, 2 * Hkv * D] or null
  const cache_t* cos_sin_cache;  // [max_pos, rot_dim] or null (no RoPE)
  const int64_t* positions;
  const int64_t* slots;
  int64_t positions_stride, slots_stride;
  KvFillShape shape;

  // kv_cache[layer, 0 or 1, slot of token t, head, :].
  scalar_t* head_in_cache(int64_t layer, bool is_v, int64_t t, int64_t head) const {
    const int64_t slots_per_layer = shape.num_slots() * shape.kv_width();
    return kv_cache + (2 * layer + (is_v ? 1 : 0)) * slots_per_layer + slots[t * slots_stride] * shape.kv_width() +
           head * shape.head_dim;
  }

  // The bias of K/V head `head` of `layer`, or null.
  const scalar_t* head_bias(int64_t layer, bool is_v, int64_t head) const {
    if (bias == nullptr) return nullptr;
    return bias + layer * 2 * shape.kv_width() + (is_v ? shape.kv_width() : 0) + head * shape.head_dim;
  }

  // x (fp32, one head, bias already added) -> the cache; K is rotated at token t's position.
  template <bool kNeox>
  void store_head(scalar_t* dst, const float* x, bool is_v, int64_t t) const {
    const int64_t rot_dim = (is_v || cos_sin_cache == nullptr) ? 0 : shape.rot_dim;
    if (rot_dim > 0) {
      const cache_t* cos = cos_sin_cache + positions[t * positions_stride] * rot_dim;
      rotary::rotate_head<kNeox>(dst, x, cos, cos + rot_dim / 2, static_cast<int>(rot_dim / 2));
    }
#pragma omp simd
    for (int64_t i = rot_dim; i < shape.head_dim; ++i) dst[i] = static_cast<scalar_t>(x[i]);
  }
};

template <typename in_t, typename scalar_t>
inline void add_bias(float* x, const in_t* src, const scalar_t* bias, int64_t n) {
  if (bias == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(src[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(src[i]) + static_cast<float>(bias[i]);
  }
}

// Decode-sized batches: one task per (layer, K/V head). It streams that head's D weight rows once
// per tile of up to kStreamingTile tokens (only the tokens that write this layer: a prefix of the plan), then
// biases, rotates and stores each token's head while it is still in L1.
template <bool kNeox, typename scalar_t, typename cache_t>
void fill_streaming(const Epilogue<scalar_t, cache_t>& e, const scalar_t* weight,
                    const cpu::dot_input_t<scalar_t, scalar_t>* normed, const FillPlan& plan) {
  const KvFillShape& s = e.shape;
  const int64_t d = s.hidden_size, head_dim = s.head_dim;
  const int64_t heads_per_layer = 2 * s.num_kv_heads;  // the weight's row order: K heads, then V heads
  const int64_t num_tasks = (s.num_layers - plan.first_layer) * heads_per_layer;
  const int64_t grain = std::max<int64_t>(1, 32768 / (head_dim * d));
  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> projected(kStreamingTile * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t layer = plan.first_layer + task / heads_per_layer;
      const int64_t head_row = task % heads_per_layer;  // K heads 0..Hkv-1, then V heads
      const bool is_v = head_row >= s.num_kv_heads;
      const int64_t head = head_row % s.num_kv_heads;
      const scalar_t* w = weight + (layer * heads_per_layer + head_row) * head_dim * d;
      const scalar_t* bias = e.head_bias(layer, is_v, head);
      const int64_t num_tokens = plan.tokens_in_layer(layer);
      for (int64_t tile = 0; tile < num_tokens; tile += kStreamingTile) {
        const int64_t n = std::min(kStreamingTile, num_tokens - tile);
        cpu::dot_rows(normed + tile * d, d, n, w, d, head_dim, d, projected.data(), head_dim);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = plan.tokens[tile + i];
          float* x = projected.data() + i * head_dim;
          add_bias(x, x, bias, head_dim);
          e.template store_head<kNeox>(e.head_in_cache(layer, is_v, t, head), x, is_v, t);
        }
      }
    }
  });
}

// Larger batches: the projections come from one GEMM, `projected` [T', L' * 2 * Hkv * D] in the
// activation dtype (row i = plan.tokens[i]); one task per (token, layer) finishes every head.
template <bool kNeox, typename scalar_t, typename cache_t>
void fill_from_gemm(const Epilogue<scalar_t, cache_t>& e, const scalar_t* projected, const FillPlan& plan) {
  const KvFillShape& s = e.shape;
  const int64_t num_layers = s.num_layers - plan.first_layer;
  const int64_t layer_width = 2 * s.kv_width();
  const int64_t grain = std::max<int64_t>(1, 32768 / layer_width);
  at::parallel_for(0, plan.size() * num_layers, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> x(s.head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_layers;
      const int64_t layer = plan.first_layer + task % num_layers;
      if (layer < plan.starts[i]) continue;
      const int64_t t = plan.tokens[i];
      const scalar_t* row = projected + (i * num_layers + layer - plan.first_layer) * layer_width;
      for (int64_t head_row = 0; head_row < 2 * s.num_kv_heads; ++head_row) {
        const bool is_v = head_row >= s.num_kv_heads;
        const int64_t head = head_row % s.num_kv_heads;
        add_bias(x.data(), row + head_row * s.head_dim, e.head_bias(layer, is_v, head), s.head_dim);
        e.template store_head<kNeox>(e.head_in_cache(layer, is_v, t, head), x.data(), is_v, t);
      }
    }
  });
}

template <bool kNeox, typename scalar_t, typename cache_t>
void fill(const Epilogue<scalar_t, cache_t>& e, const at::Tensor& hidden, const at::Tensor& weight, double eps,
          const FillPlan& plan) {
  const KvFillShape& s = e.shape;
  const int64_t d = s.hidden_size;
  const scalar_t* hidden_data = hidden.const_data_ptr<scalar_t>();
  if (!prefer_gemm(plan.size(), hidden.scalar_type())) {
    // fp32 rows, or bf16 ones where the CPU has bf16 dot products (then rounded like the GEMM
    // path's below).
    std::vector<cpu::dot_input_t<scalar_t, scalar_t>> normed(plan.size() * d);
    normalise_rows(normed.data(), hidden_data, hidden.stride(0), plan.tokens, d, static_cast<float>(eps));
    fill_streaming<kNeox>(e, weight.const_data_ptr<scalar_t>(), normed.data(), plan);
    return;
  }
  // The GEMM runs in the activation dtype, so the normalised rows are rounded to it first.
  at::Tensor normed = at::empty({plan.size(), d}, hidden.options());
  normalise_rows(normed.data_ptr<scalar_t>(), hidden_data, hidden.stride(0), plan.tokens, d, static_cast<float>(eps));
  const int64_t layer_width = 2 * s.kv_width();
  const at::Tensor stacked = weight.view({s.num_layers * layer_width, d})
                                 .narrow(0, plan.first_layer * layer_width,
                                         (s.num_layers - plan.first_layer) * layer_width);
  const at::Tensor projected = at::mm(normed, stacked.t());
  fill_from_gemm<kNeox>(e, projected.const_data_ptr<scalar_t>(), plan);
}

void kv_fill_cpu(at::Tensor& kv_cache, const at::Tensor& hidden, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cos_sin_cache,
                 const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& start_layer, double eps,
                 bool is_neox) {
  const KvFillShape s =
      check_kv_fill_args(kv_cache, hidden, weight, bias, cos_sin_cache, positions, slot_mapping, start_layer, eps);
  const FillPlan plan = plan_fill(s, positions, slot_mapping, start_layer);
  if (plan.size() == 0) return;
  const bool has_bias = bias.has_value() && bias->defined();

  // RoPE needs the cache, fp32 or the activation dtype; without it cache_t is a placeholder.
  const at::Tensor* rope_cache = s.rot_dim == 0 ? nullptr : &*cos_sin_cache;
  EECORE_DISPATCH_FLOAT(kv_cache.scalar_type(), "eecore::kv_fill", [&] {
    dispatch_rotary<scalar_t>(rope_cache, is_neox, [&](auto neox, const auto* cache) {
      using cache_t = std::remove_cv_t<std::remove_pointer_t<decltype(cache)>>;
      const Epilogue<scalar_t, cache_t> e{kv_cache.data_ptr<scalar_t>(),
                                          has_bias ? bias->const_data_ptr<scalar_t>() : nullptr,
                                          cache,
                                          positions.const_data_ptr<int64_t>(),
                                          slot_mapping.const_data_ptr<int64_t>(),
                                          positions.stride(0),
                                          slot_mapping.stride(0),
                                          s};
      fill<decltype(neox)::value>(e, hidden, weight, eps, plan);
    });
  });
}

}  // namespace
}  // namespace eecore

TORCH_LIBRARY_IMPL(eecore, CPU, m) { m.impl("kv_fill", &eecore::kv_fill_cpu); }
