// CUDA kernels of lightning_act::division_pack and lightning_act::division_unpack.
//
// Packing runs two kernels: one thread per tile computes the LFC (the tile's pixels are
// summed in the format's fixed order, which one thread can follow and a tree reduction
// could not), then quant_cuda.cuh's group encoder encodes the residual groups the way it
// encodes quantize_pack's; its chunk decoder adds the decoded residual back to the LFC.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "division.h"
#include "quant_args.h"
#include "quant_cuda.cuh"
#include "quant_math.h"

namespace lightning_act {
namespace {

template <typename scalar_t, typename lfc_t>
__global__ void __launch_bounds__(kThreadsPerBlock)
    tile_means_kernel(const scalar_t* __restrict__ input, int64_t tiles, TileGeometry geometry,
                      lfc_t* __restrict__ lfc) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tiles_per_plane = geometry.tiles_h * geometry.tiles_w;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; tile < tiles; tile += stride) {
    const int64_t plane = tile / tiles_per_plane;
    const int64_t within = tile - plane * tiles_per_plane;
    const float mean = tile_mean(input + plane * geometry.height * geometry.width, geometry,
                                 within / geometry.tiles_w, within % geometry.tiles_w);
    lfc[tile] = static_cast<lfc_t>(mean);
  }
}

// division_pack's ChunkSource: each element minus the LFC value of its tile.
template <typename scalar_t>
struct ResidualChunks {
  const scalar_t* input;
  const float* lfc;
  TileGeometry geometry;

  __device__ __forceinline__ int operator()(int64_t index, int64_t end, float (&values)[kChunk]) const {
    const int64_t available = end - index;
    if (available <= 0) {
      return 0;
    }
    TileCursor cursor(index, geometry);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < available) {
        const float base = lfc[cursor.tile];
        values[t] = sub_rn(static_cast<float>(input[index + t]), base);
        cursor.advance(geometry);
      }
    }
    return available < kChunk ? static_cast<int>(available) : kChunk;
  }
};

// division_unpack's ChunkSink: each decoded residual plus the LFC value of its tile.
template <typename scalar_t>
struct ReconstructedChunks {
  const float* lfc;
  TileGeometry geometry;
  scalar_t* output;

  __device__ __forceinline__ void operator()(int64_t index, int count, const float (&residuals)[kChunk]) const {
    TileCursor cursor(index, geometry);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < count) {
        const float base = lfc[cursor.tile];
        output[index + t] = static_cast<scalar_t>(add_rn(base, residuals[t]));
        cursor.advance(geometry);
      }
    }
  }
};

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
      constexpr auto kKernel = tile_means_kernel<input_t, scalar_t>;
      const int blocks = grid_size<kKernel>(tiles, kThreadsPerBlock);
      kKernel<<<blocks, kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
          input.const_data_ptr<input_t>(), tiles, geometry, lfc.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // The residual is taken against the LFC as stored, so its rounding lands in the residual.
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
