"""Sensitivity estimators: ``v_i(b)``, the gradient variance saved tensor ``i`` adds at ``b`` bits, returned
as ``{slot: {1: v, 2: v, 4: v, 8: v}}``.

* :func:`probe_sensitivities` measures it (GACT's probes) on a slice of the batch: the gradient error with
  only that tensor quantized, at 2 bits (or its floor). Backward scales a tensor's noise alike at every width,
  so the other widths follow from rounding it once per width:
  ``v_i(b) = v_i(2) ||Q_b(x_i) - x_i||**2 / ||Q_2(x_i) - x_i||**2``. Measuring captures what models miss
  (zero-preserving groups, tensors of few distinct values).
* :class:`GradientSensitivity` models it from the normal step: rounding a group of range ``r`` at ``b`` bits
  adds noise energy ``G r**2 S(b) / 6``, scaled by the gradient flowing out of the saving module:
  ``v_i(b) = (G / 6) sum_g r_g**2 S_i(b) mean(dL/dy**2)``. No extra pass; it ignores upstream propagation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from lightning_act.ops.validation import SUPPORTED_BITS
from lightning_act.policy.allocation import quantization_variance
from lightning_act.policy.linearized import ForwardRecorder, LinearizedProbe, Mismatch, energies_of_gradients


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
        # A tensor saved outside every module has no output gradient: no estimate, so the default bits.
        slots = [s for s in self._noise if self._slot_module[s] in self._grad]
        if not slots:
            return {}
        terms = [self._noise[s] * self._grad[self._slot_module[s]] for s in slots]
        fractions = [self._zero_preserving[s] for s in slots]
        c, z = torch.stack(terms).tolist(), torch.stack(fractions).tolist()
        return {s: {b: ci * _levels_variance(b, zi) for b in SUPPORTED_BITS} for s, ci, zi in zip(slots, c, z)}


class UpdateWeights(Sequence):
    """How much a gradient error in each parameter moves the optimizer's next update.

    A step changes a parameter by ``lr * g / d`` (``d = 1`` for SGD, ``sqrt(v_hat) + eps`` for Adam), so an
    error ``e`` has update energy ``e**2 (lr / d)**2`` per element. Under Adam, parameters with small gradients
    get large weights: noise small next to the whole gradient can still swamp their own update.

    Item ``i``, for ``params[i]``: a tensor of its shape, a float (``lr**2`` without second-moment state), or
    None where no optimizer holds it. Tensors are computed when read, so only one is held at a time.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]):
        held = {}  # id(parameter) -> (optimizer, its group)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    held[id(p)] = (optimizer, group)
        self._sources = [held.get(id(p)) and (p, *held[id(p)]) for p in params]

    def __len__(self) -> int:
        return len(self._sources)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        source = self._sources[index]
        if source is None:
            return None
        p, optimizer, group = source
        lr = float(group.get("lr", 1.0))
        state = optimizer.state.get(p, {})
        second = state.get("exp_avg_sq")
        if second is None:
            return lr * lr
        step = float(state.get("step", 0))
        beta2 = group.get("betas", (0.9, 0.999))[1]
        correction = 1.0 - beta2**step if step > 0 else 1.0
        denom = (second.float() / correction).sqrt_().add_(float(group.get("eps", 1e-8)))
        return denom.reciprocal_().square_().mul_(lr * lr)


def update_weights(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]) -> UpdateWeights:
    """:class:`UpdateWeights` of ``optimizers`` for ``params``."""
    return UpdateWeights(optimizers, params)


class _Blend(Sequence):
    """Per parameter, ``sum_j c_j W_j`` (``W_j = 1`` for a norm of None), computed when read."""

    def __init__(self, coefficients: Sequence[float], norms: list, size: int):
        self._coefficients, self._norms, self._size = list(coefficients), norms, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int):
        return sum(
            c * (1.0 if norm is None or norm[index] is None else norm[index])
            for c, norm in zip(self._coefficients, self._norms)
        )


class _Subset(Sequence):
    """``items[indices[i]]`` as item ``i``, read when asked."""

    def __init__(self, items: Sequence, indices: Sequence[int]):
        self._items, self._indices = items, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int):
        return self._items[self._indices[index]]


#: :func:`probe_sensitivities`' ways to measure: see its ``method``.
PROBE_METHODS = ("linearized", "per_tensor")


def probe_sensitivities(
    capture,
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    inputs=None,
    weights: Sequence[torch.Tensor | float | None] | None = None,
    update_share: float = 0.5,
    method: str = "linearized",
    directions: int = 8,
) -> dict[str, dict[int, float]]:
    """GACT's probe estimator: the gradient variance each tensor adds when quantized alone.

    With ``weights`` (:func:`update_weights`) it measures the error in two norms, the raw gradient's and the
    optimizer update's, and blends them: under Adam either alone neglects what the other catches. Each norm
    is scaled so that uniform 2 bits (or a tensor's floor) scores the same in both.

    Args:
        capture: the :class:`~lightning_act.capture.ActivationCapture` whose slots to probe.
        loss_fn: runs the forward (on a small batch) and returns the scalar loss.
        params: the parameters whose gradient variance counts; their ``.grad`` is untouched.
        inputs: tensors alive for the whole step (the batch), as in ``capture.start``.
        weights: per parameter, a factor on its squared gradient error (:func:`update_weights`).
        update_share: with ``weights``, the update norm's share of the objective, in [0, 1].
        method: ``"linearized"`` (cost independent of depth; :mod:`lightning_act.policy.linearized`)
            or ``"per_tensor"`` (GACT's own: one whole backward per tensor).
        directions: the linearized method's random directions (one forward each).

    Returns:
        ``v_i(b)`` per slot and supported width, in the update's units if ``weights`` is given.
    """
    if not 0.0 <= update_share <= 1.0:
        raise ValueError(f"update_share={update_share!r} is not supported; allowed: a number from 0 to 1")
    if method not in PROBE_METHODS:
        raise ValueError(f"method={method!r} is not supported; allowed: {', '.join(PROBE_METHODS)}")
    if isinstance(directions, bool) or not isinstance(directions, int) or directions < 1:
        raise ValueError(f"directions={directions!r} must be an int >= 1")
    if weights is not None and len(weights) != len(params):
        raise ValueError(f"weights has {len(weights)} entries for {len(params)} params")
    kept = [i for i, p in enumerate(params) if p.requires_grad]
    params = [params[i] for i in kept]
    norms = [None] if weights is None else [None, _Subset(weights, kept)]
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        # Every forward of the linearized method draws the same dropout masks.
        seed = int(torch.randint(2**62, ()))
        torch.manual_seed(seed)
        recorder = ForwardRecorder() if method == "linearized" else contextlib.nullcontext()
        with capture.probing(inputs) as probe, recorder:
            loss = loss_fn()
        floors = {slot: capture.slots[slot].min_bits for slot in probe.slots}
        # Row i: slot i's rounding noise at each supported width.
        noise = dict(zip(probe.slots, probe.rounding_energies(SUPPORTED_BITS).tolist()))
        probed = {
            slot: width for slot in probe.slots if (width := _probe_width(floors[slot], noise[slot])) is not None
        }  # else exact at every width
        if method == "linearized":
            linearized = LinearizedProbe(probe, recorder, loss, params, norms)
            linearized.measure(probed)
            whole = [slot for slot in probed if slot in linearized.unrouted]
        else:
            whole = list(probed)
        # Per slot: the error of its rounding at the probed width, per norm or already blended.
        measured = _measure_whole(probe, loss, params, norms, {slot: probed[slot] for slot in whole})
        blended: dict[str, float] = {}
        # Each slot's noise energy at its reference width (2 bits or its floor) relative to the probed width's:
        # the blend weighs the norms at uniform reference widths.
        reference = {slot: max(2, floor) for slot, floor in floors.items()}
        to_reference = {
            slot: noise[slot][SUPPORTED_BITS.index(reference[slot])] / noise[slot][SUPPORTED_BITS.index(width)]
            for slot, width in probed.items()
        }
        if method == "linearized":
            routed = [slot for slot in probed if slot not in linearized.unrouted]
            local = {}
            if routed:  # every slot's local errors in one transfer
                local = dict(zip(routed, torch.stack([linearized.local[slot] for slot in routed]).tolist()))
            totals = [
                sum(to_reference[slot] * values[j] for slot, values in (local | measured).items())
                for j in range(len(norms))
            ]
            if len(norms) > 1:
                totals = [a + b for a, b in zip(totals, linearized.upstream_totals(to_reference).tolist())]
            coefficients = _blend_coefficients(totals, update_share)

            def forward():
                torch.manual_seed(seed)
                return loss_fn()

            weights_blended = _Blend(coefficients, norms, len(params))
            try:
                upstream = linearized.upstream(forward, directions, weights_blended)
            except Mismatch:  # the forward is not repeatable: probe every tensor whole
                measured |= _measure_whole(probe, loss, params, norms, {slot: probed[slot] for slot in routed})
            else:
                for slot, values in local.items():
                    blended[slot] = sum(c * v for c, v in zip(coefficients, values)) + upstream.get(slot, 0.0)
            del linearized
        if not blended:  # every slot measured whole: the blend's scale from exact totals
            coefficients = _blend_coefficients(
                [sum(to_reference[slot] * values[j] for slot, values in measured.items()) for j in range(len(norms))],
                update_share,
            )
        for slot, values in measured.items():
            blended[slot] = sum(c * v for c, v in zip(coefficients, values))
        probe.quantize_only(None, 0)
        del loss
    tables = {slot: dict.fromkeys(SUPPORTED_BITS, 0.0) for slot in probe.slots}
    for slot, width in probed.items():
        energy = dict(zip(SUPPORTED_BITS, noise[slot]))
        tables[slot] = {bits: blended[slot] * energy[bits] / energy[width] for bits in SUPPORTED_BITS}
    return tables


def _blend_coefficients(totals: list[float], update_share: float) -> list[float]:
    """The blend's factor on each norm (gradient, update), the gradient's rescaled so that uniform reference
    widths score the same in both."""
    if len(totals) == 1:
        return [1.0]
    gradient_total, update_total = totals
    if not update_total > 0.0:  # no update to disturb (a learning rate of 0): the gradient's alone
        return [1.0, 0.0]
    scale = update_total / gradient_total if gradient_total > 0.0 else 0.0
    return [(1.0 - update_share) * scale, update_share]


def _measure_whole(probe, loss: torch.Tensor, params, norms: list, widths: dict[str, int]) -> dict[str, list[float]]:
    """Per slot, per norm: the error of a whole backward with only that slot rounded."""
    if not widths:
        return {}
    exact = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    measured = {}
    for slot, width in widths.items():
        probe.quantize_only(slot, width)
        measured[slot] = energies_of_gradients(
            params,
            norms,
            lambda: torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True),
            reference=exact,
        ).tolist()
    probe.quantize_only(None, 0)
    return measured


def _probe_width(floor: int, noise: Sequence[float]) -> int | None:
    """The width a slot is probed at: 2 bits (what most allocations hinge on) or the narrowest above its
    floor, else the narrowest that adds noise; None if no allowed width adds any."""
    allowed = sorted((b for b in SUPPORTED_BITS if b >= floor), key=lambda b: (b < 2, b))
    energy = dict(zip(SUPPORTED_BITS, noise))
    return next((b for b in allowed if energy[b] > 0.0), None)
