// CUDA kernels of lightning_act::quantize_pack and lightning_act::unpack_dequantize: the
// group encoder and chunk decoder of quant_cuda.cuh over the input and output tensors, read
// and written with 16-byte vector accesses where aligned (8 values are one or two of them).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "quant_args.h"
#include "quant_cuda.cuh"

namespace lightning_act {
namespace {

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

// quantize_pack's ChunkSource: the input values as float32.
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

// Stores the first `count` of 8 decoded values.
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

std::tuple<at::Tensor, at::Tensor> quantize_pack_cuda(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                      int64_t seed) {
  const auto [codes, stats] = quantize_pack_outputs(input, bits, group_size);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t numel = input.numel();
  if (numel == 0) {
    return {codes, stats};
  }
  const bool vector_loads = is_aligned(input.const_data_ptr(), 16);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cuda", [&] {
    const InputChunks<scalar_t> source{input.const_data_ptr<scalar_t>(), vector_loads};
    encode_groups(source, numel, bits, group_size, static_cast<uint64_t>(seed), codes, stats);
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cuda(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                  int64_t numel, at::ScalarType dtype) {
  const at::Tensor output = unpack_dequantize_output(codes, stats, bits, group_size, numel, dtype);
  const c10::cuda::CUDAGuard device_guard(codes.device());
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cuda", [&] {
    const OutputChunks<scalar_t> sink{output.mutable_data_ptr<scalar_t>()};
    decode_groups(codes, stats, numel, bits, group_size, sink);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("quantize_pack", &quantize_pack_cuda);
  m.impl("unpack_dequantize", &unpack_dequantize_cuda);
}

}  // namespace lightning_act
