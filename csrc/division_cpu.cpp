// CPU kernels of lightning_act::division_pack and lightning_act::division_unpack.
//
// Packing takes two parallel passes: the tile means (the LFC), then the residual groups,
// which quant_cpu.h's group encoder encodes the way it encodes quantize_pack's. Groups need
// LFC values of tiles that other tasks of the first pass computed, hence two passes rather
// than one. Unpacking adds the LFC back to the residuals quant_cpu.h's decoder reads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "division.h"
#include "quant_args.h"
#include "quant_cpu.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

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

// division_pack's GroupSource: each element minus the LFC value of its tile.
template <typename scalar_t>
struct ResidualGroups {
  const scalar_t* input;
  const float* lfc;
  TileGeometry geometry;

  const float* operator()(int64_t start, int64_t count, float* buffer) const {
    TileCursor cursor(start, geometry);
    for (int64_t i = 0; i < count; ++i) {
      buffer[i] = sub_rn(static_cast<float>(input[start + i]), lfc[cursor.tile]);
      cursor.advance(geometry);
    }
    return buffer;
  }
};

// division_unpack's GroupSink: each decoded residual plus the LFC value of its tile.
template <typename scalar_t>
struct ReconstructedGroups {
  const float* lfc;
  TileGeometry geometry;
  scalar_t* output;

  void operator()(int64_t start, int64_t count, const float* residuals) const {
    TileCursor cursor(start, geometry);
    for (int64_t i = 0; i < count; ++i) {
      output[start + i] = static_cast<scalar_t>(add_rn(lfc[cursor.tile], residuals[i]));
      cursor.advance(geometry);
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> division_pack_cpu(const at::Tensor& input, int64_t block_h,
                                                                  int64_t block_w, int64_t bits, int64_t group_size,
                                                                  int64_t seed, at::ScalarType lfc_dtype) {
  const auto [lfc, codes, stats] = division_pack_outputs(input, block_h, block_w, bits, group_size, lfc_dtype);
  if (input.numel() == 0) {
    return {lfc, codes, stats};
  }
  const TileGeometry geometry = make_geometry(input.size(1), input.size(2), block_h, block_w);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cpu", [&] {
    using input_t = scalar_t;
    LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(lfc_dtype, "division_pack_cpu_lfc", [&] {
      tile_means_kernel(input.const_data_ptr<input_t>(), lfc.size(0), geometry, lfc.mutable_data_ptr<scalar_t>());
    });
  });
  // The residual is taken against the LFC as stored, so its rounding lands in the residual.
  const at::Tensor lfc_float = lfc.to(at::kFloat);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cpu", [&] {
    const ResidualGroups<scalar_t> source{input.const_data_ptr<scalar_t>(), lfc_float.const_data_ptr<float>(),
                                          geometry};
    encode_groups(source, input.numel(), bits, group_size, static_cast<uint64_t>(seed), codes, stats);
  });
  return {lfc, codes, stats};
}

at::Tensor division_unpack_cpu(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats, int64_t height,
                               int64_t width, int64_t block_h, int64_t block_w, int64_t bits, int64_t group_size,
                               at::ScalarType dtype) {
  const at::Tensor output =
      division_unpack_output(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  const int64_t numel = output.numel();
  if (numel == 0) {
    return output;
  }
  const TileGeometry geometry = make_geometry(height, width, block_h, block_w);
  const at::Tensor lfc_float = lfc.to(at::kFloat).contiguous();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "division_unpack_cpu", [&] {
    const ReconstructedGroups<scalar_t> sink{lfc_float.const_data_ptr<float>(), geometry,
                                             output.mutable_data_ptr<scalar_t>()};
    decode_groups(codes, stats, numel, bits, group_size, sink);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("division_pack", &division_pack_cpu);
  m.impl("division_unpack", &division_unpack_cpu);
}

}  // namespace lightning_act
