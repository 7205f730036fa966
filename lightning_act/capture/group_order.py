"""Along which axis each saved tensor's quantization groups run: the last (memory order)
or an earlier one (``quantize_pack``'s ``column_major`` over a view of the tensor),
whichever puts the least rounding noise in it.

Stochastic rounding adds noise of energy ``G r**2 S(b) / 6`` to a group of ``G`` values
spanning ``r``, so a tensor's noise at any width is proportional to the sum of its groups'
squared ranges. Which axis makes that sum smallest depends on the data, not the op:

* a transformer's ``(batch, tokens, features)`` activations have a few features much
  larger than the rest; in memory order every group (one token's features) spans them,
  along the tokens only their own groups do. Attention's query, key and value are stored
  as ``(batch, tokens, heads, head features)``: their groups run best along the tokens,
  two axes before the last;
* rows of very different scale favour memory order instead: a GraphSAGE layer on Cora,
  whose node rows are normalised bag-of-words, had 3.3x the variance with groups along the
  nodes.

So each slot is surveyed once, on the first step it is saved in, before its axis is fixed:
for every axis, the sum of squared ranges of the groups that would run along it is reduced
on the device as the tensor is stored (in memory order), and all of them are read in one
host transfer when the session stops. Later steps store the slot along the axis that won,
if it beat memory order by more than :data:`MARGIN`, and unless memory order stores it
exactly: values on their group's grid (its ends, a zero-preserving group's zeros) round to
themselves, so a tensor of a few distinct values, such as Cora's binary features after
dropout, costs nothing in memory order, which the ranges do not tell (they favoured the
nodes' axis there by 26%, for a slower strided read and write of nothing gained). The
expected noise in memory order, :func:`~lightning_act.ops.reference.rounding_variance` at
the slot's width, tells. It is not the measure between axes: the gradient weighs each value
by what backward multiplies it with, and over the model-library suite the ranges chose the
better axis more often (GIN on Cora: 0.13x memory order's gradient variance by the ranges,
1.0x by the expected noise, which favoured memory order by 1.6x).

Groups along axis ``k`` read the tensor as matrices of ``shape[k]`` rows by the product of
the later sizes as columns, column by column: the same bytes, the same kernels, a strided
read and write.

The survey reads each order in pieces of at most a 32nd of the tensor (:func:`survey_piece`):
its temporaries (a reordered copy, the float grid of the expected noise) then stay within
what storing the tensor at a few bits frees, so the step that surveys peaks no higher than
the steps after it, nor than the same step without compression. Reordering the whole tensor
at once raised a 4-layer transformer's first step to 1.76x its steady peak. The
decisions live per model, so the ``with compress_activations(model)`` block of every step
shares them. ``CompressionConfig(group_order="memory")`` turns the survey off.
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
    """Sum over the whole groups of ``values`` (1-D, in the order they are grouped) of the
    squared range: what the rounding noise scales with. NaN when a group holds NaN or Inf."""
    whole = values.numel() // group_size * group_size
    groups = values[:whole].view(-1, group_size)
    spread = groups.amax(dim=1).float() - groups.amin(dim=1).float()
    return spread.square().sum()


def candidate_axes(dense: torch.Tensor, group_size: int) -> list[int]:
    """The axes other than the last that groups could run along: at least 2 long, with at
    least 2 values after them per row, in a tensor of a few groups."""
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
    """``dense``'s whole groups, in the order groups along ``axis`` (None: the last) read it,
    as ``(groups, group_size)`` matrices of about ``piece`` values each. Groups that span two
    pieces are carried over whole; a ragged tail is left out, as :func:`range_energy` leaves it.
    Memory order yields views; another axis, a copy of one piece at a time."""
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
    """The values of ``matrices`` (``(count, rows, columns)``) column by column, a few whole
    matrices, or a few columns of one, at a time (copies)."""
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
        #: Names these decisions in this process, anew whenever decisions are replaced: the
        #: compiled graph ops' C++ side keeps the axes it was told under it.
        self.token = next(self._tokens)
        #: slot -> the axis its groups run along; None: the last (memory order).
        self.axis: dict[str, int | None] = {}
        # slot -> (candidate axes, energies: memory order's expected noise and squared
        # ranges, then each candidate's squared ranges)
        self._surveys: dict[str, tuple[list[int], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: nn.Module | None, group_size: int) -> GroupOrders:
        """The decisions for ``model``'s slots, shared by every capture of it."""
        if model is None:
            return cls(group_size)
        by_group_size = cls._of_model.setdefault(model, {})
        return by_group_size.setdefault(group_size, cls(group_size))

    def order(self, slot: str, dense: torch.Tensor, bits: int) -> int | None:
        """The axis to group ``dense`` (contiguous), saved in ``slot`` at ``bits``, along
        (None: the last); surveys the slot while undecided (memory order meanwhile)."""
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
