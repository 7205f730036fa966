"""A peak-memory target in a plain PyTorch loop: what ``ActCompression(memory_target=...)``
does in a Lightning run, for a loop written by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_act.capture.engine import ActivationCapture, runs_compiled, tensors_in
from lightning_act.config import CompressionConfig
from lightning_act.monitor import StepPeakMemory, step_holdings, storage_bytes
from lightning_act.policy.memory_target import (
    MemoryTargetError,
    TargetBits,
    Verdict,
    parse_memory_target,
    unreachable_message,
)


class MemoryTarget:
    """Keep every training step's peak at or under a target by choosing each saved tensor's bits,
    closed loop on the measured peak (see :mod:`lightning_act.policy.memory_target`).

    The ``with target.step(...)`` block must hold the whole step: forward, backward, optimizer step.
    After :meth:`calibrate`, measured sensitivity rather than element count decides where bits go.

    Args:
        model: the model trained (its parameters are never compressed; its module names key the rules).
        target: bytes, a size (``"20GiB"``) or a fraction in (0, 1] of the device's memory.
        optimizers: the loop's optimizers: named in an unreachable target's error, and
            :meth:`calibrate` weighs gradient error by their update.
        rules: per-module and per-op overrides, as ``ActCompression``'s.
        config: a :class:`~lightning_act.CompressionConfig`; or its fields as keywords.

    Raises:
        ValueError: a setting is out of range; the message names it and what is allowed.

    Example::

        target = MemoryTarget(model, "2GiB", optimizers=[optimizer])
        for x, y in loader:
            with target.step(inputs=x):
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        target: int | float | str,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        rules: Mapping[str, int | str] | None = None,
        config: CompressionConfig | None = None,
        **settings,
    ):
        if config is not None and settings:
            raise ValueError(f"pass either config or keyword settings, not both (got {sorted(settings)})")
        device = next(model.parameters()).device
        self.target = target
        self.policy = TargetBits(target, rules=rules)
        self.policy.target_bytes = parse_memory_target(target, device)
        if any(map(runs_compiled, model.modules())):
            self.policy.follow_compiled()
        self.capture = ActivationCapture(config or CompressionConfig(**settings), model, self.policy)
        self.model = model
        self.optimizers = list(optimizers)
        self.meter = StepPeakMemory(device, model)
        self.meter.follow_optimizers(self.optimizers)
        #: Per slot, the variance it adds at each bit width (from :meth:`calibrate`).
        self.sensitivity: dict[str, dict[int, float]] = {}
        #: Steps run so far, and the last one's peak in bytes (None where it cannot be measured).
        self.steps = 0
        self.last_peak_bytes: int | None = None

    @contextlib.contextmanager
    def step(self, inputs: Any = None) -> Iterator[ActivationCapture]:
        """One training step: its saved tensors stored by the plan, its peak measured after.

        Args:
            inputs: the batch's tensors (alive for the whole step: kept as they are).

        Raises:
            MemoryTargetError: the step ran every tensor at its lowest bits and still peaked
                over the target.
        """
        self.policy.follow_batch(storage_bytes(tensors_in(inputs)))
        self.meter.start()
        with self.capture.capturing(inputs=inputs) as capture:
            yield capture
        self.steps += 1
        self.last_peak_bytes = self.meter.peak_bytes()
        if self.last_peak_bytes is None:
            return  # not measurable here
        lasting = self.meter.lasting_peak_bytes()
        verdict = self.policy.observe(lasting, self.capture.slots, compiled=self.capture.compiled_in_session)
        if verdict is Verdict.UNREACHABLE:
            self.policy.restart()  # a smaller batch next is measured afresh
            raise MemoryTargetError(self._unreachable(inputs, lasting))
        if verdict is Verdict.MOVE:
            self.policy.update(self.sensitivity, self.capture.slots)

    def close(self) -> None:
        """Release the capture: the model runs as it did before."""
        self.capture.close()
        self.meter.close()

    def calibrate(self, loss_fn: Callable[[], torch.Tensor], inputs: Any = None) -> None:
        """Measure each saved tensor's sensitivity on a small batch and re-plan with it (``loss_fn``
        runs the forward and returns the loss; ``inputs`` are its tensors)."""
        self.sensitivity = self.capture.measure_sensitivity(loss_fn, inputs, self.optimizers)
        self.policy.update(self.sensitivity, self.capture.slots)

    def _unreachable(self, inputs: Any, lasting_peak: int) -> str:
        held = step_holdings(self.model, self.optimizers, tensors_in(inputs), self.capture.report.stored_bytes)
        return unreachable_message(
            self.target,
            self.policy.target_bytes,
            self.last_peak_bytes,
            lasting_peak,
            self.steps,
            self.meter.source,
            held,
            self.meter.device.type,
        )
