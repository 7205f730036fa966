"""Bit policies: the answer to "how many bits does this saved tensor get?".

A saved tensor is identified by its *slot*: the qualified name of the module that saved it
and its position among the tensors that module saved in one forward (``layer1.0.conv1#0``).
Slots are stable from step to step for a fixed graph; a slot first seen later simply gets
the policy's default until the next recalibration includes it.
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_act.ops.reference import SUPPORTED_BITS
from lightning_act.policy.allocation import EXACT, allocate_bits

EXACT_NAME = "exact"
_UNMATCHED = object()


def parse_bits(value: int | str | None, knob: str) -> int | None:
    """``1, 2, 4, 8`` stay as they are; ``"exact"`` (or None) means keep the tensor exact."""
    if value is None or value == EXACT_NAME:
        return EXACT
    if isinstance(value, bool) or value not in SUPPORTED_BITS:
        allowed = ", ".join(map(str, SUPPORTED_BITS))
        raise ValueError(f"{knob}={value!r} is not supported; allowed: {allowed} or '{EXACT_NAME}'")
    return int(value)


def bits_name(bits: int | None) -> str:
    return EXACT_NAME if bits is EXACT else str(bits)


@dataclass
class SlotInfo:
    """What the policy needs to know about one saved tensor."""

    module: str
    shape: tuple[int, ...]
    numel: int
    groups: int
    element_bits: int


class ModuleRules:
    """Per-module overrides: ``{"conv1": 8, "fc": "exact", "blocks.*.attn*": 8}``.

    Patterns are shell-style (``fnmatch``) and matched against the qualified module name
    of the innermost module that saved the tensor; the first matching pattern wins.

    Raises:
        ValueError: a value is not 1, 2, 4, 8 or "exact".
    """

    def __init__(self, rules: Mapping[str, int | str] | None = None):
        self.rules = dict(rules or {})
        self._parsed = [(p, parse_bits(v, f"rules[{p!r}]")) for p, v in self.rules.items()]
        self._cache: dict[str, object] = {}

    def lookup(self, module: str):
        """The pinned bits for ``module``, or ``_UNMATCHED``."""
        found = self._cache.get(module, _UNMATCHED)
        if found is _UNMATCHED and module not in self._cache:
            found = next((bits for pattern, bits in self._parsed if fnmatch.fnmatchcase(module, pattern)), _UNMATCHED)
            self._cache[module] = found
        return found


class BitPolicy(ABC):
    """Base class: module rules first, then the policy's own choice."""

    def __init__(self, rules: Mapping[str, int | str] | None = None):
        self.rules = ModuleRules(rules)

    def bits_for(self, slot: str, module: str) -> int | None:
        pinned = self.rules.lookup(module)
        return self.choose(slot) if pinned is _UNMATCHED else pinned

    def is_pinned(self, module: str) -> bool:
        return self.rules.lookup(module) is not _UNMATCHED

    @abstractmethod
    def choose(self, slot: str) -> int | None:
        """The bits of a slot that no module rule pins."""


class FixedBits(BitPolicy):
    """The same bits for every tensor (after module rules)."""

    def __init__(self, bits: int = 2, rules: Mapping[str, int | str] | None = None):
        super().__init__(rules)
        self.bits = parse_bits(bits, "bits")

    def choose(self, slot: str) -> int | None:
        return self.bits


class AdaptiveBits(BitPolicy):
    """Per-tensor bits that minimise the estimated gradient variance within a byte budget.

    Args:
        budget: average bits per value over the tensors it allocates (fractional allowed);
            per-group statistics are counted, so a budget of 2 stores what uniform 2-bit
            quantization stores.
        candidates: the choices, from 1, 2, 4, 8 and "exact".
        rules: per-module overrides, outside the budget.

    Raises:
        ValueError: the budget is outside [1, 8] or a candidate is not allowed.
    """

    def __init__(
        self,
        budget: float = 2.0,
        candidates: Sequence[int | str] = (1, 2, 4, 8, EXACT_NAME),
        rules: Mapping[str, int | str] | None = None,
    ):
        super().__init__(rules)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 1.0 <= budget <= 8.0:
            raise ValueError(f"budget={budget!r} must be a number of bits in [1, 8]")
        self.budget = float(budget)
        self.candidates = [parse_bits(c, "candidates") for c in candidates]
        widths = [b for b in self.candidates if b is not EXACT]
        if not widths or min(widths) > self.budget:
            raise ValueError(f"candidates={list(candidates)!r} need a bit width <= budget={budget!r}")
        # Before the first calibration (and for slots it has not seen): the widest that fits.
        self.default_bits = max(b for b in widths if b <= self.budget)
        self.assignment: dict[str, int | None] = {}

    def choose(self, slot: str) -> int | None:
        return self.assignment.get(slot, self.default_bits)

    def update(
        self, variance: Mapping[str, Mapping[int, float]], slots: Mapping[str, SlotInfo]
    ) -> dict[str, int | None]:
        """Re-solve the allocation for the slots that have an estimate and no module rule.

        Args:
            variance: per slot, the gradient variance it adds at each bit width (from an
                estimator in :mod:`lightning_act.policy.estimators`).
            slots: every slot to allocate, with its size.
        """
        sizes = {
            k: (s.numel, s.groups, s.element_bits)
            for k, s in slots.items()
            if k in variance and not self.is_pinned(s.module)
        }
        self.assignment = allocate_bits(variance, sizes, self.budget, self.candidates)
        return self.assignment

    def state_dict(self) -> dict:
        return {"slots": list(self.assignment), "bits": [bits_name(b) for b in self.assignment.values()]}

    def load_state_dict(self, state: Mapping) -> None:
        self.assignment = {s: parse_bits(int(b) if b.isdigit() else b, "bits") for s, b in zip(state["slots"], state["bits"])}
