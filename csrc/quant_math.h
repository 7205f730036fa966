// Per-value math of quantize_pack / unpack_dequantize, shared by the CPU and CUDA kernels.
// Each float step is one IEEE float32 op in the order of lightning_act/ops/reference.py, so
// both match it bit for bit; the _rn intrinsics (device) and -ffp-contract=off (host) forbid FMA.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LIGHTNING_ACT_HD __host__ __device__ __forceinline__
#else
#define LIGHTNING_ACT_HD inline
#endif

namespace lightning_act {

constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kExponentBits = 0x7F800000u;  // also the bits of +inf
constexpr uint16_t kStatsNanBits = 0x7FC0;       // positive quiet NaN in bfloat16
constexpr uint16_t kStatsSignBit = 0x8000;

LIGHTNING_ACT_HD uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

LIGHTNING_ACT_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

LIGHTNING_ACT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

LIGHTNING_ACT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LIGHTNING_ACT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LIGHTNING_ACT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

constexpr uint32_t kMixMultiplier1 = 0x7FEB352Du;
constexpr uint32_t kMixMultiplier2 = 0x846CA68Bu;

// mix32 without its first step, x ^= x >> 16.
LIGHTNING_ACT_HD uint32_t mix32_tail(uint32_t x) {
  x *= kMixMultiplier1;
  x ^= x >> 15;
  x *= kMixMultiplier2;
  x ^= x >> 16;
  return x;
}

// A bijective 32-bit hash ("lowbias32"): reference.mix32.
LIGHTNING_ACT_HD uint32_t mix32(uint32_t x) { return mix32_tail(x ^ (x >> 16)); }

// Noise stream key for indices with high half `index_high` (reference._stream_key); a group
// never straddles two streams.
LIGHTNING_ACT_HD uint32_t stream_key(uint64_t seed, uint32_t index_high) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) ^ index_high));
}

// u in [0, 1): 24 hash bits times 2**-24, exact in float32.
LIGHTNING_ACT_HD float noise_of_hash(uint32_t hash) {
  return mul_rn(static_cast<float>(static_cast<int32_t>(hash >> 8)), 5.9604644775390625e-8f);  // 2**-24
}

// Rounding noise u in [0, 1) of element `index` (reference.uniform_noise).
LIGHTNING_ACT_HD float uniform_noise(uint32_t key, uint64_t index) {
  return noise_of_hash(mix32(static_cast<uint32_t>(index) ^ key));
}

// uniform_noise over indices sharing bits 16..31 (any group: sizes divide 65536): mix32's
// first step is then the same xor for all, so run_key folds it into the key once.
LIGHTNING_ACT_HD uint32_t run_key(uint32_t key, uint32_t first_index) { return key ^ ((first_index ^ key) >> 16); }

LIGHTNING_ACT_HD float run_noise(uint32_t run_key, uint32_t index) { return noise_of_hash(mix32_tail(index ^ run_key)); }

// float32 bits rounded to bfloat16 (as float32 bits) toward -inf or +inf.
LIGHTNING_ACT_HD uint32_t bf16_bits_rounded(uint32_t bits, bool upward) {
  const uint32_t truncated = bits & 0xFFFF0000u;  // toward zero
  const bool inexact = (bits & 0xFFFFu) != 0;
  const bool negative = (bits & kSignBit) != 0;
  const bool away_from_zero = inexact && (upward ? !negative : negative);
  return away_from_zero ? truncated + 0x10000u : truncated;
}

// float32 bits -> int32 in numeric order (-0 below +0), so min/max are exact and
// order-independent. Self-inverse.
LIGHTNING_ACT_HD int32_t order_key(uint32_t bits) {
  const uint32_t magnitude_flip = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) & 0x7FFFFFFFu;
  return static_cast<int32_t>(bits ^ magnitude_flip);
}

LIGHTNING_ACT_HD float key_float(int32_t key) {
  return bits_float(static_cast<uint32_t>(order_key(static_cast<uint32_t>(key))));
}

// First-pass statistics of a group, which fix its (low, step).
struct GroupRange {
  int32_t min_key = INT32_MAX;
  int32_t max_key = INT32_MIN;
  uint32_t min_positive_bits = kExponentBits;  // +inf: no positive value seen
  uint32_t nonfinite = 0;

  LIGHTNING_ACT_HD void add(float value) {
    const uint32_t bits = float_bits(value);
    add_ordered(bits);
    nonfinite |= static_cast<uint32_t>((bits & kExponentBits) == kExponentBits);
  }

  // add without the NaN/Inf test: callers set `nonfinite` from keys_reach_nonfinite().
  LIGHTNING_ACT_HD void add_ordered(uint32_t bits) {
    const int32_t key = order_key(bits);
    min_key = key < min_key ? key : min_key;
    max_key = key > max_key ? key : max_key;
    // Positive floats (incl. +inf) are the bits in (0, 2**31), ordered as unsigned ints.
    const uint32_t positive_bits = static_cast<int32_t>(bits) > 0 ? bits : kExponentBits;
    min_positive_bits = positive_bits < min_positive_bits ? positive_bits : min_positive_bits;
  }

  // Finite keys lie strictly between those of -inf and +inf; NaNs beyond them.
  LIGHTNING_ACT_HD bool keys_reach_nonfinite() const {
    return max_key >= order_key(kExponentBits) || min_key <= order_key(kSignBit | kExponentBits);
  }

  LIGHTNING_ACT_HD void merge(int32_t other_min_key, int32_t other_max_key, uint32_t other_min_positive_bits,
                              uint32_t other_nonfinite) {
    min_key = other_min_key < min_key ? other_min_key : min_key;
    max_key = other_max_key > max_key ? other_max_key : max_key;
    min_positive_bits = other_min_positive_bits < min_positive_bits ? other_min_positive_bits : min_positive_bits;
    nonfinite |= other_nonfinite;
  }
};

// A group's quantization grid and the two bfloat16 words stored for it.
struct GroupParams {
  float low = 0.0f;        // bfloat16 value, rounded down
  float step = 0.0f;       // bfloat16 value, rounded up; its magnitude only
  float max_level = 0.0f;  // largest code before the zero-preserving shift
  bool zero_preserving = false;
  bool finite = false;
  uint16_t stats_low = kStatsNanBits;
  uint16_t stats_step = kStatsNanBits;
};

LIGHTNING_ACT_HD GroupParams group_params(const GroupRange& range, int bits) {
  GroupParams params;
  if (range.nonfinite) {
    return params;
  }
  const float group_min = key_float(range.min_key);
  const float group_max = key_float(range.max_key);
  params.finite = true;
  params.zero_preserving = bits >= 2 && group_min == 0.0f;
  const uint32_t plain_levels = (1u << bits) - 1u;
  params.max_level = static_cast<float>(params.zero_preserving ? plain_levels - 1u : plain_levels);

  float low = group_min;
  if (params.zero_preserving) {
    low = range.min_positive_bits == kExponentBits ? 0.0f : bits_float(range.min_positive_bits);
  }
  const uint32_t low_bits = bf16_bits_rounded(float_bits(low), /*upward=*/false);
  params.low = bits_float(low_bits);
  const float step = div_rn(sub_rn(group_max, params.low), params.max_level);
  const uint32_t step_bits = bf16_bits_rounded(float_bits(step), /*upward=*/true);
  params.step = bits_float(step_bits);
  if ((low_bits & kExponentBits) == kExponentBits || (step_bits & kExponentBits) == kExponentBits) {
    // Range overflows float32: stored as NaN, like a non-finite group.
    return GroupParams();
  }

  params.stats_low = static_cast<uint16_t>(low_bits >> 16);
  params.stats_step = static_cast<uint16_t>(step_bits >> 16);
  if (params.zero_preserving) {
    params.stats_step |= kStatsSignBit;
  }
  return params;
}

// Code of scaled level q + u. The reference floors then clamps to [0, max_level]; clamping
// then truncating gives the same integer with the conversion in range, and NaN -> 0 as in the
// reference. Selects, not branches, so group loops vectorise.
LIGHTNING_ACT_HD uint32_t code_of_level(float level, float value, float max_level, bool zero_preserving) {
  level = level > 0.0f ? level : 0.0f;
  level = level < max_level ? level : max_level;
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(level));
  const uint32_t shifted = value > 0.0f ? code + 1u : 0u;
  return zero_preserving ? shifted : code;
}

// encode_value for a finite group with positive step, params as scalars (vectorises on CPU).
LIGHTNING_ACT_HD uint32_t encode_with_step(float value, float low, float step, float max_level, bool zero_preserving,
                                           float noise) {
  return code_of_level(add_rn(div_rn(sub_rn(value, low), step), noise), value, max_level, zero_preserving);
}

LIGHTNING_ACT_HD uint32_t encode_value(float value, const GroupParams& params, float noise) {
  if (!params.finite) {
    return 0;
  }
  if (params.step > 0.0f) {
    return encode_with_step(value, params.low, params.step, params.max_level, params.zero_preserving, noise);
  }
  // Zero step: the scaled offset is 0.
  return code_of_level(add_rn(0.0f, noise), value, params.max_level, params.zero_preserving);
}

// A group's grid as read back from its two bfloat16 stats words.
struct DecodeParams {
  float low;
  float step;
  bool zero_preserving;
};

LIGHTNING_ACT_HD DecodeParams decode_params(uint16_t stats_low, uint16_t stats_step) {
  DecodeParams params;
  params.low = bits_float(static_cast<uint32_t>(stats_low) << 16);
  params.step = bits_float(static_cast<uint32_t>(stats_step & 0x7FFFu) << 16);
  params.zero_preserving = (stats_step & kStatsSignBit) != 0;
  return params;
}

// Zero-preserving code 0 gives +0.0 by masking the bits, not branching, so loops vectorise.
LIGHTNING_ACT_HD float decode_value(uint32_t code, const DecodeParams& params) {
  const float level = sub_rn(static_cast<float>(code), params.zero_preserving ? 1.0f : 0.0f);
  const float decoded = add_rn(params.low, mul_rn(level, params.step));
  const uint32_t keep = params.zero_preserving && code == 0 ? 0u : ~0u;
  return bits_float(float_bits(decoded) & keep);
}

// column_major read order: row-major `rows x columns` matrices read column by column. The
// cursor walks it keeping the memory offset.
struct ColumnMajorCursor {
  int64_t rows;
  int64_t columns;
  int64_t row;
  int64_t column;
  int64_t offset;

  LIGHTNING_ACT_HD void next() {
    if (row + 1 < rows) {
      ++row;
      offset += columns;
    } else if (column + 1 < columns) {  // the top of the next column
      row = 0;
      ++column;
      offset -= (rows - 1) * columns - 1;
    } else {  // the first value of the next matrix, just past this one's last
      row = 0;
      column = 0;
      offset += 1;
    }
  }
};

struct ColumnMajorOrder {
  int64_t rows;
  int64_t columns;

  LIGHTNING_ACT_HD ColumnMajorCursor at(int64_t index) const {
    const int64_t values_per_matrix = rows * columns;
    const int64_t matrix = index / values_per_matrix;
    const int64_t within = index - matrix * values_per_matrix;
    const int64_t column = within / rows;
    const int64_t row = within - column * rows;
    return ColumnMajorCursor{rows, columns, row, column, matrix * values_per_matrix + row * columns + column};
  }
};

}  // namespace lightning_act
