// Runs the CUDA kernels of csrc/ on the CPU through the emulator, one case per line of
// standard input, reading and writing raw little-endian arrays (test_emulated_kernels.py
// writes the inputs and compares the outputs with the CPU kernels):
//
//   quantize_pack DTYPE BITS GROUP SEED SMS OFFSET NUMEL INPUT CODES STATS ROWS COLUMNS
//   unpack_dequantize DTYPE BITS GROUP SMS OFFSET NUMEL CODES STATS OUTPUT ROWS COLUMNS
//   division_pack DTYPE LFC_DTYPE PLANES HEIGHT WIDTH BLOCK_H BLOCK_W BITS GROUP SEED SMS OFFSET
//                 INPUT LFC CODES STATS
//   division_unpack DTYPE LFC_DTYPE PLANES HEIGHT WIDTH BLOCK_H BLOCK_W BITS GROUP SMS
//                   LFC CODES STATS OUTPUT
//
// ROWS and COLUMNS are 0 for values in memory order, else the matrices of a column_major
// pack. DTYPE and LFC_DTYPE are float32, float16 or bfloat16; SMS is the emulated device's
// multiprocessor count, which sets the grid size. OFFSET places the op's input (the codes,
// for the decoders) OFFSET elements into its allocation, so a nonzero OFFSET makes it
// misaligned. Every buffer is allocated at its exact size, so AddressSanitizer reports any
// read or write past it, and outputs start filled with 0xA5 bytes, so an element the kernels
// never write shows up as a mismatch.
//
// What follows each launch mirrors csrc/quant_cuda.cu and csrc/division_cuda.cu, with raw
// buffers for tensors.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "emulated_cuda.h"
// Included after the stand-ins they build on.
#include "division_kernels.cuh"
#include "quant_kernels.cuh"

namespace {

using lightning_act::ColumnMajorInputChunks;
using lightning_act::ColumnMajorOrder;
using lightning_act::ColumnMajorOutputChunks;
using lightning_act::InputChunks;
using lightning_act::OutputChunks;
using lightning_act::ReconstructedChunks;
using lightning_act::ResidualChunks;
using lightning_act::TileGeometry;

constexpr unsigned char kFill = 0xA5;
constexpr std::size_t kAlignment = 64;  // as CUDA's allocator, whose blocks are at least 256-byte aligned

// An exact-size allocation holding `count` elements `offset` elements past its start.
template <typename T>
class Buffer {
 public:
  Buffer(std::size_t count, std::size_t offset) : count_(count), offset_(offset) {
    // Never empty, so that even a zero-size buffer has an address ASan guards.
    const std::size_t bytes = std::max<std::size_t>(1, (offset + count) * sizeof(T));
    if (posix_memalign(&memory_, kAlignment, bytes) != 0) {
      throw std::runtime_error("out of memory");
    }
    std::memset(memory_, kFill, bytes);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(memory_); }

  T* data() { return static_cast<T*>(memory_) + offset_; }
  std::size_t size() const { return count_; }

  void read(const std::string& path) {
    FILE* file = std::fopen(path.c_str(), "rb");
    if (file == nullptr) {
      throw std::runtime_error("cannot open " + path);
    }
    const std::size_t got = count_ == 0 ? 0 : std::fread(data(), sizeof(T), count_, file);
    const bool longer = std::fgetc(file) != EOF;
    std::fclose(file);
    if (got != count_ || longer) {
      throw std::runtime_error(path + " does not hold " + std::to_string(count_) + " elements of " +
                               std::to_string(sizeof(T)) + " bytes");
    }
  }

  void write(const std::string& path) {
    FILE* file = std::fopen(path.c_str(), "wb");
    if (file == nullptr || (count_ != 0 && std::fwrite(data(), sizeof(T), count_, file) != count_)) {
      throw std::runtime_error("cannot write " + path);
    }
    std::fclose(file);
  }

 private:
  void* memory_ = nullptr;
  std::size_t count_;
  std::size_t offset_;
};

// Calls fn(T{}) for the element type named `dtype`.
template <typename Fn>
void dispatch_dtype(const std::string& dtype, Fn&& fn) {
  if (dtype == "float32") {
    fn(float{});
  } else if (dtype == "float16") {
    fn(c10::Half{});
  } else if (dtype == "bfloat16") {
    fn(c10::BFloat16{});
  } else {
    throw std::runtime_error("dtype " + dtype + " is not supported; allowed: float32, float16, bfloat16");
  }
}

// Calls fn(std::integral_constant<int, bits>{}).
template <typename Fn>
void dispatch_bits(int bits, Fn&& fn) {
  switch (bits) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
    case 8:
      return fn(std::integral_constant<int, 8>{});
    default:
      throw std::runtime_error("bits=" + std::to_string(bits) + " is not supported; allowed: 1, 2, 4, 8");
  }
}

void require_parsed(const std::istream& args) {
  if (!args) {
    throw std::runtime_error("malformed arguments");
  }
}

int64_t groups_of(int64_t numel, int64_t group_size) { return (numel + group_size - 1) / group_size; }

void check(cudaError_t error) {
  if (error != cudaSuccess) {
    throw std::runtime_error("CUDA error " + std::to_string(error));
  }
}

// Encodes `source`'s numel values into new codes and stats files, like encode_groups.
template <typename Source>
void encode(const Source& source, int64_t numel, int bits, int64_t group_size, uint64_t seed,
            const std::string& codes_path, const std::string& stats_path) {
  const int64_t groups = groups_of(numel, group_size);
  Buffer<uint8_t> codes(groups * group_size * bits / 8, 0);
  Buffer<uint16_t> stats(groups * 2, 0);
  if (numel > 0) {
    dispatch_bits(bits, [&](auto bits_constant) {
      check(lightning_act::launch_encode_groups<decltype(bits_constant)::value>(
          source, numel, group_size, seed, codes.data(), reinterpret_cast<uint32_t*>(stats.data()), nullptr));
    });
  }
  codes.write(codes_path);
  stats.write(stats_path);
}

// Decodes codes and stats files into `sink`, like decode_groups; `offset` misplaces the codes.
template <typename Sink>
void decode(const Sink& sink, int64_t numel, int bits, int64_t group_size, std::size_t offset,
            const std::string& codes_path, const std::string& stats_path) {
  const int64_t groups = groups_of(numel, group_size);
  Buffer<uint8_t> codes(groups * group_size * bits / 8, offset);
  Buffer<uint16_t> stats(groups * 2, 0);
  codes.read(codes_path);
  stats.read(stats_path);
  if (numel > 0) {
    dispatch_bits(bits, [&](auto bits_constant) {
      check(lightning_act::launch_decode_groups<decltype(bits_constant)::value>(codes.data(), stats.data(), numel,
                                                                                group_size, sink, nullptr));
    });
  }
}

void quantize_pack(std::istream& args) {
  std::string dtype, input_path, codes_path, stats_path;
  int bits;
  int64_t group_size, numel, rows, columns;
  uint64_t seed;
  std::size_t offset;
  args >> dtype >> bits >> group_size >> seed >> emu::device().multiprocessors >> offset >> numel >> input_path >>
      codes_path >> stats_path >> rows >> columns;
  require_parsed(args);
  dispatch_dtype(dtype, [&](auto type) {
    using scalar_t = decltype(type);
    Buffer<scalar_t> input(numel, offset);
    input.read(input_path);
    if (rows > 0) {
      const ColumnMajorInputChunks<scalar_t> source{input.data(), ColumnMajorOrder{rows, columns}};
      encode(source, numel, bits, group_size, seed, codes_path, stats_path);
    } else {
      const InputChunks<scalar_t> source{input.data(), lightning_act::is_aligned(input.data(), 16)};
      encode(source, numel, bits, group_size, seed, codes_path, stats_path);
    }
  });
}

void unpack_dequantize(std::istream& args) {
  std::string dtype, codes_path, stats_path, output_path;
  int bits;
  int64_t group_size, numel, rows, columns;
  std::size_t offset;
  args >> dtype >> bits >> group_size >> emu::device().multiprocessors >> offset >> numel >> codes_path >>
      stats_path >> output_path >> rows >> columns;
  require_parsed(args);
  dispatch_dtype(dtype, [&](auto type) {
    using scalar_t = decltype(type);
    Buffer<scalar_t> output(numel, 0);
    if (rows > 0) {
      const ColumnMajorOutputChunks<scalar_t> sink{output.data(), ColumnMajorOrder{rows, columns}};
      decode(sink, numel, bits, group_size, offset, codes_path, stats_path);
    } else {
      decode(OutputChunks<scalar_t>{output.data()}, numel, bits, group_size, offset, codes_path, stats_path);
    }
    output.write(output_path);
  });
}

struct DivisionShape {
  std::string dtype, lfc_dtype;
  int64_t planes, height, width, block_h, block_w;
  int bits;
  int64_t group_size;

  TileGeometry geometry() const { return lightning_act::make_geometry(height, width, block_h, block_w); }
  int64_t numel() const { return planes * height * width; }
  int64_t tiles() const { return planes * geometry().tiles_h * geometry().tiles_w; }
};

std::istream& operator>>(std::istream& args, DivisionShape& shape) {
  return args >> shape.dtype >> shape.lfc_dtype >> shape.planes >> shape.height >> shape.width >> shape.block_h >>
         shape.block_w >> shape.bits >> shape.group_size;
}

// The LFC as float32, like the ops' lfc.to(at::kFloat).
template <typename lfc_t>
std::vector<float> as_float(Buffer<lfc_t>& lfc) {
  std::vector<float> values(lfc.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(lfc.data()[i]);
  }
  return values;
}

void division_pack(std::istream& args) {
  DivisionShape shape;
  uint64_t seed;
  std::size_t offset;
  std::string input_path, lfc_path, codes_path, stats_path;
  args >> shape >> seed >> emu::device().multiprocessors >> offset >> input_path >> lfc_path >> codes_path >>
      stats_path;
  require_parsed(args);
  dispatch_dtype(shape.dtype, [&](auto type) {
    using scalar_t = decltype(type);
    Buffer<scalar_t> input(shape.numel(), offset);
    input.read(input_path);
    dispatch_dtype(shape.lfc_dtype, [&](auto lfc_type) {
      using lfc_t = decltype(lfc_type);
      Buffer<lfc_t> lfc(shape.tiles(), 0);
      if (shape.numel() > 0) {
        check(lightning_act::launch_tile_means(input.data(), shape.tiles(), shape.geometry(), lfc.data(), nullptr));
      }
      lfc.write(lfc_path);
      const std::vector<float> lfc_float = as_float(lfc);
      const ResidualChunks<scalar_t> source{input.data(), lfc_float.data(), shape.geometry()};
      encode(source, shape.numel(), shape.bits, shape.group_size, seed, codes_path, stats_path);
    });
  });
}

void division_unpack(std::istream& args) {
  DivisionShape shape;
  std::string lfc_path, codes_path, stats_path, output_path;
  args >> shape >> emu::device().multiprocessors >> lfc_path >> codes_path >> stats_path >> output_path;
  require_parsed(args);
  dispatch_dtype(shape.dtype, [&](auto type) {
    using scalar_t = decltype(type);
    dispatch_dtype(shape.lfc_dtype, [&](auto lfc_type) {
      using lfc_t = decltype(lfc_type);
      Buffer<lfc_t> lfc(shape.tiles(), 0);
      lfc.read(lfc_path);
      const std::vector<float> lfc_float = as_float(lfc);
      Buffer<scalar_t> output(shape.numel(), 0);
      const ReconstructedChunks<scalar_t> sink{lfc_float.data(), shape.geometry(), output.data()};
      decode(sink, shape.numel(), shape.bits, shape.group_size, 0, codes_path, stats_path);
      output.write(output_path);
    });
  });
}

}  // namespace

int main() {
  std::string line;
  int cases = 0;
  while (std::getline(std::cin, line)) {
    if (line.empty()) {
      continue;
    }
    emu::set_context(line.c_str());
    std::istringstream args(line);
    std::string op;
    args >> op;
    try {
      if (op == "quantize_pack") {
        quantize_pack(args);
      } else if (op == "unpack_dequantize") {
        unpack_dequantize(args);
      } else if (op == "division_pack") {
        division_pack(args);
      } else if (op == "division_unpack") {
        division_unpack(args);
      } else {
        throw std::runtime_error("unknown op " + op);
      }
    } catch (const std::exception& error) {
      std::cerr << "run_kernels: " << error.what() << " in case: " << line << "\n";
      return 2;
    }
    ++cases;
  }
  std::cout << cases << " cases\n";
  return 0;
}
