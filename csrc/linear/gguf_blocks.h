// GGUF (llama.cpp) weight block formats, and the dequantization of a row of blocks into fp32.
//
// A quantized GGUF matrix [N, K] is stored row by row, each row K / W blocks of W weights:
//   Q4_0 (type 2)   W 32,  18 bytes: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1 (type 3)   W 32,  20 bytes: fp16 d, fp16 m, 16 bytes             w = d * q + m
//   Q5_0 (type 6)   W 32,  22 bytes: fp16 d, u32 high bits, 16 bytes      w = d * (q - 16)
//   Q5_1 (type 7)   W 32,  24 bytes: fp16 d, fp16 m, u32 high bits, 16    w = d * q + m
//   Q8_0 (type 8)   W 32,  34 bytes: fp16 d, 32 int8                      w = d * q
//   Q4_K (type 12)  W 256, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for
//                   its 8 groups of 32, 128 bytes of nibbles             w = (d sc) q - (dmin mn)
//   Q5_K (type 13)  W 256, 176 bytes: Q4_K's, plus 32 bytes of fifth bits after the scales
//   Q6_K (type 14)  W 256, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
//                   scales (one per 16 weights), fp16 d                  w = (d sc) (q - 32)
// In a 32-weight nibble block, byte j holds weight j in its low nibble and weight j + 16 in its
// high one, and bit j of Q5's u32 is weight j's fifth bit. In the K formats, group g (32 weights)
// takes the nibbles (low for even g, high for odd) of bytes 32 (g / 2) .. of the quants; Q5_K's
// fifth bit of weight l in group g is bit g of byte l; Q6_K's half h = g / 4, k = g % 4 takes the
// low (k < 2) or high nibbles of ql[64 h + 32 (k % 2) + l] and bits 2k of qh[32 h + l].
//
// The values are exactly the `gguf` package's dequantizer's (gguf.quants): every product above is
// exact in fp32 (an 11-bit fp16 significand times integers of at most 13 bits together), and the
// `+ m` / `- dmin mn` is one fp32 rounding after it, never fused into a multiply-add (so the
// decoders here keep the multiply and the add apart, and are compiled without contraction).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common/cpu_vec.h"

namespace eecore::gguf {

// Every kernel works in groups of 32 weights: a block of the 32-weight formats, an eighth of a K
// format's superblock.
constexpr int64_t kGroupWeights = 32;

// How far ahead of the bytes it multiplies a GGUF kernel that reads a weight once, in address
// order, asks for the weight (into L2, by prefetcht1): one row's worth at a time in the exact kernel's
// one-row dots (linear_gguf_cpu.cpp), one block's in the 8-bit kernel (gguf_q8.h). Left to the
// hardware prefetcher the weight arrived late, and a pass cost about its memory time plus its
// arithmetic. 6 KiB is about one 16-row group of a 576-wide projection in Q4_1; 2-4 KiB gained less,
// 12 KiB and more less again (Zen 5, 2 threads; docs/gguf.md has the figures).
constexpr int64_t kStreamAheadBytes = 6144;

enum class QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct BlockFormat {
  QuantType type;
  const char* name;
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

inline constexpr BlockFormat kFormats[] = {
    {QuantType::Q4_0, "Q4_0", 32, 18},   {QuantType::Q4_1, "Q4_1", 32, 20},   {QuantType::Q5_0, "Q5_0", 32, 22},
    {QuantType::Q5_1, "Q5_1", 32, 24},   {QuantType::Q8_0, "Q8_0", 32, 34},   {QuantType::Q4_K, "Q4_K", 256, 144},
    {QuantType::Q5_K, "Q5_K", 256, 176}, {QuantType::Q6_K, "Q6_K", 256, 210},
};

// The format of GGML type id `type`, or nullptr for a type these kernels do not take.
inline const BlockFormat* find_format(int64_t type) {
  for (const BlockFormat& f : kFormats)
    if (static_cast<int64_t>(f.type) == type) return &f;
  return nullptr;
}

// "2 (Q4_0), 3 (Q4_1), ..." for error messages.
inline std::string format_list() {
  std::string s;
  for (const BlockFormat& f : kFormats) {
    if (!s.empty()) s += ", ";
    s += std::to_string(static_cast<int64_t>(f.type)) + " (" + f.name + ")";
  }
  return s;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

// Group g's (scale, min) of a Q4_K / Q5_K superblock: 6-bit fields, the first four groups' in the
// low bits of bytes 0..7, the last four's split between bytes 8..11 and the top bits of 0..7.
inline void scale_min_k(const uint8_t* scales, int g, int& scale, int& min) {
  if (g < 4) {
    scale = scales[g] & 63;
    min = scales[g + 4] & 63;
  } else {
    scale = (scales[g + 4] & 0x0F) | ((scales[g - 4] >> 6) << 4);
    min = (scales[g + 4] >> 4) | ((scales[g] >> 6) << 4);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#define EECORE_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define EECORE_NO_FP_CONTRACT
#endif

// ---- one block into fp32 (the exact values, for whole-weight dequantization) ------------------

EECORE_NO_FP_CONTRACT inline void dequantize_q4_0(const uint8_t* block, float* dst) {
  const float d = half_at(block);
  const uint8_t* qs = block + 2;
  for (int j = 0; j < 16; ++j) {
    dst[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
    dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

EECORE_NO_FP_CONTRACT inline void dequantize_q4_1(const uint8_t* block, float* dst) {
  const float d = half_at(block), m = half_at(block + 2);
  const uint8_t* qs = block + 4;
  for (int j = 0; j < 16; ++j) {
    const float lo = d * static_cast<float>(qs[j] & 0x0F), hi = d * static_cast<float>(qs[j] >> 4);
    dst[j] = lo + m;
    dst[j + 16] = hi + m;
  }
}

// Q5_0 / Q5_1's 32 five-bit integers.
inline void five_bit_quants(const uint8_t* qh_bytes, const uint8_t* qs, int* q) {
  const uint32_t qh = u32_at(qh_bytes);
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
    q[j + 16] = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
  }
}

EECORE_NO_FP_CONTRACT inline void dequantize_q5_0(const uint8_t* block, float* dst) {
  const float d = half_at(block);
  int q[32];
  five_bit_quants(block + 2, block + 6, q);
  for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(q[j] - 16);
}

EECORE_NO_FP_CONTRACT inline void dequantize_q5_1(const uint8_t* block, float* dst) {
  const float d = half_at(block), m = half_at(block + 2);
  int q[32];
  five_bit_quants(block + 4, block + 8, q);
  for (int j = 0; j < 32; ++j) {
    const float scaled = d * static_cast<float>(q[j]);
    dst[j] = scaled + m;
  }
}

EECORE_NO_FP_CONTRACT inline void dequantize_q8_0(const uint8_t* block, float* dst) {
  const float d = half_at(block);
  const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
  for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(qs[j]);
}

// Q4_K (fifth_bits null) and Q5_K: 256 weights.
EECORE_NO_FP_CONTRACT inline void dequantize_k4_k5(const uint8_t* block, const uint8_t* fifth_bits,
                                                   const uint8_t* qs, float* dst) {
  const float d = half_at(block), dmin = half_at(block + 2);
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    scale_min_k(block + 4, g, scale, min);
    const float ds = d * static_cast<float>(scale), dm = dmin * static_cast<float>(min);
    const uint8_t* bytes = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      int q = (bytes[l] >> shift) & 0x0F;
      if (fifth_bits != nullptr) q |= ((fifth_bits[l] >> g) & 1) << 4;
      const float scaled = ds * static_cast<float>(q);
      dst[32 * g + l] = scaled - dm;
    }
  }
}

EECORE_NO_FP_CONTRACT inline void dequantize_q6_k(const uint8_t* block, float* dst) {
  const uint8_t *ql = block, *qh = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int g = 0; g < 8; ++g) {
    const int h = g / 4, k = g % 4;
    for (int l = 0; l < 32; ++l) {
      const int low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
      const int high = (qh[32 * h + l] >> (2 * k)) & 3;
      const float ds = d * static_cast<float>(scales[2 * g + l / 16]);
      dst[32 * g + l] = ds * static_cast<float>((low | (high << 4)) - 32);
    }
  }
}

// One row of K weights (K / W blocks of `type`) into `dst` [K] fp32.
inline void dequantize_row(int64_t type, const uint8_t* row, int64_t K, float* dst) {
  const BlockFormat& f = *find_format(type);
  const int64_t blocks = K / f.weights;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * f.bytes;
    float* out = dst + b * f.weights;
    switch (f.type) {
      case QuantType::Q4_0: dequantize_q4_0(block, out); break;
      case QuantType::Q4_1: dequantize_q4_1(block, out); break;
      case QuantType::Q5_0: dequantize_q5_0(block, out); break;
      case QuantType::Q5_1: dequantize_q5_1(block, out); break;
      case QuantType::Q8_0: dequantize_q8_0(block, out); break;
      case QuantType::Q4_K: dequantize_k4_k5(block, nullptr, block + 16, out); break;
      case QuantType::Q5_K: dequantize_k4_k5(block, block + 16, block + 48, out); break;
      case QuantType::Q6_K: dequantize_q6_k(block, out); break;
    }
  }
}

}  // namespace eecore::gguf
