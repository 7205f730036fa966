// DIVISION's CUDA tile-means kernel and residual ChunkSource/ChunkSink. No ATen/c10 headers
// (tests/emu runs this on the CPU).
#pragma once

#include <cstdint>

#include "division_math.h"
#include "quant_kernels.cuh"
#include "quant_math.h"

namespace lightning_act {

// One thread per tile: the format fixes the summation order, which a tree reduction breaks.
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

template <typename scalar_t, typename lfc_t>
cudaError_t launch_tile_means(const scalar_t* input, int64_t tiles, const TileGeometry& geometry, lfc_t* lfc,
                              cudaStream_t stream) {
  constexpr auto kKernel = tile_means_kernel<scalar_t, lfc_t>;
  int blocks = 0;
  const cudaError_t error = grid_size<kKernel>(tiles, kThreadsPerBlock, &blocks);
  if (error != cudaSuccess) {
    return error;
  }
  LIGHTNING_ACT_LAUNCH(kKernel, blocks, stream, input, tiles, geometry, lfc);
  return cudaGetLastError();
}

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

}  // namespace lightning_act
