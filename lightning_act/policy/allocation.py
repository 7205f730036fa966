"""The bit allocation problem: minimise the estimated gradient variance under a byte budget.

Stochastic rounding noise of different tensors is independent, so the gradient variance is the sum of each
tensor's ``v_i(b_i)`` (``c_i * S(b)`` with ``S(b) = 1 / (2**b - 1)**2`` for a plain quantizer; see
:mod:`lightning_act.policy.estimators`). The budget counts real bytes (``b`` bits per value plus 32 bits of
statistics per group, or the element size for an exact tensor): a multiple-choice knapsack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

EXACT = None  # "keep this tensor as it is"
STATS_BITS_PER_GROUP = 32
_BUDGET_UNITS = 20_000


def quantization_variance(bits: int | None) -> float:
    """``S(b)``: the variance factor of ``bits``-bit stochastic rounding (0 for exact)."""
    return 0.0 if bits is None else 1.0 / float((1 << bits) - 1) ** 2


def storage_bits(bits: int | None, numel: int, groups: int, element_bits: int) -> int:
    """Bits a tensor occupies when stored at ``bits`` (``None``: kept as it is)."""
    return numel * element_bits if bits is None else numel * bits + groups * STATS_BITS_PER_GROUP


def allocate_bits(
    variance: Mapping[str, Mapping[int, float]],
    sizes: Mapping[str, tuple[int, int, int]],
    budget_bits: float,
    candidates: Sequence[int | None],
    floors: Mapping[str, int] | None = None,
) -> dict[str, int | None]:
    """Bits per tensor that minimise the summed gradient variance at an average of bits.

    Args:
        variance: per tensor key, the gradient variance it adds at each bit width (1, 2, 4, 8); a
            tensor without an estimate counts as insensitive, an exact one adds none.
        sizes: ``(numel, groups, element_bits)`` per tensor key to allocate.
        budget_bits: average code bits per value (fractional allowed): the total allowed is what
            uniform quantization at these bits (or each tensor's floor, where higher) would store.
        candidates: the allowed choices, bit widths and/or ``None`` for "keep exact".
        floors: per key, the fewest bits it may get (its narrower candidates are skipped).

    Returns:
        ``{key: bits or None}`` for every key of ``sizes``.
    """
    return allocate_storage(variance, sizes, uniform_storage(sizes, budget_bits, floors or {}), candidates, floors)


def uniform_storage(sizes: Mapping[str, tuple[int, int, int]], bits: float, floors: Mapping[str, int]) -> float:
    """Bits uniform quantization at ``bits`` (or each tensor's floor, where higher) stores, statistics included."""
    return sum(n * max(bits, floors.get(k, 1)) + g * STATS_BITS_PER_GROUP for k, (n, g, _) in sizes.items())


def allocate_storage(
    variance: Mapping[str, Mapping[int, float]],
    sizes: Mapping[str, tuple[int, int, int]],
    allowed: float,
    candidates: Sequence[int | None],
    floors: Mapping[str, int] | None = None,
) -> dict[str, int | None]:
    """Bits per tensor that minimise the summed gradient variance within ``allowed`` bits of storage (other
    arguments as :func:`allocate_bits`'s); each tensor's cheapest choice where even those are over."""
    keys = list(sizes)
    if not keys:
        return {}
    floors = floors or {}
    options = {}
    for k in keys:
        floor = floors.get(k, 1)
        choices = [b for b in candidates if b is None or b >= floor] or [floor]
        options[k] = sorted(
            (
                (storage_bits(b, *sizes[k]), 0.0 if b is None else max(variance.get(k, {}).get(b, 0.0), 0.0), b)
                for b in choices
            ),
            key=lambda option: option[0],
        )
    if sum(options[k][0][0] for k in keys) >= allowed:
        return {k: options[k][0][2] for k in keys}
    # Dynamic programming over the budget in _BUDGET_UNITS units: greedy and Lagrangian solutions flip identical
    # tensors all at once and let a cheap upgrade use up the slack a valuable one needed. Costs are rounded
    # down to whole units, so an answer may overshoot by a unit per tensor: then shrink the capacity and retry.
    unit = allowed / _BUDGET_UNITS
    capacity = _BUDGET_UNITS
    while True:
        chosen, cost = _knapsack(keys, options, unit, capacity)
        if cost <= allowed or capacity == 0:
            return chosen
        capacity = max(capacity - math.ceil((cost - allowed) / unit), 0)


def _knapsack(keys, options, unit: float, capacity: int) -> tuple[dict[str, int | None], int]:
    best = np.zeros(capacity + 1)  # least variance within c units
    picks = []
    for k in keys:
        table = np.full((len(options[k]), capacity + 1), math.inf)
        for j, (cost, var, _) in enumerate(options[k]):
            width = int(cost // unit)
            if width <= capacity:
                table[j, width:] = best[: capacity + 1 - width] + var
        # The first least option per capacity, as argmin(axis=0) picks it, which is slow over a few rows.
        best = table.min(axis=0)
        pick = np.zeros(capacity + 1, dtype=np.int8)
        for j in range(len(table) - 1, -1, -1):
            np.putmask(pick, table[j] == best, j)
        picks.append(pick)
    chosen: dict[str, int | None] = {}
    remaining, total = capacity, 0
    for k, pick in zip(reversed(keys), reversed(picks)):
        cost, _, bits = options[k][int(pick[remaining])]
        chosen[k] = bits
        total += cost
        remaining -= int(cost // unit)
    return {k: chosen[k] for k in keys}, total
