// The emulator's scheduler: every CUDA thread of a block is a fiber (ucontext) on one OS
// thread. A fiber runs until it reaches a warp shuffle or returns from the kernel; a shuffle
// completes once every lane of its mask has arrived, and the lanes then go on. The order in
// which runnable fibers resume is shuffled, so code that relies on an order CUDA does not
// promise shows up as a mismatch.
//
// Fiber switches are announced to AddressSanitizer, which otherwise takes a fiber's stack
// for a corrupted one.
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emulated_cuda.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace emu {
namespace {

// Kernels here use a few hundred bytes of stack; sanitizers multiply that.
constexpr std::size_t kStackBytes = 256 * 1024;

enum class LaneState { kRunnable, kWaiting, kExited };

struct Lane {
  ucontext_t context;
  char* stack = nullptr;
  LaneState state = LaneState::kRunnable;
  uint64_t sent = 0;
  uint64_t received = 0;
  int lane_mask = 0;
};

// The shuffle a warp's lanes are gathering at; `arrived` holds the lanes there so far.
struct Meeting {
  bool open = false;
  unsigned mask = 0;
  unsigned arrived = 0;
  int width = 0;
  std::size_t size = 0;
  std::source_location where;
};

struct Block {
  std::vector<Lane> lanes;
  std::vector<Meeting> meetings;  // one per warp
  const std::function<void()>* body = nullptr;
  int current = -1;  // the lane running now
  ucontext_t scheduler;
#if defined(__SANITIZE_ADDRESS__)
  const void* scheduler_stack = nullptr;
  std::size_t scheduler_stack_size = 0;
#endif
};

Block block_state;
std::string context_text = "(no case)";
std::mt19937 schedule_random(20240601u);

std::string site(const std::source_location& where) {
  return std::string(where.file_name()) + ":" + std::to_string(where.line()) + ":" + std::to_string(where.column());
}

std::string hex(unsigned mask) {
  char text[16];
  std::snprintf(text, sizeof(text), "%#x", mask);
  return text;
}

std::string lane_list(unsigned lanes) {
  std::string text;
  for (int lane = 0; lane < warpSize; ++lane) {
    if (lanes >> lane & 1u) {
      text += (text.empty() ? "" : ",") + std::to_string(lane);
    }
  }
  return text.empty() ? "none" : text;
}

[[noreturn]] void fail(const std::string& message) {
  const std::string warp =
      block_state.current >= 0 ? ", warp " + std::to_string(block_state.current / warpSize) : std::string();
  std::fprintf(stderr, "emulator: %s\n  block %u of %u%s; case: %s\n", message.c_str(), blockIdx.x, gridDim.x,
               warp.c_str(), context_text.c_str());
  std::fflush(stderr);
  std::abort();
}

unsigned exited_lanes(int warp) {
  unsigned lanes = 0;
  for (int lane = 0; lane < warpSize; ++lane) {
    const int index = warp * warpSize + lane;
    if (index < static_cast<int>(block_state.lanes.size()) && block_state.lanes[index].state == LaneState::kExited) {
      lanes |= 1u << lane;
    }
  }
  return lanes;
}

// Leaves the running fiber for the scheduler; returns when the scheduler resumes it.
void yield_to_scheduler(bool exiting) {
  Lane& lane = block_state.lanes[block_state.current];
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, block_state.scheduler_stack,
                                 block_state.scheduler_stack_size);
  swapcontext(&lane.context, &block_state.scheduler);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)exiting;
  swapcontext(&lane.context, &block_state.scheduler);
#endif
}

void lane_main() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &block_state.scheduler_stack, &block_state.scheduler_stack_size);
#endif
  (*block_state.body)();
  const int index = block_state.current;
  const int warp = index / warpSize;
  const int lane = index % warpSize;
  block_state.lanes[index].state = LaneState::kExited;
  const Meeting& meeting = block_state.meetings[warp];
  if (meeting.open && (meeting.mask >> lane & 1u)) {
    fail("lane " + std::to_string(lane) + " exited while lanes " + lane_list(meeting.arrived) +
         " wait for it in __shfl_xor_sync at " + site(meeting.where) + " with mask " + hex(meeting.mask));
  }
  yield_to_scheduler(/*exiting=*/true);
  fail("an exited fiber was resumed");
}

// Switches from the scheduler into lane `index` until it waits or exits.
void resume(int index) {
  Lane& lane = block_state.lanes[index];
  block_state.current = index;
  threadIdx = uint3{static_cast<unsigned>(index) % blockDim.x, 0, 0};
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, lane.stack, kStackBytes);
  swapcontext(&block_state.scheduler, &lane.context);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  swapcontext(&block_state.scheduler, &lane.context);
#endif
  block_state.current = -1;
}

// Hands every lane of a complete meeting the value of its source lane.
void exchange(int warp) {
  Meeting& meeting = block_state.meetings[warp];
  for (int lane = 0; lane < warpSize; ++lane) {
    if (!(meeting.mask >> lane & 1u)) {
      continue;
    }
    Lane& reader = block_state.lanes[warp * warpSize + lane];
    int source = lane ^ reader.lane_mask;
    // Past the end of the reader's width segment, CUDA returns the reader's own value.
    if (source >= (lane / meeting.width + 1) * meeting.width) {
      source = lane;
    }
    if (source < 0 || source >= warpSize || !(meeting.mask >> source & 1u)) {
      block_state.current = warp * warpSize + lane;
      fail("lane " + std::to_string(lane) + " reads lane " + std::to_string(source) + " (lane mask " +
           std::to_string(reader.lane_mask) + "), which is not in the mask " + hex(meeting.mask) +
           " of __shfl_xor_sync at " + site(meeting.where));
    }
    reader.received = block_state.lanes[warp * warpSize + source].sent;
    reader.state = LaneState::kRunnable;
  }
  meeting = Meeting();
}

std::vector<char*>& stacks() {
  static std::vector<char*> pool;
  return pool;
}

char* stack_for(std::size_t index) {
  auto& pool = stacks();
  while (pool.size() <= index) {
    void* memory = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      std::perror("emulator: mmap of a fiber stack");
      std::abort();
    }
    pool.push_back(static_cast<char*>(memory));
  }
#if defined(__SANITIZE_ADDRESS__)
  // A previous fiber on this stack may have left poisoned frames behind.
  ASAN_UNPOISON_MEMORY_REGION(pool[index], kStackBytes);
#endif
  return pool[index];
}

void run_block(unsigned threads, const std::function<void()>& body) {
  block_state.body = &body;
  block_state.lanes.assign(threads, Lane());
  block_state.meetings.assign((threads + warpSize - 1) / warpSize, Meeting());
  for (unsigned index = 0; index < threads; ++index) {
    Lane& lane = block_state.lanes[index];
    lane.stack = stack_for(index);
    getcontext(&lane.context);
    lane.context.uc_stack.ss_sp = lane.stack;
    lane.context.uc_stack.ss_size = kStackBytes;
    lane.context.uc_link = nullptr;
    makecontext(&lane.context, lane_main, 0);
  }
  std::vector<int> order(threads);
  std::iota(order.begin(), order.end(), 0);
  unsigned remaining = threads;
  while (remaining > 0) {
    std::shuffle(order.begin(), order.end(), schedule_random);
    bool progressed = false;
    for (const int index : order) {
      if (block_state.lanes[index].state != LaneState::kRunnable) {
        continue;
      }
      resume(index);
      progressed = true;
      remaining -= block_state.lanes[index].state == LaneState::kExited;
    }
    for (std::size_t warp = 0; warp < block_state.meetings.size(); ++warp) {
      const Meeting& meeting = block_state.meetings[warp];
      if (meeting.open && meeting.arrived == meeting.mask) {
        exchange(static_cast<int>(warp));
        progressed = true;
      }
    }
    if (!progressed) {
      std::string waiting;
      for (std::size_t warp = 0; warp < block_state.meetings.size(); ++warp) {
        const Meeting& meeting = block_state.meetings[warp];
        if (meeting.open) {
          waiting += " warp " + std::to_string(warp) + ": lanes " + lane_list(meeting.arrived) + " of mask " +
                     hex(meeting.mask) + " at " + site(meeting.where) + ";";
        }
      }
      fail("deadlock: no lane can go on;" + waiting);
    }
  }
}

}  // namespace

Device& device() {
  static Device emulated;
  return emulated;
}

void set_context(const char* description) {
#if defined(__SANITIZE_ADDRESS__)
  // An AddressSanitizer report then ends with the case it happened in.
  static const bool registered = [] {
    __sanitizer_set_death_callback([] { std::fprintf(stderr, "emulator case: %s\n", context_text.c_str()); });
    return true;
  }();
  (void)registered;
#endif
  context_text = description;
}

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    fail("only 1-D grids and blocks are emulated");
  }
  if (grid.x == 0 || block.x == 0 || block.x > 1024) {
    fail("invalid launch: " + std::to_string(grid.x) + " blocks of " + std::to_string(block.x) + " threads");
  }
  gridDim = grid;
  blockDim = block;
  std::vector<unsigned> blocks(grid.x);
  std::iota(blocks.begin(), blocks.end(), 0u);
  std::shuffle(blocks.begin(), blocks.end(), schedule_random);
  for (const unsigned index : blocks) {
    blockIdx = uint3{index, 0, 0};
    run_block(block.x, body);
  }
}

uint64_t shuffle_xor(unsigned mask, uint64_t value, std::size_t size, int lane_mask, int width,
                     const std::source_location& where) {
  const int index = block_state.current;
  if (index < 0) {
    fail("__shfl_xor_sync called outside a kernel");
  }
  const int warp = index / warpSize;
  const int lane = index % warpSize;
  if (!(mask >> lane & 1u)) {
    fail("lane " + std::to_string(lane) + " calls __shfl_xor_sync at " + site(where) + " with mask " +
         hex(mask) + ", which leaves it out");
  }
  if (width < 1 || width > warpSize || (width & (width - 1)) != 0) {
    fail("__shfl_xor_sync at " + site(where) + " has width " + std::to_string(width) +
         "; allowed: a power of two up to 32");
  }
  Meeting& meeting = block_state.meetings[warp];
  if (!meeting.open) {
    const unsigned exited = exited_lanes(warp) & mask;
    if (exited != 0) {
      fail("lane " + std::to_string(lane) + " waits in __shfl_xor_sync at " + site(where) + " with mask " +
           hex(mask) + " for lanes " + lane_list(exited) + ", which have exited");
    }
    meeting = Meeting{true, mask, 0u, width, size, where};
  } else if (meeting.mask != mask || meeting.width != width || meeting.size != size ||
             meeting.where.line() != where.line() || meeting.where.column() != where.column() ||
             std::string(meeting.where.file_name()) != where.file_name()) {
    fail("lanes of one warp reach different shuffles: lanes " + lane_list(meeting.arrived) + " wait at " +
         site(meeting.where) + " (mask " + hex(meeting.mask) + ", width " + std::to_string(meeting.width) +
         ", " + std::to_string(meeting.size) + " bytes), lane " + std::to_string(lane) + " arrives at " + site(where) +
         " (mask " + hex(mask) + ", width " + std::to_string(width) + ", " + std::to_string(size) +
         " bytes)");
  }
  Lane& self = block_state.lanes[index];
  self.sent = value;
  self.lane_mask = lane_mask;
  self.state = LaneState::kWaiting;
  meeting.arrived |= 1u << lane;
  yield_to_scheduler(/*exiting=*/false);
  return self.received;
}

}  // namespace emu
