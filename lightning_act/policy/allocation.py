"""The bit allocation problem: minimise the estimated gradient variance under a byte budget.

The noise that stochastic rounding adds to different tensors is independent, so the
gradient variance is the sum of what each tensor adds at its bit width, ``v_i(b_i)``
(``c_i * S(b)`` with ``S(b) = 1 / (2**b - 1)**2`` for a plain quantizer; the estimators
measure or model ``v_i`` per bit width, see :mod:`lightning_act.policy.estimators`). The budget
counts real bytes: ``b`` bits per value plus 32 bits of statistics per group, or the
original element size for a tensor kept exact. The problem is solved through its
Lagrangian: for a price ``lam`` on bytes each tensor independently picks
``argmin_b v_i(b) + lam * cost_i(b)``; bisection finds the lowest price that fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

EXACT = None  # "keep this tensor as it is"
STATS_BITS_PER_GROUP = 32


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
) -> dict[str, int | None]:
    """Bits per tensor that minimise the summed gradient variance within the budget.

    Args:
        variance: per tensor key, the estimated gradient variance it adds at each bit
            width (keys 1, 2, 4, 8); a tensor without an estimate counts as insensitive, and
            a tensor kept exact adds none.
        sizes: ``(numel, groups, element_bits)`` per tensor key; these are allocated.
        budget_bits: average code bits per value; the allowed total is what every tensor
            would occupy at this many bits, statistics included (fractional allowed).
        candidates: the allowed choices, bit widths and/or ``None`` for "keep exact".

    Returns:
        The chosen bits (or ``None``) per key of ``sizes``.
    """
    keys = list(sizes)
    if not keys:
        return {}
    allowed = sum(n * budget_bits + g * STATS_BITS_PER_GROUP for n, g, _ in sizes.values())
    options = {
        k: sorted(
            (
                (storage_bits(b, *sizes[k]), 0.0 if b is None else max(variance.get(k, {}).get(b, 0.0), 0.0), b)
                for b in candidates
            ),
            key=lambda option: option[0],
        )
        for k in keys
    }

    def choose(price: float) -> tuple[dict[str, int | None], float]:
        chosen, used = {}, 0
        for k in keys:  # ties go to the cheaper option
            cost, _, bits = min(options[k], key=lambda o: (o[1] + price * o[0], o[0]))
            chosen[k] = bits
            used += cost
        return chosen, used

    # Choices only change at the prices where two options of one tensor tie, and the bytes
    # used never grow with the price: binary search over those breakpoints is exact.
    prices = sorted(
        {0.0}
        | {
            (va - vb) / (cb - ca)
            for k in keys
            for (ca, va, _) in options[k]
            for (cb, vb, _) in options[k]
            if cb > ca and va > vb
        }
    )
    lo, hi = 0, len(prices) - 1
    if choose(prices[hi])[1] > allowed:
        return choose(prices[hi])[0]  # even the cheapest choice is over budget
    while lo < hi:
        mid = (lo + hi) // 2
        if choose(prices[mid])[1] <= allowed:
            hi = mid
        else:
            lo = mid + 1
    return choose(prices[lo])[0]
