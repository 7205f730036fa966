// CPU division_pack / division_unpack. Packing: tile means (LFC), then residual groups via
// quant_cpu.h (two passes, since a group needs LFC values other tasks compute). Element
// passes run row by row against the row's upsampled LFC, so they vectorise.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "division.h"
#include "quant_args.h"
#include "quant_cpu.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

// Tile means of tile rows [first, last). Each tile sums in tile_mean's order; a tile row's
// tiles sum side by side, overlapping additions without reordering any.
template <typename scalar_t, typename lfc_t>
struct TileMeansTask {
  const scalar_t* input;
  TileGeometry geometry;
  lfc_t* lfc;
  std::vector<float> totals;

  template <typename Isa>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t first, int64_t last, Isa) {
    const int64_t full_tiles = geometry.width / geometry.block_w;
    const int64_t edge_columns = geometry.width - full_tiles * geometry.block_w;
    totals.resize(geometry.tiles_w);
    float* const sums = totals.data();
    for (int64_t tile_row = first; tile_row < last; ++tile_row) {
      const int64_t plane = tile_row / geometry.tiles_h;
      const int64_t first_row = (tile_row - plane * geometry.tiles_h) * geometry.block_h;
      const int64_t rows = std::min(geometry.block_h, geometry.height - first_row);
      std::fill(totals.begin(), totals.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* line = input + (plane * geometry.height + first_row + r) * geometry.width;
        for (int64_t c = 0; c < geometry.block_w; ++c) {
          for (int64_t t = 0; t < full_tiles; ++t) {
            sums[t] = add_rn(sums[t], static_cast<float>(line[t * geometry.block_w + c]));
          }
        }
        for (int64_t c = 0; c < edge_columns; ++c) {
          sums[full_tiles] = add_rn(sums[full_tiles], static_cast<float>(line[full_tiles * geometry.block_w + c]));
        }
      }
      for (int64_t t = 0; t < geometry.tiles_w; ++t) {
        const int64_t columns = t < full_tiles ? geometry.block_w : edge_columns;
        lfc[tile_row * geometry.tiles_w + t] = static_cast<lfc_t>(div_rn(sums[t], static_cast<float>(rows * columns)));
      }
    }
  }
};

// A row's float32 LFC upsampled to the width (rows numbered across planes); rebuilt only
// when the tile row changes.
class UpsampledRow {
 public:
  UpsampledRow(const float* lfc, const TileGeometry& geometry) : lfc_(lfc), geometry_(geometry) {}

  LIGHTNING_ACT_ALWAYS_INLINE const float* of_row(int64_t row) {
    const int64_t plane = row / geometry_.height;
    const int64_t tile_row = plane * geometry_.tiles_h + (row - plane * geometry_.height) / geometry_.block_h;
    if (tile_row != tile_row_) {
      tile_row_ = tile_row;
      values_.resize(geometry_.width);
      const float* means = lfc_ + tile_row * geometry_.tiles_w;
      for (int64_t t = 0; t < geometry_.tiles_w; ++t) {
        const int64_t first = t * geometry_.block_w;
        std::fill(values_.begin() + first, values_.begin() + std::min(first + geometry_.block_w, geometry_.width),
                  means[t]);
      }
    }
    return values_.data();
  }

 private:
  const float* lfc_;
  TileGeometry geometry_;
  std::vector<float> values_;
  int64_t tile_row_ = -1;
};

// Calls fn(row, column, offset, length) per single-row run of [start, start + count).
template <typename Fn>
LIGHTNING_ACT_ALWAYS_INLINE void for_each_row_run(int64_t start, int64_t count, int64_t width, Fn&& fn) {
  int64_t row = start / width;
  int64_t column = start - row * width;
  for (int64_t offset = 0; offset < count; ++row, column = 0) {
    const int64_t length = std::min(width - column, count - offset);
    fn(row, column, offset, length);
    offset += length;
  }
}

template <typename scalar_t>
struct ResidualGroups {
  const scalar_t* input;
  int64_t width;
  UpsampledRow upsampled;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) {
    for_each_row_run(start, count, width, [&](int64_t row, int64_t column, int64_t offset, int64_t length) {
      const float* means = upsampled.of_row(row) + column;
      const scalar_t* values = input + start + offset;
      float* residuals = buffer + offset;
      for (int64_t i = 0; i < length; ++i) {
        residuals[i] = sub_rn(static_cast<float>(values[i]), means[i]);
      }
    });
    return buffer;
  }
};

template <typename scalar_t>
struct ReconstructedGroups {
  scalar_t* output;
  int64_t width;
  UpsampledRow upsampled;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& residual) {
    for_each_row_run(start, count, width, [&](int64_t row, int64_t column, int64_t offset, int64_t length) {
      const float* means = upsampled.of_row(row) + column;
      scalar_t* values = output + start + offset;
      for (int64_t i = 0; i < length; ++i) {
        values[i] = static_cast<scalar_t>(add_rn(means[i], residual(offset + i)));
      }
    });
  }

  void finish() const {}
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
      const TileMeansTask<input_t, scalar_t> task{input.const_data_ptr<input_t>(), geometry,
                                                  lfc.mutable_data_ptr<scalar_t>(), {}};
      parallel_tasks(lfc.size(0) * geometry.tiles_h, geometry.block_h * geometry.width, task);
    });
  });
  // Residual against the LFC as stored, so its rounding lands in the residual.
  const at::Tensor lfc_float = lfc.to(at::kFloat);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cpu", [&] {
    const ResidualGroups<scalar_t> source{input.const_data_ptr<scalar_t>(), geometry.width,
                                          UpsampledRow(lfc_float.const_data_ptr<float>(), geometry)};
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
    const ReconstructedGroups<scalar_t> sink{output.mutable_data_ptr<scalar_t>(), geometry.width,
                                             UpsampledRow(lfc_float.const_data_ptr<float>(), geometry)};
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
