"""Stand-ins: what is stored in a saved tensor's place where its values cannot be stored as they
are (the cells between constants, masked or non-finite values), and how the tensor comes back."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_act.codecs.exact import MaskCodec


class ThresholdCells(NamedTuple):
    """A tensor backward only compares with constants (``clamp(min=eps)``'s ``x >= eps``): stored
    as the cell each value falls in (below the first constant, equal to it, between it and the
    next, ..., above the last, NaN: ``2 k + 2`` cells for ``k`` constants) and decoded to a value
    in that cell, so every comparison with those constants, strict or not, comes out as with the
    tensor itself. Use :meth:`of`, which checks each cell has a value in the tensor's dtype."""

    thresholds: tuple[float, ...]
    #: A value in each cell, in the tensor's dtype (as floats; NaN last).
    values: tuple[float, ...]
    dtype: torch.dtype

    #: The stored cells serve this op alone: another op's save of the tensor is stored again.
    for_its_op_alone = True

    @staticmethod
    def of(thresholds: tuple[float, ...], dtype: torch.dtype) -> ThresholdCells | None:
        """The cells between ``thresholds`` for a tensor of ``dtype``; None where a cell has no
        value of its own in that dtype (constants one rounding apart, or not finite)."""
        if not thresholds or not all(math.isfinite(c) for c in thresholds):
            return None
        # Worked out on real CPU tensors, also while a graph is traced under fake tensors.
        with unset_fake_temporarily():
            return ThresholdCells._work_out(thresholds, dtype)

    @staticmethod
    def _work_out(thresholds: tuple[float, ...], dtype: torch.dtype) -> ThresholdCells | None:
        constants = torch.tensor(sorted(set(thresholds)), dtype=torch.float64).to(dtype)
        if constants.unique().numel() != len(set(thresholds)):
            return None  # two constants the same in this dtype: their comparisons differ
        edges = constants.tolist()
        values = [edges[0] - max(1.0, abs(edges[0]))]
        for low, high in zip(edges, edges[1:]):
            values += [low, low + (high - low) / 2]
        values += [edges[-1], edges[-1] + max(1.0, abs(edges[-1]))]
        inside = torch.tensor(values, dtype=torch.float64).to(dtype)
        if not bool(inside.isfinite().all()):
            return None
        expected = ThresholdCells(tuple(edges), (), dtype).cell(inside)
        if not torch.equal(expected, torch.arange(len(values), dtype=torch.uint8)):
            return None  # a value that rounds out of its cell in this dtype
        return ThresholdCells(tuple(edges), tuple(inside.tolist()) + (math.nan,), dtype)

    @property
    def count(self) -> int:
        return 2 * len(self.thresholds) + 2

    def cell(self, x: torch.Tensor) -> torch.Tensor:
        """The cell of each value of ``x``: ``uint8``, NaN in the last."""
        cells = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for constant in self.thresholds:
            cells += (x > constant).to(torch.uint8) * 2 + (x == constant).to(torch.uint8)
        return cells.masked_fill_(x.isnan(), 2 * len(self.thresholds) + 1)

    def unpack(self, record) -> torch.Tensor:
        """A tensor in the recorded cells, from the record of :meth:`cell`."""
        cells = record.unpack()
        values = torch.tensor(self.values, dtype=self.dtype, device=cells.device)
        return values[cells.long()]


class MinusInfinityStandIn:
    """A tensor backward reads through an exponential (log-probabilities, a log-sum-exp, an
    attention mask) whose masked positions (``-inf``, or a finite mask value as large such as
    ``torch.finfo(dtype).min``) are stored as its smallest other value plus a 1-bit mask, and
    put back at unpack as the tensor's smallest value (exact where masked positions hold one
    value; else exponentiated to zero next to any unmasked one). Needed because the codec
    decodes a group holding a non-finite value, or overflowing its statistics, as NaN, so a
    fault never becomes a finite wrong gradient; a mask value is not a fault. On a GPU this is
    done whether or not a masked value is there (looking would synchronise); on the CPU only
    where one is. The copy decodes to the tensor itself, so other saves may share it."""

    for_its_op_alone = False

    @staticmethod
    def store(x: torch.Tensor) -> tuple[torch.Tensor, _MinusInfinity | None]:
        # Half the dtype's most negative value: no sum of scores reaches it.
        masked = x <= torch.finfo(x.dtype).min / 2
        if x.device.type == "cpu" and not masked.any():
            return x, None  # on the CPU, looking costs no synchronisation: no mask needed
        low = torch.where(masked, torch.inf, x).amin()
        low = torch.where(low.isinf(), 0.0, low)  # every value masked: any stand-in will do
        return torch.where(masked, low, x), _MinusInfinity(MaskCodec().pack(masked, 0, 0), x.amin())


class _MinusInfinity(NamedTuple):
    mask: object  # a MaskCodec record
    fill: torch.Tensor  # the tensor's smallest value, 0-dim, on its device

    def unpack(self, record) -> torch.Tensor:
        """The tensor backward reads, from the record its stand-in was stored in."""
        return self.restore(record.unpack())

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded.masked_fill_(self.mask.unpack().view(decoded.shape), self.fill)


class FiniteStandIn:
    """What a match partner (:attr:`Decision.match_partner`) stores: its values with NaN and
    infinities as 0, since the codec decodes a group holding a non-finite value as NaN
    throughout, turning its finite neighbours' matches into mismatches. Comparisons still come
    out alike: a NaN matched nothing, and a matched infinity is rebuilt from the same stored 0
    backward compares it with. Other saves read its values, so they do not share this copy."""

    for_its_op_alone = True

    @staticmethod
    def store(x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), None
