"""Along which axis each saved tensor's quantization groups run: the last (memory order) or an
earlier one (``column_major`` over a view: ``shape[k]`` rows by the later sizes, a strided read),
whichever puts the least rounding noise in it.

A group's rounding noise scales with its squared range, and the best axis depends on the data:
outsized features favour groups along the tokens, rows of very different scale memory order. So
each slot is surveyed on the first step it is saved in: per axis, the sum of squared ranges is
reduced on the device, all read in one host transfer when the session stops. Later steps use the
winner if it beats memory order by more than :data:`MARGIN`, unless memory order stores the slot
exactly (values on their group's grid, as binary features, round to themselves: the ranges miss
it, :func:`~lightning_act.ops.reference.rounding_variance` does not). Ranges, not that expected
noise, choose between axes: the gradient weighs each value by what backward multiplies it with.

The survey reads pieces of at most a 32nd of the tensor (:func:`survey_piece`), so its temporaries
fit in what storing the tensor at a few bits frees and the surveying step peaks no higher than
later ones. Decisions live per model. ``CompressionConfig(group_order="memory")`` turns it off.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from lightning_act.ops.reference import rounding_variance

#: Another axis must leave at most this share of memory order's noise to be chosen: a near
#: tie keeps memory order, whose reads and writes are contiguous.
MARGIN = 0.9


def range_energy(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum of the squared ranges of the whole groups of 1-D ``values``: what rounding noise
    scales with. NaN when a group holds NaN or Inf."""
    whole = values.numel() // group_size * group_size
    groups = values[:whole].view(-1, group_size)
    spread = groups.amax(dim=1).float() - groups.amin(dim=1).float()
    return spread.square().sum()


def candidate_axes(dense: torch.Tensor, group_size: int) -> list[int]:
    """The axes other than the last that groups could run along (at least 2 long, with at least
    2 values after them)."""
    if dense.numel() < 2 * group_size:
        return []
    return [axis for axis in range(dense.dim() - 1) if dense.shape[axis] >= 2 and dense.shape[axis + 1 :].numel() >= 2]


#: The most values a survey reads at a time, whatever the tensor's size.
_LARGEST_PIECE = 1 << 20


def survey_piece(numel: int, group_size: int) -> int:
    """Values a survey of a tensor of ``numel`` reads at a time: a 32nd of it (at most
    :data:`_LARGEST_PIECE`), in whole groups."""
    return max(group_size, min(_LARGEST_PIECE, numel // 32) // group_size * group_size)


def grouped_pieces(dense: torch.Tensor, axis: int | None, group_size: int, piece: int) -> Iterator[torch.Tensor]:
    """``dense``'s whole groups along ``axis`` (None: the last) as ``(groups, group_size)``
    matrices of about ``piece`` values; a ragged tail is left out, as :func:`range_energy` does.
    Memory order yields views; another axis, one copied piece at a time."""
    if axis is None or axis == dense.dim() - 1:
        flat = dense.view(-1)
        whole = flat.numel() // group_size * group_size
        for start in range(0, whole, piece):
            yield flat[start : min(start + piece, whole)].view(-1, group_size)
        return
    rows, columns = dense.shape[axis], dense.shape[axis + 1 :].numel()
    matrices = dense.view(-1, rows, columns)
    carry = None
    for values in _column_major_pieces(matrices, piece):
        if carry is not None and carry.numel():
            values = torch.cat([carry, values])
        whole = values.numel() // group_size * group_size
        if whole:
            yield values[:whole].view(-1, group_size)
        carry = values[whole:]


def _column_major_pieces(matrices: torch.Tensor, piece: int) -> Iterator[torch.Tensor]:
    """The values of ``(count, rows, columns)`` ``matrices`` column by column, copied a few
    matrices or columns at a time."""
    count, rows, columns = matrices.shape
    if rows * columns <= piece:
        step = piece // (rows * columns)
        for start in range(0, count, step):
            yield matrices[start : start + step].transpose(1, 2).reshape(-1)
        return
    step = max(1, piece // rows)
    for matrix in matrices:
        for start in range(0, columns, step):
            yield matrix[:, start : start + step].t().reshape(-1)


class GroupOrders:
    """The group axis of each slot of one model at one group size, decided by surveys."""

    _of_model: weakref.WeakKeyDictionary[nn.Module, dict[int, GroupOrders]] = weakref.WeakKeyDictionary()
    _tokens = itertools.count(1)

    def __init__(self, group_size: int):
        self.group_size = group_size
        #: Names these decisions, anew whenever they are replaced: the graph ops' C++ side
        #: keeps the axes it was told under it.
        self.token = next(self._tokens)
        #: slot -> the axis its groups run along; None: the last (memory order).
        self.axis: dict[str, int | None] = {}
        # slot -> (candidate axes, energies as :meth:`_energies` returns them)
        self._surveys: dict[str, tuple[list[int], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: nn.Module | None, group_size: int) -> GroupOrders:
        """The decisions for ``model``'s slots, shared by every capture of it."""
        if model is None:
            return cls(group_size)
        by_group_size = cls._of_model.setdefault(model, {})
        return by_group_size.setdefault(group_size, cls(group_size))

    def order(self, slot: str, dense: torch.Tensor, bits: int) -> int | None:
        """The axis to group contiguous ``dense`` along (None: the last); surveys the slot while
        undecided, in memory order meanwhile."""
        if slot in self.axis:
            return self.axis[slot]
        if slot not in self._surveys and (axes := candidate_axes(dense, self.group_size)):
            with torch.no_grad():  # on the survey step only, a piece at a time
                self._surveys[slot] = (axes, self._energies(dense, axes, bits))
        return None

    def _energies(self, dense: torch.Tensor, axes: list[int], bits: int) -> torch.Tensor:
        """Memory order's expected noise at ``bits`` and squared ranges, then each of
        ``axes``'s squared ranges, summed on the device."""
        size, piece = self.group_size, survey_piece(dense.numel(), self.group_size)
        noise = sum(
            rounding_variance(groups.view(-1), bits, size) for groups in grouped_pieces(dense, None, size, piece)
        )
        energies = [noise]
        for axis in (None, *axes):
            energies.append(
                sum(range_energy(groups.view(-1), size) for groups in grouped_pieces(dense, axis, size, piece))
            )
        return torch.stack(energies)

    def restore(self, axes: dict[str, int | None]) -> None:
        """Take over decisions made before (a resumed run's checkpoint)."""
        self.axis.update(axes)
        self.token = next(self._tokens)

    def settle(self) -> None:
        """Decide every surveyed slot (one host transfer for all of them)."""
        if not self._surveys:
            return
        slots = list(self._surveys)
        energies = torch.cat([self._surveys[slot][1] for slot in slots]).tolist()
        start = 0
        for slot in slots:
            axes = self._surveys[slot][0]
            noise, memory, *others = energies[start : start + 2 + len(axes)]
            start += 2 + len(axes)
            best = min(range(len(axes)), key=lambda i: others[i])
            # A comparison with NaN (a non-finite activation) is False: memory order.
            self.axis[slot] = axes[best] if noise > 0 and others[best] < MARGIN * memory else None
        self._surveys.clear()
