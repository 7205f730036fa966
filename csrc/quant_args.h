// Argument checks, allocation and dispatch shared by the CPU and CUDA ops, so both devices
// give the same errors and shapes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

namespace lightning_act {

#define LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)            \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                       \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

inline void check_quant_args(int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "lightning_act: bits=", bits,
              " is not supported; allowed: 1, 2, 4, 8");
  TORCH_CHECK(group_size >= 8 && group_size <= 65536 && (group_size & (group_size - 1)) == 0,
              "lightning_act: group_size=", group_size, " must be a power of two in [8, 65536]");
}

inline int64_t num_groups(int64_t numel, int64_t group_size) { return (numel + group_size - 1) / group_size; }

inline void check_quantize_input(const at::Tensor& input, bool column_major) {
  TORCH_CHECK(is_supported_float(input.scalar_type()), "lightning_act.quantize_pack: input dtype is ",
              input.scalar_type(), "; allowed: Float, Half, BFloat16");
  TORCH_CHECK(input.is_contiguous(), "lightning_act.quantize_pack: input must be contiguous; got shape ",
              input.sizes(), " with strides ", input.strides());
  TORCH_CHECK(!column_major || input.dim() >= 2, "lightning_act.quantize_pack: column_major=True reads matrices ",
              "column by column: input must be at least 2-D; got shape ", input.sizes());
}

// Uninitialized codes (last group padded) and [groups, 2] bfloat16 stats for `numel` values.
inline std::tuple<at::Tensor, at::Tensor> empty_codes_and_stats(int64_t numel, int64_t bits, int64_t group_size,
                                                                const at::TensorOptions& options) {
  const int64_t groups = num_groups(numel, group_size);
  return {at::empty({groups * group_size * bits / 8}, options.dtype(at::kByte)),
          at::empty({groups, 2}, options.dtype(at::kBFloat16))};
}

inline void check_packed_codes(const char* op, const at::Tensor& codes, int64_t groups, int64_t bits,
                               int64_t group_size, int64_t numel) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "lightning_act.", op, ": codes dtype is ", codes.scalar_type(),
              "; allowed: Byte (uint8)");
  TORCH_CHECK(codes.is_contiguous(), "lightning_act.", op, ": codes must be contiguous; got strides ",
              codes.strides());
  const int64_t expected_bytes = groups * group_size * bits / 8;
  TORCH_CHECK(codes.numel() == expected_bytes, "lightning_act.", op, ": codes hold ", codes.numel(), " bytes; ",
              groups, " groups of ", group_size, " values at ", bits, " bits need ", expected_bytes);
  TORCH_CHECK(numel >= 0 && numel <= groups * group_size, "lightning_act.", op, ": numel=", numel, " must be in [0, ",
              groups * group_size, "] for ", groups, " groups of ", group_size);
}

// Returns the number of groups.
inline int64_t check_decode_args(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                 int64_t numel, at::ScalarType dtype, int64_t rows = 0, int64_t columns = 0) {
  check_quant_args(bits, group_size);
  TORCH_CHECK(stats.scalar_type() == at::kBFloat16, "lightning_act.unpack_dequantize: stats dtype is ",
              stats.scalar_type(), "; allowed: BFloat16");
  TORCH_CHECK(stats.dim() == 2 && stats.size(1) == 2, "lightning_act.unpack_dequantize: stats must have shape ",
              "[groups, 2]; got ", stats.sizes());
  TORCH_CHECK(stats.is_contiguous(), "lightning_act.unpack_dequantize: stats must be contiguous; got strides ",
              stats.strides());
  TORCH_CHECK(codes.device() == stats.device(), "lightning_act.unpack_dequantize: codes are on ", codes.device(),
              " but stats are on ", stats.device());
  const int64_t groups = stats.size(0);
  check_packed_codes("unpack_dequantize", codes, groups, bits, group_size, numel);
  TORCH_CHECK(is_supported_float(dtype), "lightning_act.unpack_dequantize: dtype is ", dtype,
              "; allowed: Float, Half, BFloat16");
  TORCH_CHECK((rows == 0 && columns == 0) || (rows > 0 && columns > 0 && numel % (rows * columns) == 0),
              "lightning_act.unpack_dequantize: rows=", rows, ", columns=", columns, ": allowed are both 0 (values ",
              "in memory order) or both positive with numel=", numel, " a multiple of rows * columns (whole ",
              "matrices packed column by column)");
  return groups;
}

// As ops.validation.check_lookup_levels; allocates the output uninitialized.
inline at::Tensor lookup_levels_output(const at::Tensor& codes, const at::Tensor& levels, int64_t bits,
                                       int64_t group_size, int64_t numel) {
  check_quant_args(bits, group_size);
  TORCH_CHECK(is_supported_float(levels.scalar_type()), "lightning_act.lookup_levels: levels dtype is ",
              levels.scalar_type(), "; allowed: Float, Half, BFloat16");
  TORCH_CHECK(levels.dim() == 2 && levels.size(1) == (int64_t{1} << bits), "lightning_act.lookup_levels: levels ",
              "must have shape [groups, ", int64_t{1} << bits, "] at bits=", bits, "; got ", levels.sizes());
  TORCH_CHECK(levels.is_contiguous(), "lightning_act.lookup_levels: levels must be contiguous; got strides ",
              levels.strides());
  TORCH_CHECK(codes.device() == levels.device(), "lightning_act.lookup_levels: codes are on ", codes.device(),
              " but levels are on ", levels.device());
  check_packed_codes("lookup_levels", codes, levels.size(0), bits, group_size, numel);
  return at::empty({numel}, levels.options());
}

// The C++ side of the op's fake in ops/schemas.py.
inline std::tuple<at::Tensor, at::Tensor> quantize_pack_outputs(const at::Tensor& input, int64_t bits,
                                                                int64_t group_size, bool column_major = false) {
  check_quant_args(bits, group_size);
  check_quantize_input(input, column_major);
  return empty_codes_and_stats(input.numel(), bits, group_size, input.options());
}

inline at::Tensor unpack_dequantize_output(const at::Tensor& codes, const at::Tensor& stats, int64_t bits,
                                           int64_t group_size, int64_t numel, at::ScalarType dtype,
                                           int64_t rows = 0, int64_t columns = 0) {
  check_decode_args(codes, stats, bits, group_size, numel, dtype, rows, columns);
  return at::empty({numel}, codes.options().dtype(dtype));
}

template <typename Fn>
void dispatch_bits(int64_t bits, Fn&& fn) {
  switch (bits) {
    case 1:
      fn(std::integral_constant<int, 1>{});
      break;
    case 2:
      fn(std::integral_constant<int, 2>{});
      break;
    case 4:
      fn(std::integral_constant<int, 4>{});
      break;
    case 8:
      fn(std::integral_constant<int, 8>{});
      break;
    default:
      TORCH_CHECK(false, "lightning_act: bits=", bits, " is not supported; allowed: 1, 2, 4, 8");
  }
}

}  // namespace lightning_act
