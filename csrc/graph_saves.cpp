// pack_saved / unpack_saved, which a compiled graph calls per saved tensor per step (CPU and
// CUDA). Plans registered by lightning_act/capture/compiled.py as packers/decoders run here
// without Python (seeded, counted, stats kept; kept-alive inputs handed back unwritten);
// everything else goes to pack_saved_python / unpack_saved_python. Python reads the counts
// via graph_native_drain. Kernels are called through the dispatcher, as from Python.
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
#include <utility>
#include <vector>

#include "quant_args.h"

namespace lightning_act {
namespace {

// The forms the native path stores, from the names of lightning_act.capture.decide.Form the plans
// carry. A derivative save packs as kQuant and decodes as kDerivative (inverted back to the input).
enum Form : int64_t { kQuant, kMask, kIndex, kDerivative, kCopy };

Form form_named(c10::string_view name) {
  if (name == "quantize") return kQuant;
  if (name == "mask") return kMask;
  if (name == "index") return kIndex;
  if (name == "copy") return kCopy;
  TORCH_CHECK(false, "lightning_act: no native path stores the form '", std::string(name), "'");
}

// A registered plan: quantized (``axis`` -1 for memory order; ``along_axis`` plans add a third
// part, the (rows, columns) read), a mask, or integers as ``value - offset`` in ``bits``
// (IndexCodec's layout, planar bit fields). ``kept_only`` plans serve only kept-alive inputs.
struct Packer {
  int64_t id;
  bool kept_only;
  int64_t form;
  int64_t bits;
  int64_t group_size;
  int64_t axis;
  bool along_axis;
  int64_t numel;
  int64_t token;
  int64_t offset;
};

// A kDerivative decoder's inverse of h (DerivativeSubstitute.restore_quantized in
// lightning_act.codecs.derivative): a _Grid uniform in h, piece ``j`` starting at
// ``low + j * step``. ``level_codes`` is one group holding every code.
struct Inverse {
  at::Tensor level_codes;
  int64_t level_width = 0;
  double low = 0;
  double step = 0;
  at::Tensor starts;
  at::Tensor slopes;
};

struct Decoder {
  int64_t form;
  int64_t offset;
  int64_t bits;
  int64_t group_size;
  bool along_axis;
  Inverse inverse;
};

struct State {
  std::mutex mutex;
  bool active = false;
  // The capturing session's decisions; packers of another token go back to Python.
  int64_t token = 0;
  std::unordered_set<int64_t> external_storages;
  uint64_t seed_base = 0;
  uint64_t seed_count = 0;
  std::unordered_map<std::string, Packer> packers;
  std::unordered_map<std::string, Decoder> decoders;
  // First part of each save handed back unwritten -> the input unpack returns. Dead entries
  // are dropped at each new entry, drain and session change.
  std::unordered_map<const c10::TensorImpl*, std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, at::Tensor>>
      kept_parts;
  std::vector<int64_t> counts;  // by packer id, since the last drain
  std::vector<int64_t> kept_counts;  // by packer id: its inputs handed back unwritten
  std::vector<at::Tensor> stats;
  std::vector<int64_t> stat_ids;
};

State& state() {
  static State instance;
  return instance;
}

// Chunking of DerivativeSubstitute.restore (codecs/derivative.py _chunks); must match for bit-exactness.
constexpr int64_t kMinChunk = 1 << 14, kMaxChunks = 16;

// The same mixer as lightning_act.capture.engine.splitmix64.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

at::Tensor kept_input_locked(State& s, const at::Tensor& part) {
  if (s.kept_parts.empty()) return {};
  const auto found = s.kept_parts.find(part.unsafeGetTensorImpl());
  return found == s.kept_parts.end() || found->second.first.expired() ? at::Tensor() : found->second.second;
}

void forget_dead_kept_locked(State& s) {
  for (auto entry = s.kept_parts.begin(); entry != s.kept_parts.end();) {
    entry = entry->second.first.expired() ? s.kept_parts.erase(entry) : std::next(entry);
  }
}

void keep_locked(State& s, const at::Tensor& part, const at::Tensor& input) {
  forget_dead_kept_locked(s);
  c10::weak_intrusive_ptr<c10::TensorImpl> watched(part.getIntrusivePtr());
  s.kept_parts.insert_or_assign(part.unsafeGetTensorImpl(), std::make_pair(std::move(watched), input));
}

void count_locked(std::vector<int64_t>& counts, int64_t id) {
  if (static_cast<int64_t>(counts.size()) <= id) counts.resize(id + 1, 0);
  ++counts[id];
}

int64_t next_seed_locked(State& s) {
  ++s.seed_count;
  return static_cast<int64_t>(splitmix64(s.seed_base + s.seed_count) >> 1);
}

// Whether the layout is a permutation of dense (graph_ops._memory_order).
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

// x's values in the order restore() puts them back in (graph_ops._flat).
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

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>&
lookup_levels_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lightning_act::lookup_levels", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op;
}

// Inverts 1-D ``values`` in place, chunked to bound temporaries: DerivativeSubstitute.restore
// op for op and chunk for chunk, so bit-identical to Python.
void invert_in_place(const Inverse& inverse, const at::Tensor& values) {
  const int64_t pieces = inverse.starts.numel();
  const double scale = inverse.step > 0 ? 1 / inverse.step : 0.0;
  const int64_t total = values.numel();
  const int64_t chunk = std::max(kMinChunk, (total + kMaxChunks - 1) / kMaxChunks);
  for (int64_t start = 0; start < total; start += chunk) {
    at::Tensor target = values.narrow(0, start, std::min(chunk, total - start));
    const at::Tensor h = target.to(at::kFloat);
    at::Tensor position = h.sub(inverse.low).mul_(scale).clamp_(0, pieces);
    const at::Tensor piece = position.to(at::kInt).clamp_(0, pieces - 1);
    const at::Tensor fraction = position.sub_(piece);
    target.copy_(inverse.starts.index_select(0, piece).addcmul_(inverse.slopes.index_select(0, piece), fraction));
  }
}

// DerivativeSubstitute.restore_quantized op for op: each group's levels inverted, then read
// back by code (lookup_levels); with at least as many levels as values, the values directly.
at::Tensor decode_derivative(const Decoder& decoder, const at::Tensor& codes, const at::Tensor& stats, int64_t numel,
                             at::ScalarType dtype) {
  const Inverse& inverse = decoder.inverse;
  const int64_t groups = stats.size(0), levels = int64_t{1} << decoder.bits, width = inverse.level_width;
  if (levels >= decoder.group_size) {
    const at::Tensor values =
        unpack_dequantize_op().call(codes, stats, decoder.bits, decoder.group_size, numel, dtype, 0, 0);
    invert_in_place(inverse, values);
    return values;
  }
  const at::Tensor decoded = unpack_dequantize_op().call(inverse.level_codes.repeat({groups}), stats, decoder.bits,
                                                         width, groups * width, dtype, 0, 0);
  const at::Tensor table = decoded.view({groups, width}).narrow(1, 0, levels).contiguous().view(-1);
  invert_in_place(inverse, table);
  return lookup_levels_op().call(codes, table.view({groups, levels}), decoder.bits, decoder.group_size, numel);
}

// graph_ops._restore: the saved tensor from its values in memory order, row-major where its
// strides leave gaps (graph_ops.unpacked_stride).
at::Tensor restore(const at::Tensor& flat_values, at::IntArrayRef size, at::IntArrayRef stride) {
  if (memory_order(size, stride)) return flat_values.as_strided(size, stride);
  return flat_values.view(size);
}

// ops.layout.pack_bit_fields(codes, bits, planar=True), op for op, so the bytes match.
at::Tensor pack_bit_fields(at::Tensor codes, int64_t bits) {
  if (bits == 8) return codes;
  const int64_t per_byte = 8 / bits;
  const int64_t padding = (per_byte - codes.numel() % per_byte) % per_byte;
  if (padding > 0) codes = at::cat({codes, at::zeros({padding}, codes.options())});
  const at::Tensor fields = codes.view({per_byte, -1});
  at::Tensor packed = fields[0].clone();
  for (int64_t field = 1; field < per_byte; ++field) {
    packed.bitwise_or_(fields[field].bitwise_left_shift(field * bits));
  }
  return packed;
}

at::Tensor unpack_bit_fields(const at::Tensor& packed, int64_t bits, int64_t numel) {
  if (bits == 8) return packed.narrow(0, 0, numel);
  const int64_t per_byte = 8 / bits;
  at::Tensor codes = at::empty({packed.numel() * per_byte}, packed.options());
  const at::Tensor fields = codes.view({per_byte, -1});
  for (int64_t field = 0; field < per_byte; ++field) {
    at::Tensor out = fields[field];
    at::bitwise_and_out(out, packed.bitwise_right_shift(field * bits), (1 << bits) - 1);
  }
  return codes.narrow(0, 0, numel);
}

// IndexCodec's _WIDE_CODE_DTYPES.
bool wide_index(int64_t bits) { return bits == 16 || bits == 32; }

// codecs.exact IndexCodec.pack, op for op: narrow codes wrap mod 256, wide ones use a signed dtype.
at::Tensor pack_index(const at::Tensor& input, int64_t bits, int64_t offset) {
  const at::Tensor values = flat(input).view({-1});
  if (wide_index(bits)) return (values - offset).to(bits == 16 ? at::kShort : at::kInt);
  return pack_bit_fields(values.to(at::kByte) - ((offset % 256) + 256) % 256, bits);
}

// IndexTensor.unpack.
at::Tensor unpack_index(const at::Tensor& codes, int64_t bits, int64_t offset, int64_t numel, at::ScalarType dtype) {
  at::Tensor values = (wide_index(bits) ? codes : unpack_bit_fields(codes, bits, numel)).to(dtype);
  values += offset;
  return values;
}

// Unwritten parts of the right sizes for a kept-alive input (the graph checks sizes; unpack
// only needs the first part's identity).
std::vector<at::Tensor> unwritten_parts(const Packer& packer, const at::Tensor& input) {
  const auto options = input.options();
  if (packer.form == kMask) return {at::empty({(input.numel() + 7) / 8}, options.dtype(at::kByte))};
  if (packer.form == kIndex) {
    if (wide_index(packer.bits)) {
      return {at::empty({input.numel()}, options.dtype(packer.bits == 16 ? at::kShort : at::kInt))};
    }
    const int64_t per_byte = 8 / packer.bits;
    return {at::empty({(input.numel() + per_byte - 1) / per_byte}, options.dtype(at::kByte))};
  }
  auto [codes, stats] = empty_codes_and_stats(input.numel(), packer.bits, packer.group_size, options);
  if (!packer.along_axis) return {codes, stats};
  return {codes, stats, at::zeros({2}, at::dtype(at::kLong))};
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
  bool native = false, kept_alive = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto found = s.active ? s.packers.find(std::string(plan)) : s.packers.end();
    native = found != s.packers.end() && found->second.numel == input.numel() && found->second.token == s.token;
    if (native) {
      packer = found->second;
      // A copy is as large as its input, so a kept-alive input is copied all the same.
      kept_alive = packer.form != kCopy &&
                   s.external_storages.count(reinterpret_cast<int64_t>(input.storage().data())) > 0;
      native = kept_alive || !packer.kept_only;
      if (native && !kept_alive) seed = next_seed_locked(s);  // a mask's too: the stream stays Python's
    }
  }
  if (!native) return pack_saved_python(input, plan);  // unlocked: Python registers what it learns
  if (kept_alive) {
    std::vector<at::Tensor> parts = unwritten_parts(packer, input);
    std::lock_guard<std::mutex> lock(s.mutex);
    keep_locked(s, parts[0], input);
    count_locked(s.kept_counts, packer.id);
    return parts;
  }
  std::vector<at::Tensor> parts;
  if (packer.form == kCopy) {
    const at::Tensor values = flat(input).view({-1});
    parts = {values.is_alias_of(input) ? values.clone() : values};
  } else if (packer.form == kMask) {
    parts = {pack_bit_fields(flat(input).view({-1}).view(at::kByte), 1)};
  } else if (packer.form == kIndex) {
    parts = {pack_index(input, packer.bits, packer.offset)};
  } else if (!packer.along_axis) {
    auto [codes, stats] = quantize_pack_op().call(flat(input), packer.bits, packer.group_size, seed, false);
    parts = {codes, stats};
  } else {
    // Groups along ``axis``: matrices size(axis) x (later sizes), read column by column.
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
  count_locked(s.counts, packer.id);
  if (packer.form == kQuant) {
    s.stats.push_back(parts[1]);
    s.stat_ids.push_back(packer.id);
  }
  return parts;
}

// SymInt sizes for inductor's cpp_wrapper / AOTInductor; concrete when the kernel runs.
at::Tensor unpack_saved(at::TensorList parts, c10::SymIntArrayRef sym_size, c10::SymIntArrayRef sym_stride,
                        at::ScalarType dtype, c10::string_view plan) {
  State& s = state();
  Decoder decoder{};
  bool native = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    at::Tensor kept = kept_input_locked(s, parts[0]);
    if (kept.defined()) {
      // A kept-alive input, viewed as the saved tensor (a plan may pack a view of it).
      const at::IntArrayRef size = C10_AS_INTARRAYREF_SLOW(sym_size);
      at::Tensor view = kept.sizes() == size ? kept
                                             : kept.as_strided(size, C10_AS_INTARRAYREF_SLOW(sym_stride),
                                                               kept.storage_offset());
      return memory_order(view.sizes(), view.strides()) ? view : view.contiguous();
    }
    const auto found = s.decoders.find(std::string(plan));
    native = found != s.decoders.end();
    if (native) decoder = found->second;
  }
  // A derivative decoder serves only its inverse's device.
  native = native && (decoder.form != kDerivative || decoder.inverse.starts.device() == parts[0].device());
  if (!native) return unpack_saved_python(parts, sym_size, sym_stride, dtype, plan);
  const at::IntArrayRef size = C10_AS_INTARRAYREF_SLOW(sym_size), stride = C10_AS_INTARRAYREF_SLOW(sym_stride);
  int64_t numel = 1;
  for (const int64_t length : size) numel *= length;
  if (decoder.form == kCopy) return restore(parts[0], size, stride);
  if (decoder.form == kMask) return restore(unpack_bit_fields(parts[0], 1, numel).view(at::kBool), size, stride);
  if (decoder.form == kIndex) {
    return restore(unpack_index(parts[0], decoder.bits, decoder.offset, numel, dtype), size, stride);
  }
  if (decoder.form == kDerivative) {
    return restore(decode_derivative(decoder, parts[0], parts[1], numel, dtype), size, stride);
  }
  int64_t rows = 0, columns = 0;
  if (decoder.along_axis) {  // the matrices' shape, on the host
    const int64_t* shape = parts[2].data_ptr<int64_t>();
    rows = shape[0];
    columns = shape[1];
  }
  const at::Tensor decoded =
      unpack_dequantize_op().call(parts[0], parts[1], decoder.bits, decoder.group_size, numel, dtype, rows, columns);
  return restore(decoded, size, stride);
}

// ---------------------------------------------------------------- control, from Python
void native_session(bool active, int64_t token, std::vector<int64_t> external_storages) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.active = active;
  s.token = token;
  forget_dead_kept_locked(s);  // a step's batch is not held into the next
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

void native_packer(c10::string_view plan, int64_t id, bool kept_only, c10::string_view form, int64_t bits,
                   int64_t group_size, int64_t axis, bool along_axis, int64_t numel, int64_t token, int64_t offset) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.packers[std::string(plan)] =
      Packer{id, kept_only, form_named(form), bits, group_size, axis, along_axis, numel, token, offset};
}

void native_decoder(c10::string_view plan, c10::string_view form, int64_t bits, int64_t group_size, bool along_axis,
                    int64_t offset) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.decoders[std::string(plan)] = Decoder{form_named(form), offset, bits, group_size, along_axis, {}};
}

void native_derivative_decoder(c10::string_view plan, int64_t bits, int64_t group_size, const at::Tensor& level_codes,
                               int64_t level_width, double low, double step, const at::Tensor& starts,
                               const at::Tensor& slopes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.decoders[std::string(plan)] =
      Decoder{kDerivative, 0, bits, group_size, false, Inverse{level_codes, level_width, low, step, starts, slopes}};
}

void native_kept(const at::Tensor& part, const at::Tensor& input) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  keep_locked(s, part, input);
}

// Flattened (packer id, count) pairs of nonzero counts; resets the counts.
std::vector<int64_t> drain_counts(std::vector<int64_t>& counts) {
  std::vector<int64_t> drained;
  for (size_t id = 0; id < counts.size(); ++id) {
    if (counts[id] > 0) {
      drained.push_back(static_cast<int64_t>(id));
      drained.push_back(counts[id]);
    }
  }
  counts.assign(counts.size(), 0);
  return drained;
}

// Counts (packed, kept) and stats since the last drain: with ``each``, per tensor with packer
// ids; otherwise concatenated per device (enough for the non-finite check).
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>> native_drain(
    bool each) {
  State& s = state();
  std::vector<int64_t> counts, kept_counts;
  std::vector<at::Tensor> stats;
  std::vector<int64_t> stat_ids;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    counts = drain_counts(s.counts);
    kept_counts = drain_counts(s.kept_counts);
    forget_dead_kept_locked(s);
    stats.swap(s.stats);
    stat_ids.swap(s.stat_ids);
  }
  if (each || stats.empty()) return {counts, kept_counts, stats, stat_ids};
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device;
  for (const at::Tensor& group_stats : stats) {
    auto found = std::find_if(by_device.begin(), by_device.end(),
                              [&](const auto& entry) { return entry.first == group_stats.device(); });
    if (found == by_device.end()) found = by_device.insert(by_device.end(), {group_stats.device(), {}});
    found->second.push_back(group_stats);
  }
  std::vector<at::Tensor> joined;
  for (const auto& entry : by_device) joined.push_back(at::cat(entry.second));
  return {counts, kept_counts, joined, {}};
}

void native_forget_packers() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.packers.clear();
  s.counts.clear();
  s.kept_counts.clear();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lightning_act, m) {
  m.def("graph_native_session(bool active, int token, int[] external_storages) -> ()", &native_session);
  m.def("graph_native_external(int storage) -> ()", &native_external);
  m.def("graph_native_seeds(int base, int count) -> ()", &native_seeds);
  m.def("graph_native_next_seed() -> int", &native_next_seed);
  m.def("graph_native_packer(str plan, int id, bool kept_only, str form, int bits, int group_size, int axis, "
        "bool along_axis, int numel, int token, int offset) -> ()",
        &native_packer);
  m.def("graph_native_decoder(str plan, str form, int bits, int group_size, bool along_axis, int offset) -> ()",
        &native_decoder);
  m.def("graph_native_derivative_decoder(str plan, int bits, int group_size, Tensor level_codes, int level_width, "
        "float low, float step, Tensor starts, Tensor slopes) -> ()",
        &native_derivative_decoder);
  m.def("graph_native_kept(Tensor part, Tensor input) -> ()", &native_kept);
  m.def("graph_native_drain(bool each) -> (int[] counts, int[] kept_counts, Tensor[] stats, int[] stat_ids)",
        &native_drain);
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
