"""What one captured forward saved for backward and what is stored instead: per module, per
slot, in total, and what became of each saved tensor."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_act.policy.bits import bits_name

OUTSIDE_MODULES = "<outside modules>"


class Outcome(enum.Enum):
    """What became of one saved tensor; the value is its key in :attr:`CompressionReport.counts`."""

    #: A parameter, or a view of one: alive anyway, in neither byte total.
    PARAMETER = "parameter"
    #: Part of the step's input (or a buffer): alive anyway, in neither byte total.
    EXTERNAL = "external"
    #: Autocast's copy of a parameter, re-created at unpack: stores nothing.
    RECAST = "recast"
    #: Kept as it is (too small, overlapping elements, a dtype no codec takes, a cast parameter).
    KEPT = "kept"
    #: Kept as it is because no trace could read how backward uses it (:attr:`CompressionReport.untraced`).
    UNTRACED = "untraced"
    #: Kept exact because the policy, a rule or a probe says so.
    EXACT = "exact"
    #: A reduction statistic, kept exact.
    STATISTIC = "statistic"
    #: Stored lossy by a codec at the bits the policy chose.
    COMPRESSED = "compressed"
    #: A mask or indices, stored exactly in fewer bits.
    LOSSLESS = "lossless"
    #: Served by the copy stored for an earlier save of the same tensor: stores nothing more.
    DEDUPLICATED = "deduplicated"
    #: Computed again in backward from what other saves of its call store (a fused
    #: attention's output and logsumexp): stores nothing.
    RECOMPUTED = "recomputed"

    def __init__(self, value: str):
        # Plain attributes, not properties: the capture engine reads them for every save.
        #: The value again (an enum's ``value`` is a property).
        self.key = value
        #: Whether the saved tensor's own storage stays allocated for backward.
        self.keeps_storage = value in ("kept", "untraced", "exact", "statistic")
        #: Whether its tensors are in the byte totals and the per-module rows.
        self.counted = value not in ("parameter", "external")

    @property
    def description(self) -> str:
        """What happened, in the summary's words."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Outcome.COMPRESSED: "compressed at the bits shown",
    Outcome.LOSSLESS: "masks or indices stored exactly in fewer bits",
    Outcome.DEDUPLICATED: "served by the copy of an earlier save of the same tensor",
    Outcome.RECOMPUTED: "attention outputs recomputed in backward from the stored inputs",
    Outcome.EXACT: "kept exact by a rule or the policy",
    Outcome.STATISTIC: "normalization or softmax statistics kept exact",
    Outcome.KEPT: "kept as they are (small, or no codec takes them)",
    Outcome.UNTRACED: "kept as they are: no trace could read how backward uses them (listed below)",
    Outcome.RECAST: "low-precision copies of parameters, re-made in backward",
    Outcome.PARAMETER: "parameters or their views",
    Outcome.EXTERNAL: "from the batch or buffers",
}


#: The ``bits`` of a save counted without a width (a mask, a kept tensor); None is a width: exact.
NO_BITS = object()


@dataclass
class ModuleMemory:
    """Bytes one module's saved tensors would have kept, and what is stored instead."""

    saved_bytes: int = 0
    stored_bytes: int = 0
    tensors: int = 0
    #: How many of its tensors a codec stored lossy (:attr:`Outcome.COMPRESSED`), eager or compiled.
    compressed: int = 0
    bits: set = field(default_factory=set)
    codecs: set = field(default_factory=set)
    #: The torch functions that saved its tensors (``conv2d``, ``relu``).
    ops: set = field(default_factory=set)
    #: How many of its tensors had each :class:`Outcome` (by its value).
    outcomes: dict[str, int] = field(default_factory=dict)

    def note(self, outcome: Outcome, op: str | None, count: int = 1) -> None:
        """Count ``count`` more tensors saved by ``op`` in this module, and what became of them."""
        self.tensors += count
        key = outcome.key
        self.outcomes[key] = self.outcomes.get(key, 0) + count
        if op is not None:
            self.ops.add(op)

    def add(self, other: ModuleMemory, times: int = 1) -> None:
        """Add ``times`` copies of ``other``'s tensors and bytes."""
        self.saved_bytes += other.saved_bytes * times
        self.stored_bytes += other.stored_bytes * times
        self.tensors += other.tensors * times
        self.compressed += other.compressed * times
        self.bits |= other.bits
        self.codecs |= other.codecs
        self.ops |= other.ops
        for outcome, count in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count * times

    def bits_label(self) -> str:
        """The bit widths used, e.g. ``"2"`` or ``"2,8,exact"`` (``-`` when none applied)."""
        return ",".join(bits_name(b) for b in sorted(self.bits, key=lambda b: 99 if b is None else b)) or "-"

    def ops_label(self) -> str:
        """The ops that saved its tensors, e.g. ``"conv2d"`` or ``"linear,relu"``."""
        return ",".join(sorted(self.ops)) or "-"

    def codecs_label(self) -> str:
        """How its tensors are stored, e.g. ``"quant"``, ``"division,quant,index"`` or
        ``"quant,as is"``; ``shared`` where another save's copy serves them."""
        labels = sorted(self.codecs)
        if any(self.outcomes.get(o.value) for o in Outcome if o.keeps_storage):
            labels.append("as is")
        if self.outcomes.get(Outcome.DEDUPLICATED.value):
            labels.append("shared")
        if self.outcomes.get(Outcome.RECAST.value):
            labels.append("re-made")
        return ",".join(labels) or "-"

    def ratio_label(self) -> str:
        """``saved / stored`` as ``"15.06x"``; ``-`` where either is zero (see the summary's legend)."""
        return f"{self.saved_bytes / self.stored_bytes:.2f}x" if self.saved_bytes and self.stored_bytes else "-"


@dataclass(frozen=True)
class SlotMemory:
    """One stored tensor: where and by which op it was saved, its shape, codec, bits and bytes."""

    module: str
    shape: tuple[int, ...]
    bits: int | None
    saved_bytes: int
    stored_bytes: int
    codec: str = "stored"
    op: str | None = None


class ReportDelta:
    """What a fixed set of saved tensors adds to a report, summed once: a compiled graph packs the
    same tensors every step, so :meth:`CompressionReport.add` adds them in a few operations."""

    def __init__(self) -> None:
        self.saved_bytes = 0
        self.stored_bytes = 0
        self.counts: dict[str, int] = {}
        self.modules: dict[str, ModuleMemory] = {}
        self.slots: dict[str, SlotMemory] = {}

    def note(self, module: str, outcome: Outcome, op: str | None, saved: int, stored: int) -> ModuleMemory:
        """Count one more tensor of ``module``, saved by ``op``, and its bytes."""
        self.counts[outcome.value] = self.counts.get(outcome.value, 0) + 1
        memory = _row(self.modules, module)
        memory.note(outcome, op)
        memory.saved_bytes += saved
        memory.stored_bytes += stored
        self.saved_bytes += saved
        self.stored_bytes += stored
        return memory

    def add(self, other: ReportDelta, times: int = 1) -> None:
        """Add ``times`` copies of ``other``."""
        self.saved_bytes += other.saved_bytes * times
        self.stored_bytes += other.stored_bytes * times
        for outcome, count in other.counts.items():
            self.counts[outcome] = self.counts.get(outcome, 0) + count * times
        _add_rows(self.modules, other.modules, times)
        self.slots.update(other.slots)


def _row(rows: dict[str, ModuleMemory], name: str) -> ModuleMemory:
    """``rows``' row of module ``name``, made empty where there is none yet."""
    row = rows.get(name)
    if row is None:
        row = rows[name] = ModuleMemory()
    return row


def _add_rows(rows: dict[str, ModuleMemory], added: dict[str, ModuleMemory], times: int = 1) -> None:
    for name, memory in added.items():
        _row(rows, name).add(memory, times)


@dataclass(eq=False)
class CompressionReport:
    """What one captured forward saved for backward, per module and in total.

    ``saved_bytes`` counts each storage autograd would have kept alive once (views and
    expanded tensors share storage); ``stored_bytes`` counts what is really allocated for
    backward instead. Tensors that stay alive anyway (parameters, the input batch) are in
    neither. ``counts`` holds how many saved tensors had each :class:`Outcome` (by its value).
    ``nonfinite_groups`` is a device tensor (reading it synchronizes).
    """

    saved_bytes: int = 0
    stored_bytes: int = 0
    slots: dict[str, SlotMemory] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    nonfinite_groups: torch.Tensor | int = 0
    #: The tensors kept whole because their op's backward could not be traced, by op:
    #: ``[tensors, stored bytes, why]``.
    untraced: dict[str, list] = field(default_factory=dict)
    _modules: dict[str, ModuleMemory] = field(default_factory=dict, repr=False)
    #: Saves counted by :meth:`count` whose per-module rows are not folded into ``_modules`` yet.
    _counted: list[tuple] = field(default_factory=list, repr=False)
    #: Added deltas whose per-module rows are not folded into ``_modules`` yet.
    _unfolded: list[ReportDelta] = field(default_factory=list, repr=False)

    def count(
        self,
        module: str,
        op: str | None,
        outcome: Outcome,
        saved: int,
        stored: int,
        bits: Any = NO_BITS,
        codec: str | None = None,
        untraced: str | None = None,
    ) -> None:
        """Count one tensor of ``module``, saved by ``op``: ``saved`` bytes autograd would keep,
        ``stored`` bytes stored instead, at ``bits`` (None: exact) by ``codec``; ``untraced``:
        why its op could not be traced. Totals now; its module's row only when the rows are
        read (at logging steps, not every step)."""
        if untraced is not None:
            entry = self.untraced.setdefault(op or "-", [0, 0, untraced])
            entry[0] += 1
            entry[1] += stored
        key = outcome.key
        self.counts[key] = self.counts.get(key, 0) + 1
        self.saved_bytes += saved
        self.stored_bytes += stored
        self._counted.append((module, op, outcome, saved, stored, bits, codec))

    @property
    def modules(self) -> dict[str, ModuleMemory]:
        """Per module (by its name in the model), what its saved tensors kept and stored."""
        if self._counted:
            for module, op, outcome, saved, stored, bits, codec in self._counted:
                row = _row(self._modules, module)
                row.note(outcome, op)
                row.saved_bytes += saved
                row.stored_bytes += stored
                if outcome is Outcome.COMPRESSED:
                    row.compressed += 1
                if bits is not NO_BITS:
                    row.bits.add(bits)
                if codec is not None:
                    row.codecs.add(codec)
            self._counted.clear()
        if self._unfolded:
            for delta in self._unfolded:
                _add_rows(self._modules, delta.modules)
            self._unfolded.clear()
        return self._modules

    def add(self, delta: ReportDelta) -> None:
        """Add what ``delta`` counts: its totals now, its per-module rows when they are read."""
        self.saved_bytes += delta.saved_bytes
        self.stored_bytes += delta.stored_bytes
        for outcome, count in delta.counts.items():
            self.counts[outcome] = self.counts.get(outcome, 0) + count
        self.slots.update(delta.slots)
        self._unfolded.append(delta)

    @property
    def ratio(self) -> float:
        """``saved_bytes / stored_bytes`` (1.0 when nothing was saved)."""
        return self.saved_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def summary(self, max_modules: int | None = 20) -> str:
        """A fixed-width table of the modules that save the most, then the totals, what became
        of the saved tensors, and a legend for what needs one.

        Args:
            max_modules: rows to show (None: every module); a line says how many are left out.
        """
        rows = sorted(self.modules.items(), key=lambda kv: (kv[1].saved_bytes, kv[1].stored_bytes), reverse=True)
        shown = rows if max_modules is None else rows[:max_modules]
        cells = [
            (
                name,
                _clip(m.ops_label()),
                f"{m.saved_bytes / MIB:.3f}",
                f"{m.stored_bytes / MIB:.3f}",
                m.ratio_label(),
                str(m.tensors),
                m.bits_label(),
                m.codecs_label(),
            )
            for name, m in shown
        ]
        tensors = sum(m.tensors for m in self.modules.values())
        total = (
            "total",
            "",
            f"{self.saved_bytes / MIB:.3f}",
            f"{self.stored_bytes / MIB:.3f}",
            f"{self.ratio:.2f}x",
            str(tensors),
            "",
            "",
        )
        widths = [max(len(row[i]) for row in [_HEADER, *cells, total]) for i in range(len(_HEADER))]

        def line(row: tuple[str, ...]) -> str:
            return "  ".join(
                cell.rjust(w) if i in _RIGHT_ALIGNED else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()

        lines = [
            "MiB for backward: 'autograd keeps' without compression, 'stored' with it; ratio = autograd keeps / stored",
            line(_HEADER),
            *map(line, cells),
        ]
        if len(rows) > len(shown):
            lines.append(f"... {len(rows) - len(shown)} more modules: summary(max_modules=None) lists them all")
        lines.append(line(total))
        lines += self._outcome_lines(tensors)
        if any(m.ratio_label() == "-" and (m.saved_bytes or m.stored_bytes) for _, m in shown):
            lines += [
                "ratio '-': a tensor's bytes count in the row of the module that saved it first. A row that stores",
                "  MiB but keeps none stores again a tensor saved first elsewhere (in another layout); a row that",
                "  keeps MiB but stores none is served by other rows' copies or re-makes its tensors in backward",
            ]
        return "\n".join(lines)

    def _outcome_lines(self, tensors: int) -> list[str]:
        """What became of the saved tensors: those in the table, then those alive anyway."""

        def counts(counted: bool) -> list[tuple[int, str]]:
            return [
                (self.counts[o.value], text)
                for o, text in _DESCRIPTIONS.items()
                if o.counted is counted and self.counts.get(o.value)
            ]

        width = max([len(str(n)) for n, _ in counts(True)], default=1)
        lines = [f"{tensors} saved tensors in the table:", *(f"  {n:>{width}}  {text}" for n, text in counts(True))]
        uncounted = counts(False)
        if uncounted:
            lines.append("not in the table, alive anyway: " + ", ".join(f"{text}: {n}" for n, text in uncounted))
        if self.untraced:
            lines.append("kept whole, no trace could read how backward uses them:")
            lines += [
                f"  {op}: {n} tensors, {stored / MIB:.3f} MiB ({why})" for op, (n, stored, why) in self.untraced.items()
            ]
        return lines


MIB = 2**20
_HEADER = ("module", "op", "autograd keeps", "stored", "ratio", "tensors", "bits", "stored as")
_RIGHT_ALIGNED = {2, 3, 4, 5}
_OP_WIDTH = 28


def _clip(text: str, width: int = _OP_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
