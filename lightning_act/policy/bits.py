"""Bit policies: how many bits each saved tensor gets.

A saved tensor is identified by its *slot*: the qualified name of the module that saved it and its position
among that module's saves in one forward (``layer1.0.conv1#0``). A slot first seen later gets the policy's
default until the next recalibration includes it.
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_act.config import CODECS
from lightning_act.ops.validation import SUPPORTED_BITS
from lightning_act.policy.allocation import EXACT, allocate_storage, uniform_storage

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
    #: The torch function that saved it (``"conv2d"``, ``"relu"``), None if unknown.
    op: str | None = None
    #: The fewest bits it may get: 2 for a ReLU output, whose zeros must stay exact; 8 for what backward puts
    #: through a softmax (softmax outputs, log-probabilities, attention's query and key), where noise turns
    #: into bias.
    min_bits: int = 1


@dataclass(frozen=True)
class Rule:
    """What a matching rule sets: the codec, the bits, or both (None leaves it to the policy)."""

    codec: str | None = None
    bits: int | None | object = _UNMATCHED

    @property
    def pins_bits(self) -> bool:
        return self.bits is not _UNMATCHED


def parse_rule(value: int | str | None, knob: str) -> Rule:
    """``8``, ``"exact"``, a codec name (``"division"``) or both (``"division:4"``)."""
    if not isinstance(value, str) or value == EXACT_NAME or value.isdigit():
        return Rule(bits=parse_bits(int(value) if isinstance(value, str) and value.isdigit() else value, knob))
    codec, colon, bits = value.partition(":")
    widths = {str(b) for b in SUPPORTED_BITS} | {EXACT_NAME}
    if codec not in CODECS or (colon and bits not in widths):
        raise ValueError(
            f"{knob}={value!r} is not supported; allowed: {', '.join(map(str, SUPPORTED_BITS))}, '{EXACT_NAME}', "
            f"a codec ({', '.join(CODECS)}) or codec:bits such as 'division:4'"
        )
    return Rule(codec, parse_bits(int(bits) if bits.isdigit() else bits, knob) if colon else _UNMATCHED)


def _matches(pattern: str, name: str | None) -> bool:
    return name is not None and fnmatch.fnmatchcase(name, pattern)


class SaveRules:
    """Overrides by module and by op: ``{"conv1": 8, "fc": "exact", "layer4.*": "division",
    "op:scaled_dot_product_attention": "quant:8"}``.

    A key is an ``fnmatch`` pattern for the qualified name of the innermost module that saved
    the tensor or, after ``op:``, for the torch function that saved it (``conv2d``, ``linear``,
    ``softmax``, ...; see :mod:`lightning_act.optrack`). A value pins the bits (1, 2, 4, 8 or
    ``"exact"``), the codec (``"quant"``, ``"division"``, ``"pool"``) or both (``"division:4"``).
    The first matching key wins.

    Raises:
        ValueError: a value is none of these; the message names the key.
    """

    def __init__(self, rules: Mapping[str, int | str] | None = None):
        self.rules = dict(rules or {})
        self._parsed = []
        for key, value in self.rules.items():
            on_op = key.startswith("op:")
            self._parsed.append((on_op, key[3:] if on_op else key, parse_rule(value, f"rules[{key!r}]")))
        self._cache: dict[tuple[str, str | None], Rule | None] = {}
        #: The keys that matched a lookup so far (shadowed by an earlier key or not).
        self.matched: set[str] = set()
        self._warned: set[str] = set()

    def by_key(self) -> list[tuple[str, Rule]]:
        """Each key with its parsed rule, in the order given."""
        return [(key, rule) for key, (_, _, rule) in zip(self.rules, self._parsed)]

    def lookup(self, module: str, op: str | None = None) -> Rule | None:
        """The first rule matching ``module`` or ``op``, or None."""
        key = (module, op)
        if key not in self._cache:
            # Note every matching key, so that a key matching nothing (a typo) can be reported.
            hits = [
                i for i, (on_op, pattern, _) in enumerate(self._parsed) if _matches(pattern, op if on_op else module)
            ]
            keys = list(self.rules)
            self.matched.update(keys[i] for i in hits)
            self._cache[key] = self._parsed[hits[0]][2] if hits else None
        return self._cache[key]

    def warn_unmatched(self, module_names: Iterable[str], op_names: Iterable[str] = ()) -> list[str]:
        """Warn once per key that matched no lookup so far, suggesting the nearest of ``module_names`` (or, for
        an ``op:`` key, of ``op_names``); returns the keys warned about."""
        unmatched = [key for key in self.rules if key not in self.matched and key not in self._warned]
        if not unmatched:
            return []
        modules = sorted(set(module_names) | {module for module, _ in self._cache})
        ops = sorted(set(op_names) | {op for _, op in self._cache if op is not None})
        for key in unmatched:
            self._warned.add(key)
            on_op = key.startswith("op:")
            pattern, names, kind = (key[3:], ops, "op") if on_op else (key, modules, "module")
            # Compare what the pattern spells, without its wildcards.
            nearest = difflib.get_close_matches(pattern.strip("*?.").replace("*", ""), names, n=3, cutoff=0.5)
            named = [] if on_op else [name for name in modules if _matches(pattern, name)]
            if named:
                hint = (
                    f"it names {', '.join(named[:3])}{', ...' if len(named) > 3 else ''}, which saved nothing a rule "
                    "sets (inputs, parameters, masks and tensors below min_numel are never compressed)"
                )
            elif nearest:
                hint = f"nearest {kind} names: " + ", ".join(("op:" if on_op else "") + name for name in nearest)
            elif names:
                hint = f"no {kind} name is close; some that exist: " + ", ".join(names[:5])
            else:
                hint = f"no {kind} names were seen"
            warnings.warn(
                f"lightning_act: rules[{key!r}] matched no saved tensor in the first step; {hint}", stacklevel=2
            )
        return unmatched


class BitPolicy(ABC):
    """Base class: rules first, then the policy's own choice."""

    _instances = itertools.count()

    def __init__(self, rules: Mapping[str, int | str] | None = None):
        self.rules = SaveRules(rules)
        self._instance = next(BitPolicy._instances)

    def choices_state(self) -> object:
        """What the choices depend on besides the rules: graphs compiled under one state are reused under an
        equal one. For an unknown subclass only the same instance counts as the same state; a policy that
        changes its choices in place must return what changed."""
        return "instance", type(self).__qualname__, getattr(self, "_instance", id(self))

    def bits_for(self, slot: str, info: SlotInfo) -> int | None:
        rule = self.rules.lookup(info.module, info.op)
        bits = rule.bits if rule is not None and rule.pins_bits else self.choose(slot)
        return bits if bits is EXACT else max(bits, info.min_bits)

    def pins_bits(self, info: SlotInfo) -> bool:
        rule = self.rules.lookup(info.module, info.op)
        return rule is not None and rule.pins_bits

    @abstractmethod
    def choose(self, slot: str) -> int | None:
        """The bits of a slot that no rule pins."""


class FixedBits(BitPolicy):
    """The same bits for every tensor (after module rules)."""

    def __init__(self, bits: int = 2, rules: Mapping[str, int | str] | None = None):
        super().__init__(rules)
        self.bits = parse_bits(bits, "bits")

    def choose(self, slot: str) -> int | None:
        return self.bits

    def choices_state(self) -> object:
        return self.bits


class AllocatedBits(BitPolicy):
    """Per-tensor bits (1, 2, 4, 8 or exact) that minimise the estimated gradient variance within an allowance
    of storage, which subclasses set (:meth:`allowance`).

    Args:
        candidates: the choices, from 1, 2, 4, 8 and "exact".
        rules: per-module and per-op overrides (:class:`SaveRules`), outside the allowance.
        default_bits: the bits of a slot before the first allocation includes it.

    Raises:
        ValueError: a candidate is not allowed.
    """

    def __init__(self, candidates: Sequence[int | str], rules: Mapping[str, int | str] | None, default_bits: int):
        super().__init__(rules)
        self.candidates = [parse_bits(c, "candidates") for c in candidates]
        self.default_bits = default_bits
        self.assignment: dict[str, int | None] = {}
        # The floors of the slots the last update allocated.
        self._floors: dict[str, int] = {}

    def choose(self, slot: str) -> int | None:
        return self.assignment.get(slot, self.default_bits)

    def choices_state(self) -> object:
        """The plan's choices (:meth:`differing`), so that a plan equal to the default (a memory target's first,
        every tensor at its floor) reuses the default's compiled graphs instead of compiling again."""
        return self.differing(self.assignment), self.default_bits

    def differing(self, assignment: Mapping[str, int | None]) -> list[tuple[str, int | None]]:
        """The slots of ``assignment`` whose bits differ from the default's, sorted: equal lists, equal plans."""
        floors, default = self._floors, self.default_bits
        return sorted(
            (slot, bits)
            for slot, bits in assignment.items()
            if bits is EXACT or max(bits, floors.get(slot, bits)) != max(default, floors.get(slot, default))
        )

    def update(
        self, variance: Mapping[str, Mapping[int, float]], slots: Mapping[str, SlotInfo]
    ) -> dict[str, int | None]:
        """Re-solve the allocation for the slots that have an estimate and no rule pinning bits.

        Args:
            variance: per slot, the gradient variance it adds at each bit width
                (:mod:`lightning_act.policy.estimators`).
            slots: every slot to allocate, with its size.
        """
        free = {k: s for k, s in slots.items() if k in variance and not self.pins_bits(s)}
        sizes = {k: (s.numel, s.groups, s.element_bits) for k, s in free.items()}
        floors = self._floors = {k: s.min_bits for k, s in free.items()}
        self.assignment = allocate_storage(variance, sizes, self.allowance(sizes, floors), self.candidates, floors)
        return self.assignment

    @abstractmethod
    def allowance(self, sizes: Mapping[str, tuple[int, int, int]], floors: Mapping[str, int]) -> float:
        """Bits of storage the slots of ``sizes`` may occupy in all."""

    def state_dict(self) -> dict:
        return {"slots": list(self.assignment), "bits": [bits_name(b) for b in self.assignment.values()]}

    def load_state_dict(self, state: Mapping) -> None:
        self.assignment = {
            s: parse_bits(int(b) if b.isdigit() else b, "bits") for s, b in zip(state["slots"], state["bits"])
        }


class AdaptiveBits(AllocatedBits):
    """Per-tensor bits that minimise the estimated gradient variance at an average of bits.

    Args:
        budget: average bits per value over the tensors it allocates (fractional allowed), with
            statistics and floors counted as uniform quantization pays them: a budget of 2 stores
            what ``FixedBits(2)`` stores.
        candidates: the choices, from 1, 2, 4, 8 and "exact".
        rules: per-module and per-op overrides (:class:`SaveRules`); pinned bits are outside the budget.

    Raises:
        ValueError: the budget is outside [1, 8] or a candidate is not allowed.
    """

    def __init__(
        self,
        budget: float = 2.0,
        candidates: Sequence[int | str] = (1, 2, 4, 8, EXACT_NAME),
        rules: Mapping[str, int | str] | None = None,
    ):
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 1.0 <= budget <= 8.0:
            raise ValueError(f"budget={budget!r} must be a number of bits in [1, 8]")
        widths = [b for b in (parse_bits(c, "candidates") for c in candidates) if b is not EXACT]
        if not widths or min(widths) > budget:
            raise ValueError(f"candidates={list(candidates)!r} need a bit width <= budget={budget!r}")
        # Before the first calibration (and for slots it has not seen): the widest that fits.
        super().__init__(candidates, rules, default_bits=max(b for b in widths if b <= budget))
        self.budget = float(budget)

    def allowance(self, sizes: Mapping[str, tuple[int, int, int]], floors: Mapping[str, int]) -> float:
        return uniform_storage(sizes, self.budget, floors)
