// CUDA quantize_pack / unpack_dequantize around quant_kernels.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "quant_args.h"
#include "quant_cuda.cuh"

namespace lightning_act {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_pack_cuda(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                      int64_t seed, bool column_major) {
  const auto [codes, stats] = quantize_pack_outputs(input, bits, group_size, column_major);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t numel = input.numel();
  if (numel == 0) {
    return {codes, stats};
  }
  const bool vector_loads = is_aligned(input.const_data_ptr(), 16);
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cuda", [&] {
    const scalar_t* data = input.const_data_ptr<scalar_t>();
    if (column_major) {
      const ColumnMajorInputChunks<scalar_t> source{data, ColumnMajorOrder{input.size(-2), input.size(-1)}};
      encode_groups(source, numel, bits, group_size, static_cast<uint64_t>(seed), codes, stats);
    } else {
      encode_groups(InputChunks<scalar_t>{data, vector_loads}, numel, bits, group_size, static_cast<uint64_t>(seed),
                    codes, stats);
    }
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cuda(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                  int64_t numel, at::ScalarType dtype, int64_t rows, int64_t columns) {
  const at::Tensor output = unpack_dequantize_output(codes, stats, bits, group_size, numel, dtype, rows, columns);
  const c10::cuda::CUDAGuard device_guard(codes.device());
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cuda", [&] {
    scalar_t* data = output.mutable_data_ptr<scalar_t>();
    if (rows > 0) {
      decode_groups(codes, stats, numel, bits, group_size, ColumnMajorOutputChunks<scalar_t>{data, {rows, columns}});
    } else {
      decode_groups(codes, stats, numel, bits, group_size, OutputChunks<scalar_t>{data});
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("quantize_pack", &quantize_pack_cuda);
  m.impl("unpack_dequantize", &unpack_dequantize_cuda);
}

}  // namespace lightning_act
