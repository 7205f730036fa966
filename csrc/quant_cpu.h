// The CPU group encoder and decoder of quantize_pack / unpack_dequantize (quant_cpu.cpp)
// and of division_pack / division_unpack's residual (division_cpu.cpp). Groups are
// independent, so both run in parallel over groups.
//
// A group is encoded in two passes over its float32 values: one gathers its range, one
// encodes. Codes are written to a byte buffer first so the encode loop has no bit-twiddling
// and vectorizes, then packed. Decoding extracts each code from its byte in one plain loop.
//
// The ops differ only in where a group's float32 values come from and where the decoded
// ones go, which the loops take as functors:
//
// * a GroupSource, `const float* operator()(int64_t start, int64_t count, float* buffer) const`,
//   returns the values [start, start + count): written to `buffer` (room for a group), or
//   where they already are;
// * a GroupSink, `void operator()(int64_t start, int64_t count, const float* values) const`,
//   stores the decoded values [start, start + count).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {

// Values per parallel task: large enough that scheduling costs nothing next to the work.
constexpr int64_t kValuesPerTask = 1 << 15;

// at::parallel_for's grain size for items of `values_per_item` values each.
inline int64_t grain(int64_t values_per_item) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_item));
}

// Packs one-byte codes (each below 2**kBits) little-endian, 8 / kBits per byte.
template <int kBits>
void pack_codes(const uint8_t* codes, int64_t count, uint8_t* packed) {
  if constexpr (kBits == 8) {
    std::memcpy(packed, codes, count);
  } else {
    constexpr int kPerByte = 8 / kBits;
    for (int64_t byte = 0; byte < count / kPerByte; ++byte) {
      uint8_t value = 0;
      for (int j = 0; j < kPerByte; ++j) {
        value |= static_cast<uint8_t>(codes[byte * kPerByte + j] << (j * kBits));
      }
      packed[byte] = value;
    }
  }
}

// Quantizes the `numel` values of `source` to `bits` bits into `codes` and `stats`,
// allocated by empty_codes_and_stats.
template <typename GroupSource>
void encode_groups(const GroupSource& source, int64_t numel, int64_t bits, int64_t group_size, uint64_t seed,
                   const at::Tensor& codes, const at::Tensor& stats) {
  uint8_t* const code_bytes = codes.mutable_data_ptr<uint8_t>();
  uint16_t* const stats_words = reinterpret_cast<uint16_t*>(stats.mutable_data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    at::parallel_for(0, num_groups(numel, group_size), grain(group_size), [&](int64_t first_group, int64_t last_group) {
      std::vector<float> buffer(group_size);
      std::vector<uint8_t> group_codes(group_size);
      for (int64_t group = first_group; group < last_group; ++group) {
        const int64_t start = group * group_size;
        const int64_t valid = std::min(group_size, numel - start);
        const float* values = source(start, valid, buffer.data());
        GroupRange range;
        for (int64_t i = 0; i < valid; ++i) {
          range.add(values[i]);
        }
        const GroupParams params = group_params(range, kBits);
        stats_words[2 * group] = params.stats_low;
        stats_words[2 * group + 1] = params.stats_step;

        uint8_t* packed = code_bytes + start * kBits / 8;
        if (!params.finite) {
          std::memset(packed, 0, group_size * kBits / 8);
          continue;
        }
        const uint32_t key = stream_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32));
        for (int64_t i = 0; i < valid; ++i) {
          group_codes[i] = static_cast<uint8_t>(
              encode_value(values[i], params, uniform_noise(key, static_cast<uint64_t>(start + i))));
        }
        // The last group's padding gets code 0.
        std::fill(group_codes.begin() + valid, group_codes.end(), 0);
        pack_codes<kBits>(group_codes.data(), group_size, packed);
      }
    });
  });
}

// Decodes the first `numel` values of `codes` and `stats`, at `bits` bits, into `sink`.
template <typename GroupSink>
void decode_groups(const at::Tensor& codes, const at::Tensor& stats, int64_t numel, int64_t bits,
                   int64_t group_size, const GroupSink& sink) {
  const uint8_t* const code_bytes = codes.const_data_ptr<uint8_t>();
  const uint16_t* const stats_words = reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    constexpr int kPerByte = 8 / kBits;
    constexpr uint32_t kMask = (1u << kBits) - 1u;
    at::parallel_for(0, num_groups(numel, group_size), grain(group_size), [&](int64_t first_group, int64_t last_group) {
      std::vector<float> buffer(group_size);
      float* const values = buffer.data();
      for (int64_t group = first_group; group < last_group; ++group) {
        const DecodeParams params = decode_params(stats_words[2 * group], stats_words[2 * group + 1]);
        const int64_t start = group * group_size;
        const uint8_t* packed = code_bytes + start * kBits / 8;
        const int64_t valid = std::min(group_size, numel - start);
        for (int64_t i = 0; i < valid; ++i) {
          values[i] = decode_value((packed[i / kPerByte] >> ((i % kPerByte) * kBits)) & kMask, params);
        }
        sink(start, valid, values);
      }
    });
  });
}

}  // namespace lightning_act
