// quant_kernels.cuh's launchers on tensors and the current stream. Uses c10 stream headers,
// not ATen/cuda/CUDAContext.h (cuBLAS/cuSPARSE), so a bare CUDA toolkit suffices.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "quant_args.h"
#include "quant_kernels.cuh"

namespace lightning_act {

template <typename ChunkSource>
void encode_groups(const ChunkSource& source, int64_t numel, int64_t bits, int64_t group_size, uint64_t seed,
                   const at::Tensor& codes, const at::Tensor& stats) {
  dispatch_bits(bits, [&](auto bits_constant) {
    C10_CUDA_CHECK(launch_encode_groups<decltype(bits_constant)::value>(
        source, numel, group_size, seed, codes.mutable_data_ptr<uint8_t>(),
        reinterpret_cast<uint32_t*>(stats.mutable_data_ptr<at::BFloat16>()), c10::cuda::getCurrentCUDAStream()));
  });
}

template <typename ChunkSink>
void decode_groups(const at::Tensor& codes, const at::Tensor& stats, int64_t numel, int64_t bits,
                   int64_t group_size, const ChunkSink& sink) {
  dispatch_bits(bits, [&](auto bits_constant) {
    C10_CUDA_CHECK(launch_decode_groups<decltype(bits_constant)::value>(
        codes.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(stats.const_data_ptr<at::BFloat16>()),
        numel, group_size, sink, c10::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace lightning_act
