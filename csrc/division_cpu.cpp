// CPU kernels of lightning_act::division_pack and lightning_act::division_unpack.
//
// Packing takes two parallel passes: the tile means (the LFC), then the residual groups,
// each group computing its residuals into a float32 buffer, reducing their range and
// encoding them as quantize_pack does. Groups need LFC values of tiles that other tasks
// of the first pass computed, hence two passes rather than one.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "division.h"
#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

// Values per parallel task: large enough that scheduling costs nothing next to the work.
constexpr int64_t kValuesPerTask = 1 << 15;

int64_t grain(int64_t values_per_item) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_item));
}

template <typename scalar_t, typename lfc_t>
void tile_means_kernel(const scalar_t* input, int64_t planes, const TileGeometry& geometry, lfc_t* lfc) {
  const int64_t tile_rows = planes * geometry.tiles_h;
  const int64_t values_per_tile_row = geometry.block_h * geometry.width;
  at::parallel_for(0, tile_rows, grain(values_per_tile_row), [&](int64_t first, int64_t last) {
    for (int64_t tile_row = first; tile_row < last; ++tile_row) {
      const int64_t plane = tile_row / geometry.tiles_h;
      const scalar_t* plane_values = input + plane * geometry.height * geometry.width;
      for (int64_t tile_column = 0; tile_column < geometry.tiles_w; ++tile_column) {
        const float mean = tile_mean(plane_values, geometry, tile_row % geometry.tiles_h, tile_column);
        lfc[tile_row * geometry.tiles_w + tile_column] = static_cast<lfc_t>(mean);
      }
    }
  });
}

template <typename scalar_t, int kBits>
void encode_residual_kernel(const scalar_t* input, const float* lfc, int64_t numel, const TileGeometry& geometry,
                            int64_t group_size, uint64_t seed, uint8_t* codes, uint16_t* stats) {
  constexpr int kPerByte = 8 / kBits;
  const int64_t groups = num_groups(numel, group_size);
  at::parallel_for(0, groups, grain(group_size), [&](int64_t first_group, int64_t last_group) {
    std::vector<float> residual(group_size);
    std::vector<uint8_t> group_codes(group_size);
    for (int64_t group = first_group; group < last_group; ++group) {
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      TileCursor cursor(start, geometry);
      for (int64_t i = 0; i < valid; ++i) {
        residual[i] = sub_rn(static_cast<float>(input[start + i]), lfc[cursor.tile]);
        cursor.advance(geometry);
      }
      GroupRange range;
      for (int64_t i = 0; i < valid; ++i) {
        range.add(residual[i]);
      }
      const GroupParams params = group_params(range, kBits);
      stats[2 * group] = params.stats_low;
      stats[2 * group + 1] = params.stats_step;

      uint8_t* packed = codes + start * kBits / 8;
      if (!params.finite) {
        std::memset(packed, 0, group_size * kBits / 8);
        continue;
      }
      // Codes go to a byte buffer first so that this loop has no bit-twiddling and vectorizes.
      const uint32_t key = stream_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32));
      for (int64_t i = 0; i < valid; ++i) {
        group_codes[i] = static_cast<uint8_t>(
            encode_value(residual[i], params, uniform_noise(key, static_cast<uint64_t>(start + i))));
      }
      std::fill(group_codes.begin() + valid, group_codes.end(), 0);
      for (int64_t byte = 0; byte < group_size / kPerByte; ++byte) {
        uint8_t value = 0;
        for (int j = 0; j < kPerByte; ++j) {
          value |= static_cast<uint8_t>(group_codes[byte * kPerByte + j] << (j * kBits));
        }
        packed[byte] = value;
      }
    }
  });
}

template <typename scalar_t, int kBits>
void decode_kernel(const float* lfc, const uint8_t* codes, const uint16_t* stats, int64_t numel,
                   const TileGeometry& geometry, int64_t group_size, scalar_t* output) {
  constexpr int kPerByte = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int64_t groups = num_groups(numel, group_size);
  at::parallel_for(0, groups, grain(group_size), [&](int64_t first_group, int64_t last_group) {
    for (int64_t group = first_group; group < last_group; ++group) {
      const DecodeParams params = decode_params(stats[2 * group], stats[2 * group + 1]);
      const int64_t start = group * group_size;
      const int64_t valid = std::min(group_size, numel - start);
      TileCursor cursor(start, geometry);
      for (int64_t i = 0; i < valid; ++i) {
        const int64_t index = start + i;
        const uint32_t code = (codes[index / kPerByte] >> ((index % kPerByte) * kBits)) & kMask;
        const float base = lfc[cursor.tile];
        output[index] = static_cast<scalar_t>(add_rn(base, decode_value(code, params)));
        cursor.advance(geometry);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> division_pack_cpu(const at::Tensor& input, int64_t block_h,
                                                                  int64_t block_w, int64_t bits, int64_t group_size,
                                                                  int64_t seed, at::ScalarType lfc_dtype) {
  check_division_pack_args(input, block_h, block_w, bits, group_size, lfc_dtype);
  const int64_t planes = input.size(0);
  const TileGeometry geometry = make_geometry(input.size(1), input.size(2), block_h, block_w);
  const int64_t numel = input.numel();
  const int64_t groups = num_groups(numel, group_size);
  at::Tensor lfc = at::empty({planes, geometry.tiles_h, geometry.tiles_w}, input.options().dtype(lfc_dtype));
  at::Tensor codes = at::empty({groups * group_size * bits / 8}, input.options().dtype(at::kByte));
  at::Tensor stats = at::empty({groups, 2}, input.options().dtype(at::kBFloat16));
  if (numel == 0) {
    return {lfc, codes, stats};
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cpu", [&] {
    using input_t = scalar_t;
    LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(lfc_dtype, "division_pack_cpu_lfc", [&] {
      tile_means_kernel(input.const_data_ptr<input_t>(), planes, geometry, lfc.mutable_data_ptr<scalar_t>());
    });
  });
  // The residual is taken against the LFC as stored, so its rounding lands in the residual.
  const at::Tensor lfc_float = lfc.to(at::kFloat);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cpu", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      encode_residual_kernel<scalar_t, decltype(bits_constant)::value>(
          input.const_data_ptr<scalar_t>(), lfc_float.const_data_ptr<float>(), numel, geometry, group_size,
          static_cast<uint64_t>(seed), codes.mutable_data_ptr<uint8_t>(),
          reinterpret_cast<uint16_t*>(stats.mutable_data_ptr<at::BFloat16>()));
    });
  });
  return {lfc, codes, stats};
}

at::Tensor division_unpack_cpu(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats, int64_t height,
                               int64_t width, int64_t block_h, int64_t block_w, int64_t bits, int64_t group_size,
                               at::ScalarType dtype) {
  check_division_unpack_args(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  const TileGeometry geometry = make_geometry(height, width, block_h, block_w);
  at::Tensor output = at::empty({lfc.size(0), height, width}, codes.options().dtype(dtype));
  const int64_t numel = output.numel();
  if (numel == 0) {
    return output;
  }
  const at::Tensor lfc_float = lfc.to(at::kFloat).contiguous();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "division_unpack_cpu", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      decode_kernel<scalar_t, decltype(bits_constant)::value>(
          lfc_float.const_data_ptr<float>(), codes.const_data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()), numel, geometry, group_size,
          output.mutable_data_ptr<scalar_t>());
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("division_pack", &division_pack_cpu);
  m.impl("division_unpack", &division_unpack_cpu);
}

}  // namespace lightning_act
