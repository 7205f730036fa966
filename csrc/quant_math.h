// Per-value math of quantize_pack / unpack_dequantize, shared by the CPU and CUDA kernels.
//
// The storage format and the pure-PyTorch oracle live in lightning_act/ops/reference.py.
// Every floating-point step below is a single IEEE float32 operation in the reference's
// order, so both kernels reproduce the reference bit for bit. On the device the
// round-to-nearest intrinsics keep nvcc from fusing a multiply and an add into an FMA;
// host code is compiled with -ffp-contract=off for the same reason.
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

// mix32's multipliers, named for the CPU's vector form of mix32_tail (quant_cpu.h).
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

// Key of the noise stream of the elements whose index has high half `index_high`
// (reference._stream_key). A group never straddles two streams: group sizes divide 2**32.
LIGHTNING_ACT_HD uint32_t stream_key(uint64_t seed, uint32_t index_high) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) ^ index_high));
}

// The noise u in [0, 1) a hash gives: exact in float32, 24 random bits times a power of two.
LIGHTNING_ACT_HD float noise_of_hash(uint32_t hash) {
  return mul_rn(static_cast<float>(static_cast<int32_t>(hash >> 8)), 5.9604644775390625e-8f);  // 2**-24
}

// Rounding noise u in [0, 1) of element `index` (reference.uniform_noise).
LIGHTNING_ACT_HD float uniform_noise(uint32_t key, uint64_t index) {
  return noise_of_hash(mix32(static_cast<uint32_t>(index) ^ key));
}

// uniform_noise over a run of elements whose indices share their bits 16..31, such as a
// group (group sizes divide 65536 and groups start at multiples of their size). Then
// x = index ^ key has the same bits 16..31 throughout, so mix32's first step xors every x
// with the same word: run_key folds that word into the key once and run_noise skips the step.
LIGHTNING_ACT_HD uint32_t run_key(uint32_t key, uint32_t first_index) { return key ^ ((first_index ^ key) >> 16); }

LIGHTNING_ACT_HD float run_noise(uint32_t run_key, uint32_t index) { return noise_of_hash(mix32_tail(index ^ run_key)); }

// float32 bits rounded to a bfloat16 value (still as float32 bits) toward -inf or +inf.
LIGHTNING_ACT_HD uint32_t bf16_bits_rounded(uint32_t bits, bool upward) {
  const uint32_t truncated = bits & 0xFFFF0000u;  // toward zero
  const bool inexact = (bits & 0xFFFFu) != 0;
  const bool negative = (bits & kSignBit) != 0;
  const bool away_from_zero = inexact && (upward ? !negative : negative);
  return away_from_zero ? truncated + 0x10000u : truncated;
}

// Maps float32 bits to an int32 whose signed order is the numeric order of the floats, with
// -0 below +0. Reducing these integers gives exact, NaN-free min/max that do not depend on
// the order in which a kernel visits the values. The map is its own inverse.
LIGHTNING_ACT_HD int32_t order_key(uint32_t bits) {
  const uint32_t magnitude_flip = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) & 0x7FFFFFFFu;
  return static_cast<int32_t>(bits ^ magnitude_flip);
}

LIGHTNING_ACT_HD float key_float(int32_t key) {
  return bits_float(static_cast<uint32_t>(order_key(static_cast<uint32_t>(key))));
}

// What the first pass over a group gathers: the statistics that fix its (low, step).
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

  // add without the test for NaN and Inf: a loop that gathers a group this way sets
  // `nonfinite` once at the end, from the extreme keys.
  LIGHTNING_ACT_HD void add_ordered(uint32_t bits) {
    const int32_t key = order_key(bits);
    min_key = key < min_key ? key : min_key;
    max_key = key > max_key ? key : max_key;
    // Positive floats (including +inf) are exactly the bit patterns in (0, 2**31); their
    // unsigned order is their numeric order.
    const uint32_t positive_bits = static_cast<int32_t>(bits) > 0 ? bits : kExponentBits;
    min_positive_bits = positive_bits < min_positive_bits ? positive_bits : min_positive_bits;
  }

  // Whether the keys from min_key to max_key reach NaN or Inf: every finite value's key lies
  // strictly between those of -inf and +inf, and every NaN's beyond them.
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
    // The group spans more than float32 can hold: stored as NaN, like a non-finite group.
    return GroupParams();
  }

  params.stats_low = static_cast<uint16_t>(low_bits >> 16);
  params.stats_step = static_cast<uint16_t>(step_bits >> 16);
  if (params.zero_preserving) {
    params.stats_step |= kStatsSignBit;
  }
  return params;
}

// The code of a value whose scaled level (its offset in steps plus the noise) is `level`.
//
// The reference floors q + u and then clamps to [0, max_level]. Clamping first and then
// truncating toward zero gives the same integer (the bounds are integers, and every value
// below 0 floors to a negative code that clamps to 0) without a floor, and keeps the
// float-to-int conversion in range. A NaN q, reachable only when a group's range overflows
// float32, becomes code 0 like the reference's float-to-uint8 conversion. Selects rather
// than branches, so that loops over a group vectorise.
LIGHTNING_ACT_HD uint32_t code_of_level(float level, float value, float max_level, bool zero_preserving) {
  level = level > 0.0f ? level : 0.0f;
  level = level < max_level ? level : max_level;
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(level));
  const uint32_t shifted = value > 0.0f ? code + 1u : 0u;
  return zero_preserving ? shifted : code;
}

// The code of one value of a finite group whose step is positive, the group's grid passed
// as plain values: the form of encode_value that CPU loops over a group vectorise.
LIGHTNING_ACT_HD uint32_t encode_with_step(float value, float low, float step, float max_level, bool zero_preserving,
                                           float noise) {
  return code_of_level(add_rn(div_rn(sub_rn(value, low), step), noise), value, max_level, zero_preserving);
}

// The code of one value of a group, before packing.
LIGHTNING_ACT_HD uint32_t encode_value(float value, const GroupParams& params, float noise) {
  if (!params.finite) {
    return 0;
  }
  if (params.step > 0.0f) {
    return encode_with_step(value, params.low, params.step, params.max_level, params.zero_preserving, noise);
  }
  // A zero step (every value equal, or one positive value besides zeros): the scaled
  // offset is 0.
  return code_of_level(add_rn(0.0f, noise), value, params.max_level, params.zero_preserving);
}

// A group's grid as unpack_dequantize reads it back from its two bfloat16 words.
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

// Computes the value and then clears its bits for a zero-preserving group's code 0 (+0.0),
// instead of branching, so that loops over a group vectorise.
LIGHTNING_ACT_HD float decode_value(uint32_t code, const DecodeParams& params) {
  const float level = sub_rn(static_cast<float>(code), params.zero_preserving ? 1.0f : 0.0f);
  const float decoded = add_rn(params.low, mul_rn(level, params.step));
  const uint32_t keep = params.zero_preserving && code == 0 ? 0u : ~0u;
  return bits_float(float_bits(decoded) & keep);
}

// quantize_pack's column_major read: matrices of `rows x columns` values in row-major
// memory, read column by column. A cursor walks that read, one value at a time, keeping the
// memory offset of the value it stands on.
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

  // The cursor on value `index` of the read.
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
