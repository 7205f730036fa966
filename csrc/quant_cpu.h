// The CPU group encoder and decoder of quantize_pack / unpack_dequantize (quant_cpu.cpp)
// and of division_pack / division_unpack's residual (division_cpu.cpp). Groups are
// independent, so both run in parallel over groups.
//
// Every loop over a group is branch-free and runs over plain arrays, so the compiler
// vectorises it, the noise hash included: a group's constants (finite or not, zero-preserving
// or not, zero step or not) are decided once per group, outside the loops. A group is encoded
// in two passes over its float32 values, one gathering its range and one computing its codes
// into a byte buffer, then packed; decoding unpacks the bytes into that buffer and decodes
// them as it stores them. The per-value math is quant_math.h's, shared with the CUDA kernels, so both produce
// the same bits.
//
// The build targets baseline x86-64, which every user machine runs. The loops are compiled a
// second time for AVX2 and the CPU picks one at run time: AVX2 doubles the vector width and
// has the 32-bit multiply (vpmulld) the noise hash needs, which SSE2 lacks.
//
// The ops differ only in where a group's float32 values come from and where the decoded
// ones go, which the loops take as functors. Each parallel task works on its own copy, so a
// functor may keep scratch state:
//
// * a GroupSource, `const float* operator()(int64_t start, int64_t count, float* buffer)`,
//   returns the values [start, start + count): written to `buffer` (room for a group), or
//   where they already are;
// * a GroupSink, `void operator()(int64_t start, int64_t count, const Decoded& decoded)`,
//   stores the values [start, start + count), where value start + i is decoded(i), a float:
//   decoding runs inside the sink's store loop, in one pass.
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
#define LIGHTNING_ACT_AVX2_DISPATCH 1
#define LIGHTNING_ACT_TARGET_AVX2 __attribute__((target("avx2")))
#endif

#if defined(__GNUC__)
// Loop bodies are inlined into each per-target copy of a task, so they are compiled (and
// vectorised) for that target.
#define LIGHTNING_ACT_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define LIGHTNING_ACT_ALWAYS_INLINE inline
#endif

namespace lightning_act {

// Values per parallel task: large enough that scheduling costs nothing next to the work.
constexpr int64_t kValuesPerTask = 1 << 15;

// at::parallel_for's grain size for items of `values_per_item` values each.
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

template <typename Task>
void run_portable(Task& task, int64_t first, int64_t last) {
  task(first, last);
}

#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
template <typename Task>
LIGHTNING_ACT_TARGET_AVX2 void run_avx2(Task& task, int64_t first, int64_t last) {
  task(first, last);
}
#endif

// Runs `task(first, last)` over [0, items) in parallel, each parallel task on its own copy
// of `task`, compiled for AVX2 where the CPU has it. Task::operator() must be
// LIGHTNING_ACT_ALWAYS_INLINE.
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

// The integer type holding the codes of one packed byte, one code per byte: a byte packs
// 8 / kBits codes.
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

// Packs `count` one-byte codes (each below 2**kBits; count a multiple of 8) little-endian,
// 8 / kBits per byte. The codes of a byte, read as one little-endian word, sit 8 bits apart;
// shifting the word right by j * (8 - kBits) moves code j to bit j * kBits and every code
// after it to bit 8 or higher, so OR-ing the shifts leaves the packed byte in the low 8 bits.
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

// The inverse of pack_codes for `bytes` packed bytes: shifting a byte left by
// j * (8 - kBits) moves code j to bit 8 * j, and the mask keeps the low kBits of every byte.
template <int kBits>
LIGHTNING_ACT_ALWAYS_INLINE void unpack_codes(const uint8_t* packed, int64_t bytes, uint8_t* codes) {
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

LIGHTNING_ACT_ALWAYS_INLINE GroupRange range_of(const float* values, int64_t count) {
  GroupRange range;
  for (int64_t i = 0; i < count; ++i) {
    range.add_ordered(float_bits(values[i]));
  }
  range.nonfinite = range.keys_reach_nonfinite();
  return range;
}

// The codes of a finite group's `count` values, the first of which has index `first_index`
// (low 32 bits) in its noise stream `key`: encode_value with the group's branches taken
// outside the loop.
template <bool kZeroPreserving, bool kPositiveStep>
LIGHTNING_ACT_ALWAYS_INLINE void encode_codes(const float* values, int64_t count, const GroupParams& params,
                                              uint32_t key, uint32_t first_index, uint8_t* codes) {
  const float low = params.low;
  const float step = params.step;
  const float max_level = params.max_level;
  const uint32_t noise_key = run_key(key, first_index);
  const uint32_t n = static_cast<uint32_t>(count);  // a 32-bit index vectorises with 32-bit lanes
  for (uint32_t i = 0; i < n; ++i) {
    const float noise = run_noise(noise_key, first_index + i);
    const uint32_t code = kPositiveStep
                              ? encode_with_step(values[i], low, step, max_level, kZeroPreserving, noise)
                              : code_of_level(add_rn(0.0f, noise), values[i], max_level, kZeroPreserving);
    codes[i] = static_cast<uint8_t>(code);
  }
}

// One parallel task of encode_groups: groups [first_group, last_group).
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

  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first_group, int64_t last_group) {
    buffer.resize(group_size);
    codes.resize(group_size);
    for (int64_t group = first_group; group < last_group; ++group) {
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      const float* values = source(start, valid, buffer.data());
      const GroupParams params = group_params(range_of(values, valid), kBits);
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
      if (params.zero_preserving) {
        positive_step ? encode_codes<true, true>(values, valid, params, key, first_index, codes.data())
                      : encode_codes<true, false>(values, valid, params, key, first_index, codes.data());
      } else {
        positive_step ? encode_codes<false, true>(values, valid, params, key, first_index, codes.data())
                      : encode_codes<false, false>(values, valid, params, key, first_index, codes.data());
      }
      // The last group's padding gets code 0.
      std::fill(codes.begin() + valid, codes.end(), 0);
      pack_codes<kBits>(codes.data(), group_size, packed);
    }
  }
};

// Quantizes the `numel` values of `source` to `bits` bits into `codes` and `stats`,
// allocated by empty_codes_and_stats.
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

// One parallel task of decode_groups: groups [first_group, last_group).
template <int kBits, typename GroupSink>
struct DecodeTask {
  GroupSink sink;
  int64_t numel;
  int64_t group_size;
  const uint8_t* code_bytes;
  const uint16_t* stats_words;
  std::vector<uint8_t> codes;

  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first_group, int64_t last_group) {
    constexpr int kPerByte = 8 / kBits;
    codes.resize(group_size);
    const uint8_t* const group_codes = codes.data();
    for (int64_t group = first_group; group < last_group; ++group) {
      const DecodeParams params = decode_params(stats_words[2 * group], stats_words[2 * group + 1]);
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      unpack_codes<kBits>(code_bytes + start * kBits / 8, (valid + kPerByte - 1) / kPerByte, codes.data());
      // The sink's loop gets decode_value with the group's kind as a constant: no branch.
      const auto store = [&](auto zero_preserving) {
        DecodeParams group_params = params;
        group_params.zero_preserving = decltype(zero_preserving)::value;
        sink(start, valid, [group_codes, group_params](int64_t i) { return decode_value(group_codes[i], group_params); });
      };
      params.zero_preserving ? store(std::true_type{}) : store(std::false_type{});
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
