"""Peak memory of a whole training step, against the limit of any saved-tensor compression.

What decides the largest batch that fits is the **peak** of a training step (forward and
backward), not what the forward keeps. For each model at one batch this benchmark measures:

* ``kept``: what the forward keeps for backward (its allocations minus its frees);
* ``peak``: the highest point of the step's live memory above its start (parameter
  gradients are allocated in backward, so they are in it);

for three ways of running the same step:

* ``none``: nothing compressed;
* ``act_2bit``: this library, every saved tensor at 2 bits (:class:`~lightning_act.ActivationCapture`);
* ``limit``: every saved floating-point tensor that is not a parameter or part of the batch
  stored as *nothing* and re-created empty (uninitialised) when backward unpacks it. The
  gradients are meaningless, the memory pattern is exact: what remains is what no
  saved-tensor codec can remove (parameter gradients, backward's transients: grad_output,
  grad_input, one decoded input at a time, workspaces). Integer and boolean tensors (max-pool
  indices, masks) are kept as they are.

It reports the kept ratio, the peak ratio and the limit ratio against ``none``, and the share
of the limit reached: ``limit peak / act_2bit peak`` (100% means no codec could do better).

On the CPU both figures come from the profiler's allocation events (``profile_memory=True``),
replayed in time order: their running sum is the live memory, its maximum the peak. On a
GPU, ``torch.cuda.memory_allocated`` and ``max_memory_allocated``.

``--timeline`` lists what is alive at the peak moment, grouped by what allocated it (the
module in forward, the backward node and op in backward), which explains the gap between a
method's peak and the limit's. ``--largest-batch`` finds the largest batch whose step fits
under a memory cap for ``none``, ``act_2bit`` and ``act_budget2`` (the adaptive policy at a
2-bit budget): on the CPU by the peak measured as above, on a GPU by real out-of-memory
errors, each try in its own process.

    python benchmarks/peak_memory.py                          # every model, about 10 minutes
    python benchmarks/peak_memory.py --models resnet18_cifar --timeline
    python benchmarks/peak_memory.py --largest-batch --models resnet50 transformer --cap-mib 1024
    python benchmarks/peak_memory.py --first-steps 3 --models transformer gatv2_cora
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_act import ActivationCapture, CompressionConfig, ops
from lightning_act.codecs.quant import GroupQuantCodec, QuantizedTensor
from lightning_act.policy import AdaptiveBits, FixedBits

from harness import (
    Workload,
    _git,
    build_char_transformer,
    build_resnet,
    environment,
    planetoid,
)

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
FORWARD_RANGE = "peak_memory.forward"
# What the child process of one GPU largest-batch try prints before its result.
TRY_RESULT_PREFIX = "peak-memory-try "
PROBE_SAMPLES = 4


# --------------------------------------------------------------------------- models
def _node_loss(model: nn.Module, graph) -> torch.Tensor:
    logits = model(graph.x, graph.edge_index)
    return nn.functional.cross_entropy(logits[graph.train_mask], graph.y[graph.train_mask])


class GraphNetwork(nn.Module):
    """Two message-passing layers with ReLU and dropout, as the usual Cora baselines."""

    def __init__(self, conv: str, in_channels: int, num_classes: int, hidden: int = 64, heads: int = 8):
        super().__init__()
        from torch_geometric import nn as gnn

        if conv == "gcn":
            self.conv1, self.conv2 = gnn.GCNConv(in_channels, hidden), gnn.GCNConv(hidden, num_classes)
        elif conv == "sage":
            self.conv1, self.conv2 = gnn.SAGEConv(in_channels, hidden), gnn.SAGEConv(hidden, num_classes)
        elif conv == "gin":
            self.conv1 = gnn.GINConv(
                nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            )
            self.conv2 = gnn.GINConv(
                nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
            )
        elif conv == "gatv2":
            self.conv1 = gnn.GATv2Conv(in_channels, hidden // heads, heads=heads, dropout=0.5)
            self.conv2 = gnn.GATv2Conv(hidden, num_classes, heads=1, dropout=0.5)
        else:
            raise ValueError(f"conv={conv!r} is not supported; allowed: gcn, sage, gin, gatv2")
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(self.dropout(x), edge_index))
        return self.conv2(self.dropout(x), edge_index)


def build_graph_network(batch: int, device: torch.device, data_dir: Path, conv: str) -> Workload:
    cora = planetoid(data_dir)
    model = GraphNetwork(conv, cora.num_features, cora.num_classes).to(device)
    return Workload(model, (cora.data.to(device),), _node_loss, [model.conv1, model.conv2], 1)


class SequenceClassifier(nn.Module):
    """A 2-layer LSTM over embedded tokens, classifying each sequence from its last state."""

    def __init__(self, vocab: int = 256, width: int = 256, layers: int = 2, classes: int = 10):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embedding(tokens))
        return self.head(output[:, -1])


def build_lstm(batch: int, device: torch.device, data_dir: Path, length: int = 128) -> Workload:
    model = SequenceClassifier().to(device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch, length), generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    return Workload(model, (tokens, labels), lambda m, t, y: nn.functional.cross_entropy(m(t), y), [model.lstm], batch)


@dataclass(frozen=True)
class ModelSpec:
    title: str
    build: Callable[..., Workload]
    batch: int
    sizes: dict = field(default_factory=dict)


# Without dropout, as large language models are trained: attention then runs the fused
# (flash) kernel, which keeps no attention matrix for backward.
TRANSFORMER_SIZES = {"d_model": 256, "n_layers": 4, "n_heads": 4, "block_size": 256, "dropout": 0.0}
MODELS: dict[str, ModelSpec] = {
    "resnet18_cifar": ModelSpec(
        "ResNet-18, CIFAR stem, 32x32",
        build_resnet,
        64,
        {"arch": "resnet18", "image_size": 32, "cifar_stem": True, "num_classes": 10},
    ),
    "resnet50": ModelSpec(
        "ResNet-50, 224x224",
        build_resnet,
        8,
        {"arch": "resnet50", "image_size": 224, "cifar_stem": False, "num_classes": 1000},
    ),
    "transformer": ModelSpec("pre-norm char transformer d256 L4 T256", build_char_transformer, 16, TRANSFORMER_SIZES),
    "gcn_cora": ModelSpec("GCN on Cora", build_graph_network, 1, {"conv": "gcn"}),
    "sage_cora": ModelSpec("GraphSAGE on Cora", build_graph_network, 1, {"conv": "sage"}),
    "gin_cora": ModelSpec("GIN on Cora", build_graph_network, 1, {"conv": "gin"}),
    "gatv2_cora": ModelSpec("GATv2 on Cora (8 heads)", build_graph_network, 1, {"conv": "gatv2"}),
    "lstm": ModelSpec("LSTM 2x256, T128", build_lstm, 32),
}


def build(name: str, batch: int, device: torch.device, data_dir: Path) -> Workload:
    torch.manual_seed(0)
    spec = MODELS[name]
    workload = spec.build(batch, device, data_dir, **spec.sizes)
    workload.model.train()
    return workload


# --------------------------------------------------------------------------- methods
class Method:
    """No compression; subclasses handle saved tensors from :meth:`start` (before the
    forward) to :meth:`finish` (after the backward)."""

    def prepare(self, workload: Workload) -> None:
        """One-off work before the measured step (the adaptive policy's calibration)."""

    def start(self, workload: Workload) -> None:
        """The forward begins."""

    def before_backward(self) -> None:
        """The forward is done; backward begins."""

    def finish(self) -> None:
        """Backward is done."""


class Compression(Method):
    """This library: ``bits`` for every tensor, or the adaptive policy at a ``budget``,
    armed and paused exactly as :class:`~lightning_act.ActCompression` does: capture starts
    before the forward, pauses for the backward and stops after it."""

    def __init__(self, bits: int = 2, budget: float | None = None, group_order: str = "auto"):
        self.bits = bits
        self.budget = budget
        self.group_order = group_order
        self.capture: ActivationCapture | None = None

    def prepare(self, workload: Workload) -> None:
        policy = FixedBits(self.bits) if self.budget is None else AdaptiveBits(self.budget)
        config = CompressionConfig(bits=self.bits, group_order=self.group_order)
        self.capture = ActivationCapture(config, workload.model, policy)
        if self.budget is not None:
            # ActCompression's first probe recalibration, on a few leading samples.
            sample = workload.leading_rows(PROBE_SAMPLES)
            self.capture.calibrate(lambda: workload.loss(sample), inputs=sample)

    def start(self, workload: Workload) -> None:
        self.capture.start(inputs=workload.batch)

    def before_backward(self) -> None:
        self.capture.pause()

    def finish(self) -> None:
        self.capture.resume()
        self.capture.stop()


class _Nothing:
    """What the limit keeps of a saved tensor: its layout, no data."""

    __slots__ = ("size", "order", "broadcast", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.size, self.dtype, self.device = t.shape, t.dtype, t.device
        #: Dimensions from the outermost in memory to the innermost, and the broadcast ones.
        self.order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        self.broadcast = {d for d in range(t.dim()) if t.stride(d) == 0}

    def empty(self) -> torch.Tensor:
        """An uninitialised tensor of the saved one's shape and memory order, holding each of
        its distinct elements once: a view into a larger buffer (q, k, v of a fused
        projection) comes back dense, as any codec must decode it."""
        stored = [1 if d in self.broadcast else self.size[d] for d in self.order]
        dense = torch.empty(stored, dtype=self.dtype, device=self.device)
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        return dense.permute(inverse).expand(self.size)


class Limit(Method):
    """Every saved float tensor that is not a parameter or the batch is stored as nothing
    and re-created empty at unpack: the floor of any saved-tensor compression."""

    def start(self, workload: Workload) -> None:
        alive = {p.untyped_storage().data_ptr() for p in workload.model.parameters()}
        alive |= {b.untyped_storage().data_ptr() for b in workload.model.buffers()}
        alive |= {t.untyped_storage().data_ptr() for t in _tensors(workload.batch)}

        def pack(t: torch.Tensor):
            if not t.is_floating_point() or t.untyped_storage().data_ptr() in alive:
                return t.detach()
            return _Nothing(t)

        def unpack(saved):
            return saved if isinstance(saved, torch.Tensor) else saved.empty()

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks.__enter__()

    def before_backward(self) -> None:
        # Each saved tensor keeps its own unpack hook: the hooks are needed at pack time only.
        self.hooks.__exit__(None, None, None)


class _Unwritten(QuantizedTensor):
    """A quantizer's record whose codes and statistics are allocated at their real sizes and
    never computed; it decodes to uninitialised memory."""

    __slots__ = ()

    def unpack(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.codes.device)


def _unwritten_pack(codec: GroupQuantCodec) -> Callable:
    def pack(dense: torch.Tensor, bits: int, seed: int, group_axis: int | None = None) -> QuantizedTensor:
        # The op's shape function gives the sizes of its outputs without running it; they
        # depend on the number of values only, not on the axis groups run along.
        codes, stats = ops.quantize_pack(dense.detach().to("meta"), bits, codec.group_size, seed)
        return _Unwritten(
            torch.empty_like(codes, device=dense.device),
            torch.zeros_like(stats, device=dense.device),
            bits,
            codec.group_size,
            dense.shape,
            dense.dtype,
        )

    return pack


class CodecFloor(Compression):
    """This library at 2 bits with its quantizers' kernels taken out: every record allocates
    exactly the bytes the quantizer stores and holds them as long as autograd holds it, and
    decodes to an uninitialised tensor, as the limit's does; the decisions, layouts and
    sharing are the library's own. Between the limit and this floor lie the stored bytes
    themselves (the information no 2-bit codec can drop); between this floor and the 2-bit
    run, whatever the kernels allocate around them."""

    def start(self, workload: Workload) -> None:
        # Row quantizers are made on first use, so the ones the warm-up step made are swapped here.
        for codec in [*self.capture.store._codecs.values(), *self.capture.store._row_codecs.values()]:
            if isinstance(codec, GroupQuantCodec):
                codec.pack = _unwritten_pack(codec)
        super().start(workload)


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif hasattr(obj, "to_dict"):  # torch_geometric Data
        yield from _tensors(list(obj.to_dict().values()))


METHODS: dict[str, Callable[[], Method]] = {
    "none": Method,
    "act_2bit": lambda: Compression(bits=2),
    "act_budget2": lambda: Compression(budget=2.0),
    "codec_floor": CodecFloor,
    "limit": Limit,
}


# --------------------------------------------------------------------------- measurement
@dataclass
class Allocation:
    size: int
    phase: str  # "forward" or "backward"
    origin: str  # what allocated it: module (forward) or backward node and op


@dataclass
class StepMemory:
    kept_bytes: int
    peak_bytes: int
    #: What was alive at the peak moment, allocated during the step (CPU only).
    live_at_peak: list[Allocation] = field(default_factory=list)
    #: The allocation that reached the peak (CPU only).
    peak_event: Allocation | None = None


def train_step(workload: Workload, method: Method) -> None:
    workload.model.zero_grad(set_to_none=True)
    method.start(workload)
    loss = workload.loss()
    method.before_backward()
    loss.backward()
    method.finish()


def measure_step(workload: Workload, method: Method, device: torch.device, timeline: bool = False) -> StepMemory:
    """Kept and peak bytes of one training step above its start (gradients set to None first).

    Garbage from before the step (reference cycles holding tensors, which the collector
    frees whenever it runs) is collected first, and the collector is off during the step, so
    that no earlier work's memory is freed inside it."""
    workload.model.zero_grad(set_to_none=True)
    gc.collect()
    with _collector_off():
        return _measure_step(workload, method, device, timeline)


@contextlib.contextmanager
def _collector_off():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _measure_step(workload: Workload, method: Method, device: torch.device, timeline: bool) -> StepMemory:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        method.start(workload)
        loss = workload.loss()
        method.before_backward()
        torch.cuda.synchronize(device)
        kept = torch.cuda.memory_allocated(device) - start
        loss.backward()
        method.finish()
        torch.cuda.synchronize(device)
        return StepMemory(kept, torch.cuda.max_memory_allocated(device) - start)
    names = {module: name or type(module).__name__ for name, module in workload.model.named_modules()}
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        if timeline:
            stack.enter_context(_module_ranges(names))
        with record_function(FORWARD_RANGE):
            method.start(workload)
            loss = workload.loss()
            method.before_backward()
        loss.backward()
        method.finish()
    return replay(prof.profiler.kineto_results.experimental_event_tree())


@contextlib.contextmanager
def _module_ranges(names: dict[nn.Module, str]):
    """A profiler range per module call in forward, so that allocations name their module."""
    open_ranges: list = []

    def enter(module, args):
        if module in names:
            open_ranges.append(torch.ops.profiler._record_function_enter_new("module:" + names[module], None))

    def leave(module, args, output):
        if module in names and open_ranges:
            torch.ops.profiler._record_function_exit._RecordFunction(open_ranges.pop())

    handles = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(leave, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def replay(tree) -> StepMemory:
    """The running sum of the allocation events in time order: kept bytes and peak, and
    what was alive at the peak."""
    from torch._C._profiler import _EventType

    def allocations(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                yield node
            yield from allocations(node.children)

    events = sorted(allocations(tree), key=lambda node: node.start_time_ns)
    live: dict[int, tuple] = {}  # ptr -> (event, size)
    running = peak = kept = 0
    peak_live: dict[int, tuple] = {}
    peak_event = None
    for event in events:
        size = event.extra_fields.alloc_size
        running += size
        in_forward = _enclosing(event, FORWARD_RANGE) is not None
        if in_forward:
            kept += size
        if size > 0:
            live[event.extra_fields.ptr] = (event, size)
        else:
            live.pop(event.extra_fields.ptr, None)
        if running > peak:
            peak, peak_event = running, event
            peak_live = dict(live)
    return StepMemory(
        kept,
        peak,
        [_describe(event, size) for event, size in peak_live.values()],
        None if peak_event is None else _describe(peak_event, peak_event.extra_fields.alloc_size),
    )


def _enclosing(event, name: str):
    node = event.parent
    while node is not None:
        if node.name == name:
            return node
        node = node.parent
    return None


def _describe(event, size: int) -> Allocation:
    ops, module, backward = [], None, None
    node = event.parent
    while node is not None:
        if node.name.startswith("module:") and module is None:
            module = node.name[len("module:") :]
        elif node.name.startswith("autograd::engine::evaluate_function: ") and backward is None:
            backward = node.name.split(": ", 1)[1]
        elif node.name.startswith(("aten::", "lightning_act::")) and len(ops) < 2:
            ops.append(node.name)
        node = node.parent
    phase = "forward" if _enclosing(event, FORWARD_RANGE) is not None else "backward"
    where = module if phase == "forward" else backward
    return Allocation(size, phase, f"{where or '-'} / {' < '.join(ops) or '-'}")


def timeline_table(memory: StepMemory, rows: int = 25) -> str:
    """The allocations alive at the peak, grouped by origin, largest first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for allocation in memory.live_at_peak:
        groups.setdefault((allocation.phase, allocation.origin), []).append(allocation.size)
    ordered = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = []
    if memory.peak_event is not None:
        lines.append(
            f"  peak reached in {memory.peak_event.phase} by {memory.peak_event.origin} "
            f"({memory.peak_event.size / MIB:.2f} MiB)"
        )
    lines.append(f"  {'MiB':>8}  {'count':>5}  phase     allocated by (module or backward node / op)")
    for (phase, origin), sizes in ordered[:rows]:
        lines.append(f"  {sum(sizes) / MIB:>8.2f}  {len(sizes):>5}  {phase:<8}  {origin}")
    rest = ordered[rows:]
    if rest:
        lines.append(
            f"  {sum(sum(s) for _, s in rest) / MIB:>8.2f}  {sum(len(s) for _, s in rest):>5}  "
            f"({len(rest)} more origins)"
        )
    by_phase = {p: sum(a.size for a in memory.live_at_peak if a.phase == p) for p in ("forward", "backward")}
    lines.append(
        f"  live at peak: {memory.peak_bytes / MIB:.2f} MiB = forward-allocated "
        f"{by_phase['forward'] / MIB:.2f} + backward-allocated {by_phase['backward'] / MIB:.2f} "
        f"(+ net frees of memory held before the step)"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- part: peak
def peak_part(
    models: list[str], device: torch.device, data_dir: Path, timeline: bool, results: dict, save: Callable[[], None]
) -> None:
    for name in models:
        spec = MODELS[name]
        workload = build(name, spec.batch, device, data_dir)
        row: dict = {"title": spec.title, "batch": spec.batch}
        for method_name in ("none", "act_2bit", "codec_floor", "limit"):
            method = METHODS[method_name]()
            method.prepare(workload)
            train_step(workload, method)  # warm up: lazily built kernels, allocator caches
            memory = measure_step(workload, method, device, timeline=timeline)
            row[method_name] = {"kept_bytes": memory.kept_bytes, "peak_bytes": memory.peak_bytes}
            log(
                f"{name} bs{spec.batch} {method_name}: kept {memory.kept_bytes / MIB:.2f} MiB, "
                f"peak {memory.peak_bytes / MIB:.2f} MiB"
            )
            if timeline and memory.live_at_peak:
                table = timeline_table(memory)
                row[method_name]["timeline"] = table
                print(table, flush=True)
        none, act, floor, limit = row["none"], row["act_2bit"], row["codec_floor"], row["limit"]
        row["kept_ratio"] = none["kept_bytes"] / max(act["kept_bytes"], 1)
        row["peak_ratio"] = none["peak_bytes"] / max(act["peak_bytes"], 1)
        row["floor_ratio"] = none["peak_bytes"] / max(floor["peak_bytes"], 1)
        row["limit_ratio"] = none["peak_bytes"] / max(limit["peak_bytes"], 1)
        row["floor_reached"] = floor["peak_bytes"] / max(act["peak_bytes"], 1)
        row["limit_reached"] = limit["peak_bytes"] / max(act["peak_bytes"], 1)
        row["floor_of_limit"] = limit["peak_bytes"] / max(floor["peak_bytes"], 1)
        results["peak"][name] = row
        save()
        log(
            f"{name}: kept {row['kept_ratio']:.2f}x, peak {row['peak_ratio']:.2f}x, "
            f"2-bit floor {row['floor_ratio']:.2f}x, limit {row['limit_ratio']:.2f}x; "
            f"{100 * row['floor_reached']:.1f}% of the floor and "
            f"{100 * row['limit_reached']:.1f}% of the limit reached (the floor itself: "
            f"{100 * row['floor_of_limit']:.1f}% of the limit)"
        )


# --------------------------------------------------------------------------- part: largest batch
def largest_fitting(fits: Callable[[int], bool], guess: int, floor: int = 1) -> int:
    """The largest batch ``b >= floor`` with ``fits(b)`` (0 if even ``floor`` does not fit),
    assuming ``fits`` is monotone: galloping from ``guess`` then bisection."""
    guess = max(guess, floor)
    step = 1
    if fits(guess):
        low, high = guess, None
        while high is None:
            candidate = low + step
            if fits(candidate):
                low, step = candidate, step * 2
            else:
                high = candidate
    else:
        high, low = guess, None
        while low is None:
            candidate = max(high - step, floor)
            if fits(candidate):
                low = candidate
            elif candidate == floor:
                return 0
            else:
                high, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def first_steps_part(
    models: list[str], device: torch.device, data_dir: Path, steps: int, results: dict, save: Callable[[], None]
) -> None:
    """The peak of each of the first ``steps`` steps of a fresh model in one process, without
    compression and at 2 bits, with no warm-up step: the first step surveys the group axes and
    must fit where the steps after it fit (a user sizes the batch by them)."""
    for name in models:
        spec = MODELS[name]
        row: dict = {"title": spec.title, "batch": spec.batch}
        for method_name in ("none", "act_2bit"):
            workload = build(name, spec.batch, device, data_dir)
            method = METHODS[method_name]()
            method.prepare(workload)
            row[method_name] = [measure_step(workload, method, device).peak_bytes for _ in range(steps)]
            log(
                f"{name} bs{spec.batch} {method_name}: peaks "
                + ", ".join(f"{peak / MIB:.1f}" for peak in row[method_name])
                + " MiB"
            )
        row["worst_over_none"] = max(row["act_2bit"]) / max(max(row["none"]), 1)
        results["first_steps"][name] = row
        save()


def batch_part(
    models: list[str],
    device: torch.device,
    data_dir: Path,
    cap_bytes: int,
    results: dict,
    save: Callable[[], None],
    args: argparse.Namespace,
) -> None:
    for name in models:
        spec = MODELS[name]
        entry = results["largest_batch"].setdefault(name, {"title": spec.title, "cap_mib": cap_bytes / MIB})
        for method_name in ("none", "act_2bit", "act_budget2"):
            tries: dict[int, int | bool] = {}
            if device.type == "cuda":

                def fits(batch: int) -> bool:
                    tries[batch] = _try_in_subprocess(args, name, method_name, batch, cap_bytes)
                    return tries[batch]

                guess = spec.batch
            else:
                method = METHODS[method_name]()
                # Calibrated once at the model's batch; the slots (and bits) do not depend on the batch.
                method.prepare(build(name, spec.batch, device, data_dir))
                slope = _peak_per_sample(name, spec.batch, method, device, data_dir)

                def fits(batch: int) -> bool:
                    workload = build(name, batch, device, data_dir)
                    if isinstance(method, Compression):
                        method.capture = _rebind(method.capture, workload.model)
                    train_step(workload, method)
                    tries[batch] = measure_step(workload, method, device).peak_bytes
                    log(f"  {name} {method_name} batch {batch}: peak {tries[batch] / MIB:.1f} MiB")
                    return tries[batch] <= cap_bytes

                guess = int(cap_bytes / slope)
            largest = largest_fitting(fits, guess)
            entry[method_name] = {
                "largest_batch": largest,
                "tries": {str(b): (v if isinstance(v, bool) else v / MIB) for b, v in sorted(tries.items())},
            }
            log(f"{name} {method_name}: largest batch {largest} under {cap_bytes / MIB:.0f} MiB")
            save()


def _rebind(capture: ActivationCapture, model: nn.Module) -> ActivationCapture:
    """The same policy (its calibrated bits) on a capture that names ``model``'s modules."""
    return ActivationCapture(capture.config, model, capture.policy)


def _peak_per_sample(name: str, batch: int, method: Method, device: torch.device, data_dir: Path) -> float:
    """Peak bytes per sample, measured at ``batch`` (a first guess for the search)."""
    workload = build(name, batch, device, data_dir)
    if isinstance(method, Compression):
        method.capture = _rebind(method.capture, workload.model)
    train_step(workload, method)
    return measure_step(workload, method, device).peak_bytes / batch


def _try_in_subprocess(args: argparse.Namespace, model: str, method: str, batch: int, cap_bytes: int) -> bool:
    """Two training steps at ``batch`` in a fresh process, its GPU memory capped: an
    out-of-memory error there cannot leave this process's allocator fragmented."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--data-dir",
        str(args.data_dir),
        "--cap-mib",
        str(cap_bytes / MIB),
        "--try-batch",
        model,
        method,
        str(batch),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.try_timeout)
    except subprocess.TimeoutExpired:
        log(f"  {model} {method} batch {batch}: over {args.try_timeout:.0f} s, counted as not fitting")
        return False
    for line in done.stdout.splitlines():
        if line.startswith(TRY_RESULT_PREFIX):
            fits = json.loads(line[len(TRY_RESULT_PREFIX) :])["fits"]
            log(f"  {model} {method} batch {batch}: {'fits' if fits else 'out of memory'}")
            return fits
    raise RuntimeError(f"batch try {command} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")


def run_one_try(model: str, method_name: str, batch: int, cap_bytes: int, data_dir: Path) -> dict:
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(cap_bytes / total, 1.0), device)
    try:
        method = METHODS[method_name]()
        # The adaptive policy calibrates on a few samples of a small batch, as the callback does.
        method.prepare(build(model, MODELS[model].batch, device, data_dir))
        workload = build(model, batch, device, data_dir)
        if isinstance(method, Compression):
            method.capture = _rebind(method.capture, workload.model)
        for _ in range(2):
            train_step(workload, method)
        torch.cuda.synchronize(device)
        return {"fits": True, "peak_bytes": torch.cuda.max_memory_allocated(device)}
    except torch.OutOfMemoryError:
        return {"fits": False}


# --------------------------------------------------------------------------- output
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        f"# Peak memory of a training step, {results['device_type']}",
        "",
        f"`{results['command']}` on {results['environment']['device']}, {results['date']}; "
        f"commit `{results['commit']}`. Every number below was measured in this run.",
        "",
        "*kept*: what the forward keeps for backward; *peak*: the step's peak above its start (forward + "
        "backward, parameter gradients included); *limit*: the same step with every saved non-parameter float "
        "tensor stored as nothing and re-created empty at unpack (no saved-tensor codec can go below it); "
        "*2-bit floor*: the same step holding exactly the bytes the 2-bit run stored, as long as autograd "
        "holds them, and nothing else (no codec storing those bytes can go below it); *reached*: limit or "
        "floor peak / 2-bit peak.",
        "",
    ]
    if results["peak"]:
        lines += [
            "| model | batch | kept none MiB | kept 2-bit MiB | kept ratio | peak none MiB | peak 2-bit MiB "
            "| peak ratio | 2-bit floor MiB | limit MiB | limit ratio | floor reached | limit reached "
            "| floor / limit |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["peak"].values():
            none, act, floor, limit = row["none"], row["act_2bit"], row["codec_floor"], row["limit"]
            lines.append(
                f"| {row['title']} | {row['batch']} | {none['kept_bytes'] / MIB:.1f} | {act['kept_bytes'] / MIB:.1f} "
                f"| {row['kept_ratio']:.2f}x | {none['peak_bytes'] / MIB:.1f} | {act['peak_bytes'] / MIB:.1f} "
                f"| {row['peak_ratio']:.2f}x | {floor['peak_bytes'] / MIB:.1f} | {limit['peak_bytes'] / MIB:.1f} "
                f"| {row['limit_ratio']:.2f}x | {100 * row['floor_reached']:.1f}% | {100 * row['limit_reached']:.1f}% "
                f"| {100 * row['floor_of_limit']:.1f}% |"
            )
    if results["largest_batch"]:
        lines += [
            "",
            "## Largest batch under a memory cap",
            "",
            "| model | cap MiB | none | 2 bits | budget 2 | 2 bits vs none | budget 2 vs none |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for entry in results["largest_batch"].values():
            sizes = [entry.get(m, {}).get("largest_batch") for m in ("none", "act_2bit", "act_budget2")]
            if None in sizes:
                continue
            lines.append(
                f"| {entry['title']} | {entry['cap_mib']:.0f} | {sizes[0]} | {sizes[1]} | {sizes[2]} "
                f"| {sizes[1] / max(sizes[0], 1):.2f}x | {sizes[2] / max(sizes[0], 1):.2f}x |"
            )
    if results["first_steps"]:
        lines += [
            "",
            "## The first steps",
            "",
            "Each step's peak, in one process from a fresh model (no warm-up step; the first surveys group axes).",
            "",
            "| model | batch | none MiB per step | 2-bit MiB per step | worst 2-bit / worst none |",
            "|---|---:|---|---|---:|",
        ]
        for row in results["first_steps"].values():
            none, act = (", ".join(f"{peak / MIB:.1f}" for peak in row[m]) for m in ("none", "act_2bit"))
            lines.append(f"| {row['title']} | {row['batch']} | {none} | {act} | {row['worst_over_none']:.2f}x |")
    for row in results["peak"].values():
        for method in ("none", "act_2bit", "codec_floor", "limit"):
            if "timeline" in row[method]:
                lines += [
                    "",
                    f"## Alive at the peak: {row['title']}, {method}",
                    "",
                    "```",
                    row[method]["timeline"],
                    "```",
                ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data",
        help="folder with planetoid/Cora/raw/ (the layout of ../shared/data)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--timeline", action="store_true", help="list what is alive at each peak (CPU)")
    parser.add_argument(
        "--largest-batch", action="store_true", help="instead of the peak table: the largest batch under --cap-mib"
    )
    parser.add_argument("--cap-mib", type=float, default=1024.0, help="memory cap of --largest-batch")
    parser.add_argument(
        "--first-steps",
        type=int,
        default=0,
        metavar="N",
        help="instead of the peak table: each of the first N steps' peak, from a fresh model",
    )
    parser.add_argument("--try-timeout", type=float, default=300.0, help="seconds per GPU batch try")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads")
    parser.add_argument("--try-batch", nargs=3, metavar=("MODEL", "METHOD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    cap_bytes = int(args.cap_mib * MIB)
    if args.try_batch:
        model, method, batch = args.try_batch
        print(TRY_RESULT_PREFIX + json.dumps(run_one_try(model, method, int(batch), cap_bytes, args.data_dir)))
        return
    torch.set_num_threads(args.threads)
    ops.ensure_kernels(device)
    models = args.models or (["resnet50", "transformer"] if args.largest_batch else list(MODELS))
    stem = f"peak_memory_{device.type}" + (
        "_batch" if args.largest_batch else "_first_steps" if args.first_steps else ""
    )
    results = {
        "device_type": device.type,
        "command": "python benchmarks/peak_memory.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "environment": environment(device),
        "peak": {},
        "largest_batch": {},
        "first_steps": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
        write_markdown(results, args.out / f"{stem}.md")

    if args.largest_batch:
        batch_part(models, device, args.data_dir, cap_bytes, results, save, args)
    elif args.first_steps:
        first_steps_part(models, device, args.data_dir, args.first_steps, results, save)
    else:
        peak_part(models, device, args.data_dir, args.timeline, results, save)
    save()


if __name__ == "__main__":
    main()
