// CPU kernels of lightning_act::quantize_pack and lightning_act::unpack_dequantize.
//
// Groups are independent, so both ops run in parallel over groups. Within a group the
// quantizer makes two passes over float32 values: one gathers the group's range, one
// encodes; codes are written to a per-task byte buffer first so the encode loop has no
// bit-twiddling and vectorizes, then packed.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "packed codes are assembled as little-endian words");

// Values per parallel task: large enough that scheduling costs nothing next to the work.
constexpr int64_t kValuesPerTask = 1 << 15;

int64_t grain_in_groups(int64_t group_size) { return std::max<int64_t>(1, kValuesPerTask / group_size); }

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

template <typename scalar_t, int kBits>
void quantize_pack_kernel(const scalar_t* input, int64_t numel, int64_t group_size, uint64_t seed, uint8_t* codes,
                          uint16_t* stats) {
  const int64_t groups = num_groups(numel, group_size);
  at::parallel_for(0, groups, grain_in_groups(group_size), [&](int64_t first_group, int64_t last_group) {
    std::vector<float> converted(std::is_same_v<scalar_t, float> ? 0 : group_size);
    std::vector<uint8_t> group_codes(group_size);
    for (int64_t group = first_group; group < last_group; ++group) {
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      const float* values;
      if constexpr (std::is_same_v<scalar_t, float>) {
        values = input + start;
      } else {
        for (int64_t i = 0; i < valid; ++i) {
          converted[i] = static_cast<float>(input[start + i]);
        }
        values = converted.data();
      }

      GroupRange range;
      for (int64_t i = 0; i < valid; ++i) {
        range.add(values[i]);
      }
      const GroupParams params = group_params(range, kBits);
      stats[2 * group] = params.stats_low;
      stats[2 * group + 1] = params.stats_step;

      uint8_t* packed = codes + start * kBits / 8;
      if (!params.finite) {
        std::memset(packed, 0, group_size * kBits / 8);
        continue;
      }
      const uint32_t key = stream_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32));
      for (int64_t i = 0; i < valid; ++i) {
        group_codes[i] = static_cast<uint8_t>(
            encode_value(values[i], params, uniform_noise(key, static_cast<uint64_t>(start + i))));
      }
      std::fill(group_codes.begin() + valid, group_codes.end(), 0);
      pack_codes<kBits>(group_codes.data(), group_size, packed);
    }
  });
}

template <typename scalar_t, int kBits>
void unpack_dequantize_kernel(const uint8_t* codes, const uint16_t* stats, int64_t numel, int64_t group_size,
                              scalar_t* output) {
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  const int64_t groups = num_groups(numel, group_size);
  at::parallel_for(0, groups, grain_in_groups(group_size), [&](int64_t first_group, int64_t last_group) {
    for (int64_t group = first_group; group < last_group; ++group) {
      const DecodeParams params = decode_params(stats[2 * group], stats[2 * group + 1]);
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      // 8 codes fill exactly kBits bytes: one word per 8 values.
      for (int64_t chunk = 0; chunk < valid; chunk += 8) {
        uint64_t word = 0;
        std::memcpy(&word, codes + (start + chunk) * kBits / 8, kBits);
        float values[8];
        for (int t = 0; t < 8; ++t) {
          values[t] = decode_value(static_cast<uint32_t>((word >> (t * kBits)) & kMask), params);
        }
        const int64_t count = std::min<int64_t>(8, valid - chunk);
        for (int64_t t = 0; t < count; ++t) {
          output[start + chunk + t] = static_cast<scalar_t>(values[t]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_pack_cpu(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                     int64_t seed) {
  check_quant_args(bits, group_size);
  check_quantize_input(input);
  const int64_t numel = input.numel();
  const int64_t groups = num_groups(numel, group_size);
  at::Tensor codes = at::empty({groups * group_size * bits / 8}, input.options().dtype(at::kByte));
  at::Tensor stats = at::empty({groups, 2}, input.options().dtype(at::kBFloat16));
  if (groups == 0) {
    return {codes, stats};
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cpu", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      quantize_pack_kernel<scalar_t, decltype(bits_constant)::value>(
          input.const_data_ptr<scalar_t>(), numel, group_size, static_cast<uint64_t>(seed),
          codes.mutable_data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(stats.mutable_data_ptr<at::BFloat16>()));
    });
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cpu(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                 int64_t numel, at::ScalarType dtype) {
  check_decode_args(codes, stats, bits, group_size, numel, dtype);
  at::Tensor output = at::empty({numel}, codes.options().dtype(dtype));
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cpu", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      unpack_dequantize_kernel<scalar_t, decltype(bits_constant)::value>(
          codes.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()),
          numel, group_size, output.mutable_data_ptr<scalar_t>());
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("quantize_pack", &quantize_pack_cpu);
  m.impl("unpack_dequantize", &unpack_dequantize_cpu);
}

}  // namespace lightning_act
