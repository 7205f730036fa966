// The CUDA group encoder and chunk decoder of quantize_pack / unpack_dequantize and of
// division_pack / division_unpack's residual, with the host code that sizes and starts them.
//
// Device code and the CUDA runtime API only, no ATen or c10 header: nvcc compiles it for the
// ops (quant_cuda.cuh ties it to tensors), and the lock-step emulator of tests/emu compiles
// the same text as plain C++ and runs it on the CPU under sanitizers. The input and output
// element types (float, c10::Half, c10::BFloat16) come in as template arguments.
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
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "quant_math.h"

// Starts `kernel` on `blocks` blocks of kThreadsPerBlock threads on `stream`. The emulator
// defines it before including this header, since only nvcc parses the triple chevrons.
#ifndef LIGHTNING_ACT_LAUNCH
#define LIGHTNING_ACT_LAUNCH(kernel, blocks, stream, ...) \
  kernel<<<(blocks), ::lightning_act::kThreadsPerBlock, 0, (stream)>>>(__VA_ARGS__)
#endif

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

template <typename scalar_t>
__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  return static_cast<float>(scalar_t(static_cast<uint16_t>(bits), scalar_t::from_bits()));
}

// Loads the 8 values of a full chunk as float32; `vector_load` needs 16-byte alignment.
template <typename scalar_t>
__device__ __forceinline__ void load_full_chunk(const scalar_t* __restrict__ src, bool vector_load,
                                                float (&values)[kChunk]) {
  if (vector_load) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      const float4 low = reinterpret_cast<const float4*>(src)[0];
      const float4 high = reinterpret_cast<const float4*>(src)[1];
      values[0] = low.x, values[1] = low.y, values[2] = low.z, values[3] = low.w;
      values[4] = high.x, values[5] = high.y, values[6] = high.z, values[7] = high.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        values[t] = half_bits_to_float<scalar_t>(words[t / 2] >> (16 * (t % 2)));
      }
    }
  } else {
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      values[t] = static_cast<float>(src[t]);
    }
  }
}

// quantize_pack's ChunkSource: the input values as float32, read with 16-byte vector loads
// where aligned (8 values are one or two of them).
template <typename scalar_t>
struct InputChunks {
  const scalar_t* input;
  bool vector_loads;  // the input is 16-byte aligned

  __device__ __forceinline__ int operator()(int64_t index, int64_t end, float (&values)[kChunk]) const {
    const int64_t available = end - index;
    if (available >= kChunk) {
      load_full_chunk(input + index, vector_loads, values);
      return kChunk;
    }
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      values[t] = t < available ? static_cast<float>(input[index + t]) : 0.0f;
    }
    return available > 0 ? static_cast<int>(available) : 0;
  }
};

// Stores the first `count` of 8 decoded values; a full chunk with 16-byte vector stores.
template <typename scalar_t>
__device__ __forceinline__ void store_chunk(scalar_t* __restrict__ dst, int count, const float (&values)[kChunk]) {
  if (count == kChunk) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      reinterpret_cast<float4*>(dst)[0] = make_float4(values[0], values[1], values[2], values[3]);
      reinterpret_cast<float4*>(dst)[1] = make_float4(values[4], values[5], values[6], values[7]);
    } else {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        words[w] = static_cast<uint32_t>(scalar_t(values[2 * w]).x) |
                   (static_cast<uint32_t>(scalar_t(values[2 * w + 1]).x) << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < count) {
      dst[t] = scalar_t(values[t]);
    }
  }
}

// unpack_dequantize's ChunkSink: the output, freshly allocated and so 16-byte aligned.
template <typename scalar_t>
struct OutputChunks {
  scalar_t* output;

  __device__ __forceinline__ void operator()(int64_t index, int count, const float (&values)[kChunk]) const {
    store_chunk(output + index, count, values);
  }
};

// quantize_pack's ChunkSource for column_major: a chunk's 8 values run down a column,
// `columns` values apart in memory. The lanes of a group read 8 rows each of the same
// columns, and the groups of the next lanes and warps of the block the next columns, so the
// block's loads of one row fall in the same few sectors, which L1 serves after the first.
template <typename scalar_t>
struct ColumnMajorInputChunks {
  const scalar_t* input;
  ColumnMajorOrder order;

  __device__ __forceinline__ int operator()(int64_t index, int64_t end, float (&values)[kChunk]) const {
    const int64_t available = end - index;
    const int count = available >= kChunk ? kChunk : (available > 0 ? static_cast<int>(available) : 0);
    ColumnMajorCursor cursor = order.at(index);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      values[t] = t < count ? static_cast<float>(input[cursor.offset]) : 0.0f;
      if (t + 1 < count) {
        cursor.next();
      }
    }
    return count;
  }
};

// unpack_dequantize's ChunkSink for a column_major pack: the values scattered back to their
// places in row-major memory.
template <typename scalar_t>
struct ColumnMajorOutputChunks {
  scalar_t* output;
  ColumnMajorOrder order;

  __device__ __forceinline__ void operator()(int64_t index, int count, const float (&values)[kChunk]) const {
    ColumnMajorCursor cursor = order.at(index);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < count) {
        output[cursor.offset] = scalar_t(values[t]);
        cursor.next();
      }
    }
  }
};

inline bool is_aligned(const void* pointer, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

// Blocks of one resident wave, capped by the work: with grid-stride loops every block gets
// the same share, so a second, partial wave would only add a tail.
template <auto kKernel>
cudaError_t grid_size(int64_t work_items, int64_t items_per_block, int* blocks) {
  // Occupancy depends on the kernel's register use only: queried once per kernel.
  static std::atomic<int> resident_per_sm{0};
  int blocks_per_sm = resident_per_sm.load(std::memory_order_relaxed);
  if (blocks_per_sm == 0) {
    cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kKernel, kThreadsPerBlock, 0);
    if (error != cudaSuccess) {
      return error;
    }
    blocks_per_sm = std::max(blocks_per_sm, 1);
    resident_per_sm.store(blocks_per_sm, std::memory_order_relaxed);
  }
  int device = 0;
  int sms = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t needed = (work_items + items_per_block - 1) / items_per_block;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(sms) * blocks_per_sm)));
  return error;
}

// Quantizes the `numel` values of `source` to kBits bits on `stream`: the codes of every
// group (the last one padded to group_size values) to `codes`, each group's two bfloat16
// words to `stats`.
template <int kBits, typename ChunkSource>
cudaError_t launch_encode_groups(const ChunkSource& source, int64_t numel, int64_t group_size, uint64_t seed,
                                 uint8_t* codes, uint32_t* stats, cudaStream_t stream) {
  const int64_t groups = (numel + group_size - 1) / group_size;
  const int lanes_per_group = static_cast<int>(std::min<int64_t>(kWarpSize, group_size / kChunk));
  constexpr auto kKernel = encode_groups_kernel<ChunkSource, kBits>;
  int blocks = 0;
  const cudaError_t error = grid_size<kKernel>(groups, kThreadsPerBlock / lanes_per_group, &blocks);
  if (error != cudaSuccess) {
    return error;
  }
  LIGHTNING_ACT_LAUNCH(kKernel, blocks, stream, source, numel, groups, static_cast<int>(group_size), lanes_per_group,
                       seed, reinterpret_cast<CodeWord<kBits>*>(codes), stats);
  return cudaGetLastError();
}

// Decodes the first `numel` values of `codes` and `stats` at kBits bits into `sink` on `stream`.
template <int kBits, typename ChunkSink>
cudaError_t launch_decode_groups(const uint8_t* codes, const uint16_t* stats, int64_t numel, int64_t group_size,
                                 const ChunkSink& sink, cudaStream_t stream) {
  const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(group_size));
  const bool aligned_codes = is_aligned(codes, 8);
  constexpr auto kKernel = decode_chunks_kernel<ChunkSink, kBits>;
  int blocks = 0;
  const cudaError_t error = grid_size<kKernel>((numel + kChunk - 1) / kChunk, kThreadsPerBlock, &blocks);
  if (error != cudaSuccess) {
    return error;
  }
  LIGHTNING_ACT_LAUNCH(kKernel, blocks, stream, codes, stats, numel, group_shift, aligned_codes, sink);
  return cudaGetLastError();
}

}  // namespace lightning_act
