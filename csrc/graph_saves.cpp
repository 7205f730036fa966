// The host side of lightning_act::pack_saved and lightning_act::unpack_saved, the ops a
// compiled graph calls for each tensor it saves for backward, for CPU and CUDA tensors.
//
// They run once per saved tensor per step, so the common case stays in C++: a plan the
// Python implementation (lightning_act/capture/compiled.py) has already handled once and
// registered here as a "packer" (groups in memory order or along a decided axis) is packed
// with the next seed of the graph seed stream, counted, and its stats kept for the session's
// report, all without Python. Everything else goes to that Python implementation, through
// the ops pack_saved_python / unpack_saved_python: plans not registered yet (the first call
// of each, a survey still running), masks, integer and derivative saves, a tensor whose
// storage the session keeps alive anyway (its batch), and any call while no session is
// capturing. Python reads the counts at the end of the session (graph_native_drain).
//
// The quantizer is called through the dispatcher, so a CUDA tensor goes to the CUDA kernels
// (or to the reference where they did not build), exactly as from Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace lightning_act {
namespace {

// How a registered plan packs: ``axis`` -1 for memory order; ``survey`` plans return a third
// part, the matrices (rows, columns) the groups were read as.
struct Packer {
  int64_t id;
  int64_t bits;
  int64_t group_size;
  int64_t axis;
  bool survey;
  int64_t numel;
  int64_t token;
};

struct Decoder {
  int64_t bits;
  int64_t group_size;
  bool survey;
};

struct State {
  std::mutex mutex;
  bool active = false;
  // Which decisions the capturing session follows (its model's group axes): a packer
  // registered under another token goes back to Python, which registers it anew.
  int64_t token = 0;
  std::unordered_set<int64_t> external_storages;
  uint64_t seed_base = 0;
  uint64_t seed_count = 0;
  std::unordered_map<std::string, Packer> packers;
  std::unordered_map<std::string, Decoder> decoders;
  // The first parts of the saves Python handed back unwritten (their input is kept alive
  // instead): unpack leaves them to Python, which holds the inputs.
  std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> kept_parts;
  std::vector<int64_t> counts;  // by packer id, since the last drain
  std::vector<at::Tensor> stats;
  std::vector<int64_t> stat_ids;
};

State& state() {
  static State instance;
  return instance;
}

// The same mixer as lightning_act.capture.engine.splitmix64.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

bool is_kept_locked(State& s, const at::Tensor& part) {
  if (s.kept_parts.empty()) return false;
  const auto found = s.kept_parts.find(part.unsafeGetTensorImpl());
  return found != s.kept_parts.end() && !found->second.expired();
}

int64_t next_seed_locked(State& s) {
  ++s.seed_count;
  return static_cast<int64_t>(splitmix64(s.seed_base + s.seed_count) >> 1);
}

// Whether sizes and strides fill one run of memory with no gap and no overlap (any
// permutation of dense): lightning_act.capture.compiled._memory_order.
bool memory_order(at::IntArrayRef size, at::IntArrayRef stride) {
  int64_t contiguous = 1;  // the common case first: row-major
  bool row_major = true;
  for (int64_t d = static_cast<int64_t>(size.size()) - 1; d >= 0 && row_major; --d) {
    row_major = size[d] == 1 || stride[d] == contiguous;
    contiguous *= size[d];
  }
  if (row_major) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions longer than 1
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] != 1) dims.emplace_back(stride[d], size[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [step, length] : dims) {
    if (step != expected) return false;
    expected *= length;
  }
  return true;
}

// x's values in the order restore() puts them back in: lightning_act.capture.compiled._flat
// (the quantizer reads a contiguous tensor of any shape as its values in order).
at::Tensor flat(const at::Tensor& x) {
  if (x.is_contiguous()) return x;
  if (memory_order(x.sizes(), x.strides())) return x.as_strided({x.numel()}, {1});
  return x.contiguous().view({-1});
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t, int64_t, bool)>&
quantize_pack_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("lightning_act::quantize_pack", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t, int64_t, bool)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                                          at::ScalarType, int64_t, int64_t)>&
unpack_dequantize_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lightning_act::unpack_dequantize", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, at::ScalarType, int64_t,
                            int64_t)>();
  return op;
}

std::vector<at::Tensor> pack_saved_python(const at::Tensor& input, c10::string_view plan) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("lightning_act::pack_saved_python", "")
                             .typed<std::vector<at::Tensor>(const at::Tensor&, c10::string_view)>();
  return op.call(input, plan);
}

at::Tensor unpack_saved_python(at::TensorList parts, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                               at::ScalarType dtype, c10::string_view plan) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("lightning_act::unpack_saved_python", "")
                             .typed<at::Tensor(at::TensorList, c10::SymIntArrayRef, c10::SymIntArrayRef,
                                               at::ScalarType, c10::string_view)>();
  return op.call(parts, size, stride, dtype, plan);
}

std::vector<at::Tensor> pack_saved(const at::Tensor& input, c10::string_view plan) {
  State& s = state();
  Packer packer{};
  int64_t seed = 0;
  bool native = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto found = s.active ? s.packers.find(std::string(plan)) : s.packers.end();
    native = found != s.packers.end() && found->second.numel == input.numel() && found->second.token == s.token &&
             s.external_storages.count(reinterpret_cast<int64_t>(input.storage().data())) == 0;
    if (native) {
      packer = found->second;
      seed = next_seed_locked(s);
    }
  }
  if (!native) return pack_saved_python(input, plan);  // unlocked: Python registers what it learns
  std::vector<at::Tensor> parts;
  if (!packer.survey) {
    auto [codes, stats] = quantize_pack_op().call(flat(input), packer.bits, packer.group_size, seed, false);
    parts = {codes, stats};
  } else {
    // Groups along ``axis``: the input read as matrices of its size by the product of the
    // later sizes, column by column (a survey plan's input is contiguous).
    int64_t rows = 0, columns = 0;
    at::Tensor source = input;
    if (packer.axis >= 0 && packer.axis < input.dim() - 1) {
      rows = input.size(packer.axis);
      columns = 1;
      for (int64_t d = packer.axis + 1; d < input.dim(); ++d) columns *= input.size(d);
      source = input.view({-1, rows, columns});
    }
    auto [codes, stats] = quantize_pack_op().call(source, packer.bits, packer.group_size, seed, rows > 0);
    at::Tensor shape = at::empty({2}, at::dtype(at::kLong));
    shape.data_ptr<int64_t>()[0] = rows;
    shape.data_ptr<int64_t>()[1] = columns;
    parts = {codes, stats, shape};
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  if (static_cast<int64_t>(s.counts.size()) <= packer.id) s.counts.resize(packer.id + 1, 0);
  ++s.counts[packer.id];
  s.stats.push_back(parts[1]);
  s.stat_ids.push_back(packer.id);
  return parts;
}

// Sizes and strides as SymInt lists: a graph's Python wrapper passes them as integer lists,
// inductor's C++ wrapper (``cpp_wrapper``, AOTInductor) as lists of SymInts; both are
// concrete when the kernel runs.
at::Tensor unpack_saved(at::TensorList parts, c10::SymIntArrayRef sym_size, c10::SymIntArrayRef sym_stride,
                        at::ScalarType dtype, c10::string_view plan) {
  State& s = state();
  Decoder decoder{};
  bool native = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto found = s.decoders.find(std::string(plan));
    native = found != s.decoders.end() && !is_kept_locked(s, parts[0]);
    if (native) decoder = found->second;
  }
  if (!native) return unpack_saved_python(parts, sym_size, sym_stride, dtype, plan);
  const at::IntArrayRef size = C10_AS_INTARRAYREF_SLOW(sym_size), stride = C10_AS_INTARRAYREF_SLOW(sym_stride);
  int64_t rows = 0, columns = 0;
  if (decoder.survey) {  // the matrices' shape, on the host
    const int64_t* shape = parts[2].data_ptr<int64_t>();
    rows = shape[0];
    columns = shape[1];
  }
  int64_t numel = 1;
  for (const int64_t length : size) numel *= length;
  at::Tensor decoded =
      unpack_dequantize_op().call(parts[0], parts[1], decoder.bits, decoder.group_size, numel, dtype, rows, columns);
  if (memory_order(size, stride)) return decoded.as_strided(size, stride);
  return at::empty_strided(size, stride, decoded.options()).copy_(decoded.view(size));
}

// ---------------------------------------------------------------- control, from Python
void native_session(bool active, int64_t token, std::vector<int64_t> external_storages) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.active = active;
  s.token = token;
  s.external_storages = std::unordered_set<int64_t>(external_storages.begin(), external_storages.end());
}

void native_external(int64_t storage) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.external_storages.insert(storage);
}

void native_seeds(int64_t base, int64_t count) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.seed_base = static_cast<uint64_t>(base);
  s.seed_count = static_cast<uint64_t>(count);
}

int64_t native_next_seed() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return next_seed_locked(s);
}

void native_packer(c10::string_view plan, int64_t id, int64_t bits, int64_t group_size, int64_t axis, bool survey,
                   int64_t numel, int64_t token) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.packers[std::string(plan)] = Packer{id, bits, group_size, axis, survey, numel, token};
}

void native_decoder(c10::string_view plan, int64_t bits, int64_t group_size, bool survey) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.decoders[std::string(plan)] = Decoder{bits, group_size, survey};
}

void native_kept(const at::Tensor& part) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto entry = s.kept_parts.begin(); entry != s.kept_parts.end();) {  // those whose graph state died
    entry = entry->second.expired() ? s.kept_parts.erase(entry) : std::next(entry);
  }
  s.kept_parts.emplace(part.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(part.getIntrusivePtr()));
}

// What was packed here since the last drain: (packer id, count) pairs flattened, and each
// packed tensor's stats with its packer id.
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>> native_drain() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<int64_t> counts;
  for (size_t id = 0; id < s.counts.size(); ++id) {
    if (s.counts[id] > 0) {
      counts.push_back(static_cast<int64_t>(id));
      counts.push_back(s.counts[id]);
    }
  }
  s.counts.assign(s.counts.size(), 0);
  std::vector<at::Tensor> stats;
  std::vector<int64_t> stat_ids;
  stats.swap(s.stats);
  stat_ids.swap(s.stat_ids);
  return {counts, stats, stat_ids};
}

void native_forget_packers() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.packers.clear();
  s.counts.clear();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lightning_act, m) {
  m.def("graph_native_session(bool active, int token, int[] external_storages) -> ()", &native_session);
  m.def("graph_native_external(int storage) -> ()", &native_external);
  m.def("graph_native_seeds(int base, int count) -> ()", &native_seeds);
  m.def("graph_native_next_seed() -> int", &native_next_seed);
  m.def("graph_native_packer(str plan, int id, int bits, int group_size, int axis, bool survey, int numel, int token)"
        " -> ()",
        &native_packer);
  m.def("graph_native_decoder(str plan, int bits, int group_size, bool survey) -> ()", &native_decoder);
  m.def("graph_native_kept(Tensor part) -> ()", &native_kept);
  m.def("graph_native_drain() -> (int[] counts, Tensor[] stats, int[] stat_ids)", &native_drain);
  m.def("graph_native_forget_packers() -> ()", &native_forget_packers);
}

TORCH_LIBRARY_IMPL(lightning_act, CPU, m) {
  m.impl("pack_saved", &pack_saved);
  m.impl("unpack_saved", &unpack_saved);
}

TORCH_LIBRARY_IMPL(lightning_act, CUDA, m) {
  m.impl("pack_saved", &pack_saved);
  m.impl("unpack_saved", &unpack_saved);
}

}  // namespace lightning_act
