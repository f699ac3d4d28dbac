// out[i][j] = sum_k h[i][k] * w[j][k]: the dot products of a few rows (hidden states, a decode
// batch) with many weight rows in their storage dtype (fp32, bf16, fp16, or int8: the integers of
// a weight-only int8 linear, whose per-row scales the caller applies to the sums). The one "few
// rows x many weight rows" kernel of the CPU ops: linear (decode-sized inputs), lm_head_top2_gap (a
// vocab tile of logits), mlp_confidence (the classifier's first layer) and kv_fill (a K/V head's
// projection).
//
// Why not a GEMM library: at decode sizes this is a matrix-vector product bound by reading the
// weight, and a BLAS small-M path is often far from the memory bandwidth (and widens bf16/fp16
// weights through a copy). Here the weight is read exactly once, in its own dtype, converted to
// fp32 in registers (or multiplied as bf16 pairs, see EECORE_CPU_BF16_DOT), and the kernel keeps
// MR x NR independent fp32 accumulators (enough FMAs in flight to cover their latency),
// converting each weight vector once for MR hidden rows. Lengths d >= 1 (the callers check).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/cpu_vec.h"
#include "eecore/int8_linear.h"

// AVX512-BF16 (Zen 4, Sapphire Rapids and newer) multiplies bf16 pairs natively: vdpbf16ps does
// 32 exact products per instruction, summed into 16 fp32 lanes. Where both operands are bf16
// already, that is 4x the multiply-adds of widening to fp32 first, and decode batches of a bf16
// model are compute-bound on such CPUs from a handful of rows up.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && EECORE_VEC8_AVX2
#define EECORE_CPU_BF16_DOT 1
#else
#define EECORE_CPU_BF16_DOT 0
#endif

// AVX512-VNNI (Zen 4, Ice Lake and newer) multiplies int16 pairs natively: vpdpwssd does 32 exact
// products per instruction, summed into 16 int32 lanes. Weight-only int8 rows then need one widening
// (int8 -> int16) per 32 weights instead of two conversions to fp32 per 16 (see dot_input_t).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && EECORE_VEC8_AVX2
#define EECORE_CPU_INT8_VNNI 1
#else
#define EECORE_CPU_INT8_VNNI 0
#endif

// Without VNNI, AVX2 still multiplies int16 pairs natively: vpmaddwd does 16 exact products per
// instruction, summed in pairs into 8 int32 lanes (then one vpaddd into the accumulator). Against
// widening both operands to fp32 (8 products per FMA, two conversions per operand vector), the int8
// projections of 8 of SmolLM2's layers on a Zen 3 (2 threads, processes alternated, medians of 3)
// ran at 1 / 4 / 90 rows in 0.98 / 2.30 / 47.4 ms against 1.20 / 2.60 / 48.1 ms, and the exit-ready
// layer preset (an int8 draft copy) 1.087x faster (median of 6 alternated pairs). Many rows stay
// far from the instruction's peak, stalled on the weight stream, not on arithmetic.
#if EECORE_VEC8_AVX2 && !EECORE_CPU_INT8_VNNI
#define EECORE_CPU_INT8_MADD 1
#else
#define EECORE_CPU_INT8_MADD 0
#endif

namespace eecore::cpu {

// The element type in which a caller hands `dot_rows` its hidden rows when they are stored as
// `in_t` and the weight as `w_t`:
//  * int8 weights (weight-only int8): int16, each row rounded to 16-bit integers with a scale of
//    its own (eecore/int8_linear.h), on every CPU, so the op means the same everywhere; with
//    EECORE_CPU_INT8_VNNI or EECORE_CPU_INT8_MADD the products and sums are then exact integers.
//  * bf16 as they are where both are bf16 and the CPU has bf16 dot products;
//  * fp32 otherwise. (Float weights never round the rows: fp32 stays fp32 against bf16 weights.)
template <typename in_t, typename w_t>
using dot_input_t = std::conditional_t<
    std::is_same_v<w_t, int8_t>, int16_t,
    std::conditional_t<EECORE_CPU_BF16_DOT && std::is_same_v<in_t, c10::BFloat16> && std::is_same_v<w_t, c10::BFloat16>,
                       c10::BFloat16, float>>;

// One input row of a weight-only int8 linear rounded to int16 (eecore/int8_linear.h): q[k] =
// round-half-even(x[k] * (range / max|x|)); returns the row's scale max|x| / range (x ~ scale * q),
// 0 for a zero row, NaN for a row holding inf or NaN (its outputs are then NaN, as float products
// would have made them).
#if defined(__AVX512F__)
// 16 elements as fp32 lanes, for the rounding below (fp32 and bf16 rows; other types go scalar).
inline __m512 load_row_x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row_x16(const c10::BFloat16* p) { return load_bf16x16(p); }

// round_row_to_int16 16 lanes at a time: the same max, the same fp32 products and the same
// round-half-even (vrndscaleps in the default rounding mode is nearbyint), so the same integers.
// A decode step rounds every row of every int8 projection: one element took ~2.4 ns scalar, which
// made the rounding cost more than the tile products at 16 rows of 1,536 features.
template <typename in_t>
inline float round_row_to_int16_x16(const in_t* x, int64_t d, int32_t range, int16_t* q) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; k += 16) {
    const __m512 v = load_row_x16(x + k);
    finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_EQ_OQ);  // inf - inf and NaN are NaN
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  const float top = _mm512_reduce_max_ps(amax);
  if (finite != 0xFFFF || top == 0.f) {
    std::fill(q, q + d, int16_t{0});
    return finite == 0xFFFF ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const __m512 inv = _mm512_set1_ps(static_cast<float>(range) / top);
  const __m512 hi = _mm512_set1_ps(static_cast<float>(range)), lo = _mm512_set1_ps(-static_cast<float>(range));
  for (int64_t k = 0; k < d; k += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load_row_x16(x + k), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
  }
  return top / static_cast<float>(range);
}
#endif

template <typename in_t>
inline float round_row_to_int16(const in_t* x, int64_t d, int32_t range, int16_t* q) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<in_t, float> || std::is_same_v<in_t, c10::BFloat16>) {
    if (d % 16 == 0) return round_row_to_int16_x16(x, d, range, q);
  }
#endif
  float amax = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < d; ++k) {
    const float v = static_cast<float>(x[k]);
    finite &= std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (!finite || amax == 0.f) {
    std::fill(q, q + d, int16_t{0});
    return finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = static_cast<float>(range) / amax;
  for (int64_t k = 0; k < d; ++k) {
    const float r = std::nearbyint(static_cast<float>(x[k]) * inv);
    q[k] = static_cast<int16_t>(std::clamp(r, -static_cast<float>(range), static_cast<float>(range)));
  }
  return amax / static_cast<float>(range);
}

// Software prefetch of the weight (batches of 2 or more rows). The weight comes from DRAM, and on
// its own the hardware prefetcher lets memory idle while a slice is reused from L1 by the later
// hidden rows. Two distances:
//  * the next slice, at the same position (kNextSlice...MaxRows below): while the groups of hidden
//    rows work through one slice, the next one streams in, so memory is busy the whole time, not
//    only while the first group passes. The row limits are measured, not derived: past them (fp32
//    at 12 rows and more) the short distance below was faster, perhaps because the arithmetic of
//    that many rows then takes longer than a slice's fetch.
//  * kPrefetchBytes along each stream, past those rows: 1-2 KiB ahead ran SmolLM2's projections at
//    8-24 rows 1.2-1.3x faster than 8 KiB on a Zen 3 (3 x 4 blocks); 4 KiB was already as slow as 8.
// Both prefetch into L2 (prefetcht1), not L1: a slice ahead would not fit in L1 beside the current
// slice and the hidden rows, and at the short distance the L2 hint measured faster too. On a Zen 4
// (2 threads, AVX-512, runs alternated with the L1 form at 2 KiB) SmolLM2's 30 layers of
// projections ran at 4 / 5 / 9 rows 13.6 / 13.9 / 17.5 ms against 15.9 / 17.2 / 19.6 in fp32 (one
// row: 14.0) and 6.7 / 6.8 / 8.8 ms against 8.2 / 9.4 / 10.5 in bf16; 12-24 fp32 rows 1.06-1.08x
// faster (one run of 5), and a 2048-wide model's layers 1.2-1.4x at 4-16 rows. Prefetches never fault, so
// running past the end of the weight is harmless.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kNextSliceMaxRowsFp32 = 10;  // fp32 hidden rows: 12 rows ran 1.05x slower
constexpr int64_t kNextSliceMaxRowsBf16 = 24;  // bf16 x bf16 (vdpbf16ps): faster at every streamed size
// ... except on AVX-512 where more fp32 rows than that go next-slice too, with the prefetches
// shared out: group g of G prefetches the streams s with s % G == g, so the next slice is requested
// across the whole time the groups spend on this one, not all of it while the first group passes
// (every group repeating the same prefetches, which then miss nothing). With SmolLM2's projections
// streaming from DRAM in huge pages (2 threads, Intel Xeon, same-process A/B), 12 / 16 / 20 / 24 rows
// ran 1.03-1.04 / 1.07-1.09 / 1.10 / 1.05-1.06x faster than at the short distance; 8 rows are
// unchanged. A chunked pass (rows too long for the cache, below) keeps every group prefetching: 16
// rows of 2304 ran 0.975x with the shares.
#if defined(__AVX512F__)
constexpr bool kShareNextSlicePrefetches = true;
#else
constexpr bool kShareNextSlicePrefetches = false;  // not measured on AVX2
#endif
// Where a prefetch puts its line: prefetcht1, the L2 (see above).
inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
// Hidden rows up to this size are kept whole while the weight streams past; larger ones are cut
// into chunks of the length (see dot_rows). Only the slice (16 KiB) and one group's rows must sit
// in L1; the other groups' rows wait in L2, so the bound is set by L2 (half of 256 KiB, the
// smallest common one). Chunking makes each pass read part-rows (a strided pattern) and moves the
// prefetch to the same position one slice on: with a 28 KiB bound (fit in L1 beside the slice),
// SmolLM2's projections at 16-24 rows ran 1.1-1.3x slower than whole on a Zen 3 (1 and 2 threads).
constexpr int64_t kHiddenChunkBytes = 128 * 1024;

// Scratch space of n elements: N of them inline (in the owner, on the stack), more on the heap. A
// decode step's converted hidden rows (a few rows of a few thousand elements) then cost no
// allocation.
template <typename T, size_t N>
class ScratchBuffer {
 public:
  T* get(size_t n) {
    if (n <= N) return inline_;
    heap_.resize(n);
    return heap_.data();
  }

 private:
  alignas(64) T inline_[N];
  std::vector<T> heap_;
};

// The hidden rows in the form dot_rows reads them against `w_t` weights: the caller's own rows,
// without a copy, where their type already is dot_input_t, else a copy made once (each hidden row
// is read once per weight row, so converting it on every read would cost more): fp32, or int16
// rows with a scale each against int8 weights (`row_scale`: 1 for the other forms).
template <typename in_t, typename w_t>
class DotInput {
 public:
  using type = dot_input_t<in_t, w_t>;

  DotInput(const in_t* rows, int64_t ld, int64_t m, int64_t d) {
    if constexpr (std::is_same_v<type, in_t>) {
      data_ = rows;
      ld_ = ld;
    } else {
      type* copy = copy_.get(static_cast<size_t>(m * d));
      if constexpr (std::is_same_v<type, int16_t>) {
        scales_ = scale_buffer_.get(static_cast<size_t>(m));
        const int32_t range = int16_row_range(d);
        for (int64_t r = 0; r < m; ++r) scales_[r] = round_row_to_int16(rows + r * ld, d, range, copy + r * d);
      } else {
        for (int64_t r = 0; r < m; ++r) convert_to_float(rows + r * ld, copy + r * d, d);
      }
      data_ = copy;
      ld_ = d;
    }
  }
  DotInput(const DotInput&) = delete;  // data_ may point into this object
  DotInput& operator=(const DotInput&) = delete;

  const type* row(int64_t i) const { return data_ + i * ld_; }
  int64_t ld() const { return ld_; }
  float row_scale(int64_t i) const { return scales_ == nullptr ? 1.f : scales_[i]; }

 private:
  static constexpr size_t kInlineBytes = 16384;
  ScratchBuffer<type, kInlineBytes / sizeof(type)> copy_;
  ScratchBuffer<float, 32> scale_buffer_;
  float* scales_ = nullptr;
  const type* data_ = nullptr;
  int64_t ld_ = 0;
};

// How dot_block multiplies hidden rows of type h_t by weight rows of type w_t: `Acc` is a vector
// of fp32 partial sums, `step` the elements one multiply-add instruction covers, load_h/load_w
// load `step` elements of a row.
//  * fp32 x fp32 on AVX-512: 16 lanes per instruction, half the instructions of two 256-bit
//    halves for the same multiply-adds; that matters once a decode batch makes the block
//    compute-bound (SmolLM2's projections at B = 8: 1.1-1.2x).
//  * bf16 x bf16 with EECORE_CPU_BF16_DOT: vdpbf16ps, 32 exact products summed into 16 lanes.
//  * int16 x int8 with EECORE_CPU_INT8_VNNI: vpdpwssd, 32 exact integer products per instruction;
//    with EECORE_CPU_INT8_MADD (AVX2): vpmaddwd + vpaddd, 16.
//  * anything else (fp32 hidden rows against fp32, bf16 or fp16 weights; int16 rows against int8
//    weights on a CPU with neither): Vec8, both operands widened to fp32 in registers (an int16 x
//    int8 product is exact in fp32).
template <typename h_t, typename w_t>
struct DotLanes {
  using Acc = Vec8;  // also the type of a loaded hidden or weight vector
  static constexpr int64_t step = kVecWidth;
  static Acc zero() { return Vec8::zero(); }
  static Vec8 load_h(const h_t* p) { return Vec8::load(p); }
  static Vec8 load_w(const w_t* p) { return Vec8::load(p); }
  static Acc fma(Acc acc, Vec8 h, Vec8 w) { return eecore::cpu::fma(h, w, acc); }
  static float sum(Acc acc) { return reduce_add(acc); }
  static void sum4(Acc a, Acc b, Acc c, Acc d, float* out) { reduce_add4(a, b, c, d, out); }
};

#if defined(__AVX512F__) && EECORE_VEC8_AVX2
// The 16 lanes of a 512-bit sum: its two 256-bit halves through memory, then Vec8's sum (GCC
// 12's 512-bit reduce and extract intrinsics trip -Wuninitialized on their own internals).
inline Vec8 fold16(__m512 acc) {  // lanes i + (i + 8)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  return Vec8{_mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8))};
}
inline float reduce_add16(__m512 acc) { return reduce_add(fold16(acc)); }

// Four reduce_add16 at once, in the same order (reduce_add4 adds as reduce_add does): a block's
// outputs get the bits of single reductions for a quarter of the horizontal work, which at the
// lengths of a small model's rows (576) is a large share of a block's instructions.
inline void reduce_add16x4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  reduce_add4(fold16(a), fold16(b), fold16(c), fold16(d), out);
}

template <>
struct DotLanes<float, float> {
  using Acc = __m512;
  static constexpr int64_t step = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512 load_h(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
  static Acc fma(Acc acc, __m512 h, __m512 w) { return _mm512_fmadd_ps(h, w, acc); }
  static float sum(Acc acc) { return reduce_add16(acc); }
  static void sum4(Acc a, Acc b, Acc c, Acc d, float* out) { reduce_add16x4(a, b, c, d, out); }
};

#endif

#if EECORE_CPU_INT8_VNNI
// int16 hidden rows x int8 weights: each 32 weights widened to int16 once (vpmovsxbw), then
// vpdpwssd: 32 exact products into 16 int32 lanes (int16_row_range keeps a lane from overflowing).
// The lanes are summed in fp32.
template <>
struct DotLanes<int16_t, int8_t> {
  using Acc = __m512i;
  static constexpr int64_t step = 32;
  static Acc zero() { return _mm512_setzero_si512(); }
  static __m512i load_h(const int16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i load_w(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Acc fma(Acc acc, __m512i h, __m512i w) { return _mm512_dpwssd_epi32(acc, h, w); }
  // (the zero-masked form of vcvtdq2ps: GCC 12's plain _mm512_cvtepi32_ps trips -Wuninitialized on
  // its own internals, as its reduce intrinsics do; with an all-ones mask it is the same instruction)
  static __m512 to_float(__m512i acc) { return _mm512_maskz_cvtepi32_ps(static_cast<__mmask16>(0xFFFF), acc); }
  static float sum(Acc acc) { return reduce_add16(to_float(acc)); }
  static void sum4(Acc a, Acc b, Acc c, Acc d, float* out) {
    reduce_add16x4(to_float(a), to_float(b), to_float(c), to_float(d), out);
  }
};
#endif

#if EECORE_CPU_INT8_MADD
// int16 hidden rows x int8 weights on AVX2: each 16 weights widened to int16 once (vpmovsxbw), then
// vpmaddwd: 16 exact products summed in pairs into 8 int32 lanes, added to the accumulator (each
// lane then holds twice the products of a vpdpwssd lane of the same row, which int16_row_range
// allows for). The lanes are summed in fp32.
template <>
struct DotLanes<int16_t, int8_t> {
  using Acc = __m256i;
  static constexpr int64_t step = 16;
  static Acc zero() { return _mm256_setzero_si256(); }
  static __m256i load_h(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256i load_w(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Acc fma(Acc acc, __m256i h, __m256i w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(h, w)); }
  static Vec8 to_float(Acc acc) { return Vec8{_mm256_cvtepi32_ps(acc)}; }
  static float sum(Acc acc) { return reduce_add(to_float(acc)); }
  static void sum4(Acc a, Acc b, Acc c, Acc d, float* out) {
    reduce_add4(to_float(a), to_float(b), to_float(c), to_float(d), out);
  }
};
#endif

#if EECORE_CPU_BF16_DOT
template <>
struct DotLanes<c10::BFloat16, c10::BFloat16> {
  using Acc = __m512;
  static constexpr int64_t step = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512bh load_h(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh load_w(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc fma(Acc acc, __m512bh h, __m512bh w) { return _mm512_dpbf16_ps(acc, h, w); }
  static float sum(Acc acc) { return reduce_add16(acc); }
  static void sum4(Acc a, Acc b, Acc c, Acc d, float* out) { reduce_add16x4(a, b, c, d, out); }
};
#endif

// Keeps a loaded vector in a register. Left alone, GCC re-reads the hidden and weight vectors from
// memory as the operand of every FMA that uses them (and spills accumulators around the loop):
// the 3 x 4 block then issues 15 loads per 12 FMAs, and on a Zen 3 ran at 44 GFLOP/s from L1
// against 62-68 with its operands pinned; streaming a decode batch's weights from DRAM at 12-24
// rows, 1.15-1.3x faster. The empty asm only claims to modify the register; it emits nothing.
#if EECORE_VEC8_AVX2
inline void pin_register(Vec8& v) { asm volatile("" : "+x"(v.v)); }
inline void pin_register(__m256i& v) { asm volatile("" : "+x"(v)); }
#else
inline void pin_register(Vec8&) {}
#endif
#if defined(__AVX512F__) && EECORE_VEC8_AVX2
inline void pin_register(__m512& v) { asm volatile("" : "+v"(v)); }
#endif
#if EECORE_CPU_BF16_DOT
inline void pin_register(__m512bh& v) { asm volatile("" : "+v"(v)); }
#endif
#if EECORE_CPU_INT8_VNNI
inline void pin_register(__m512i& v) { asm volatile("" : "+v"(v)); }
#endif

// One MR x NR block: h rows i < MR (stride ldh), w rows j < NR (stride ldw), length d; the dot
// product of h row i and w row j goes to out[i * ldo + j * ldc].
// `ahead` is how many elements past each weight load to prefetch (`Shared`: only for the w rows j
// whose bit is set in `prefetch_rows`); `accumulate` adds to `out`.
// `Pin`: the hidden vectors stay pinned in registers (the loop below the unpinned one). Either
// loop adds each product into its accumulator in k order, so the bits are the same.
template <int MR, int NR, typename h_t, typename w_t, bool Pin = (MR == 3), bool Shared = false>
inline void dot_block(const h_t* h, int64_t ldh, const w_t* w, int64_t ldw, int64_t d, float* out, int64_t ldo,
                      int64_t ldc, int64_t ahead, bool accumulate, unsigned prefetch_rows = ~0u) {
  using L = DotLanes<h_t, w_t>;
  typename L::Acc acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = L::zero();
  int64_t k = 0;
  if constexpr (!Pin) {
    // Other blocks leave the loads to the compiler: at one row (a batch-1 decode, bound by the
    // weight stream) it schedules them ahead better than pinned ones, and pinned 2 x 4 blocks
    // measured slower than 4 x 4 with its spills.
    for (; k + L::step <= d; k += L::step) {
      decltype(L::load_w(w)) wv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        if (!Shared || (prefetch_rows >> j & 1u)) prefetch_to_l2(w + j * ldw + k + ahead);
        wv[j] = L::load_w(w + j * ldw + k);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const auto hv = L::load_h(h + i * ldh + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[i][j] = L::fma(acc[i][j], hv, wv[j]);
      }
    }
  }
  for (; k + L::step <= d; k += L::step) {
    // The MR hidden vectors stay in registers while the NR weight vectors pass one at a time:
    // MR * NR accumulators + MR + 1 live vectors (the 3 x 4 block fills AVX2's 16 exactly).
    decltype(L::load_h(h)) hv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      hv[i] = L::load_h(h + i * ldh + k);
      pin_register(hv[i]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if (!Shared || (prefetch_rows >> j & 1u)) prefetch_to_l2(w + j * ldw + k + ahead);
      auto wv = L::load_w(w + j * ldw + k);
      pin_register(wv);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][j] = L::fma(acc[i][j], hv[i], wv);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[NR];
    if constexpr (NR == 4) {
      L::sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    } else {
      for (int j = 0; j < NR; ++j) sums[j] = L::sum(acc[i][j]);
    }
    for (int j = 0; j < NR; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < d; ++kk) s += static_cast<float>(h[i * ldh + kk]) * static_cast<float>(w[j * ldw + kk]);
      float& o = out[i * ldo + j * ldc];
      o = accumulate ? o + s : s;
    }
  }
}

// The weight rows are read as kStreams runs in address order at once: a block of NR = 4 weight
// rows takes row j of each quarter of the rows (j, j + q, j + 2q, j + 3q), so each of its four
// rows continues where the previous block's left off. Four long sequential streams keep four
// hardware prefetch streams busy: at batch 1 (one hidden row) that reads the weight 1.6-1.9x
// faster than four adjacent rows per block (which, block after block, is four short strided
// streams), and faster than one row at a time (bench/test_bench_linear.py). Every output is still
// the sum of one accumulator in k order, so the bits do not depend on the layout or the batch.
constexpr int64_t kStreams = 4;

// MR hidden rows against the weight rows j0 <= j < j1 of each stream (q rows apart; NR = 4
// blocks, prefetching along the streams in `prefetch_streams`), or, with q == 0, against the rows
// j0 <= j < j1 one at a time (the rows left over).
template <int MR, typename h_t, typename w_t, bool Pin = (MR == 3), bool Shared = false>
inline void dot_rows_mr(const h_t* h, int64_t ldh, const w_t* w, int64_t ldw, int64_t q, int64_t j0, int64_t j1,
                        int64_t d, float* out, int64_t ldo, int64_t ahead, bool accumulate,
                        unsigned prefetch_streams = ~0u) {
  if (q > 0) {
    for (int64_t j = j0; j < j1; ++j)
      dot_block<MR, kStreams, h_t, w_t, Pin, Shared>(h, ldh, w + j * ldw, q * ldw, d, out + j, ldo, q, ahead,
                                                     accumulate, prefetch_streams);
  } else {
    for (int64_t j = j0; j < j1; ++j)
      dot_block<MR, 1, h_t, w_t, Pin>(h, ldh, w + j * ldw, ldw, d, out + j, ldo, 1, ahead, accumulate);
  }
}

// Hidden rows per block. A block keeps kGroupRows x kStreams fp32 accumulators in registers beside
// its operands: AVX-512's 32 registers hold a 4 x 4 block, pinned or as the compiler schedules it
// (see dot_rows_groups for which); AVX2's 16 hold the pinned 3 x 4 block exactly (16 + 4 + 1 did
// not fit: 4 x 4 spilled accumulators every step, and batches of 12-16 rows ran 1.2-1.3x slower).
#if defined(__AVX512F__)
constexpr int64_t kGroupRows = 4;
#else
constexpr int64_t kGroupRows = 3;
#endif
// ... except int16 x int8 blocks on AVX2's madd path, in 2-row groups: vpmaddwd cannot add into its
// accumulator, so each product needs a register of its own, and a 3 x 4 block (12 accumulators, 3
// hidden vectors, a weight vector and a product) kept its accumulators on the stack, loading and
// storing each one every step.
template <typename h_t, typename w_t>
constexpr int64_t group_rows() {
  return EECORE_CPU_INT8_MADD && std::is_same_v<h_t, int16_t> && std::is_same_v<w_t, int8_t> ? 2 : kGroupRows;
}

// Hidden rows [0, m) in groups of at most group_rows() against dot_rows_mr's weight rows [j0, j1);
// `Shared`: each group prefetches only its share of the streams (see kShareNextSlicePrefetches; a
// template argument, so that the other calls test no mask).
// The groups are as even as possible (9 rows: 3 + 3 + 3, not 4 + 4 + 1): a one-row group reads as
// many weight vectors as it does FMAs, from L1. SmolLM2's 30 layers of projections (fp32, 2
// threads, Zen 4 with AVX-512, runs alternated): 9 rows 20.3 -> 19.1 ms, 13 rows 26.0 -> 23.6 ms,
// 5 rows unchanged (16.7 ms; one row: 12.3 ms). Each output is one accumulator either way, so the
// grouping changes no bits.
template <typename h_t, typename w_t, bool Shared = false>
inline void dot_rows_groups(const h_t* h, int64_t ldh, int64_t m, const w_t* w, int64_t ldw, int64_t q, int64_t j0,
                            int64_t j1, int64_t d, float* out, int64_t ldo, int64_t ahead, bool accumulate) {
  constexpr int64_t kRows = group_rows<h_t, w_t>();
  const int64_t groups = (m + kRows - 1) / kRows;
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    unsigned streams = 0;  // group g's share: streams g, g + groups, ...
    for (int64_t s = g; s < kStreams; s += groups) streams |= 1u << s;
    const int64_t rows = (m - i) / (groups - g) + ((m - i) % (groups - g) != 0);  // ceil of an even share
    const h_t* hi = h + i * ldh;
    float* oi = out + i * ldo;
    switch (rows) {
#if defined(__AVX512F__)
      case 4:
        // The same split for 4 x 4 blocks (16 accumulators + 5 live vectors: AVX-512's 32 registers
        // hold them pinned). Beside other groups (8, 12, 16, 24 rows: batched decode, verification)
        // pinning makes the group compute faster, and those sizes are compute-bound: SmolLM2's
        // 30-layer pass (fp32, 2 threads, Zen 4, alternated, medians of 15) at 8 sequences x 1 / 2 /
        // 3 rows ran 1.08 / 1.11 / 1.21x faster, one sequence's 8 rows 1.04x; bf16 and int8 weights
        // unchanged (0.98-1.06x). A lone group of 4 (a 4-row call, bound by the weight stream) keeps
        // the compiler's schedule: pinned, it ran 0.89x.
        if (m == 4)
          dot_rows_mr<4, h_t, w_t, false>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate);
        else
          dot_rows_mr<4, h_t, w_t, true, Shared>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate, streams);
        break;
#endif
      case 3:
        // With AVX-512's 32 registers a lone group of 3 (a 3-row call) runs faster as the compiler
        // schedules it: SmolLM2's projections at 3 rows 15.3 -> 13.5 ms fp32, 7.3 -> 6.2 ms bf16
        // (Zen 4, 2 threads, alternated), where it had been slower than 4 rows. Beside other groups
        // (7 = 4 + 3, 9 = 3 + 3 + 3) the pinned block stays: unpinned, those ran 1.09 / 1.11x slower.
        if (kGroupRows == 4 && m == 3)
          dot_rows_mr<3, h_t, w_t, false>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate);
        else
          dot_rows_mr<3, h_t, w_t, true, Shared>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate, streams);
        break;
      case 2: dot_rows_mr<2, h_t, w_t, false, Shared>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate, streams); break;
      default: dot_rows_mr<1, h_t, w_t, false, Shared>(hi, ldh, w, ldw, q, j0, j1, d, oi, ldo, ahead, accumulate, streams); break;
    }
    i += rows;
  }
}

// out[i * ldo + j] = <h[i], w[j]> for i < m hidden rows (row stride ldh; fp32, or bf16 against
// bf16 weights where EECORE_CPU_BF16_DOT: see dot_input_t) and j < n weight rows (row stride
// ldw), each of length d.
//
// The weight slice is the outer loop: each slice of w is read from memory once, by the first
// group of hidden rows, and from L1 by the others. Hidden rows go in groups of kGroupRows, each
// against four weight rows at a time (one per stream, see kStreams): a 3 x 4 block loads 7
// vectors per 12 FMAs, a 4 x 4 block 8 per 16 (4 x 2 needed 6 per 8, and at B = 8 ran the
// layer's projections 1.25x and the LM head 1.4x slower). The hidden rows should fit in L2
// (callers sweep larger batches in parts).
template <typename h_t, typename w_t>
void dot_rows(const h_t* h, int64_t ldh, int64_t m, const w_t* w, int64_t ldw, int64_t n, int64_t d, float* out,
              int64_t ldo) {
  static_assert(std::is_same_v<h_t, dot_input_t<h_t, w_t>>, "dot_rows: hidden rows must be fp32, bf16 "
                "against bf16 weights on a CPU with AVX512-BF16, or int16 against int8 weights (see dot_input_t)");
  // The hidden rows are re-read for every slice of weight rows, so they should stay in cache (see
  // kHiddenChunkBytes). Where they would not (e.g. 16 fp32 rows of 4096), the length is cut into
  // chunks that do, and the partial dot products are summed in `out`; the prefetches then run one
  // slice ahead at the same position instead of further along the stream (read in a later chunk).
  const int64_t hidden_bytes = m * d * static_cast<int64_t>(sizeof(h_t));
  const int64_t chunks = (hidden_bytes + kHiddenChunkBytes - 1) / kHiddenChunkBytes;
  const bool chunked = chunks > 1;
  // equal chunks, each a whole number of 32-element steps (no short tail chunk)
  const int64_t kc = chunked ? ((d + chunks - 1) / chunks + 31) / 32 * 32 : d;
  const int64_t q = n / kStreams;  // rows per stream; rows kStreams * q .. n - 1 are left over
  for (int64_t k0 = 0; k0 < d; k0 += kc) {
    const int64_t len = std::min(kc, d - k0);
    // Weight rows per slice: about 16 KiB, so the slice stays in L1 while every hidden row passes.
    const int64_t cols = std::max<int64_t>(kStreams, (16384 / (len * static_cast<int64_t>(sizeof(w_t)))) & ~int64_t{3});
    const int64_t per_stream = cols / kStreams;
    // Within a stream the next rows are the next addresses: prefetch along it, or one slice on
    // (see kPrefetchBytes; a chunked pass reads the next chunk at this position one slice on).
    // One hidden row never revisits the slice, so memory never idles and the hardware prefetchers
    // keep up with the four streams alone: there the software prefetch (of the line being loaded,
    // ahead = 0) only costs, 8-12% of a batch-1 step.
    const int64_t next_slice_rows = sizeof(h_t) == 2 ? kNextSliceMaxRowsBf16 : kNextSliceMaxRowsFp32;
    const bool shared = kShareNextSlicePrefetches && sizeof(h_t) == 4 && m > next_slice_rows && !chunked;
    const bool next_slice = chunked || shared || (m > 1 && m <= next_slice_rows);
    // ... except int8 weights, whose one-row pass (a draft copy's, at batch 1) read its weight at
    // ~38 GB/s with the prefetchers alone, where fp32's reads at 42-53: asked for kPrefetchBytes
    // ahead, SmolLM2's 120 projections in int8 ran 2.78 -> 2.43 ms (medians of 4 alternated runs)
    // and the copy's pass 1.25-1.31 -> 1.17-1.25 ms (Zen 5, 2 threads); fp32 and bf16 rows asked
    // ahead gained nothing.
    const bool one_row_ahead = m == 1 && sizeof(w_t) == 1;
    const int64_t ahead = next_slice ? per_stream * ldw
                                     : m == 1 && !one_row_ahead ? 0 : kPrefetchBytes / static_cast<int64_t>(sizeof(w_t));
    const bool accumulate = k0 > 0;
    const w_t* wk = w + k0;
    const h_t* hk = h + k0;
    for (int64_t j0 = 0; j0 < q; j0 += per_stream) {
      if constexpr (kShareNextSlicePrefetches && sizeof(h_t) == 4) {
        if (shared) {
          dot_rows_groups<h_t, w_t, true>(hk, ldh, m, wk, ldw, q, j0, std::min(q, j0 + per_stream), len, out, ldo,
                                          ahead, accumulate);
          continue;
        }
      }
      dot_rows_groups(hk, ldh, m, wk, ldw, q, j0, std::min(q, j0 + per_stream), len, out, ldo, ahead, accumulate);
    }
    dot_rows_groups(hk, ldh, m, wk, ldw, 0, kStreams * q, n, len, out, ldo, ahead, accumulate);
  }
}

}  // namespace eecore::cpu
