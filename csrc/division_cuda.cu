// CUDA division_pack (tile means, then the group encoder on residuals) / division_unpack.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "division.h"
#include "division_kernels.cuh"
#include "quant_args.h"
#include "quant_cuda.cuh"

namespace lightning_act {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> division_pack_cuda(const at::Tensor& input, int64_t block_h,
                                                                   int64_t block_w, int64_t bits, int64_t group_size,
                                                                   int64_t seed, at::ScalarType lfc_dtype) {
  const auto [lfc, codes, stats] = division_pack_outputs(input, block_h, block_w, bits, group_size, lfc_dtype);
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (input.numel() == 0) {
    return {lfc, codes, stats};
  }
  const TileGeometry geometry = make_geometry(input.size(1), input.size(2), block_h, block_w);
  const int64_t tiles = lfc.numel();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cuda", [&] {
    using input_t = scalar_t;
    LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(lfc_dtype, "division_pack_cuda_lfc", [&] {
      C10_CUDA_CHECK(launch_tile_means(input.const_data_ptr<input_t>(), tiles, geometry,
                                       lfc.mutable_data_ptr<scalar_t>(), c10::cuda::getCurrentCUDAStream()));
    });
  });
  // Residual against the LFC as stored, so its rounding lands in the residual.
  const at::Tensor lfc_float = lfc.to(at::kFloat);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cuda", [&] {
    const ResidualChunks<scalar_t> source{input.const_data_ptr<scalar_t>(), lfc_float.const_data_ptr<float>(),
                                          geometry};
    encode_groups(source, input.numel(), bits, group_size, static_cast<uint64_t>(seed), codes, stats);
  });
  return {lfc, codes, stats};
}

at::Tensor division_unpack_cuda(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats,
                                int64_t height, int64_t width, int64_t block_h, int64_t block_w, int64_t bits,
                                int64_t group_size, at::ScalarType dtype) {
  const at::Tensor output =
      division_unpack_output(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  const c10::cuda::CUDAGuard device_guard(codes.device());
  const int64_t numel = output.numel();
  if (numel == 0) {
    return output;
  }
  const TileGeometry geometry = make_geometry(height, width, block_h, block_w);
  const at::Tensor lfc_float = lfc.to(at::kFloat).contiguous();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "division_unpack_cuda", [&] {
    const ReconstructedChunks<scalar_t> sink{lfc_float.const_data_ptr<float>(), geometry,
                                             output.mutable_data_ptr<scalar_t>()};
    decode_groups(codes, stats, numel, bits, group_size, sink);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("division_pack", &division_pack_cuda);
  m.impl("division_unpack", &division_unpack_cuda);
}

}  // namespace lightning_act
