// CUDA kernels of lightning_act::quantize_pack and lightning_act::unpack_dequantize.
//
// Both ops are memory-bound, so the kernels are shaped around memory traffic:
//
// * a chunk is 8 consecutive values: their codes fill exactly `bits` bytes, stored as one
//   uint8/16/32/64 word, and 8 values are one or two 16-byte vector loads;
// * a group is owned by T = min(32, group_size / 8) lanes of a warp, chunk c by lane c % T.
//   The lanes reduce the group's range with warp shuffles (no shared memory, no block
//   barrier), then encode in a second pass: the lane's first chunk is still in registers,
//   later chunks are re-read while they are hot in cache. With the default group size
//   (256) every lane has a single chunk and the input is read from memory once;
// * a grid-stride loop over groups with 64-bit indices covers any tensor size with one
//   resident wave of blocks.
// c10's stream and guard headers rather than ATen/cuda/CUDAContext.h, which pulls in the
// cuBLAS/cuSPARSE headers: the kernels then build with a bare CUDA toolkit.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "quant_args.h"
#include "quant_math.h"

namespace lightning_act {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kChunk = 8;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

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

// Loads the values [index, min(index + 8, end)) as float32; returns how many (0 to 8).
template <typename scalar_t>
__device__ __forceinline__ int load_chunk(const scalar_t* __restrict__ input, int64_t index, int64_t end,
                                          bool vector_load, float (&values)[kChunk]) {
  const int64_t available = end - index;
  if (available >= kChunk) {
    load_full_chunk(input + index, vector_load, values);
    return kChunk;
  }
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    values[t] = t < available ? static_cast<float>(input[index + t]) : 0.0f;
  }
  return available > 0 ? static_cast<int>(available) : 0;
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
    quantize_pack_kernel(const scalar_t* __restrict__ input, int64_t numel, int64_t groups, int group_size,
                         int lanes_per_group, uint64_t seed, bool vector_loads,
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
    const int first_count = load_chunk(input, first_index, end, vector_loads, first_values);
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      if (t < first_count) {
        range.add(first_values[t]);
      }
    }
    for (int chunk = lane_in_group + lanes_per_group; chunk < chunks_per_group; chunk += lanes_per_group) {
      float values[kChunk];
      const int count = load_chunk(input, start + static_cast<int64_t>(chunk) * kChunk, end, vector_loads, values);
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
      const int count = params.finite ? load_chunk(input, index, end, vector_loads, values) : 0;
      codes[index / kChunk] = encode_chunk<kBits>(values, count, params, key, index);
    }
  }
}

// Stores 8 decoded values, or the first `available` of them at the end of the output.
template <typename scalar_t>
__device__ __forceinline__ void store_chunk(scalar_t* __restrict__ dst, int64_t available,
                                            const float (&values)[kChunk]) {
  if (available >= kChunk) {
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
    if (t < available) {
      dst[t] = scalar_t(values[t]);
    }
  }
}

// One thread per chunk of 8 values. The output is freshly allocated, so 16-byte aligned.
template <typename scalar_t, int kBits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    unpack_dequantize_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ stats, int64_t numel,
                             int group_shift, bool aligned_codes, scalar_t* __restrict__ output) {
  using Word = typename CodeWord<kBits>::type;
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
      word = reinterpret_cast<const Word*>(codes)[chunk];
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
    store_chunk(output + index, numel - index, values);
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

bool is_aligned(const void* pointer, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

std::tuple<at::Tensor, at::Tensor> quantize_pack_cuda(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                      int64_t seed) {
  check_quant_args(bits, group_size);
  check_quantize_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t numel = input.numel();
  const int64_t groups = num_groups(numel, group_size);
  at::Tensor codes = at::empty({groups * group_size * bits / 8}, input.options().dtype(at::kByte));
  at::Tensor stats = at::empty({groups, 2}, input.options().dtype(at::kBFloat16));
  if (groups == 0) {
    return {codes, stats};
  }
  const int lanes_per_group = static_cast<int>(std::min<int64_t>(kWarpSize, group_size / kChunk));
  const int64_t groups_per_block = kThreadsPerBlock / lanes_per_group;
  const bool vector_loads = is_aligned(input.const_data_ptr(), 16);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cuda", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      constexpr int kBits = decltype(bits_constant)::value;
      constexpr auto kKernel = quantize_pack_kernel<scalar_t, kBits>;
      const int blocks = grid_size<kKernel>(groups, groups_per_block);
      kKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
          input.const_data_ptr<scalar_t>(), numel, groups, static_cast<int>(group_size), lanes_per_group,
          static_cast<uint64_t>(seed), vector_loads,
          reinterpret_cast<typename CodeWord<kBits>::type*>(codes.mutable_data_ptr<uint8_t>()),
          reinterpret_cast<uint32_t*>(stats.mutable_data_ptr<at::BFloat16>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cuda(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                  int64_t numel, at::ScalarType dtype) {
  check_decode_args(codes, stats, bits, group_size, numel, dtype);
  const c10::cuda::CUDAGuard device_guard(codes.device());
  at::Tensor output = at::empty({numel}, codes.options().dtype(dtype));
  if (numel == 0) {
    return output;
  }
  const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(group_size));
  const bool aligned_codes = is_aligned(codes.const_data_ptr(), 8);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cuda", [&] {
    dispatch_bits(bits, [&](auto bits_constant) {
      constexpr int kBits = decltype(bits_constant)::value;
      constexpr auto kKernel = unpack_dequantize_kernel<scalar_t, kBits>;
      const int blocks = grid_size<kKernel>((numel + kChunk - 1) / kChunk, kThreadsPerBlock);
      kKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
          codes.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()),
          numel, group_shift, aligned_codes, output.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("quantize_pack", &quantize_pack_cuda);
  m.impl("unpack_dequantize", &unpack_dequantize_cuda);
}

}  // namespace lightning_act
