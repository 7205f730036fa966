"""Per-group stochastic quantization (ActNN's codec, with zero-preserving groups)."""

from __future__ import annotations

import torch

from lightning_act import ops

# The ops' overloads, called directly where the kernels are known to be loaded.
_QUANTIZE_PACK = torch.ops.lightning_act.quantize_pack.default
_UNPACK_DEQUANTIZE = torch.ops.lightning_act.unpack_dequantize.default


class QuantizedTensor:
    """A tensor stored as packed ``bits``-bit codes plus per-group bfloat16 statistics."""

    codec = "quant"
    __slots__ = ("codes", "stats", "bits", "group_size", "shape", "dtype", "matrix")

    def __init__(
        self,
        codes,
        stats,
        bits: int,
        group_size: int,
        shape: torch.Size,
        dtype: torch.dtype,
        matrix: tuple[int, int] = (0, 0),
    ):
        self.codes = codes
        self.stats = stats
        self.bits = bits
        self.group_size = group_size
        self.shape = shape
        self.dtype = dtype
        #: ``(rows, columns)`` of the matrices packed column by column; (0, 0): memory order.
        self.matrix = matrix

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (codes and statistics)."""
        return self.codes.untyped_storage().nbytes() + self.stats.untyped_storage().nbytes()

    def unpack(self) -> torch.Tensor:
        """A new contiguous tensor of the original shape and dtype."""
        # The op overload, not the checked wrapper: packing already loaded this device's kernels,
        # and skipping the wrapper's overhead matters for the many small records a step decodes.
        rows, columns = self.matrix
        flat = _UNPACK_DEQUANTIZE(
            self.codes, self.stats, self.bits, self.group_size, self.shape.numel(), self.dtype, rows, columns
        )
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

    def pack(self, dense: torch.Tensor, bits: int, seed: int, group_axis: int | None = None) -> QuantizedTensor:
        """Quantize a contiguous float tensor; ``seed`` selects the rounding noise. Groups run in memory order,
        or along ``group_axis``: the tensor is read column by column as matrices of ``shape[group_axis]`` rows
        (see :mod:`lightning_act.capture.group_order`)."""
        matrix, source = (0, 0), dense
        if group_axis is not None:
            matrix = (dense.shape[group_axis], dense.shape[group_axis + 1 :].numel())
            source = dense.view(-1, *matrix)
        # detached: the record must not hold the autograd graph of what it stores
        ops.ensure_kernels(source.device)
        codes, stats = _QUANTIZE_PACK(source.detach(), bits, self.group_size, seed, group_axis is not None)
        return QuantizedTensor(codes, stats, bits, self.group_size, dense.shape, dense.dtype, matrix)
