// CPU kernels of lightning_act::quantize_pack and lightning_act::unpack_dequantize: the
// group encoder and decoder of quant_cpu.h over the input and output tensors, read and
// written in memory order or, for column_major, column by column.
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "quant_args.h"
#include "quant_cpu.h"

namespace lightning_act {
namespace {

// quantize_pack's GroupSource: the input values as float32.
template <typename scalar_t>
struct InputGroups {
  const scalar_t* input;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) const {
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

// Calls fn(first, offset, run) for each stretch of values [start, start + count) of a
// column_major read that lies in one column: values first .. first + run - 1 (counted from
// start) sit at offset, offset + columns, ... in memory. Branch-free loops inside a stretch.
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

// quantize_pack's GroupSource for column_major: the values gathered column by column. A
// group runs down a column, `columns` values apart in memory; the groups after it read the
// next columns, whose values share its cache lines, so one task's groups reuse them.
template <typename scalar_t>
struct ColumnMajorInputGroups {
  const scalar_t* input;
  ColumnMajorOrder order;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) const {
    for_each_column_run(order, start, count, [&](int64_t first, int64_t offset, int64_t run) {
      const int64_t stride = order.columns;
      for (int64_t k = 0; k < run; ++k) {
        buffer[first + k] = static_cast<float>(input[offset + k * stride]);
      }
    });
    return buffer;
  }
};

// unpack_dequantize's GroupSink: the output in its dtype.
template <typename scalar_t>
struct OutputGroups {
  scalar_t* output;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& decoded) const {
    scalar_t* values = output + start;
    for (int64_t i = 0; i < count; ++i) {
      values[i] = static_cast<scalar_t>(decoded(i));
    }
  }
};

// unpack_dequantize's GroupSink for a column_major pack: the values scattered back to their
// places in row-major memory.
template <typename scalar_t>
struct ColumnMajorOutputGroups {
  scalar_t* output;
  ColumnMajorOrder order;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& decoded) const {
    for_each_column_run(order, start, count, [&](int64_t first, int64_t offset, int64_t run) {
      const int64_t stride = order.columns;
      for (int64_t k = 0; k < run; ++k) {
        output[offset + k * stride] = static_cast<scalar_t>(decoded(first + k));
      }
    });
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
      encode_groups(InputGroups<scalar_t>{data}, numel, bits, group_size, static_cast<uint64_t>(seed), codes, stats);
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
      decode_groups(codes, stats, numel, bits, group_size, OutputGroups<scalar_t>{data});
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("quantize_pack", &quantize_pack_cpu);
  m.impl("unpack_dequantize", &unpack_dequantize_cpu);
}

}  // namespace lightning_act
