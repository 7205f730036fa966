// CPU group encoder/decoder for quantize_pack / unpack_dequantize and the DIVISION residual,
// parallel over groups. Per-group branches are hoisted so every loop over a group is
// branch-free and vectorises (noise hash included). Encoding: a range pass, then a code pass
// into a byte buffer, then packing. Per-value math is quant_math.h's, shared with CUDA.
//
// Built for baseline x86-64 plus an AVX2 copy picked at run time (AVX2 has the 32-bit
// multiply the hash needs); the AVX2 copy adds hand-written range, unpack and block-encode loops.
//
// Functors (each task gets its own copy, so they may keep scratch state):
// * GroupSource `const float* operator()(start, count, float* buffer)`: values
//   [start, start + count), in `buffer` (room for a group) or where they already are;
// * GroupSink `void operator()(start, count, const Decoded& decoded)`: stores value
//   start + i = decoded(i), decoding inside the store loop.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_args.h"
#include "quant_math.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define LIGHTNING_ACT_AVX2_DISPATCH 1
#define LIGHTNING_ACT_TARGET_AVX2 __attribute__((target("avx2")))
#endif

#if defined(__GNUC__)
// Inlined into each per-target copy of a task, so compiled for that target.
#define LIGHTNING_ACT_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define LIGHTNING_ACT_ALWAYS_INLINE inline
#endif

namespace lightning_act {

// Values per parallel task: enough to amortise scheduling.
constexpr int64_t kValuesPerTask = 1 << 15;

inline int64_t grain(int64_t values_per_item) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_item));
}

inline bool cpu_has_avx2() {
#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  return has_avx2;
#else
  return false;
#endif
}

// Instruction-set tags passed to tasks, selecting hand-written paths.
struct Portable {};
struct Avx2 {};

template <typename Task>
void run_portable(Task& task, int64_t first, int64_t last) {
  task(first, last, Portable{});
}

#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
template <typename Task>
LIGHTNING_ACT_TARGET_AVX2 void run_avx2(Task& task, int64_t first, int64_t last) {
  task(first, last, Avx2{});
}
#endif

// Runs `task(first, last, isa)` over [0, items) in parallel on per-task copies, as Avx2 where
// the CPU has it, else Portable. Task::operator() must be LIGHTNING_ACT_ALWAYS_INLINE.
template <typename Task>
void parallel_tasks(int64_t items, int64_t values_per_item, const Task& task) {
  const bool avx2 = cpu_has_avx2();
  at::parallel_for(0, items, grain(values_per_item), [&](int64_t first, int64_t last) {
    Task local = task;
#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
    if (avx2) {
      run_avx2(local, first, last);
      return;
    }
#endif
    run_portable(local, first, last);
  });
}

// Prefetch distance of memory-order passes: a group's later passes run from L1, so the
// hardware prefetcher loses the stream and the next group's first pass would stall.
constexpr int64_t kGroupsAhead = 2;

// Prefetches [start, start + count) of `base` (clipped to `total`) for reading or writing.
template <bool kWrite, typename T>
LIGHTNING_ACT_ALWAYS_INLINE void prefetch_values(const T* base, int64_t start, int64_t count, int64_t total) {
  const int64_t end = std::min(start + count, total);
  const char* const first = reinterpret_cast<const char*>(base + std::min(start, total));
  const int64_t bytes = std::max<int64_t>(0, end - start) * static_cast<int64_t>(sizeof(T));
#if defined(__GNUC__)
  for (int64_t line = 0; line < bytes; line += 64) {
    __builtin_prefetch(first + line, kWrite ? 1 : 0, 3);
  }
#endif
}

// Integer holding the 8 / kBits one-byte codes of one packed byte.
template <int kBits>
struct CodeWord;
template <>
struct CodeWord<1> {
  using type = uint64_t;
};
template <>
struct CodeWord<2> {
  using type = uint32_t;
};
template <>
struct CodeWord<4> {
  using type = uint16_t;
};

// Packs `count` (a multiple of 8) one-byte codes little-endian, 8 / kBits per byte: shifting
// the codes' word right by j * (8 - kBits) puts code j at bit j * kBits; OR the shifts.
template <int kBits>
LIGHTNING_ACT_ALWAYS_INLINE void pack_codes(const uint8_t* codes, int64_t count, uint8_t* packed) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "codes are read as little-endian words");
  if constexpr (kBits == 8) {
    std::memcpy(packed, codes, count);
  } else {
    using Word = typename CodeWord<kBits>::type;
    constexpr int kPerByte = 8 / kBits;
    const uint32_t bytes = static_cast<uint32_t>(count / kPerByte);
    for (uint32_t byte = 0; byte < bytes; ++byte) {
      Word word;
      std::memcpy(&word, codes + byte * kPerByte, sizeof(word));
      Word merged = 0;
      for (int j = 0; j < kPerByte; ++j) {
        merged |= static_cast<Word>(word >> (j * (8 - kBits)));
      }
      packed[byte] = static_cast<uint8_t>(merged);
    }
  }
}

// Inverse of pack_codes: shift left by j * (8 - kBits), then mask each byte's low kBits.
template <int kBits>
LIGHTNING_ACT_ALWAYS_INLINE void unpack_codes(Portable, const uint8_t* packed, int64_t bytes, uint8_t* codes) {
  if constexpr (kBits == 8) {
    std::memcpy(codes, packed, bytes);
  } else {
    using Word = typename CodeWord<kBits>::type;
    constexpr int kPerByte = 8 / kBits;
    constexpr Word kCodeMask = static_cast<Word>(0x0101010101010101ull * ((1u << kBits) - 1u));
    const uint32_t count = static_cast<uint32_t>(bytes);
    for (uint32_t byte = 0; byte < count; ++byte) {
      const Word bits = packed[byte];
      Word spread = 0;
      for (int j = 0; j < kPerByte; ++j) {
        spread |= static_cast<Word>(bits << (j * (8 - kBits)));
      }
      spread &= kCodeMask;
      std::memcpy(codes + byte * kPerByte, &spread, sizeof(spread));
    }
  }
}

LIGHTNING_ACT_ALWAYS_INLINE GroupRange range_of(Portable, const float* values, int64_t count) {
  GroupRange range;
  for (int64_t i = 0; i < count; ++i) {
    range.add_ordered(float_bits(values[i]));
  }
  range.nonfinite = range.keys_reach_nonfinite();
  return range;
}

// encode_value over a finite group's values from `first_index` (low 32 bits) of stream `key`,
// with the group's branches hoisted into template flags.
template <bool kZeroPreserving, bool kPositiveStep>
LIGHTNING_ACT_ALWAYS_INLINE void encode_codes(const float* values, int64_t count, const GroupParams& params,
                                              uint32_t key, uint32_t first_index, uint8_t* codes) {
  const float low = params.low;
  const float step = params.step;
  const float max_level = params.max_level;
  const uint32_t noise_key = run_key(key, first_index);
  const uint32_t n = static_cast<uint32_t>(count);  // a 32-bit index vectorises with 32-bit lanes
  for (uint32_t i = 0; i < n; ++i) {
    // Zero step: the level is the noise in [0, 1), which truncates to 0, so none is drawn.
    const uint32_t code =
        kPositiveStep ? encode_with_step(values[i], low, step, max_level, kZeroPreserving,
                                         run_noise(noise_key, first_index + i))
                      : code_of_level(0.0f, values[i], max_level, kZeroPreserving);
    codes[i] = static_cast<uint8_t>(code);
  }
}

// How many leading values (finite group, positive step) an ISA-specific loop encodes and
// packs; the portable loops do the rest. None for Portable.
template <int kBits, bool kZeroPreserving>
LIGHTNING_ACT_ALWAYS_INLINE int64_t encode_blocks(Portable, const float*, int64_t, const GroupParams&, uint32_t,
                                                  uint32_t, uint8_t*) {
  return 0;
}

// Likewise for lookup_levels: leading codes looked up by an ISA-specific loop.
template <int kBits>
LIGHTNING_ACT_ALWAYS_INLINE int64_t lookup_values(Portable, const uint8_t*, const float*, int64_t, float*) {
  return 0;
}

#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
// Hand-written AVX2 forms of the loops above: bit-identical to the portable forms, which
// handle the tail short of a whole vector (or block).

template <typename T, typename Fold>
LIGHTNING_ACT_TARGET_AVX2 LIGHTNING_ACT_ALWAYS_INLINE T fold_lanes(__m256i lanes, Fold fold) {
  alignas(32) T values[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(values), lanes);
  T folded = values[0];
  for (int i = 1; i < 8; ++i) {
    folded = fold(folded, values[i]);
  }
  return folded;
}

// range_of on raw bits (cheaper than order keys): signed max/min and unsigned max give both
// extreme keys; unsigned min of bits - 1 gives the smallest positive, as bits - 1 moves +0
// (wrapping) and negatives above every positive.
LIGHTNING_ACT_TARGET_AVX2 inline GroupRange range_of(Avx2, const float* values, int64_t count) {
  GroupRange range;
  const int64_t vectored = count / 8 * 8;
  if (vectored > 0) {
    const __m256i one = _mm256_set1_epi32(1);
    __m256i signed_max = _mm256_set1_epi32(INT32_MIN);
    __m256i signed_min = _mm256_set1_epi32(INT32_MAX);
    __m256i unsigned_max = _mm256_setzero_si256();
    __m256i below_positive_min = _mm256_set1_epi32(-1);
    for (int64_t i = 0; i < vectored; i += 8) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
      signed_max = _mm256_max_epi32(signed_max, bits);
      signed_min = _mm256_min_epi32(signed_min, bits);
      unsigned_max = _mm256_max_epu32(unsigned_max, bits);
      below_positive_min = _mm256_min_epu32(below_positive_min, _mm256_sub_epi32(bits, one));
    }
    const auto max = [](auto a, auto b) { return a > b ? a : b; };
    const auto min = [](auto a, auto b) { return a < b ? a : b; };
    const int32_t bits_max = fold_lanes<int32_t>(signed_max, max);
    const int32_t bits_min = fold_lanes<int32_t>(signed_min, min);
    const uint32_t bits_unsigned_max = fold_lanes<uint32_t>(unsigned_max, max);
    const uint32_t below_positive = fold_lanes<uint32_t>(below_positive_min, min);
    // Non-negative keys are the bits; a negative's key falls as its bits rise.
    const int32_t max_key = bits_max >= 0 ? bits_max : order_key(static_cast<uint32_t>(bits_min));
    const int32_t min_key = static_cast<int32_t>(bits_unsigned_max) < 0 ? order_key(bits_unsigned_max) : bits_min;
    const uint32_t min_positive_bits = below_positive < 0x7FFFFFFFu ? below_positive + 1u : kExponentBits;
    range.merge(min_key, max_key, min_positive_bits, 0);
  }
  for (int64_t i = vectored; i < count; ++i) {
    range.add_ordered(float_bits(values[i]));
  }
  range.nonfinite = range.keys_reach_nonfinite();
  return range;
}

// pack_codes for 32 one-byte codes in a register.
template <int kBits>
LIGHTNING_ACT_TARGET_AVX2 LIGHTNING_ACT_ALWAYS_INLINE void pack_block(__m256i codes, uint8_t* packed) {
  if constexpr (kBits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed), codes);
  } else if constexpr (kBits == 4) {
    // Byte pairs to code 0 + 16 * code 1 (multiply-add into 16-bit lanes).
    const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x1001));
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed), _mm256_castsi256_si128(bytes));
  } else if constexpr (kBits == 2) {
    // Pairs as above, then pair 0 + 16 * pair 1 into 32-bit lanes; gather the low bytes.
    const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x0401));
    const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00100001));
    const __m256i low_bytes = _mm256_shuffle_epi8(
        quads, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
                                -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i bytes = _mm_unpacklo_epi32(_mm256_castsi256_si128(low_bytes), _mm256_extracti128_si256(low_bytes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(packed), bytes);
  } else {
    // Each code's bit to its byte's sign bit, gathered by movemask.
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(codes, 7)));
    std::memcpy(packed, &bits, sizeof(bits));
  }
}

// encode_codes<kZeroPreserving, true> + pack_codes over whole blocks of 32 values, in registers.
template <int kBits, bool kZeroPreserving>
LIGHTNING_ACT_TARGET_AVX2 int64_t encode_blocks(Avx2, const float* values, int64_t count, const GroupParams& params,
                                                uint32_t key, uint32_t first_index, uint8_t* packed) {
  const __m256 low = _mm256_set1_ps(params.low);
  const __m256 step = _mm256_set1_ps(params.step);
  const __m256 max_level = _mm256_set1_ps(params.max_level);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 noise_unit = _mm256_set1_ps(5.9604644775390625e-8f);  // noise_of_hash's 2**-24
  const __m256i multiplier2 = _mm256_set1_epi32(static_cast<int32_t>(kMixMultiplier2));
  // mix32_tail first multiplies x = index ^ noise_key by kMixMultiplier1. With index = b + j
  // (b a multiple of 32), x = (b ^ (noise_key & ~31)) + (j ^ (noise_key & 31)), so the product
  // is a per-block scalar plus per-j products fixed across blocks: an add replaces a vpmulld.
  const uint32_t noise_key = run_key(key, first_index);
  const uint32_t block_key = noise_key & ~31u;
  __m256i lane_products[4];
  for (int v = 0; v < 4; ++v) {
    const __m256i j = _mm256_setr_epi32(8 * v, 8 * v + 1, 8 * v + 2, 8 * v + 3, 8 * v + 4, 8 * v + 5, 8 * v + 6, 8 * v + 7);
    lane_products[v] =
        _mm256_mullo_epi32(_mm256_xor_si256(j, _mm256_set1_epi32(static_cast<int32_t>(noise_key & 31u))),
                           _mm256_set1_epi32(static_cast<int32_t>(kMixMultiplier1)));
  }
  // The packs work per 128-bit half, leaving 4-byte runs as 0, 2, 4, 6, 1, 3, 5, 7.
  const __m256i run_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t blocks_end = count / 32 * 32;
  for (int64_t i = 0; i < blocks_end; i += 32) {
    const uint32_t block_index = first_index + static_cast<uint32_t>(i);
    const __m256i block_product = _mm256_set1_epi32(static_cast<int32_t>((block_index ^ block_key) * kMixMultiplier1));
    __m256i code[4];
    for (int v = 0; v < 4; ++v) {
      __m256i hash = _mm256_add_epi32(block_product, lane_products[v]);
      hash = _mm256_xor_si256(hash, _mm256_srli_epi32(hash, 15));
      hash = _mm256_mullo_epi32(hash, multiplier2);
      hash = _mm256_xor_si256(hash, _mm256_srli_epi32(hash, 16));
      const __m256 noise = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hash, 8)), noise_unit);

      const __m256 value = _mm256_loadu_ps(values + i + 8 * v);
      __m256 level = _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(value, low), step), noise);
      // code_of_level's clamps: max/min return the second operand on NaN or a tie, like its selects.
      level = _mm256_min_ps(_mm256_max_ps(level, zero), max_level);
      code[v] = _mm256_cvttps_epi32(level);
      if constexpr (kZeroPreserving) {
        const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(value, zero, _CMP_GT_OQ));
        code[v] = _mm256_and_si256(_mm256_sub_epi32(code[v], positive), positive);  // code + 1, or 0
      }
    }
    const __m256i bytes =
        _mm256_packus_epi16(_mm256_packus_epi32(code[0], code[1]), _mm256_packus_epi32(code[2], code[3]));
    pack_block<kBits>(_mm256_permutevar8x32_epi32(bytes, run_order), packed + i * kBits / 8);
  }
  return blocks_end;
}

// lookup_values for float32: the row (<= 16 values) held in registers, picked by lane permutes.
template <int kBits>
LIGHTNING_ACT_TARGET_AVX2 int64_t lookup_values(Avx2, const uint8_t* codes, const float* row, int64_t count,
                                                float* values) {
  if constexpr (kBits == 8) {
    return 0;
  } else {
    // Lanes past the row's 2**kBits values are never picked.
    __m256 low;
    if constexpr (kBits == 1) {
      low = _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(row))));
    } else if constexpr (kBits == 2) {
      low = _mm256_castps128_ps256(_mm_loadu_ps(row));
    } else {
      low = _mm256_loadu_ps(row);
    }
    const int64_t vectored = count / 8 * 8;
    for (int64_t i = 0; i < vectored; i += 8) {
      int64_t eight;
      std::memcpy(&eight, codes + i, sizeof(eight));
      const __m256i index = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
      __m256 picked = _mm256_permutevar8x32_ps(low, index);  // by the index's low 3 bits
      if constexpr (kBits == 4) {
        const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(row + 8), index);
        picked = _mm256_blendv_ps(picked, high, _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(7))));
      }
      _mm256_storeu_ps(values + i, picked);
    }
    return vectored;
  }
}

// unpack_codes, 32 codes at a time (the compiler may leave the portable loop scalar).
template <int kBits>
LIGHTNING_ACT_TARGET_AVX2 void unpack_codes(Avx2, const uint8_t* packed, int64_t bytes, uint8_t* codes) {
  if constexpr (kBits == 8) {
    std::memcpy(codes, packed, bytes);
  } else {
    constexpr int kPerByte = 8 / kBits;
    constexpr int64_t kBlockBytes = 32 / kPerByte;  // the packed bytes of 32 codes
    const int64_t blocks_end = bytes / kBlockBytes * kBlockBytes;
    for (int64_t byte = 0; byte < blocks_end; byte += kBlockBytes) {
      __m256i spread;
      if constexpr (kBits == 4) {
        const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + byte)));
        spread = _mm256_and_si256(_mm256_or_si256(words, _mm256_slli_epi16(words, 4)), _mm256_set1_epi16(0x0F0F));
      } else if constexpr (kBits == 2) {
        const __m256i words = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + byte)));
        spread = _mm256_or_si256(_mm256_or_si256(words, _mm256_slli_epi32(words, 6)),
                                 _mm256_or_si256(_mm256_slli_epi32(words, 12), _mm256_slli_epi32(words, 18)));
        spread = _mm256_and_si256(spread, _mm256_set1_epi32(0x03030303));
      } else {
        // Each packed byte copied to eight; byte j keeps bit j, then becomes 0 or 1.
        uint32_t four;
        std::memcpy(&four, packed + byte, sizeof(four));
        const __m256i copies =
            _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(four)),
                                _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bits = _mm256_and_si256(copies, _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull)));
        spread = _mm256_min_epu8(bits, _mm256_set1_epi8(1));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + byte * kPerByte), spread);
    }
    unpack_codes<kBits>(Portable{}, packed + blocks_end, bytes - blocks_end, codes + blocks_end * kPerByte);
  }
}
#endif

template <int kBits, typename GroupSource>
struct EncodeTask {
  GroupSource source;
  int64_t numel;
  int64_t group_size;
  uint64_t seed;
  uint8_t* code_bytes;
  uint16_t* stats_words;
  std::vector<float> buffer;
  std::vector<uint8_t> codes;

  template <typename Isa>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first_group, int64_t last_group, Isa isa) {
    buffer.resize(group_size);
    codes.resize(group_size);
    for (int64_t group = first_group; group < last_group; ++group) {
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      const float* values = source(start, valid, buffer.data());
      const GroupParams params = group_params(range_of(isa, values, valid), kBits);
      stats_words[2 * group] = params.stats_low;
      stats_words[2 * group + 1] = params.stats_step;

      uint8_t* packed = code_bytes + start * kBits / 8;
      if (!params.finite) {
        std::memset(packed, 0, group_size * kBits / 8);
        continue;
      }
      const uint32_t key = stream_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32));
      const uint32_t first_index = static_cast<uint32_t>(start);
      const bool positive_step = params.step > 0.0f;
      int64_t done = 0;
      if (positive_step) {
        done = params.zero_preserving ? encode_blocks<kBits, true>(isa, values, valid, params, key, first_index, packed)
                                      : encode_blocks<kBits, false>(isa, values, valid, params, key, first_index, packed);
      }
      const float* const rest = values + done;
      const int64_t rest_count = valid - done;
      const uint32_t rest_index = first_index + static_cast<uint32_t>(done);
      uint8_t* const rest_codes = codes.data() + done;
      if (params.zero_preserving) {
        positive_step ? encode_codes<true, true>(rest, rest_count, params, key, rest_index, rest_codes)
                      : encode_codes<true, false>(rest, rest_count, params, key, rest_index, rest_codes);
      } else {
        positive_step ? encode_codes<false, true>(rest, rest_count, params, key, rest_index, rest_codes)
                      : encode_codes<false, false>(rest, rest_count, params, key, rest_index, rest_codes);
      }
      // The last group's padding gets code 0.
      std::fill(codes.begin() + valid, codes.end(), 0);
      pack_codes<kBits>(rest_codes, group_size - done, packed + done * kBits / 8);
    }
  }
};

// Quantizes `numel` values of `source` into `codes` and `stats` (from empty_codes_and_stats).
template <typename GroupSource>
void encode_groups(const GroupSource& source, int64_t numel, int64_t bits, int64_t group_size, uint64_t seed,
                   const at::Tensor& codes, const at::Tensor& stats) {
  uint8_t* const code_bytes = codes.mutable_data_ptr<uint8_t>();
  uint16_t* const stats_words = reinterpret_cast<uint16_t*>(stats.mutable_data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    const EncodeTask<kBits, GroupSource> task{source, numel, group_size, seed, code_bytes, stats_words, {}, {}};
    parallel_tasks(num_groups(numel, group_size), group_size, task);
  });
}

template <int kBits, typename GroupSink>
struct DecodeTask {
  GroupSink sink;
  int64_t numel;
  int64_t group_size;
  const uint8_t* code_bytes;
  const uint16_t* stats_words;
  std::vector<uint8_t> codes;

  template <typename Isa>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first_group, int64_t last_group, Isa isa) {
    constexpr int kPerByte = 8 / kBits;
    codes.resize(group_size);
    const uint8_t* const group_codes = codes.data();
    for (int64_t group = first_group; group < last_group; ++group) {
      const DecodeParams params = decode_params(stats_words[2 * group], stats_words[2 * group + 1]);
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      unpack_codes<kBits>(isa, code_bytes + start * kBits / 8, (valid + kPerByte - 1) / kPerByte, codes.data());
      // zero_preserving as a compile-time constant, so the sink's loop has no branch.
      const auto store = [&](auto zero_preserving) {
        DecodeParams group_params = params;
        group_params.zero_preserving = decltype(zero_preserving)::value;
        sink(start, valid, [group_codes, group_params](int64_t i) { return decode_value(group_codes[i], group_params); });
      };
      params.zero_preserving ? store(std::true_type{}) : store(std::false_type{});
    }
    sink.finish();  // a sink that writes in tiles writes its last one
  }
};

// lookup_levels task: each value is its group's table row at its code.
template <int kBits, typename scalar_t>
struct LookupTask {
  const uint8_t* code_bytes;
  const scalar_t* table;  // [groups, 2**kBits]
  scalar_t* output;
  int64_t numel;
  int64_t group_size;
  std::vector<uint8_t> codes;

  template <typename Isa>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first_group, int64_t last_group, Isa isa) {
    constexpr int kPerByte = 8 / kBits;
    codes.resize(group_size);
    for (int64_t group = first_group; group < last_group; ++group) {
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      unpack_codes<kBits>(isa, code_bytes + start * kBits / 8, (valid + kPerByte - 1) / kPerByte, codes.data());
      const scalar_t* const row = table + (group << kBits);
      scalar_t* const values = output + start;
      prefetch_values<true>(output, start + kGroupsAhead * group_size, group_size, numel);
      int64_t i = 0;
      if constexpr (std::is_same_v<scalar_t, float>) {
        i = lookup_values<kBits>(isa, codes.data(), row, valid, values);
      }
      for (; i < valid; ++i) {
        values[i] = row[codes[i]];
      }
    }
  }
};

// Decodes the first `numel` values of `codes` and `stats`, at `bits` bits, into `sink`.
template <typename GroupSink>
void decode_groups(const at::Tensor& codes, const at::Tensor& stats, int64_t numel, int64_t bits,
                   int64_t group_size, const GroupSink& sink) {
  const uint8_t* const code_bytes = codes.const_data_ptr<uint8_t>();
  const uint16_t* const stats_words = reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    const DecodeTask<kBits, GroupSink> task{sink, numel, group_size, code_bytes, stats_words, {}};
    parallel_tasks(num_groups(numel, group_size), group_size, task);
  });
}

}  // namespace lightning_act
