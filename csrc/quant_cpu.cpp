// CPU kernels of quantize_pack, unpack_dequantize and lookup_levels: quant_cpu.h's encoder and
// decoders over tensors in memory order or, for column_major, column by column.
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "quant_args.h"
#include "quant_cpu.h"

namespace lightning_act {
namespace {

template <typename scalar_t>
struct InputGroups {
  const scalar_t* input;
  int64_t numel;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) const {
    prefetch_values<false>(input, start + kGroupsAhead * count, count, numel);
    if constexpr (std::is_same_v<scalar_t, float>) {
      return input + start;
    } else {
      for (int64_t i = 0; i < count; ++i) {
        buffer[i] = static_cast<float>(input[start + i]);
      }
      return buffer;
    }
  }
};

#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
// Transposes the 8 x 8 block at `in` to `out`.
LIGHTNING_ACT_TARGET_AVX2 LIGHTNING_ACT_ALWAYS_INLINE void transpose_block_avx2(const float* in, int64_t in_stride,
                                                                                float* out, int64_t out_stride) {
  const __m256 r0 = _mm256_loadu_ps(in), r1 = _mm256_loadu_ps(in + in_stride),
               r2 = _mm256_loadu_ps(in + 2 * in_stride), r3 = _mm256_loadu_ps(in + 3 * in_stride),
               r4 = _mm256_loadu_ps(in + 4 * in_stride), r5 = _mm256_loadu_ps(in + 5 * in_stride),
               r6 = _mm256_loadu_ps(in + 6 * in_stride), r7 = _mm256_loadu_ps(in + 7 * in_stride);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + out_stride, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * out_stride, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * out_stride, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * out_stride, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * out_stride, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * out_stride, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * out_stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// tile_from_matrix (kToTile) / matrix_from_tile for float32 in AVX2 registers.
template <bool kToTile>
LIGHTNING_ACT_TARGET_AVX2 void move_tile_avx2(const float* from, float* to, int64_t matrix_stride, int64_t tile_stride,
                                              int64_t rows, int64_t width) {
  const int64_t from_row = kToTile ? matrix_stride : 1, from_column = kToTile ? 1 : tile_stride;
  const int64_t to_row = kToTile ? 1 : matrix_stride, to_column = kToTile ? tile_stride : 1;
  const int64_t from_stride = kToTile ? matrix_stride : tile_stride, to_stride = kToTile ? tile_stride : matrix_stride;
  const int64_t block_rows = rows / 8 * 8, block_width = width / 8 * 8;
  const float* const matrix = kToTile ? from : to;
  for (int64_t r = 0; r < block_rows; r += 8) {
    // Prefetch rows two blocks ahead: the hardware prefetcher does not follow page-sized strides.
    for (int64_t k = r + 16; k < std::min(r + 24, rows); ++k) {
      prefetch_values<!kToTile>(matrix + k * matrix_stride, 0, width, width);
    }
    for (int64_t c = 0; c < block_width; c += 8) {
      transpose_block_avx2(from + r * from_row + c * from_column, from_stride, to + r * to_row + c * to_column,
                           to_stride);
    }
    for (int64_t k = r; k < r + 8; ++k) {
      for (int64_t c = block_width; c < width; ++c) to[k * to_row + c * to_column] = from[k * from_row + c * from_column];
    }
  }
  for (int64_t r = block_rows; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) to[r * to_row + c * to_column] = from[r * from_row + c * from_column];
  }
}
#endif

// Copies between a row-major matrix and a column-major tile of `width` columns:
// matrix[r * matrix_stride + c] = tile[c * tile_stride + r]. Matrix rows go 8 at a time,
// outermost, so each matrix line is touched whole while its 8 rows stay in L1.
template <typename From, typename To>
void tile_from_matrix(const From* matrix, int64_t matrix_stride, To* tile, int64_t tile_stride, int64_t rows,
                      int64_t width) {
#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
  if constexpr (std::is_same_v<From, float> && std::is_same_v<To, float>) {
    if (cpu_has_avx2()) {
      move_tile_avx2<true>(matrix, tile, matrix_stride, tile_stride, rows, width);
      return;
    }
  }
#endif
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t r_end = std::min(rows, r0 + 8);
    for (int64_t c = 0; c < width; ++c) {
      for (int64_t r = r0; r < r_end; ++r) tile[c * tile_stride + r] = static_cast<To>(matrix[r * matrix_stride + c]);
    }
  }
}

template <typename T>
void matrix_from_tile(const T* tile, int64_t tile_stride, T* matrix, int64_t matrix_stride, int64_t rows,
                      int64_t width) {
#if defined(LIGHTNING_ACT_AVX2_DISPATCH)
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2()) {
      move_tile_avx2<false>(tile, matrix, matrix_stride, tile_stride, rows, width);
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) matrix[r * matrix_stride + c] = tile[c * tile_stride + r];
  }
}

// Calls fn(first, offset, run) per single-column stretch of column_major read positions
// [start, start + count): values first.. (from start) sit at offset, offset + columns, ...
template <typename Fn>
LIGHTNING_ACT_ALWAYS_INLINE void for_each_column_run(const ColumnMajorOrder& order, int64_t start, int64_t count,
                                                     const Fn& fn) {
  int64_t done = 0;
  while (done < count) {
    const ColumnMajorCursor cursor = order.at(start + done);
    const int64_t run = std::min(count - done, order.rows - cursor.row);
    fn(done, cursor.offset, run);
    done += run;
  }
}

// Tile width in columns from `cursor`'s: enough to use each 64-byte line of a row once, capped
// so the tile fits in cache, and at least the group's. Rows half a 4 KiB page or more apart
// cost a TLB miss per row, so there tiles take 64 columns, up to an L2-sized tile.
inline int64_t tile_columns(const ColumnMajorOrder& order, const ColumnMajorCursor& cursor, int64_t count) {
  const bool rows_pages_apart = order.columns >= 512;
  const int64_t line_columns = rows_pages_apart ? 64 : 16;
  const int64_t max_tile_values = int64_t{1} << (rows_pages_apart ? 18 : 16);
  const int64_t cached = std::max<int64_t>(1, std::min<int64_t>(line_columns, max_tile_values / order.rows));
  const int64_t group = (cursor.row + count + order.rows - 1) / order.rows;
  return std::min(std::max(cached, group), order.columns - cursor.column);
}

// column_major GroupSource: a tile of the next columns is read row by row (each line once)
// into a column-major buffer the groups then read in order; a group spanning two matrices
// is gathered value by value.
template <typename scalar_t>
struct ColumnMajorInputGroups {
  const scalar_t* input;
  ColumnMajorOrder order;
  std::vector<float> tile;  // read positions [tile_begin, tile_end), in read order
  int64_t tile_begin = 0;
  int64_t tile_end = 0;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) {
    if (start < tile_begin || start + count > tile_end) {
      load_tile(start, count);
    }
    if (start >= tile_begin && start + count <= tile_end) {
      return tile.data() + (start - tile_begin);
    }
    for_each_column_run(order, start, count, [&](int64_t first, int64_t offset, int64_t run) {
      const int64_t stride = order.columns;
      for (int64_t k = 0; k < run; ++k) {
        buffer[first + k] = static_cast<float>(input[offset + k * stride]);
      }
    });
    return buffer;
  }

  void load_tile(int64_t start, int64_t count) {
    const ColumnMajorCursor cursor = order.at(start);
    const int64_t rows = order.rows;
    const int64_t width = tile_columns(order, cursor, count);
    tile_begin = start - cursor.row;
    tile_end = tile_begin + width * rows;
    tile.resize(width * rows);
    const scalar_t* top = input + (cursor.offset - cursor.row * order.columns);  // row 0 of the column
    tile_from_matrix(top, order.columns, tile.data(), rows, rows, width);
  }
};

template <typename scalar_t>
struct OutputGroups {
  scalar_t* output;
  int64_t numel;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& decoded) const {
    prefetch_values<true>(output, start + kGroupsAhead * count, count, numel);
    scalar_t* values = output + start;
    for (int64_t i = 0; i < count; ++i) {
      values[i] = static_cast<scalar_t>(decoded(i));
    }
  }

  void finish() const {}
};

// column_major GroupSink, mirroring ColumnMajorInputGroups: groups fill a column-major tile,
// written out row by row when full, when the next group does not continue it, or at finish();
// a group spanning two matrices is scattered value by value.
template <typename scalar_t>
struct ColumnMajorOutputGroups {
  scalar_t* output;
  ColumnMajorOrder order;
  std::vector<scalar_t> tile;  // read positions [tile_begin, filled) of [tile_begin, tile_end)
  int64_t tile_begin = 0;
  int64_t tile_end = 0;
  int64_t filled = 0;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& decoded) {
    if (start != filled || start + count > tile_end) {
      finish();
      start_tile(start, count);
    }
    if (start + count <= tile_end) {
      scalar_t* values = tile.data() + (start - tile_begin);
      for (int64_t i = 0; i < count; ++i) {
        values[i] = static_cast<scalar_t>(decoded(i));
      }
      filled = start + count;
      if (filled == tile_end) {
        finish();
      }
      return;
    }
    for_each_column_run(order, start, count, [&](int64_t first, int64_t offset, int64_t run) {
      const int64_t stride = order.columns;
      for (int64_t k = 0; k < run; ++k) {
        output[offset + k * stride] = static_cast<scalar_t>(decoded(first + k));
      }
    });
  }

  void start_tile(int64_t start, int64_t count) {
    const ColumnMajorCursor cursor = order.at(start);
    const int64_t width = tile_columns(order, cursor, count);
    tile_begin = filled = start;
    tile_end = start - cursor.row + width * order.rows;
    tile.resize(tile_end - tile_begin);
  }

  void finish() {
    if (filled == tile_begin) {
      return;
    }
    const ColumnMajorCursor cursor = order.at(tile_begin);
    const int64_t rows = order.rows;
    const int64_t width = (cursor.row + (filled - tile_begin) + rows - 1) / rows;
    scalar_t* top = output + (cursor.offset - cursor.row * order.columns);  // row 0 of the first column
    const int64_t held = filled - tile_begin;
    // (row, column) is at column * rows + row - cursor.row if in [0, held): whole columns go
    // out at once, a partial first or last one value by value.
    const int64_t first_whole = cursor.row > 0 ? 1 : 0;
    const int64_t end_whole = std::max(first_whole, (held + cursor.row) / rows);
    matrix_from_tile(tile.data() + first_whole * rows - cursor.row, rows, top + first_whole, order.columns, rows,
                     end_whole - first_whole);
    for (const int64_t column : {int64_t{0}, width - 1}) {
      if (column >= first_whole && column < end_whole) {
        continue;
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t k = column * rows + row - cursor.row;
        if (k >= 0 && k < held) {
          top[row * order.columns + column] = tile[k];
        }
      }
    }
    tile_begin = tile_end = filled = 0;
  }
};

std::tuple<at::Tensor, at::Tensor> quantize_pack_cpu(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                     int64_t seed, bool column_major) {
  const auto [codes, stats] = quantize_pack_outputs(input, bits, group_size, column_major);
  const int64_t numel = input.numel();
  if (numel == 0) {
    return {codes, stats};
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cpu", [&] {
    const scalar_t* data = input.const_data_ptr<scalar_t>();
    if (column_major) {
      const ColumnMajorInputGroups<scalar_t> source{data, ColumnMajorOrder{input.size(-2), input.size(-1)}};
      encode_groups(source, numel, bits, group_size, static_cast<uint64_t>(seed), codes, stats);
    } else {
      encode_groups(InputGroups<scalar_t>{data, numel}, numel, bits, group_size, static_cast<uint64_t>(seed), codes,
                    stats);
    }
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cpu(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                 int64_t numel, at::ScalarType dtype, int64_t rows, int64_t columns) {
  const at::Tensor output = unpack_dequantize_output(codes, stats, bits, group_size, numel, dtype, rows, columns);
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cpu", [&] {
    scalar_t* data = output.mutable_data_ptr<scalar_t>();
    if (rows > 0) {
      decode_groups(codes, stats, numel, bits, group_size, ColumnMajorOutputGroups<scalar_t>{data, {rows, columns}});
    } else {
      decode_groups(codes, stats, numel, bits, group_size, OutputGroups<scalar_t>{data, numel});
    }
  });
  return output;
}

at::Tensor lookup_levels_cpu(const at::Tensor& codes, const at::Tensor& levels, int64_t bits, int64_t group_size,
                             int64_t numel) {
  const at::Tensor output = lookup_levels_output(codes, levels, bits, group_size, numel);
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(levels.scalar_type(), "lookup_levels_cpu", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      constexpr int kBits = decltype(bits_constant)::value;
      const LookupTask<kBits, scalar_t> task{codes.const_data_ptr<uint8_t>(), levels.const_data_ptr<scalar_t>(),
                                             output.mutable_data_ptr<scalar_t>(), numel, group_size, {}};
      parallel_tasks(num_groups(numel, group_size), group_size, task);
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("quantize_pack", &quantize_pack_cpu);
  m.impl("unpack_dequantize", &unpack_dequantize_cpu);
  m.impl("lookup_levels", &lookup_levels_cpu);
}

}  // namespace lightning_act
