// DIVISION's per-tile math for CPU and CUDA; ATen-free so tests/emu can compile it as C++.
#pragma once

#include <cstdint>

#include "quant_math.h"

namespace lightning_act {

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

// LFC entry of element `index` of [planes, height, width], advanced element by element so a
// run costs one set of divisions.
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

// Tile mean as reference._tile_means, bit for bit: sum from +0.0 row by row, left to right,
// then one division.
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

}  // namespace lightning_act
