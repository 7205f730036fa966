"""DIVISION's dual-precision codec (ICML 2023): a 16-bit low-frequency component plus a quantized residual.

Backward passes mostly need an activation's low-frequency content. The codec keeps the mean of every
``block x block`` tile in 16 bits (the LFC) and quantizes the residual ``x - upsample(LFC)`` stochastically at
``bits`` per value: the residual's range is narrower, so the same bits leave less noise, and decoding is unbiased.

Residual groups are ``group_size`` consecutive values in memory order, those of
:class:`~lightning_act.codecs.GroupQuantCodec`, rather than the paper's one group per plane: this reuses the
quantizer's format, handles planes of any size and follows the residual's local range more closely. Groups that
span several small planes mix channels, which costs little once each tile's mean is removed.
"""

from __future__ import annotations

import torch

from lightning_act import ops
from lightning_act.codecs.quant import GroupQuantCodec, QuantizedTensor


class DivisionTensor:
    """A tensor stored as a per-tile 16-bit mean plus a quantized residual."""

    codec = "division"
    __slots__ = (
        "lfc",
        "codes",
        "stats",
        "bits",
        "group_size",
        "height",
        "width",
        "block_h",
        "block_w",
        "shape",
        "dtype",
    )

    def __init__(
        self,
        lfc: torch.Tensor,
        codes: torch.Tensor,
        stats: torch.Tensor,
        bits: int,
        group_size: int,
        height: int,
        width: int,
        block_h: int,
        block_w: int,
        shape: torch.Size,
        dtype: torch.dtype,
    ):
        self.lfc = lfc
        self.codes = codes
        #: The residual's group statistics; groups that held NaN or Inf are NaN here.
        self.stats = stats
        self.bits = bits
        self.group_size = group_size
        #: Size of the planes the tiles cut (``H x W``, or ``T x D`` for a sequence).
        self.height = height
        self.width = width
        self.block_h = block_h
        self.block_w = block_w
        self.shape = shape
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (LFC, residual codes and statistics)."""
        return sum(t.untyped_storage().nbytes() for t in (self.lfc, self.codes, self.stats))

    def unpack(self) -> torch.Tensor:
        """A new contiguous tensor of the original shape and dtype."""
        planes = ops.division_unpack(
            self.lfc,
            self.codes,
            self.stats,
            self.height,
            self.width,
            self.block_h,
            self.block_w,
            self.bits,
            self.group_size,
            self.dtype,
        )
        return planes.view(self.shape)


class DivisionCodec:
    """DIVISION: 16-bit tile means plus a residual quantized at ``bits`` per value.

    * 4-D ``(N, C, H, W)`` with ``H, W >= block``: each of the ``N * C`` planes is cut into
      ``block x block`` tiles (edge tiles average only the pixels they hold);
    * 3-D ``(N, T, D)`` with ``T >= block``: each feature is averaged over runs of ``block``
      positions along ``T``;
    * anything else (where the LFC would cost more than it removes) is stored as
      :class:`~lightning_act.codecs.GroupQuantCodec` stores it, at the same ``bits``.

    A ``channels_last`` activation given in memory order ``(N, H, W, C)`` is still stored
    unbiasedly, only with tiles over ``(W, C)``, which compress less well.

    Args:
        block: tile side (run length for 3-D activations), >= 2.
        lfc_dtype: dtype of the tile means: ``torch.bfloat16`` (float32's range), ``torch.float16`` (3 more
            mantissa bits; means beyond 65504 become NaN groups) or ``torch.float32``.
        group_size: residual values sharing one (low, step) pair, a power of two in [8, 65536].

    Raises:
        ValueError: a setting is out of range; the message names it and what is allowed.
    """

    name = "division"
    #: The tile mean plus a residual does not decode zeros to zeros.
    keeps_zeros = False
    #: The residual is rounded stochastically: decoding is unbiased.
    unbiased = True

    def __init__(self, block: int = 8, lfc_dtype: torch.dtype = torch.bfloat16, group_size: int = 256):
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            raise ValueError(f"block={block!r} must be an int >= 2")
        if lfc_dtype not in ops.LFC_DTYPES:
            allowed = ", ".join(str(dtype) for dtype in ops.LFC_DTYPES)
            raise ValueError(f"lfc_dtype={lfc_dtype!r} is not supported; allowed: {allowed}")
        ops.check_quant_args(2, group_size)
        self.block = block
        self.lfc_dtype = lfc_dtype
        self.group_size = group_size
        self._plain = GroupQuantCodec(group_size)

    def planes(self, shape: torch.Size) -> tuple[int, int, int, int, int] | None:
        """``(planes, height, width, block_h, block_w)`` of a shape, or None where it falls back."""
        if len(shape) == 4 and shape[2] >= self.block and shape[3] >= self.block:
            return shape[0] * shape[1], shape[2], shape[3], self.block, self.block
        if len(shape) == 3 and shape[1] >= self.block:
            return shape[0], shape[1], shape[2], self.block, 1
        return None

    def pack(self, dense: torch.Tensor, bits: int, seed: int) -> DivisionTensor | QuantizedTensor:
        """Store a contiguous float tensor; ``seed`` selects the residual's rounding noise."""
        layout = self.planes(dense.shape)
        if layout is None:
            return self._plain.pack(dense, bits, seed)
        planes, height, width, block_h, block_w = layout
        lfc, codes, stats = ops.division_pack(
            dense.detach().view(planes, height, width), block_h, block_w, bits, self.group_size, seed, self.lfc_dtype
        )
        return DivisionTensor(
            lfc, codes, stats, bits, self.group_size, height, width, block_h, block_w, dense.shape, dense.dtype
        )
