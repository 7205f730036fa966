// The parts of CUDA that csrc/*_kernels.cuh use, for g++: qualifiers, built-in index
// variables, vector types, warp shuffles, the runtime calls that size a grid, and the launch
// itself. Included before the kernel headers, it lets the unchanged kernel text run on the
// CPU, one fiber per CUDA thread, lanes of a warp in lock step at every shuffle
// (lockstep.cpp), under AddressSanitizer and UndefinedBehaviorSanitizer.
//
// The emulator checks what the hardware leaves undefined: every lane named in a shuffle's mask
// reaches the same shuffle (same source position, mask, width and value size), none of them
// has exited, each calling lane is in the mask, and each lane reads from a lane in the mask.
// A violation prints what broke, where, and the case being run, then aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

constexpr int warpSize = 32;

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The 16-byte vector types, aligned like CUDA's: a misaligned vector access is reported by
// UBSan's alignment check, as the hardware would fault on it.
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// The running CUDA thread's indices: the scheduler sets them before resuming a fiber.
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

using cudaStream_t = struct CUstream_st*;

enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

namespace emu {

// The emulated device: kernels size their grids from these.
struct Device {
  int multiprocessors = 1;
  int blocks_per_multiprocessor = 2;
};
Device& device();

// What is being run, printed with any rule violation.
void set_context(const char* description);

// Runs `body` once per thread of a `grid` of `block`s: each block's threads as fibers, the
// blocks one after another in a shuffled order.
void run_grid(dim3 grid, dim3 block, const std::function<void()>& body);

// One lane's part in a warp shuffle: waits until every lane of `mask` has arrived at the same
// shuffle, then returns the `size`-byte value of lane (own lane ^ lane_mask).
uint64_t shuffle_xor(unsigned mask, uint64_t value, std::size_t size, int lane_mask, int width,
                     const std::source_location& where);

// kernel<<<grid, block, 0, stream>>>(args...): arguments are copied to the kernel's parameter
// types first, as CUDA passes them by value.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t, Args&&... args) {
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  run_grid(grid, block, [&] { std::apply(kernel, params); });
  return cudaSuccess;
}

}  // namespace emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  const std::source_location& where = std::source_location::current()) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "4- or 8-byte values only");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = emu::shuffle_xor(mask, bits, sizeof(T), lane_mask, width, where);
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, std::size_t) {
  *blocks = emu::device().blocks_per_multiprocessor;
  return cudaSuccess;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  *value = attribute == cudaDevAttrMultiProcessorCount ? emu::device().multiprocessors : 0;
  return cudaSuccess;
}

inline cudaError_t cudaGetLastError() { return cudaSuccess; }

#define LIGHTNING_ACT_LAUNCH(kernel, blocks, stream, ...) \
  ::emu::launch(kernel, dim3(blocks), dim3(::lightning_act::kThreadsPerBlock), stream, __VA_ARGS__)
