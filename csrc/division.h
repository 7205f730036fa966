// division_pack / division_unpack argument checks and output allocation (CPU and CUDA). The
// residual is stored exactly as quantize_pack stores a float32 tensor (ops/reference.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "division_math.h"
#include "quant_args.h"

namespace lightning_act {

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

// Uninitialized (lfc, codes, stats): the C++ side of the op's fake in ops/schemas.py.
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

inline at::Tensor division_unpack_output(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats,
                                         int64_t height, int64_t width, int64_t block_h, int64_t block_w, int64_t bits,
                                         int64_t group_size, at::ScalarType dtype) {
  check_division_unpack_args(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  return at::empty({lfc.size(0), height, width}, codes.options().dtype(dtype));
}

}  // namespace lightning_act
