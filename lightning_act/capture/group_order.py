"""Which way each saved tensor's quantization groups run: along its last axis (memory
order) or down its columns (``quantize_pack``'s ``column_major``), whichever puts less
rounding noise in it.

Stochastic rounding adds noise of energy ``G r**2 S(b) / 6`` to a group of ``G`` values
spanning ``r``, so a tensor's noise at any width is proportional to the sum of its groups'
squared ranges. Which order makes that sum smaller depends on the data, not the op:

* a transformer's ``(tokens, features)`` activations have a few features much larger than
  the rest; in memory order every group (one token's features) spans them, down the columns
  only their own groups do. On the model-library suite, at 2 bits and the same stored
  bytes, column groups cut the gradient's rounding variance to 0.12-0.84 of memory order's
  on the transformers, RNNs, GIN and MobileNet (0.40);
* rows of very different scale favour memory order instead: a GraphSAGE layer on Cora,
  whose node rows are normalised bag-of-words, had 3.3x the variance with column groups.

So each slot is surveyed once, on the first step it is saved in, before its order is
fixed: both orders' sums of squared ranges are reduced on the device as the tensor is
stored (in memory order), and read in one host transfer when the session stops. Later
steps store the slot in the order that won, if it won by more than :data:`MARGIN`. The
decisions live per model, so the ``with compress_activations(model)`` block of every step
shares them. ``CompressionConfig(group_order="memory")`` turns the survey off.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

#: Column groups must leave at most this share of memory order's noise to be chosen: a
#: near tie keeps memory order, whose reads and writes are contiguous.
MARGIN = 0.9


def range_energy(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum over the whole groups of ``values`` (1-D, in the order they are grouped) of the
    squared range: what the rounding noise scales with. NaN when a group holds NaN or Inf."""
    whole = values.numel() // group_size * group_size
    groups = values[:whole].view(-1, group_size)
    spread = groups.amax(dim=1).float() - groups.amin(dim=1).float()
    return spread.square().sum()


def can_run_down_columns(dense: torch.Tensor, group_size: int) -> bool:
    """A contiguous tensor with matrices of at least 2 x 2 and a few groups to compare."""
    return dense.dim() >= 2 and dense.shape[-1] >= 2 and dense.shape[-2] >= 2 and dense.numel() >= 2 * group_size


class GroupOrders:
    """The group order of each slot of one model at one group size, decided by surveys."""

    _of_model: weakref.WeakKeyDictionary[nn.Module, dict[int, GroupOrders]] = weakref.WeakKeyDictionary()

    def __init__(self, group_size: int):
        self.group_size = group_size
        #: slot -> True where its groups run down its columns.
        self.column_major: dict[str, bool] = {}
        self._surveys: dict[str, torch.Tensor] = {}  # slot -> [memory order's, columns'] energies

    @classmethod
    def of(cls, model: nn.Module | None, group_size: int) -> GroupOrders:
        """The decisions for ``model``'s slots, shared by every capture of it."""
        if model is None:
            return cls(group_size)
        by_group_size = cls._of_model.setdefault(model, {})
        return by_group_size.setdefault(group_size, cls(group_size))

    def order(self, slot: str, dense: torch.Tensor) -> bool:
        """Whether to store ``dense`` (contiguous), saved in ``slot``, column-major; surveys
        the slot while undecided (memory order meanwhile)."""
        decided = self.column_major.get(slot)
        if decided is not None:
            return decided
        if slot not in self._surveys and can_run_down_columns(dense, self.group_size):
            with torch.no_grad():
                columns = dense.transpose(-2, -1).reshape(-1)  # a copy, on the survey step only
                self._surveys[slot] = torch.stack((range_energy(dense.view(-1), self.group_size),
                                                   range_energy(columns, self.group_size)))
        return False

    def settle(self) -> None:
        """Decide every surveyed slot (one host transfer for all of them)."""
        if not self._surveys:
            return
        slots = list(self._surveys)
        energies = torch.stack([self._surveys[slot] for slot in slots]).tolist()
        self._surveys.clear()
        for slot, (memory, columns) in zip(slots, energies):
            # A comparison with NaN (a non-finite activation) is False: memory order.
            self.column_major[slot] = columns < MARGIN * memory
