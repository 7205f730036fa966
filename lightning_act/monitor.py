"""What goes to the loggers: step peak memory, per-module memory and bits, the allocation table, a bits heatmap.

Scalars go to every logger; histograms, text and images only to TensorBoard (others have no common API for them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from lightning_act.capture import CompressionReport
from lightning_act.ops import ensure_kernels, loaded_kernels
from lightning_act.policy import SlotInfo
from lightning_act.policy.bits import bits_name

MIB = 2**20
_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


class StepPeakMemory:
    """The absolute peak memory of one training step (model, optimizer state and batch included).

    * CUDA: ``torch.cuda.max_memory_allocated`` since :meth:`start`, which resets the device's peak
      statistics for every reader: live tensors, not the allocator's cache.
    * CPU: live tensors, from a counter around the CPU allocator installed with the CPU kernels
      (``csrc/live_memory.cpp``), plus the parameters and buffers allocated before it. Without the
      kernels, on Linux, the resident high-water mark (``VmHWM``), which also counts what the C
      allocator caches (``docs/reference.md``, "A CPU's resident peak"). A Linux CPU reads it
      beside the counter too (:meth:`resident_peak_bytes`).
    * Elsewhere: ``peak_bytes()`` is None.
    """

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None):
        self.device = device
        self._untracked = 0
        self._optimizers: list[torch.optim.Optimizer] = []
        self._update_hooks: list = []
        # Parameters with optimizer state, and with a gradient, when the step began.
        self._stated_at_start: set[int] = set()
        self._graded_at_start: set[int] = set()
        self._update_peak: int | None = None
        self._earlier_peak = 0  # the step's peak before the counter was last restarted
        self._resident = device.type == "cpu" and _resident_high_water_mark() is not None and _reset_high_water_mark()
        #: Whether the figure counts live tensors only.
        self.exact = True
        if device.type == "cuda":
            self.source = "live tensors, torch.cuda.max_memory_allocated"
        elif device.type == "cpu" and _install_live_counter():
            self.source = "live tensors, lightning_act's CPU allocator counter"
            counts = torch.ops.lightning_act.live_memory_counts
            self._untracked = (
                0
                if model is None
                else storage_bytes(
                    t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu" and not counts(t)
                )
            )
        else:
            self.exact = False
            self.source = "resident high-water mark (VmHWM)" if self._resident else None

    def follow_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], update_hooks: bool = True) -> None:
        """Also measure the state ``optimizers`` allocate each step and the peak before their first
        update (see :meth:`lasting_peak_bytes`).

        Args:
            update_hooks: take that peak in the optimizers' step pre-hooks; else the caller calls
                :meth:`before_update` (Lightning's closure runs the step inside ``optimizer.step``).
        """
        optimizers = list(optimizers)
        if optimizers == self._optimizers:
            return
        self.close()
        self._optimizers = optimizers
        if update_hooks:
            self._update_hooks = [
                optimizer.register_step_pre_hook(lambda *_: self.before_update()) for optimizer in optimizers
            ]

    def close(self) -> None:
        """Stop following the optimizers."""
        for hook in self._update_hooks:
            hook.remove()
        self._optimizers, self._update_hooks = [], []

    def start(self) -> None:
        """Begin a step: the peak from now on."""
        self._restart_counter()
        if self._resident:
            _reset_high_water_mark()
        self._earlier_peak = 0
        self._update_peak = None
        self._stated_at_start = {id(p) for optimizer in self._optimizers for p in optimizer.state}
        self._graded_at_start = {id(p) for p in self._parameters() if p.grad is not None}

    def _parameters(self):
        return (p for optimizer in self._optimizers for group in optimizer.param_groups for p in group["params"])

    def before_update(self) -> None:
        """The optimizers are about to update the parameters (the first call in a step counts)."""
        if self._update_peak is None:
            self._update_peak = self.peak_bytes()

    def peak_bytes(self) -> int | None:
        """The highest memory since :meth:`start` (None where it cannot be measured)."""
        if self.device.type == "cuda":
            return max(self._earlier_peak, torch.cuda.max_memory_allocated(self.device))
        if self.exact:
            return max(self._earlier_peak, torch.ops.lightning_act.live_memory_read()[1] + self._untracked)
        return self.resident_peak_bytes()

    def live_bytes(self) -> int | None:
        """The live tensors now (None where only a high-water mark can be read)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        if self.exact:
            return torch.ops.lightning_act.live_memory_read()[0] + self._untracked
        return None

    def peak_of(self, work: Callable[[], Any]) -> tuple[Any, int | None]:
        """Run ``work`` within the step; return its result and its own peak above the live tensors
        before it (None where live tensors are not counted)."""
        before = self.live_bytes()
        if before is None:
            return work(), None
        self._earlier_peak = self.peak_bytes()
        self._restart_counter()
        result = work()
        counted = (
            torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else (torch.ops.lightning_act.live_memory_read()[1] + self._untracked)
        )
        return result, counted - before

    def _restart_counter(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.exact:
            torch.ops.lightning_act.live_memory_reset_peak()

    def lasting_peak_bytes(self, forward_peak: int | None = None) -> int | None:
        """The peak every later step of the same work reaches at least: this step's, or more where it
        left what later steps hold throughout. Optimizer state allocated lazily in the first update
        counts from the peak before that update; given ``forward_peak`` (the peak at the end of the
        forward, in a loop that clears gradients after the next forward, as Lightning's does), so do
        gradients the step did not begin with."""
        peak = self.peak_bytes()
        if peak is None or (self._update_peak is None and forward_peak is None):
            return peak
        new_state = storage_bytes(
            value
            for optimizer in self._optimizers
            for p, state in optimizer.state.items()
            if id(p) not in self._stated_at_start
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        if self._update_peak is not None:
            peak = max(peak, self._update_peak + new_state)
        if forward_peak is not None:
            new_gradients = storage_bytes(
                p.grad for p in self._parameters() if p.grad is not None and id(p) not in self._graded_at_start
            )
            peak = max(peak, forward_peak + new_state + new_gradients)
        return peak

    def resident_peak_bytes(self) -> int | None:
        """On a Linux CPU, the process's resident high-water mark since :meth:`start`."""
        return _resident_high_water_mark() if self._resident else None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def step_holdings(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch_tensors, saved_bytes: int
) -> dict[str, int]:
    """Bytes a training step holds, by holder: parameters, gradients, optimizer state, batch, saves."""
    parameters = list(model.parameters())
    return {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes(p.grad for p in parameters if p.grad is not None),
        "optimizer state": storage_bytes(
            value
            for optimizer in optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
        "the batch": storage_bytes(batch_tensors),
        "the forward's saved tensors": saved_bytes,
    }


def _install_live_counter() -> bool:
    ensure_kernels("cpu")
    return loaded_kernels()["cpu"] and torch.ops.lightning_act.live_memory_install()


def _resident_high_water_mark() -> int | None:
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", _PROC_STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return None if found is None else int(found.group(1)) * 1024


def _reset_high_water_mark() -> bool:
    """Set VmHWM to the current resident size (Linux >= 4.0: mode 5 touches nothing else)."""
    try:
        _PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def module_memory_scalars(prefix: str, report: CompressionReport, slots: Mapping[str, SlotInfo]) -> dict[str, float]:
    """Per module: MiB saved, MiB stored instead, and the element-weighted mean bits."""
    scalars: dict[str, float] = {}
    for module, memory in report.modules.items():
        scalars[f"{prefix}/saved_mib/{module}"] = memory.saved_bytes / MIB
        scalars[f"{prefix}/stored_mib/{module}"] = memory.stored_bytes / MIB
    used = {slot: memory.bits for slot, memory in report.slots.items()}
    scalars.update({f"{prefix}/bits/{module}": bits for module, bits in module_mean_bits(used, slots).items()})
    return scalars


def log_module_memory(
    loggers: Sequence[Logger], prefix: str, step: int, report: CompressionReport, slots: Mapping[str, SlotInfo]
) -> None:
    """Log one step's per-module memory and bits (see :func:`module_memory_scalars`)."""
    scalars = module_memory_scalars(prefix, report, slots)
    for logger in loggers:
        logger.log_metrics(scalars, step=step)


def module_mean_bits(assignment: Mapping[str, int | None], slots: Mapping[str, SlotInfo]) -> dict[str, float]:
    """Element-weighted mean bits per module (a tensor kept exact counts its dtype's bits)."""
    totals: dict[str, list[float]] = {}
    for slot, bits in assignment.items():
        info = slots.get(slot)
        if info is None:
            continue
        width = info.element_bits if bits is None else bits
        acc = totals.setdefault(info.module, [0.0, 0.0])
        acc[0] += width * info.numel
        acc[1] += info.numel
    return {module: weighted / count for module, (weighted, count) in totals.items() if count}


def allocation_table(
    assignment: Mapping[str, int | None],
    slots: Mapping[str, SlotInfo],
    variance: Mapping[str, Mapping[int, float]],
    report: CompressionReport,
) -> str:
    """A markdown table per slot: module, op, shape, bits, codec, bytes saved and stored, and the
    estimated variance at 2 bits and at its bits (:mod:`lightning_act.policy.estimators`' units).
    Shapes, codecs and bytes come from ``report``: pass one of a step run under ``assignment``."""
    lines = [
        "| tensor | module | op | shape | bits | codec | saved KiB | stored KiB | variance at 2 bits | at its bits |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for slot, bits in assignment.items():
        info = slots.get(slot)
        if info is None:
            continue
        memory = report.slots.get(slot)
        saved = f"{memory.saved_bytes / 1024:.1f}" if memory else "-"
        stored = f"{memory.stored_bytes / 1024:.1f}" if memory else "-"
        codec = memory.codec if memory else "-"
        shape = memory.shape if memory else info.shape
        table = variance.get(slot, {})
        at_bits = 0.0 if bits is None else table.get(bits, float("nan"))
        lines.append(
            f"| {slot} | {info.module} | {info.op or '-'} | {'x'.join(map(str, shape))} | {bits_name(bits)} "
            f"| {codec} | {saved} | {stored} | {table.get(2, float('nan')):.3e} | {at_bits:.3e} |"
        )
    return "\n".join(lines)


def bits_heatmap(history: Sequence[Mapping[str, float]], steps: Sequence[int]) -> np.ndarray:
    """An RGB image (H, W, 3, uint8): modules down, recalibrations across, colour = bits."""
    # A figure of its own with an Agg canvas: pyplot and the user's backend are left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modules = sorted({m for row in history for m in row})
    grid = np.full((len(modules), len(history)), np.nan)
    for j, row in enumerate(history):
        for i, module in enumerate(modules):
            grid[i, j] = row.get(module, np.nan)
    height = min(2.0 + 0.18 * len(modules), 40.0)
    fig = Figure(figsize=(3.0 + 0.4 * len(history), height), dpi=80)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=8, interpolation="nearest")
    ax.set_yticks(range(len(modules)), modules, fontsize=6)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6, rotation=90)
    ax.set_xlabel("step of recalibration")
    fig.colorbar(image, ax=ax, label="mean bits")
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def log_allocation(
    loggers: Sequence[Logger],
    prefix: str,
    step: int,
    assignment: Mapping[str, int | None],
    slots: Mapping[str, SlotInfo],
    variance: Mapping[str, Mapping[int, float]],
    report: CompressionReport,
    history: Sequence[Mapping[str, float]],
    history_steps: Sequence[int],
    cost: Mapping[str, float],
) -> None:
    """Log one recalibration: its cost and mean bits everywhere, media to TensorBoard."""
    scalars = {f"{prefix}/{key}": value for key, value in cost.items()}
    if any(s in slots for s in assignment):
        total = sum(slots[s].numel for s in assignment if s in slots)
        scalars[f"{prefix}/mean_bits"] = (
            sum(
                (slots[s].element_bits if b is None else b) * slots[s].numel
                for s, b in assignment.items()
                if s in slots
            )
            / total
        )
    for logger in loggers:
        logger.log_metrics(scalars, step=step)
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment
        widths = [slots[s].element_bits if b is None else b for s, b in assignment.items() if s in slots]
        if widths:
            writer.add_histogram(f"{prefix}/bits_histogram", torch.tensor(widths, dtype=torch.float32), step)
        writer.add_text(f"{prefix}/allocation", allocation_table(assignment, slots, variance, report), step)
        if history:
            writer.add_image(f"{prefix}/bits_heatmap", bits_heatmap(history, history_steps), step, dataformats="HWC")
