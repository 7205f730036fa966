"""What goes to the loggers: per-module bits, the allocation table, and a bits heatmap.

Scalars go to every Lightning logger; histograms, text and images only to TensorBoard
loggers (other loggers have no common API for them). Keys share one prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from lightning_act.capture import CompressionReport
from lightning_act.policy import SlotInfo
from lightning_act.policy.bits import bits_name


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
    """A markdown table: slot, module, the op that saved it, shape, bits, codec, bytes kept vs
    stored, and the estimated variance the tensor adds at 2 bits (its sensitivity) and at its
    chosen bits, in the estimator's units (see :mod:`lightning_act.policy.estimators`)."""
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
        table = variance.get(slot, {})
        at_bits = 0.0 if bits is None else table.get(bits, float("nan"))
        lines.append(
            f"| {slot} | {info.module} | {info.op or '-'} | {'x'.join(map(str, info.shape))} | {bits_name(bits)} "
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
    """Log one recalibration: scalars everywhere, media to TensorBoard."""
    per_module = module_mean_bits(assignment, slots)
    scalars = {f"{prefix}/bits/{module}": bits for module, bits in per_module.items()}
    scalars.update({f"{prefix}/{key}": value for key, value in cost.items()})
    if per_module:
        total = sum(slots[s].numel for s in assignment if s in slots)
        scalars[f"{prefix}/mean_bits"] = (
            sum((slots[s].element_bits if b is None else b) * slots[s].numel for s, b in assignment.items() if s in slots)
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
