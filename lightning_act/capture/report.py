"""What one captured forward saved for backward and what is stored instead: per module, per
slot, in total, and what became of each saved tensor."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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

    @property
    def keeps_storage(self) -> bool:
        """Whether the saved tensor's own storage stays allocated for backward."""
        return self in (Outcome.KEPT, Outcome.EXACT, Outcome.STATISTIC)

    @property
    def encodes(self) -> bool:
        """Whether a codec's record replaces the saved tensor."""
        return self in (Outcome.COMPRESSED, Outcome.LOSSLESS)


@dataclass
class ModuleMemory:
    """Bytes one module's saved tensors would have kept, and what is stored instead."""

    saved_bytes: int = 0
    stored_bytes: int = 0
    tensors: int = 0
    compressed: int = 0
    bits: set = field(default_factory=set)
    codecs: set = field(default_factory=set)

    def bits_label(self) -> str:
        """The bit widths used, e.g. ``"2"`` or ``"2,8,exact"`` (``-`` when none applied)."""
        return ",".join(bits_name(b) for b in sorted(self.bits, key=lambda b: 99 if b is None else b)) or "-"

    def codecs_label(self) -> str:
        """How its tensors are stored, e.g. ``"quant"`` or ``"division,quant,index"``."""
        return ",".join(sorted(self.codecs)) or "-"


@dataclass
class SlotMemory:
    """One stored tensor: where and by which op it was saved, its shape, codec, bits and bytes."""

    module: str
    shape: tuple[int, ...]
    bits: int | None
    saved_bytes: int
    stored_bytes: int
    codec: str = "stored"
    op: str | None = None


@dataclass
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
    modules: dict[str, ModuleMemory] = field(default_factory=dict)
    slots: dict[str, SlotMemory] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    nonfinite_groups: torch.Tensor | int = 0

    @property
    def ratio(self) -> float:
        """``saved_bytes / stored_bytes`` (1.0 when nothing was saved)."""
        return self.saved_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def summary(self, max_modules: int = 20) -> str:
        """A fixed-width table of the modules that save the most, then the totals."""
        rows = sorted(self.modules.items(), key=lambda kv: kv[1].saved_bytes, reverse=True)
        width = max([len("module")] + [len(name) for name, _ in rows[:max_modules]])
        lines = [f"{'module':<{width}}  {'saved MiB':>10}  {'stored MiB':>10}  {'ratio':>7}  {'tensors':>7}  {'bits':<8}  codec"]
        for name, m in rows[:max_modules]:
            ratio = m.saved_bytes / m.stored_bytes if m.stored_bytes else float("inf")
            lines.append(
                f"{name:<{width}}  {m.saved_bytes / 2**20:>10.3f}  {m.stored_bytes / 2**20:>10.3f}"
                f"  {ratio:>6.2f}x  {m.tensors:>7}  {m.bits_label():<8}  {m.codecs_label()}"
            )
        if len(rows) > max_modules:
            lines.append(f"... {len(rows) - max_modules} more modules")
        lines.append(
            f"{'total':<{width}}  {self.saved_bytes / 2**20:>10.3f}  {self.stored_bytes / 2**20:>10.3f}"
            f"  {self.ratio:>6.2f}x  {sum(m.tensors for m in self.modules.values()):>7}"
        )
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return "\n".join(lines + [f"saved tensors by decision: {counts}"])
