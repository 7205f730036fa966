// CUDA group encoder and chunk decoder (quantize_pack / unpack_dequantize and the DIVISION
// residual) with their launchers. No ATen/c10 headers: tests/emu compiles this as plain C++
// and runs it on the CPU.
//
// * a chunk is 8 values whose codes fill one `bits`-byte word;
// * a group is owned by T = min(32, group_size / 8) lanes of a warp, chunk c by lane c % T;
//   they reduce the range by warp shuffles, then encode in a second pass (first chunk still
//   in registers, later ones re-read from cache);
// * decoding is one thread per chunk; chunks never straddle groups (group_size >= 8, 2**k);
// * grid-stride loops, 64-bit indices, one resident wave of blocks.
//
// Functors:
// * ChunkSource `int operator()(int64_t index, int64_t end, float (&values)[kChunk]) const`
//   loads [index, min(index + 8, end)) and returns how many;
// * ChunkSink `void operator()(int64_t index, int count, const float (&values)[kChunk]) const`
//   stores the first `count` decoded values of the chunk at `index`.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "quant_math.h"

// The emulator defines its own, since only nvcc parses triple chevrons.
#ifndef LIGHTNING_ACT_LAUNCH
#define LIGHTNING_ACT_LAUNCH(kernel, blocks, stream, ...) \
  kernel<<<(blocks), ::lightning_act::kThreadsPerBlock, 0, (stream)>>>(__VA_ARGS__)
#endif

namespace lightning_act {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kChunk = 8;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

template <int kBits>
using CodeWord = std::conditional_t<kBits == 1, uint8_t,
                                    std::conditional_t<kBits == 2, uint16_t,
                                                       std::conditional_t<kBits == 4, uint32_t, uint64_t>>>;

// Packed codes of one chunk; values past `count` are padding (code 0).
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

  // Warp-uniform loop bound: every lane reaches every shuffle.
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
    // A group's lanes are aligned and contiguous, so xor offsets below T stay inside it.
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

// `vector_load` needs 16-byte alignment.
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

// A full chunk is stored with 16-byte vector stores.
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

// The output is freshly allocated, so 16-byte aligned.
template <typename scalar_t>
struct OutputChunks {
  scalar_t* output;

  __device__ __forceinline__ void operator()(int64_t index, int count, const float (&values)[kChunk]) const {
    store_chunk(output + index, count, values);
  }
};

// column_major ChunkSource: a chunk runs down a column. Neighbouring groups read neighbouring
// columns, so a block's loads of one row share a few sectors that L1 serves.
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

// column_major ChunkSink: values scattered back to row-major memory.
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

// Blocks of one resident wave, capped by the work (a partial second wave only adds a tail).
template <auto kKernel>
cudaError_t grid_size(int64_t work_items, int64_t items_per_block, int* blocks) {
  // Occupancy depends only on the kernel: queried once.
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

// Quantizes `numel` values of `source` into codes (last group padded) and per-group stats.
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
