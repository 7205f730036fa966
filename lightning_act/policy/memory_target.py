"""A peak-memory target: every step's measured peak held at or below a number of bytes.

:class:`TargetBits` chooses each free saved tensor's bits (floor, 1, 2, 4, 8 or exact) with the allocation
knapsack, closed loop on each step's measured peak:

1. The first two steps (after a start or restart) run every tensor at its floor, the least reachable peak; a
   step there over the target is :attr:`Verdict.UNREACHABLE` (its peak counts the optimizer state it allocated
   as held from the start). A compiling step over the target is :attr:`Verdict.UNMEASURED`: the compiler's own
   allocations may be the excess. The first step allocates what later ones keep, so moves start from the second.
2. Under the target, the plan may grow by ``(aim - peak) / slope`` bytes. In eager mode a stored byte raises the
   peak by at most one byte, so a move up from a fitting plan fits. Compiled, the compiler's buffers follow the
   bits too: the slope starts at ``COMPILED_SLOPE`` and follows what moves measure, and at most
   ``COMPILED_PLANS`` plans are made, as each recompiles.
3. Over the target, the plan moves down by the excess and never returns to storage that was over (until a
   restart), so it does not swing around the target. Compiled, after a move up, it returns to the last fitting
   plan instead.
4. A recalibration re-plans at the measured storage and adds no room: moving bits alone can move the peak.

Recomputation does not pay on top of compression (a recomputed block re-creates its activations uncompressed;
``docs/results.md``), so only bits move the peak.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping, Sequence

import torch

from lightning_act.policy.allocation import EXACT, quantization_variance, storage_bits
from lightning_act.policy.bits import EXACT_NAME, AllocatedBits, SlotInfo, parse_bits

#: Where a move up aims, as a share of the target: room for what varies between steps.
AIM = 0.98
#: The least growth of storage, as a share of the plan's, worth a move up. (A band of the target instead would
#: never move a model whose floor already peaks inside it.)
MIN_MOVE_SHARE = 0.05
#: The largest slope counted (beyond it a move would hardly move).
MAX_SLOPE = 4.0
#: A plan stays under this share of the least storage a step was measured over the target with.
CEILING_SHARE = 0.99
#: A batch this much larger than the one the plan was measured at starts it again.
BATCH_GROWTH = 1.25
#: New plans a compiled model may make after its floor: each compiles the graphs again.
COMPILED_PLANS = 3
#: The slope a compiled model's moves start from: the partition and the compiler's buffers follow the bits, so
#: moves at slope one overshoot the target.
COMPILED_SLOPE = 2.0
#: The least slope a compiled model's later moves take, whatever the last one measured.
COMPILED_LEAST_SLOPE = 1.0

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")
_FORMS = "bytes (an int), a size such as '20GiB', '512MiB' or '1.5GB', or a fraction in (0, 1] of the device's memory"


def parse_memory_target(value: int | float | str, device: torch.device | None = None) -> int:
    """A memory target in bytes.

    Args:
        value: bytes (an int > 1), a size with a unit (``"20GiB"``, ``"512 MiB"``,
            ``"1.5GB"``; B, KB, MB, GB, TB and KiB to TiB, any case), or a fraction in (0, 1]
            of the device's memory (a GPU's total memory; on the CPU, the machine's RAM).
        device: resolves a fraction; None only checks it.

    Raises:
        ValueError: the value is none of these; the message names it and what is allowed.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory_target={value!r} is not supported; allowed: {_FORMS}")
    if isinstance(value, int):
        if value <= 1:
            raise ValueError(f"memory_target={value!r} is not supported; allowed: {_FORMS}")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"memory_target={value!r} is not supported; allowed: {_FORMS}")
        return int(value * device_memory(device)) if device is not None else 0
    if isinstance(value, str):
        found = _AMOUNT.match(value)
        unit = found and _UNITS.get(found.group(2).lower())
        if found and unit and float(found.group(1)) * unit >= 2:
            return int(float(found.group(1)) * unit)
    raise ValueError(f"memory_target={value!r} is not supported; allowed: {_FORMS}")


def device_memory(device: torch.device) -> int:
    """The memory of ``device`` in bytes: a GPU's total, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raise ValueError(f"memory_target as a fraction needs the memory of device {device}; give bytes such as '20GiB'")


class MemoryTargetError(RuntimeError):
    """A memory target below the least reachable peak of a step."""


def unreachable_message(
    target: object,
    target_bytes: int,
    peak: int,
    lasting_peak: int,
    step: int,
    source: str | None,
    held: Mapping[str, int],
    device_type: str,
) -> str:
    """Why a target cannot be met: step ``step`` at every tensor's floor peaked at ``peak`` (measured by
    ``source``), every later step at least at ``lasting_peak``; ``held`` is bytes by what holds them, the
    rest is named as backward's buffers and temporaries."""
    parts = dict(held)
    parts["backward's buffers, the optimizer's temporaries and the rest"] = max(lasting_peak - sum(held.values()), 0)
    later = (
        ""
        if lasting_peak <= peak
        else (
            f", and every later step at least at {lasting_peak / 2**20:.1f} MiB, holding the optimizer state (and "
            "gradients) this step left"
        )
    )
    # Lightning's batch-size finder backs off on errors that read as running out of memory.
    oom = "CUDA out of memory" if device_type == "cuda" else "DefaultCPUAllocator: can't allocate memory"
    return (
        f"lightning_act: memory_target={target!r} ({target_bytes / 2**20:.1f} MiB) cannot be met at this batch: "
        f"with every saved tensor at its lowest bits, step {step} peaked at {peak / 2**20:.1f} MiB ({source}){later}: "
        "the least reachable peak. It holds "
        + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in parts.items())
        + f". Raise the target to at least {lasting_peak / 2**20:.1f} MiB or lower the batch size. Raised as running "
        f"out of memory ({oom}) so that Lightning's batch-size finder backs off."
    )


class Verdict(enum.Enum):
    """What one measured step says about the plan."""

    #: Under the target, with too little room for a move up worth making.
    FITS = "fits"
    #: Room for a move up (see ``MIN_MOVE_SHARE``), or over the target: :meth:`TargetBits.update`.
    MOVE = "move"
    #: Over the target with every tensor at its floor.
    UNREACHABLE = "unreachable"
    #: A compiling step over the target: not judged (the compiler's allocations may be the excess), but run.
    UNMEASURED = "unmeasured"


class TargetBits(AllocatedBits):
    """Per-tensor bits chosen so that each step's measured peak stays at or below a target (the loop: see the
    module).

    Args:
        target_bytes: the peak each step must stay at or below, in bytes.
        candidates: the choices, from 1, 2, 4, 8 and "exact".
        rules: per-module and per-op overrides (:class:`~lightning_act.policy.SaveRules`);
            their bits are outside the plan, their bytes in what it measures.

    Raises:
        ValueError: the target is not a positive number of bytes, or a candidate is not allowed.
    """

    def __init__(
        self,
        target_bytes: int | float | str,
        candidates: Sequence[int | str] = (1, 2, 4, 8, EXACT_NAME),
        rules: Mapping[str, int | str] | None = None,
    ):
        widths = [b for b in (parse_bits(c, "candidates") for c in candidates) if b is not EXACT]
        if not widths:
            raise ValueError(f"candidates={list(candidates)!r} need a bit width")
        super().__init__(candidates, rules, default_bits=min(widths))
        self.target_bytes = parse_memory_target(target_bytes)
        #: The last measured step's peak, and the storage (bits) its plan gave the free slots.
        self.measured_peak: int | None = None
        self._measured_storage: dict[str, float] = {}
        # Whether that step's plan kept every free tensor exact, and was over the target.
        self._measured_all_exact = self._over = False
        # The plan of the last measured step under the target, and its peak (None: none yet).
        self._fitting: tuple[dict[str, int | None], int] | None = None
        #: The peak the current plan is expected to stay under (None before a measurement).
        self.predicted_peak: int | None = None
        #: Peak bytes per byte of storage a move adds: at least 1 in eager, raised by what moves measure;
        #: compiled, what the last move measured.
        self.slope = 1.0
        #: New plans still allowed (None: any number; ``COMPILED_PLANS`` for a compiled model).
        self.plans_left: int | None = None
        # Steps run since the start or a restart, measured or not.
        self._steps = 0
        self._measured_total = 0.0
        # The least storage (bits) a step was measured over the target with: no plan goes back to it (None: none).
        self._ceiling: float | None = None
        # The last update left the plan as it was: the next step is not a reason to move again.
        self._stalled = False
        # The last measured step asked for a move (else an update is a recalibration, at the measured storage).
        self._moving = False
        # The batch's bytes the plan is measured at (None: none yet).
        self._planned_batch_bytes: int | None = None

    def follow_compiled(self) -> None:
        """Plan for a compiled model: at most ``COMPILED_PLANS`` plans, at a slope of ``COMPILED_SLOPE`` or more."""
        self.plans_left = COMPILED_PLANS
        self.slope = max(self.slope, COMPILED_SLOPE)

    def follow_batch(self, batch_bytes: int) -> bool:
        """:meth:`restart` (returning True) where a batch has over ``BATCH_GROWTH`` times the bytes of the one the
        plan was measured at, or under half (a batch-size search, a new stage); the loop follows smaller changes."""
        planned = self._planned_batch_bytes
        if planned is not None and planned / 2 <= batch_bytes <= BATCH_GROWTH * planned:
            return False
        self.restart()
        self._planned_batch_bytes = batch_bytes
        return planned is not None

    def restart(self) -> None:
        """Back to every tensor at its floor, measured afresh (another batch size)."""
        self.assignment = {}
        self.measured_peak = self.predicted_peak = None
        self._measured_storage = {}
        self._measured_all_exact = self._over = False
        self._fitting = None
        self._steps = 0
        self._measured_total = 0.0
        self._ceiling = None
        self._stalled = self._moving = False
        self._planned_batch_bytes = None

    def observe(self, peak_bytes: int, slots: Mapping[str, SlotInfo], compiled: bool = False) -> Verdict:
        """Take the measured peak of a step run under the current plan; ``compiled``: the step compiled graphs."""
        if compiled and peak_bytes > self.target_bytes:
            self._steps += 1  # run, so the next step is not taken for a first one
            return Verdict.UNMEASURED
        free = self._free(slots)
        storage_by_slot = {k: self._storage(k, s) for k, s in free.items()}
        storage = sum(storage_by_slot.values())
        added = (storage - self._measured_total) / 8
        if self.measured_peak is not None and added > 0.01 * self.target_bytes:
            measured = (peak_bytes - self.measured_peak) / added
            least = self.slope if self.plans_left is None else COMPILED_LEAST_SLOPE
            self.slope = min(max(least, measured), MAX_SLOPE)
        self.measured_peak = peak_bytes
        self._measured_all_exact = bool(self.assignment) and all(bits is EXACT for bits in self.assignment.values())
        self._over = peak_bytes > self.target_bytes
        if not self._over:
            self._fitting = dict(self.assignment), peak_bytes
        self._steps += 1
        self._moving = False
        self._measured_storage, self._measured_total = storage_by_slot, storage
        floor = sum(storage_bits(s.min_bits, s.numel, s.groups, s.element_bits) for s in free.values())
        exact = sum(s.numel * s.element_bits for s in free.values())
        if peak_bytes > self.target_bytes and storage > floor:
            self._ceiling = storage if self._ceiling is None else min(self._ceiling, storage)
            self._moving = True
            return Verdict.MOVE
        if peak_bytes > self.target_bytes:
            return Verdict.UNREACHABLE
        if self._steps < 2 or self._stalled:
            return Verdict.FITS
        room = AIM * self.target_bytes - peak_bytes
        if storage < exact and room > 0 and 8 * room / self.slope >= MIN_MOVE_SHARE * storage:
            self._moving = True
            return Verdict.MOVE
        return Verdict.FITS

    @property
    def all_exact_fits(self) -> bool:
        """Whether the last measured step kept every free tensor exact and stayed under the target (a plan just
        moved to all exact is not measured yet)."""
        return self._measured_all_exact and self.measured_peak is not None and self.measured_peak <= self.target_bytes

    def update(
        self, variance: Mapping[str, Mapping[int, float]], slots: Mapping[str, SlotInfo]
    ) -> dict[str, int | None]:
        """Re-plan from the last measured step (every tensor at its floor before one).

        Args:
            variance: per slot, the gradient variance it adds at each bit width (``S(b)`` per value
                where no slot has an estimate yet).
            slots: every slot, with its size.
        """
        if self._over and self.plans_left is not None and self._fitting and self._fitting[0] != self.assignment:
            return self._back_to_fitting()
        if self.plans_left == 0 and not self._over:  # a step over the target always moves
            self._stalled = True
            return self.assignment
        before = self._measured_total
        planned = dict(self.assignment)
        moving = self._moving
        assignment = super().update(_every_slot(variance, self._free(slots)), slots)
        self._moving = False  # moved: a recalibration before the next step adds nothing more
        # A move that changed nothing stalls the loop until a step is over the target or a recalibration.
        changed = self.differing(assignment) != self.differing(planned)
        self._stalled = moving and not changed
        if self.plans_left and changed and self.measured_peak is not None:
            self.plans_left -= 1  # a move: the floor's plan written out is none
        if self.measured_peak is not None:
            after = sum(self._storage(k, slots[k]) for k in self._measured_storage if k in slots)
            self.predicted_peak = self.measured_peak + int(self.slope * (after - before) // 8)
        return assignment

    def _back_to_fitting(self) -> dict[str, int | None]:
        """Compiled, over the target after a move up: back to the last fitting plan, whose graphs Dynamo's cache
        still holds, so it costs no plan. Moving down by the excess could overshoot to the floor with no plan
        left to climb back."""
        assignment, peak = self._fitting
        self.assignment = dict(assignment)
        self.predicted_peak = peak
        self._over = self._moving = self._stalled = False
        return self.assignment

    def allowance(self, sizes: Mapping[str, tuple[int, int, int]], floors: Mapping[str, int]) -> float:
        if self._steps < 2 or self.measured_peak is None:
            return 0.0  # every tensor at its cheapest
        used = sum(self._measured_storage.get(k, storage_bits(floors.get(k, 1), *size)) for k, size in sizes.items())
        room = AIM * self.target_bytes - self.measured_peak
        # Up by what the room allows at the slope; down by at least the excess; always below the ceiling. A
        # recalibration adds no storage: moving bits between tensors alone can move the peak.
        up = room / self.slope if room > 0 and self._moving else 0.0
        allowance = used + 8.0 * (up if room > 0 else room)
        if self._ceiling is not None:
            allowance = min(allowance, CEILING_SHARE * self._ceiling)
        return max(allowance, 0.0)

    def _free(self, slots: Mapping[str, SlotInfo]) -> dict[str, SlotInfo]:
        return {k: s for k, s in slots.items() if not self.pins_bits(s)}

    def _storage(self, slot: str, info: SlotInfo) -> int:
        """Bits ``slot`` occupies under the current plan."""
        return storage_bits(self.bits_for(slot, info), info.numel, info.groups, info.element_bits)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "target_bytes": self.target_bytes}


def _every_slot(
    variance: Mapping[str, Mapping[int, float]], slots: Mapping[str, SlotInfo]
) -> dict[str, Mapping[int, float]]:
    """``variance`` with an estimate for every slot: one without adds per value the median of what measured
    slots add per value (``S(b)`` where none is measured)."""
    measured = {k: v for k, v in variance.items() if k in slots}
    per_value = {}
    for b in (1, 2, 4, 8):
        ratios = sorted(v[b] / slots[k].numel for k, v in measured.items() if b in v and slots[k].numel)
        per_value[b] = ratios[len(ratios) // 2] if ratios else quantization_variance(b)
    return {k: measured.get(k) or {b: s.numel * per_value[b] for b in per_value} for k, s in slots.items()}
