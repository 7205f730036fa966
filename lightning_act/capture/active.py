"""The captures running now, the interface the graph side uses (:class:`Capture`), and the
seed mixer. The graph modules depend on this, not on the engine, so the layers import only down."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from lightning_act.capture.group_order import GroupOrders
    from lightning_act.capture.report import CompressionReport, ReportDelta
    from lightning_act.config import CompressionConfig
    from lightning_act.policy import BitPolicy, SlotInfo

_MASK64 = (1 << 64) - 1


class Capture(Protocol):
    """What the graph side uses of :class:`~lightning_act.capture.engine.ActivationCapture`."""

    paused: bool
    config: CompressionConfig
    policy: BitPolicy
    slots: dict[str, SlotInfo]
    group_orders: GroupOrders
    chooses_group_axes: bool
    estimator: Any
    report: CompressionReport
    #: The probe running now (:meth:`~lightning_act.capture.engine.ActivationCapture.probing`).
    probe: Any

    @property
    def nominal_bits(self) -> int: ...

    def pack(self, t: torch.Tensor) -> Any: ...
    def module_name(self, qualname: str | None) -> str: ...
    def compiling(self) -> None: ...
    def external_storages(self) -> list[int]: ...
    def keeps_alive(self, t: torch.Tensor) -> bool: ...
    def account_compiled(
        self, plan: str, t: torch.Tensor, parts: list[torch.Tensor], kept_alive: bool = False
    ) -> None: ...
    def account_packed(self, delta: ReportDelta, stats: list[torch.Tensor], quantized: Sequence[Any]) -> None: ...


#: The captures started and not stopped, innermost last.
CAPTURING: list[Capture] = []


def capturing_now() -> Capture | None:
    """The innermost capture capturing now, not paused (None outside any)."""
    for capture in reversed(CAPTURING):
        if not capture.paused:
            return capture
    return None


def splitmix64(x: int) -> int:
    """SplitMix64's output function: every output bit depends on every bit of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
