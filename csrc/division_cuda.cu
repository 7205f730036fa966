// CUDA kernels of lightning_act::division_pack and lightning_act::division_unpack.
//
// Packing runs two kernels: one thread per tile computes the LFC (the tile's pixels are
// summed in the format's fixed order, which one thread can follow and a tree reduction
// could not), then the residual groups are encoded the way quant_cuda.cu encodes
// quantize_pack's groups: a group is owned by T = min(32, group_size / 8) lanes of a warp,
// each lane holding chunks of 8 values, the range reduced with warp shuffles, and each
// chunk's codes written as one `bits`-byte word. Decoding is one thread per chunk.
// c10's stream and guard headers rather than ATen/cuda/CUDAContext.h, which pulls in the
// cuBLAS/cuSPARSE headers: the kernels then build with a bare CUDA toolkit.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "division.h"
#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kChunk = 8;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
// Resident blocks of 256 threads per SM at full occupancy (2048 threads); with grid-stride
// loops, more blocks than fit at once would only add a partial wave.
constexpr int kBlocksPerSm = 8;

template <int kBits>
struct CodeWord;
template <>
struct CodeWord<1> {
  using type = uint8_t;
};
template <>
struct CodeWord<2> {
  using type = uint16_t;
};
template <>
struct CodeWord<4> {
  using type = uint32_t;
};
template <>
struct CodeWord<8> {
  using type = uint64_t;
};

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

// Residuals of the elements [index, min(index + 8, end)); returns how many (0 to 8).
template <typename scalar_t>
__device__ __forceinline__ int load_residuals(const scalar_t* __restrict__ input, const float* __restrict__ lfc,
                                              int64_t index, int64_t end, const TileGeometry& geometry,
                                              float (&values)[kChunk]) {
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

// The packed codes of one chunk; values past `count` are padding and get code 0.
template <int kBits>
__device__ __forceinline__ typename CodeWord<kBits>::type encode_chunk(const float (&values)[kChunk], int count,
                                                                        const GroupParams& params, uint32_t key,
                                                                        int64_t index) {
  uint64_t word = 0;
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < count) {
      const uint32_t code = encode_value(values[t], params, uniform_noise(key, static_cast<uint64_t>(index + t)));
      word |= static_cast<uint64_t>(code) << (t * kBits);
    }
  }
  return static_cast<typename CodeWord<kBits>::type>(word);
}

template <typename scalar_t, int kBits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    encode_residual_kernel(const scalar_t* __restrict__ input, const float* __restrict__ lfc, int64_t numel,
                           int64_t groups, int group_size, int lanes_per_group, TileGeometry geometry, uint64_t seed,
                           typename CodeWord<kBits>::type* __restrict__ codes, uint32_t* __restrict__ stats) {
  const int lane = threadIdx.x % kWarpSize;
  const int lane_in_group = lane % lanes_per_group;
  const int groups_per_warp = kWarpSize / lanes_per_group;
  const int chunks_per_group = group_size / kChunk;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t group_stride = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize * groups_per_warp;

  // The loop bound is uniform across the warp, so every lane reaches every shuffle.
  for (int64_t first_group = warp * groups_per_warp; first_group < groups; first_group += group_stride) {
    const int64_t group = first_group + lane / lanes_per_group;
    const bool active = group < groups;
    const int64_t start = group * group_size;
    const int64_t end = active ? start + std::min<int64_t>(group_size, numel - start) : start;

    GroupRange range;
    float first_values[kChunk];
    const int64_t first_index = start + static_cast<int64_t>(lane_in_group) * kChunk;
    const int first_count = load_residuals(input, lfc, first_index, end, geometry, first_values);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < first_count) {
        range.add(first_values[t]);
      }
    }
    for (int chunk = lane_in_group + lanes_per_group; chunk < chunks_per_group; chunk += lanes_per_group) {
      float values[kChunk];
      const int count = load_residuals(input, lfc, start + static_cast<int64_t>(chunk) * kChunk, end, geometry, values);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t < count) {
          range.add(values[t]);
        }
      }
    }
    // Lanes of one group are aligned and contiguous, so xor offsets below T stay inside it.
    for (int offset = lanes_per_group / 2; offset > 0; offset /= 2) {
      range.merge(__shfl_xor_sync(kFullWarp, range.min_key, offset), __shfl_xor_sync(kFullWarp, range.max_key, offset),
                  __shfl_xor_sync(kFullWarp, range.min_positive_bits, offset),
                  __shfl_xor_sync(kFullWarp, range.nonfinite, offset));
    }
    if (!active) {
      continue;
    }

    const GroupParams params = group_params(range, kBits);
    if (lane_in_group == 0) {
      stats[group] = static_cast<uint32_t>(params.stats_low) | (static_cast<uint32_t>(params.stats_step) << 16);
    }
    const uint32_t key = stream_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32));
    codes[first_index / kChunk] =
        encode_chunk<kBits>(first_values, params.finite ? first_count : 0, params, key, first_index);
    for (int chunk = lane_in_group + lanes_per_group; chunk < chunks_per_group; chunk += lanes_per_group) {
      const int64_t index = start + static_cast<int64_t>(chunk) * kChunk;
      float values[kChunk];
      const int count = params.finite ? load_residuals(input, lfc, index, end, geometry, values) : 0;
      codes[index / kChunk] = encode_chunk<kBits>(values, count, params, key, index);
    }
  }
}

// One thread per chunk of 8 values; a chunk never straddles two groups (group sizes are
// powers of two >= 8).
template <typename scalar_t, int kBits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    decode_kernel(const float* __restrict__ lfc, const uint8_t* __restrict__ codes, const uint16_t* __restrict__ stats,
                  int64_t numel, int group_shift, TileGeometry geometry, scalar_t* __restrict__ output) {
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  const int64_t chunks = (numel + kChunk - 1) / kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < chunks;
       chunk += stride) {
    const int64_t index = chunk * kChunk;
    const int64_t group = index >> group_shift;
    const DecodeParams params = decode_params(stats[2 * group], stats[2 * group + 1]);
    uint64_t word = 0;
#pragma unroll
    for (int byte = 0; byte < kBits; ++byte) {
      word |= static_cast<uint64_t>(codes[chunk * kBits + byte]) << (8 * byte);
    }
    TileCursor cursor(index, geometry);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (index + t < numel) {
        const float base = lfc[cursor.tile];
        const float residual = decode_value(static_cast<uint32_t>((word >> (t * kBits)) & kMask), params);
        output[index + t] = static_cast<scalar_t>(add_rn(base, residual));
        cursor.advance(geometry);
      }
    }
  }
}

int grid_size(int64_t work_items, int64_t items_per_block) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t needed = (work_items + items_per_block - 1) / items_per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(sms) * kBlocksPerSm)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> division_pack_cuda(const at::Tensor& input, int64_t block_h,
                                                                   int64_t block_w, int64_t bits, int64_t group_size,
                                                                   int64_t seed, at::ScalarType lfc_dtype) {
  check_division_pack_args(input, block_h, block_w, bits, group_size, lfc_dtype);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t planes = input.size(0);
  const TileGeometry geometry = make_geometry(input.size(1), input.size(2), block_h, block_w);
  const int64_t numel = input.numel();
  const int64_t groups = num_groups(numel, group_size);
  at::Tensor lfc = at::empty({planes, geometry.tiles_h, geometry.tiles_w}, input.options().dtype(lfc_dtype));
  at::Tensor codes = at::empty({groups * group_size * bits / 8}, input.options().dtype(at::kByte));
  at::Tensor stats = at::empty({groups, 2}, input.options().dtype(at::kBFloat16));
  if (numel == 0) {
    return {lfc, codes, stats};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t tiles = lfc.numel();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cuda", [&] {
    using input_t = scalar_t;
    LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(lfc_dtype, "division_pack_cuda_lfc", [&] {
      tile_means_kernel<input_t, scalar_t><<<grid_size(tiles, kThreadsPerBlock), kThreadsPerBlock, 0, stream>>>(
          input.const_data_ptr<input_t>(), tiles, geometry, lfc.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // The residual is taken against the LFC as stored, so its rounding lands in the residual.
  const at::Tensor lfc_float = lfc.to(at::kFloat);
  const int lanes_per_group = static_cast<int>(std::min<int64_t>(kWarpSize, group_size / kChunk));
  const int64_t groups_per_block = kThreadsPerBlock / lanes_per_group;
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "division_pack_cuda", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      constexpr int kBits = decltype(bits_constant)::value;
      encode_residual_kernel<scalar_t, kBits><<<grid_size(groups, groups_per_block), kThreadsPerBlock, 0, stream>>>(
          input.const_data_ptr<scalar_t>(), lfc_float.const_data_ptr<float>(), numel, groups,
          static_cast<int>(group_size), lanes_per_group, geometry, static_cast<uint64_t>(seed),
          reinterpret_cast<typename CodeWord<kBits>::type*>(codes.mutable_data_ptr<uint8_t>()),
          reinterpret_cast<uint32_t*>(stats.mutable_data_ptr<at::BFloat16>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {lfc, codes, stats};
}

at::Tensor division_unpack_cuda(const at::Tensor& lfc, const at::Tensor& codes, const at::Tensor& stats,
                                int64_t height, int64_t width, int64_t block_h, int64_t block_w, int64_t bits,
                                int64_t group_size, at::ScalarType dtype) {
  check_division_unpack_args(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype);
  const c10::cuda::CUDAGuard device_guard(codes.device());
  const TileGeometry geometry = make_geometry(height, width, block_h, block_w);
  at::Tensor output = at::empty({lfc.size(0), height, width}, codes.options().dtype(dtype));
  const int64_t numel = output.numel();
  if (numel == 0) {
    return output;
  }
  const at::Tensor lfc_float = lfc.to(at::kFloat).contiguous();
  const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(group_size));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "division_unpack_cuda", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      constexpr int kBits = decltype(bits_constant)::value;
      const int blocks = grid_size((numel + kChunk - 1) / kChunk, kThreadsPerBlock);
      decode_kernel<scalar_t, kBits><<<blocks, kThreadsPerBlock, 0, stream>>>(
          lfc_float.const_data_ptr<float>(), codes.const_data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()), numel, group_shift, geometry,
          output.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("division_pack", &division_pack_cuda);
  m.impl("division_unpack", &division_unpack_cuda);
}

}  // namespace lightning_act
