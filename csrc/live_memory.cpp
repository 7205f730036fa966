// Live and peak CPU tensor bytes, like torch.cuda.memory_allocated / max_memory_allocated
// (RSS also counts the C allocator's cache). Wraps the CPU allocator: blocks keep the inner
// allocator's "simple" pointers (context == data, needed by COW clones and raw_deallocate),
// with a deleter that looks up size and inner deleter. Earlier blocks are never counted.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace lightning_act {
namespace {

struct Block {
  size_t size;
  c10::DeleterFnPtr free_inner;
};

std::mutex blocks_mutex;
std::unordered_map<void*, Block>& blocks() {
  static auto* table = new std::unordered_map<void*, Block>();  // never destroyed: blocks outlive statics
  return *table;
}

std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};

void raise_peak(int64_t now) {
  int64_t seen = peak_bytes.load(std::memory_order_relaxed);
  while (now > seen && !peak_bytes.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  Block block;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    auto found = blocks().find(data);
    block = found->second;
    blocks().erase(found);
  }
  live_bytes.fetch_sub(static_cast<int64_t>(block.size), std::memory_order_relaxed);
  block.free_inner(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &counted_delete, c10::Device(c10::DeviceType::CPU)};
    c10::DataPtr block = inner_->allocate(nbytes);
    c10::DeleterFnPtr free_inner = block.get_deleter();
    // Checked at installation: the inner allocator's blocks are their own context.
    void* data = block.release_context();
    {
      std::lock_guard<std::mutex> lock(blocks_mutex);
      blocks()[data] = Block{nbytes, free_inner};
    }
    raise_peak(live_bytes.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
               static_cast<int64_t>(nbytes));
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

// Installs on first call; whether the counter is active. Refuses an inner allocator without
// simple pointers and a plain deleter.
bool live_memory_install() {
  static CountingAllocator* installed = nullptr;
  static bool refused = false;
  if (installed != nullptr) return c10::GetCPUAllocator() == installed;
  if (refused) return false;
  c10::Allocator* inner = c10::GetCPUAllocator();
  c10::DataPtr probe = inner->allocate(64);
  if (probe.get() == nullptr || probe.get_context() != probe.get() || probe.get_deleter() == nullptr) {
    refused = true;
    return false;
  }
  probe.clear();
  installed = new CountingAllocator(inner);  // lives as long as the process: blocks point to it
  c10::SetCPUAllocator(installed, /*priority=*/1);
  return c10::GetCPUAllocator() == installed;
}

std::tuple<int64_t, int64_t> live_memory_read() {
  return {live_bytes.load(std::memory_order_relaxed), peak_bytes.load(std::memory_order_relaxed)};
}

void live_memory_reset_peak() {
  peak_bytes.store(live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

// Whether a tensor's storage is counted.
bool live_memory_counts(const at::Tensor& t) {
  return t.has_storage() && t.storage().data_ptr().get_deleter() == &counted_delete;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lightning_act, m) {
  m.def("live_memory_install() -> bool", &live_memory_install);
  m.def("live_memory_read() -> (int live, int peak)", &live_memory_read);
  m.def("live_memory_reset_peak() -> ()", &live_memory_reset_peak);
  m.def("live_memory_counts(Tensor t) -> bool", &live_memory_counts);
}

}  // namespace lightning_act
