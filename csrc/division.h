// DIVISION's ops (division_pack / division_unpack): argument checks and the per-tile math
// shared by the CPU and CUDA kernels.
//
// The storage format and the pure-PyTorch oracle live in lightning_act/ops/reference.py. The
// residual is quantized with the per-value math of quant_math.h, so a DIVISION residual is
// stored exactly as quantize_pack stores a float32 tensor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {

// How the planes of a [planes, height, width] tensor are tiled.
struct TileGeometry {
  int64_t height;
  int64_t width;
  int64_t block_h;
  int64_t block_w;
  int64_t tiles_h;
  int64_t tiles_w;
};

inline TileGeometry make_geometry(int64_t height, int64_t width, int64_t block_h, int64_t block_w) {
  return TileGeometry{height, width, block_h, block_w, (height + block_h - 1) / block_h,
                      (width + block_w - 1) / block_w};
}

// The LFC entry (index into lfc[planes, tiles_h, tiles_w]) of element `index` of a
// [planes, height, width] tensor, advanced one element at a time: a run of consecutive
// elements costs one set of divisions, not one per element.
struct TileCursor {
  int64_t row;
  int64_t column;
  int64_t row_in_tile;
  int64_t column_in_tile;
  int64_t first_tile_of_row;  // LFC entry of the tile row holding `row`, column 0
  int64_t tile;               // LFC entry of the current element

  LIGHTNING_ACT_HD TileCursor(int64_t index, const TileGeometry& geometry) {
    const int64_t plane_size = geometry.height * geometry.width;
    const int64_t plane = index / plane_size;
    const int64_t within = index - plane * plane_size;
    row = within / geometry.width;
    column = within - row * geometry.width;
    const int64_t tile_row = row / geometry.block_h;
    const int64_t tile_column = column / geometry.block_w;
    row_in_tile = row - tile_row * geometry.block_h;
    column_in_tile = column - tile_column * geometry.block_w;
    first_tile_of_row = (plane * geometry.tiles_h + tile_row) * geometry.tiles_w;
    tile = first_tile_of_row + tile_column;
  }

  LIGHTNING_ACT_HD void advance(const TileGeometry& geometry) {
    ++column;
    if (column < geometry.width) {
      if (++column_in_tile == geometry.block_w) {
        column_in_tile = 0;
        ++tile;
      }
      return;
    }
    column = 0;
    column_in_tile = 0;
    ++row;
    ++row_in_tile;
    // The next plane's first tile row directly follows this plane's last one.
    if (row == geometry.height || row_in_tile == geometry.block_h) {
      row = row == geometry.height ? 0 : row;
      row_in_tile = 0;
      first_tile_of_row += geometry.tiles_w;
    }
    tile = first_tile_of_row;
  }
};

// The float32 mean of one tile (reference: ops/reference.py _tile_means): the sum starts at
// +0.0 and adds the tile's real pixels row by row, left to right, then divides once.
template <typename scalar_t>
LIGHTNING_ACT_HD float tile_mean(const scalar_t* plane, const TileGeometry& geometry, int64_t tile_row,
                                 int64_t tile_column) {
  const int64_t first_row = tile_row * geometry.block_h;
  const int64_t first_column = tile_column * geometry.block_w;
  const int64_t rows = geometry.height - first_row < geometry.block_h ? geometry.height - first_row : geometry.block_h;
  const int64_t columns =
      geometry.width - first_column < geometry.block_w ? geometry.width - first_column : geometry.block_w;
  float total = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* line = plane + (first_row + r) * geometry.width + first_column;
    for (int64_t c = 0; c < columns; ++c) {
      total = add_rn(total, static_cast<float>(line[c]));
    }
  }
  return div_rn(total, static_cast<float>(rows * columns));
}

inline bool is_lfc_dtype(at::ScalarType dtype) { return is_supported_float(dtype); }

inline void check_blocks(int64_t block_h, int64_t block_w) {
  TORCH_CHECK(block_h >= 1, "lightning_act.division: block_h=", block_h, " must be >= 1");
  TORCH_CHECK(block_w >= 1, "lightning_act.division: block_w=", block_w, " must be >= 1");
}

inline void check_division_pack_args(const at::Tensor& input, int64_t block_h, int64_t block_w, int64_t bits,
                                     int64_t group_size, at::ScalarType lfc_dtype) {
  check_quant_args(bits, group_size);
  check_blocks(block_h, block_w);
  TORCH_CHECK(is_supported_float(input.scalar_type()), "lightning_act.division_pack: input dtype is ",
              input.scalar_type(), "; allowed: Float, Half, BFloat16");
  TORCH_CHECK(input.dim() == 3, "lightning_act.division_pack: input must be 3-D [planes, height, width]; got shape ",
              input.sizes());
  TORCH_CHECK(input.is_contiguous(), "lightning_act.division_pack: input must be contiguous; got strides ",
              input.strides());
  TORCH_CHECK(is_lfc_dtype(lfc_dtype), "lightning_act.division_pack: lfc_dtype is ", lfc_dtype,
              "; allowed: BFloat16, Half, Float");
}

// Checks the LFC against the plane size; the residual's codes and stats are checked by
// check_decode_args.
inline void check_division_unpack_args(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats,
                                       int64_t height, int64_t width, int64_t block_h, int64_t block_w, int64_t bits,
                                       int64_t group_size, at::ScalarType dtype) {
  check_blocks(block_h, block_w);
  TORCH_CHECK(height >= 0 && width >= 0, "lightning_act.division_unpack: height=", height, " and width=", width,
              " must be >= 0");
  TORCH_CHECK(is_lfc_dtype(lfc.scalar_type()), "lightning_act.division_unpack: lfc dtype is ", lfc.scalar_type(),
              "; allowed: BFloat16, Half, Float");
  const TileGeometry geometry = make_geometry(height, width, block_h, block_w);
  TORCH_CHECK(lfc.dim() == 3 && lfc.size(1) == geometry.tiles_h && lfc.size(2) == geometry.tiles_w,
              "lightning_act.division_unpack: lfc must have shape [planes, ", geometry.tiles_h, ", ", geometry.tiles_w,
              "] for ", height, "x", width, " planes in ", block_h, "x", block_w, " tiles; got ", lfc.sizes());
  TORCH_CHECK(lfc.device() == codes.device(), "lightning_act.division_unpack: lfc is on ", lfc.device(),
              " but codes are on ", codes.device());
  check_decode_args(codes, stats, bits, group_size, lfc.size(0) * height * width, dtype);
}

// Checks division_pack's arguments and allocates its outputs (lfc, codes, stats),
// uninitialized: the C++ side of the op's fake in lightning_act/ops/schemas.py.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> division_pack_outputs(const at::Tensor& input, int64_t block_h,
                                                                            int64_t block_w, int64_t bits,
                                                                            int64_t group_size,
                                                                            at::ScalarType lfc_dtype) {
  check_division_pack_args(input, block_h, block_w, bits, group_size, lfc_dtype);
  const TileGeometry geometry = make_geometry(input.size(1), input.size(2), block_h, block_w);
  const auto [codes, stats] = empty_codes_and_stats(input.numel(), bits, group_size, input.options());
  return {at::empty({input.size(0), geometry.tiles_h, geometry.tiles_w}, input.options().dtype(lfc_dtype)), codes,
          stats};
}

// Checks division_unpack's arguments and allocates its output, uninitialized.
inline at::Tensor division_unpack_output(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats,
                                         int64_t height, int64_t width, int64_t block_h, int64_t block_w, int64_t bits,
                                         int64_t group_size, at::ScalarType dtype) {
  check_division_unpack_args(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  return at::empty({lfc.size(0), height, width}, codes.options().dtype(dtype));
}

}  // namespace lightning_act
