"""Sensitivity estimators: ``v_i(b)``, the gradient variance saved tensor ``i`` adds when it
is stored at ``b`` bits. Both return ``{slot: {1: v, 2: v, 4: v, 8: v}}``.

* :func:`probe_sensitivities` measures it (GACT's probes): one forward on a slice of the
  batch with every candidate tensor kept exact, one exact backward, then for each tensor
  one backward per probed bit width with only that tensor quantized. The measurement
  includes what no model predicts well: a zero-preserving group (a ReLU output) has one
  level fewer at 2 bits (and is never given 1 bit, where its backward mask would flip).
  Costs one backward pass per tensor and probed width on the slice (default: 1 and 2
  bits, the two that decide the allocation; wider widths follow from 2 bits).
* :class:`GradientSensitivity` models it from the normal training step: stochastic
  rounding of a group with range ``r`` at ``b`` bits adds noise of energy
  ``G r**2 S(b) / 6``, which reaches the gradient scaled by the gradient flowing out of the
  module that saved the tensor: ``v_i(b) = (G / 6) sum_g r_g**2 S_i(b) mean(dL/dy**2)``,
  with ``S_i`` accounting for the tensor's zero-preserving groups. No extra pass, a few
  reductions on the calibration steps; it ignores how noise propagates upstream.

``benchmarks/adaptive_allocation.py`` measures how good each allocation is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_act.ops.reference import SUPPORTED_BITS
from lightning_act.policy.allocation import quantization_variance


def _levels_variance(bits: int, zero_preserving_fraction: float) -> float:
    """``S_i(b)``: plain groups have ``2**b - 1`` steps, zero-preserving ones one fewer."""
    plain = quantization_variance(bits)
    zero_preserving = 1.0 / float((1 << bits) - 2) ** 2 if bits >= 2 else plain
    return (1.0 - zero_preserving_fraction) * plain + zero_preserving_fraction * zero_preserving


class GradientSensitivity:
    """Accumulates the gradient estimator's terms over the calibration steps."""

    def __init__(self):
        self._noise: dict[str, torch.Tensor] = {}  # slot -> sum over groups of G r^2 / 6
        self._zero_preserving: dict[str, torch.Tensor] = {}  # slot -> fraction of such groups
        self._slot_module: dict[str, str] = {}
        self._grad: dict[str, torch.Tensor] = {}  # module -> mean square of dL/d(output)

    def observe_stats(self, slot: str, module: str, stats: torch.Tensor, bits: int, group_size: int) -> None:
        """Record a compressed tensor's group ranges (device ops only, no sync)."""
        step = stats[:, 1].float()
        zero_preserving = torch.signbit(step)
        steps = torch.where(zero_preserving, float((1 << bits) - 2), float((1 << bits) - 1)) if bits >= 2 else 1.0
        energy = (step.abs() * steps).square().nansum() * (group_size / 6.0)
        fraction = zero_preserving.float().mean()
        self._noise[slot] = self._noise[slot] + energy if slot in self._noise else energy
        self._zero_preserving[slot] = fraction
        self._slot_module[slot] = module

    def observe_output(self, module: str, output: torch.Tensor) -> None:
        """Hook the gradient that will flow into a module's output."""
        if output.requires_grad and output.is_floating_point() and output.numel():
            output.register_hook(lambda grad: self._add_grad(module, grad))

    def _add_grad(self, module: str, grad: torch.Tensor) -> None:
        energy = grad.float().square().mean()
        self._grad[module] = self._grad[module] + energy if module in self._grad else energy

    def sensitivities(self) -> dict[str, dict[int, float]]:
        """``v_i(b)`` per slot observed so far (one host synchronisation)."""
        # A tensor saved outside every module (a loss function's input, say) has no module
        # output to take the gradient from: it gets no estimate, so it keeps the default bits.
        slots = [s for s in self._noise if self._slot_module[s] in self._grad]
        if not slots:
            return {}
        terms = [self._noise[s] * self._grad[self._slot_module[s]] for s in slots]
        fractions = [self._zero_preserving[s] for s in slots]
        c, z = torch.stack(terms).tolist(), torch.stack(fractions).tolist()
        return {s: {b: ci * _levels_variance(b, zi) for b in SUPPORTED_BITS} for s, ci, zi in zip(slots, c, z)}


def probe_sensitivities(
    capture,
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    probe_bits: Sequence[int] = (1, 2),
    inputs=None,
) -> dict[str, dict[int, float]]:
    """GACT's probe estimator: the gradient variance each tensor adds when quantized alone.

    Args:
        capture: the :class:`~lightning_act.capture.ActivationCapture` whose slots to probe.
        loss_fn: runs the forward (on a small batch) and returns the scalar loss.
        params: the parameters whose gradient variance counts; their ``.grad`` is untouched.
        probe_bits: the bit widths measured (those below a slot's ``min_bits`` are skipped);
            the others are extrapolated from the widest measured with the plain
            quantizer's ``S(b)`` (wider ones add tiny variance either way).
        inputs: tensors alive for the whole step (the batch), as in ``capture.start``.

    Returns:
        ``v_i(b)`` per slot for every supported bit width.
    """
    params = [p for p in params if p.requires_grad]
    with capture.probing(inputs) as probe:
        loss = loss_fn()
    exact = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    measured: list[torch.Tensor] = []
    # A slot is probed only at the widths it may get (a ReLU output never gets 1 bit).
    floors = {slot: capture.slots[slot].min_bits for slot in probe.slots}
    widths = {slot: [b for b in probe_bits if b >= floor] or [floor] for slot, floor in floors.items()}
    for slot in probe.slots:
        for bits in widths[slot]:
            probe.quantize_only(slot, bits)
            noisy = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            measured.append(
                sum((n - e).float().square().sum() for n, e in zip(noisy, exact) if n is not None and e is not None)
            )
    probe.quantize_only(None, 0)
    del loss
    if not measured:
        return {}
    values = iter(torch.stack(measured).tolist())
    tables = {}
    for slot in probe.slots:
        table = {bits: next(values) for bits in widths[slot]}
        widest = max(table)
        for bits in SUPPORTED_BITS:
            if bits not in table:
                table[bits] = table[widest] * quantization_variance(bits) / quantization_variance(widest)
        tables[slot] = table
    return tables
