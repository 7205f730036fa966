"""What the eager capture and the compiled graph ops both read at run time: the captures
capturing now, and the mixer their rounding-seed streams draw from. A module of its own, so
that the graph ops (:mod:`~lightning_act.capture.compiled`) need not import the engine that
imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_act.capture.engine import ActivationCapture

_MASK64 = (1 << 64) - 1

#: The captures started and not stopped, innermost last.
CAPTURING: list[ActivationCapture] = []


def capturing_now() -> ActivationCapture | None:
    """The innermost capture capturing now, not paused (None outside any)."""
    for capture in reversed(CAPTURING):
        if not capture._paused:
            return capture
    return None


def splitmix64(x: int) -> int:
    """SplitMix64's output function: a 64-bit value whose bits all depend on all of ``x``'s."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
