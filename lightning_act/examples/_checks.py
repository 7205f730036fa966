"""Argument checks the example models share, so that their errors read alike."""

from __future__ import annotations


def check_positive(**sizes: int) -> None:
    """Raises ValueError naming the first of ``sizes`` that is below 1."""
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1")


def check_fraction(name: str, value: float) -> None:
    """Raises ValueError unless ``value`` (a dropout or smoothing probability) is in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1)")
