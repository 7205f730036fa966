// The CUDA group encoder and chunk decoder of quantize_pack / unpack_dequantize
// (quant_cuda.cu) and of division_pack / division_unpack's residual (division_cuda.cu).
//
// Both pairs of ops are memory-bound, so the kernels are shaped around memory traffic:
//
// * a chunk is 8 consecutive values: their codes fill exactly `bits` bytes, stored as one
//   uint8/16/32/64 word;
// * a group is owned by T = min(32, group_size / 8) lanes of a warp, chunk c by lane c % T.
//   The lanes reduce the group's range with warp shuffles (no shared memory, no block
//   barrier), then encode in a second pass: the lane's first chunk is still in registers,
//   later chunks are re-read while they are hot in cache. With the default group size
//   (256) every lane has a single chunk and the input is read from memory once;
// * decoding is one thread per chunk; a chunk never straddles two groups (group sizes are
//   powers of two >= 8);
// * grid-stride loops with 64-bit indices cover any tensor size with one resident wave of
//   blocks.
//
// The ops differ only in where the float32 values come from and where the decoded ones go,
// which the kernels take as functors:
//
// * a ChunkSource, `int operator()(int64_t index, int64_t end, float (&values)[kChunk]) const`,
//   loads the values [index, min(index + 8, end)) and returns how many (0 to 8);
// * a ChunkSink, `void operator()(int64_t index, int count, const float (&values)[kChunk]) const`,
//   stores the first `count` decoded values of the chunk starting at `index` (fewer than 8
//   only at the end of the tensor).
//
// c10's stream headers rather than ATen/cuda/CUDAContext.h, which pulls in the
// cuBLAS/cuSPARSE headers: the kernels then build with a bare CUDA toolkit.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kChunk = 8;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// The word holding the packed codes of one chunk: kBits bytes.
template <int kBits>
using CodeWord = std::conditional_t<kBits == 1, uint8_t,
                                    std::conditional_t<kBits == 2, uint16_t,
                                                       std::conditional_t<kBits == 4, uint32_t, uint64_t>>>;

// The packed codes of one chunk; values past `count` are padding and get code 0.
template <int kBits>
__device__ __forceinline__ CodeWord<kBits> encode_chunk(const float (&values)[kChunk], int count,
                                                        const GroupParams& params, uint32_t key, int64_t index) {
  uint64_t word = 0;
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < count) {
      const uint32_t code = encode_value(values[t], params, uniform_noise(key, static_cast<uint64_t>(index + t)));
      word |= static_cast<uint64_t>(code) << (t * kBits);
    }
  }
  return static_cast<CodeWord<kBits>>(word);
}

template <typename ChunkSource, int kBits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    encode_groups_kernel(ChunkSource source, int64_t numel, int64_t groups, int group_size, int lanes_per_group,
                         uint64_t seed, CodeWord<kBits>* __restrict__ codes, uint32_t* __restrict__ stats) {
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
    const int first_count = source(first_index, end, first_values);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < first_count) {
        range.add(first_values[t]);
      }
    }
    for (int chunk = lane_in_group + lanes_per_group; chunk < chunks_per_group; chunk += lanes_per_group) {
      float values[kChunk];
      const int count = source(start + static_cast<int64_t>(chunk) * kChunk, end, values);
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
      const int count = params.finite ? source(index, end, values) : 0;
      codes[index / kChunk] = encode_chunk<kBits>(values, count, params, key, index);
    }
  }
}

// One thread per chunk of 8 values.
template <typename ChunkSink, int kBits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    decode_chunks_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ stats, int64_t numel,
                         int group_shift, bool aligned_codes, ChunkSink sink) {
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  const int64_t chunks = (numel + kChunk - 1) / kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < chunks;
       chunk += stride) {
    const int64_t index = chunk * kChunk;
    const int64_t group = index >> group_shift;
    const DecodeParams params = decode_params(stats[2 * group], stats[2 * group + 1]);
    uint64_t word = 0;
    if (aligned_codes) {
      word = reinterpret_cast<const CodeWord<kBits>*>(codes)[chunk];
    } else {
#pragma unroll
      for (int byte = 0; byte < kBits; ++byte) {
        word |= static_cast<uint64_t>(codes[chunk * kBits + byte]) << (8 * byte);
      }
    }
    float values[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      values[t] = decode_value(static_cast<uint32_t>((word >> (t * kBits)) & kMask), params);
    }
    sink(index, static_cast<int>(std::min<int64_t>(kChunk, numel - index)), values);
  }
}

// Blocks of one resident wave, capped by the work: with grid-stride loops every block gets
// the same share, so a second, partial wave would only add a tail.
template <auto kKernel>
int grid_size(int64_t work_items, int64_t items_per_block) {
  // Occupancy depends on the kernel's register use only; computed once per kernel.
  static const int blocks_per_sm = [] {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreadsPerBlock, 0));
    return std::max(blocks, 1);
  }();
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t needed = (work_items + items_per_block - 1) / items_per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(sms) * blocks_per_sm)));
}

inline bool is_aligned(const void* pointer, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

// Quantizes the `numel` values of `source` to `bits` bits into `codes` and `stats`,
// allocated by empty_codes_and_stats, on the current stream.
template <typename ChunkSource>
void encode_groups(const ChunkSource& source, int64_t numel, int64_t bits, int64_t group_size, uint64_t seed,
                   const at::Tensor& codes, const at::Tensor& stats) {
  const int64_t groups = num_groups(numel, group_size);
  const int lanes_per_group = static_cast<int>(std::min<int64_t>(kWarpSize, group_size / kChunk));
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr int kBits = decltype(bits_constant)::value;
    constexpr auto kKernel = encode_groups_kernel<ChunkSource, kBits>;
    const int blocks = grid_size<kKernel>(groups, kThreadsPerBlock / lanes_per_group);
    kKernel<<<blocks, kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
        source, numel, groups, static_cast<int>(group_size), lanes_per_group, seed,
        reinterpret_cast<CodeWord<kBits>*>(codes.mutable_data_ptr<uint8_t>()),
        reinterpret_cast<uint32_t*>(stats.mutable_data_ptr<at::BFloat16>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Decodes the first `numel` values of `codes` and `stats`, at `bits` bits, into `sink` on the
// current stream.
template <typename ChunkSink>
void decode_groups(const at::Tensor& codes, const at::Tensor& stats, int64_t numel, int64_t bits,
                   int64_t group_size, const ChunkSink& sink) {
  const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(group_size));
  const bool aligned_codes = is_aligned(codes.const_data_ptr(), 8);
  dispatch_bits(bits, [&](auto bits_constant) {
    constexpr auto kKernel = decode_chunks_kernel<ChunkSink, decltype(bits_constant)::value>;
    const int blocks = grid_size<kKernel>((numel + kChunk - 1) / kChunk, kThreadsPerBlock);
    kKernel<<<blocks, kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
        codes.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()),
        numel, group_shift, aligned_codes, sink);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace lightning_act
