// CPU kernels of lightning_act::quantize_pack and lightning_act::unpack_dequantize: the
// group encoder and decoder of quant_cpu.h over the input and output tensors.
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "quant_args.h"
#include "quant_cpu.h"

namespace lightning_act {
namespace {

// quantize_pack's GroupSource: the input values as float32.
template <typename scalar_t>
struct InputGroups {
  const scalar_t* input;

  LIGHTNING_ACT_ALWAYS_INLINE const float* operator()(int64_t start, int64_t count, float* buffer) const {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return input + start;
    } else {
      for (int64_t i = 0; i < count; ++i) {
        buffer[i] = static_cast<float>(input[start + i]);
      }
      return buffer;
    }
  }
};

// unpack_dequantize's GroupSink: the output in its dtype.
template <typename scalar_t>
struct OutputGroups {
  scalar_t* output;

  template <typename Decoded>
  LIGHTNING_ACT_ALWAYS_INLINE void operator()(int64_t start, int64_t count, const Decoded& decoded) const {
    scalar_t* values = output + start;
    for (int64_t i = 0; i < count; ++i) {
      values[i] = static_cast<scalar_t>(decoded(i));
    }
  }
};

std::tuple<at::Tensor, at::Tensor> quantize_pack_cpu(const at::Tensor& input, int64_t bits, int64_t group_size,
                                                     int64_t seed) {
  const auto [codes, stats] = quantize_pack_outputs(input, bits, group_size);
  const int64_t numel = input.numel();
  if (numel == 0) {
    return {codes, stats};
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(input.scalar_type(), "quantize_pack_cpu", [&] {
    const InputGroups<scalar_t> source{input.const_data_ptr<scalar_t>()};
    encode_groups(source, numel, bits, group_size, static_cast<uint64_t>(seed), codes, stats);
  });
  return {codes, stats};
}

at::Tensor unpack_dequantize_cpu(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                                 int64_t numel, at::ScalarType dtype) {
  const at::Tensor output = unpack_dequantize_output(codes, stats, bits, group_size, numel, dtype);
  if (numel == 0) {
    return output;
  }
  LIGHTNING_ACT_DISPATCH_FLOAT_TYPES(dtype, "unpack_dequantize_cpu", [&] {
    const OutputGroups<scalar_t> sink{output.mutable_data_ptr<scalar_t>()};
    decode_groups(codes, stats, numel, bits, group_size, sink);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("quantize_pack", &quantize_pack_cpu);
  m.impl("unpack_dequantize", &unpack_dequantize_cpu);
}

}  // namespace lightning_act
