"""Per-group stochastic quantization (ActNN's codec, with zero-preserving groups)."""

from __future__ import annotations

import torch

from lightning_act import ops


class QuantizedTensor:
    """A tensor stored as packed ``bits``-bit codes plus per-group bfloat16 statistics."""

    codec = "quant"
    __slots__ = ("codes", "stats", "bits", "group_size", "shape", "dtype", "column_major")

    def __init__(self, codes, stats, bits: int, group_size: int, shape: torch.Size, dtype: torch.dtype,
                 column_major: bool = False):
        self.codes = codes
        self.stats = stats
        self.bits = bits
        self.group_size = group_size
        self.shape = shape
        self.dtype = dtype
        self.column_major = column_major

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (codes and statistics)."""
        return self.codes.untyped_storage().nbytes() + self.stats.untyped_storage().nbytes()

    def unpack(self) -> torch.Tensor:
        """A new contiguous tensor of the original shape and dtype."""
        numel = self.shape.numel()
        matrix = self.shape[-2:] if self.column_major else (0, 0)
        flat = ops.unpack_dequantize(self.codes, self.stats, self.bits, self.group_size, numel, self.dtype, *matrix)
        return flat.view(self.shape)


class GroupQuantCodec:
    """Stores a tensor at ``bits`` per value in groups of ``group_size`` consecutive values.

    Args:
        group_size: values per group, a power of two in [8, 65536].
    """

    name = "quant"
    #: Exact zeros decode to exact zeros and positive values to positive ones (at 2 bits or
    #: more: zero-preserving groups), so a ReLU output keeps its backward mask.
    keeps_zeros = True
    #: Rounding is stochastic: a decoded tensor equals the original in expectation.
    unbiased = True

    def __init__(self, group_size: int = 256):
        ops.check_quant_args(2, group_size)
        self.group_size = group_size

    def pack(self, dense: torch.Tensor, bits: int, seed: int, column_major: bool = False) -> QuantizedTensor:
        """Quantize a contiguous float tensor; ``seed`` selects the rounding noise. With
        ``column_major`` (a tensor of at least 2 dimensions) the groups run down the columns
        of its last two axes (see :mod:`lightning_act.capture.group_order`)."""
        # detached: the record must not hold the autograd graph of what it stores
        codes, stats = ops.quantize_pack(dense.detach(), bits, self.group_size, seed, column_major)
        return QuantizedTensor(codes, stats, bits, self.group_size, dense.shape, dense.dtype, column_major)
