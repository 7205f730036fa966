"""The validated settings of activation compression: one place that checks every knob."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_act.ops.validation import SUPPORTED_BITS, check_quant_args

CODECS = ("quant", "division", "pool")
GROUP_ORDERS = ("auto", "memory")


@dataclass(frozen=True)
class CompressionConfig:
    """How saved activations are stored.

    Args:
        bits: bits per stored value, one of 1, 2, 4, 8.
        group_size: consecutive values sharing one (low, step) pair, a power of two in [8, 65536];
            smaller groups track the data more closely, at 32 bits of statistics each.
        min_numel: tensors with fewer elements are kept as they are (little to save, a launch each).
        seed: seeds the rounding noise, a counter-based stream of its own: torch's global
            generator is never drawn from.
        codec: how floating-point activations are stored: ``"quant"`` (per-group stochastic
            quantization at ``bits``), ``"division"`` (DIVISION: a 16-bit ``block`` x ``block``
            average plus the residual at ``bits``, for conv and sequence activations, else
            ``"quant"``) or ``"pool"`` (a ``block`` x ``block`` average-pooled copy; lossy and
            biased, see :mod:`lightning_act.codecs.pool`). Masks and indices are always stored
            losslessly in the fewest bits they need.
        block: DIVISION's low-frequency tile, or the pool codec's kernel (>= 2).
        group_order: ``"auto"`` runs each tensor's quantizer groups along the last axis or the one
            before it, whichever rounds with less noise on its first step
            (:mod:`lightning_act.capture.group_order`); ``"memory"`` always along the last.
        unfused_recurrent: run ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` through aten's per-step ops
            instead of the fused oneDNN/cuDNN kernel, whose opaque workspace must be kept whole:
            more time, less memory (``docs/reference.md``, "Recurrent layers").

    Raises:
        ValueError: a setting is out of range; the message names it and what is allowed.
    """

    bits: int = 2
    group_size: int = 256
    min_numel: int = 2048
    seed: int = 0
    codec: str = "quant"
    block: int = 8
    group_order: str = "auto"
    unfused_recurrent: bool = False

    def __post_init__(self) -> None:
        if self.group_order not in GROUP_ORDERS:
            raise ValueError(f"group_order={self.group_order!r} is not supported; allowed: {', '.join(GROUP_ORDERS)}")
        if self.codec not in CODECS:
            raise ValueError(f"codec={self.codec!r} is not supported; allowed: {', '.join(CODECS)}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2:
            raise ValueError(f"block={self.block!r} must be an int >= 2")
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not supported; allowed: {', '.join(map(str, SUPPORTED_BITS))}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"group_size={self.group_size!r} must be an int, a power of two in [8, 65536]")
        check_quant_args(self.bits, self.group_size)
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel={self.min_numel!r} must be an int >= 0")
        if not isinstance(self.unfused_recurrent, bool):
            raise ValueError(f"unfused_recurrent={self.unfused_recurrent!r} must be True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**63)")
