"""Lossless codecs: boolean masks at 1 bit per value, integer tensors at the fewest bits their range needs, and
a 1-bit sign mask for tensors whose consumer only asks ``x > 0``.

Sub-byte codes are packed *planar* (:mod:`lightning_act.ops.layout`), which PyTorch vectorizes on any device.
"""

from __future__ import annotations

import torch

from lightning_act.ops.layout import pack_bit_fields, unpack_bit_fields

__all__ = [
    "INDEX_DTYPES",
    "INDEX_WIDTHS",
    "IndexCodec",
    "IndexTensor",
    "MaskCodec",
    "MaskTensor",
    "SignMaskCodec",
    "SignMaskTensor",
    "StoredTensor",
    "index_width",
]

#: Integer dtypes :class:`IndexCodec` stores.
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
#: Code widths :class:`IndexCodec` chooses from, narrowest first.
INDEX_WIDTHS = (1, 2, 4, 8, 16, 32)
_WIDE_CODE_DTYPES = {16: torch.int16, 32: torch.int32}


def _no_stats(device: torch.device) -> torch.Tensor:
    """Empty ``[0, 2]`` statistics: a lossless record holds no non-finite group."""
    return torch.empty(0, 2, dtype=torch.bfloat16, device=device)


class StoredTensor:
    """A tensor kept as it is (codecs use it where compressing would not pay)."""

    codec = "stored"
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (the whole storage of the tensor it holds)."""
        return self.tensor.untyped_storage().nbytes()

    @property
    def stats(self) -> torch.Tensor:
        """No group statistics: empty, so nothing is counted as non-finite."""
        return _no_stats(self.tensor.device)

    def unpack(self) -> torch.Tensor:
        """The tensor itself, not a copy: backward only reads it, and a copy would hold it twice."""
        return self.tensor


class MaskTensor:
    """A boolean tensor stored at 1 bit per value."""

    codec = "mask"
    __slots__ = ("packed", "shape")

    def __init__(self, packed: torch.Tensor, shape: torch.Size):
        self.packed = packed
        self.shape = shape

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (``ceil(numel / 8)``)."""
        return self.packed.untyped_storage().nbytes()

    @property
    def stats(self) -> torch.Tensor:
        """No group statistics: empty, so nothing is counted as non-finite."""
        return _no_stats(self.packed.device)

    def unpack(self) -> torch.Tensor:
        """The original boolean tensor, bit for bit (a new tensor)."""
        return (
            unpack_bit_fields(self.packed, 1, planar=True, numel=self.shape.numel()).view(torch.bool).view(self.shape)
        )


class MaskCodec:
    """Stores boolean tensors (ReLU and dropout masks, comparison results) losslessly at 1 bit per value.

    ``bits`` and ``seed`` of :meth:`pack` are ignored.
    """

    name = "mask"

    def pack(self, dense: torch.Tensor, bits: int, seed: int) -> MaskTensor:
        """Pack a contiguous boolean tensor.

        Raises:
            ValueError: ``dense`` is not boolean or not contiguous.
        """
        if dense.dtype != torch.bool:
            raise ValueError(f"MaskCodec: dtype {dense.dtype} is not supported; allowed: torch.bool")
        if not dense.is_contiguous():
            raise ValueError("MaskCodec: the tensor must be contiguous")
        return MaskTensor(pack_bit_fields(dense.reshape(-1).view(torch.uint8), 1, planar=True), dense.shape)


class SignMaskTensor:
    """``x > 0`` at 1 bit per value, decoded as 0/1 in the original dtype (divided by ``divisor`` if given);
    or ``low < x < high``, decoded as the interval's midpoint inside and ``high + (high - low)`` outside."""

    codec = "sign_mask"
    __slots__ = ("mask", "dtype", "divisor", "interval")

    def __init__(
        self,
        mask: MaskTensor,
        dtype: torch.dtype,
        divisor: float | None = None,
        interval: tuple[float, float] | None = None,
    ):
        self.mask = mask
        self.dtype = dtype
        self.divisor = divisor
        self.interval = interval

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (``ceil(numel / 8)``)."""
        return self.mask.nbytes

    @property
    def stats(self) -> torch.Tensor:
        """No group statistics: empty (NaN, being not ``> 0``, is stored as 0)."""
        return self.mask.stats

    def unpack(self) -> torch.Tensor:
        """A new tensor of the original dtype, decoded as the class describes."""
        values = self.mask.unpack().to(self.dtype)
        if self.interval is not None:
            low, high = self.interval
            outside = high + (high - low)
            return values.mul_((low + high) / 2 - outside).add_(outside)
        return values if self.divisor is None else values.div_(self.divisor)


class SignMaskCodec:
    """Stores only ``x > 0`` of a float tensor, or whether ``x`` lies strictly inside an interval, at 1 bit per
    value.

    Exact only for a consumer that reads nothing but that mask: LeakyReLU's backward
    (``grad * (x > 0 ? 1 : slope)``); with an interval, ReLU6, Hardtanh and Hardsigmoid; with
    ``divisor = 1 - p``, dropout's CPU noise ``bernoulli(1 - p) / (1 - p)`` (decoding repeats the
    division in the same dtype). Any other consumer gets a wrong tensor, so use it only for a
    tensor saved by such an op (see :mod:`lightning_act.optrack`), never for one a second op
    also saved. NaN decodes to 0. ``bits`` and ``seed`` of :meth:`pack` are ignored.
    """

    name = "sign_mask"

    def pack(
        self,
        dense: torch.Tensor,
        bits: int,
        seed: int,
        divisor: float | None = None,
        interval: tuple[float, float] | None = None,
    ) -> SignMaskTensor:
        """Keep ``x > 0`` of a contiguous float tensor, or ``low < x < high`` for ``interval = (low, high)``.

        Raises:
            ValueError: ``dense`` is not floating point, or the interval is empty.
        """
        if not dense.is_floating_point():
            raise ValueError(f"SignMaskCodec: dtype {dense.dtype} is not supported; allowed: floating-point dtypes")
        if interval is None:
            inside = dense > 0
        elif interval[0] < interval[1]:
            inside = (dense > interval[0]) & (dense < interval[1])
        else:
            raise ValueError(f"SignMaskCodec: interval={interval!r} is empty; allowed: (low, high) with low < high")
        return SignMaskTensor(MaskCodec().pack(inside, bits, seed), dense.dtype, divisor, interval)


class IndexTensor:
    """An integer tensor stored as ``value - offset`` in ``width``-bit codes."""

    codec = "index"
    __slots__ = ("codes", "offset", "width", "shape", "dtype")

    def __init__(self, codes: torch.Tensor, offset: int, width: int, shape: torch.Size, dtype: torch.dtype):
        self.codes = codes
        self.offset = offset
        self.width = width
        self.shape = shape
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (the codes; the offset is a Python int)."""
        return self.codes.untyped_storage().nbytes()

    @property
    def stats(self) -> torch.Tensor:
        """No group statistics: empty, so nothing is counted as non-finite."""
        return _no_stats(self.codes.device)

    def unpack(self) -> torch.Tensor:
        """The original integer tensor, bit for bit (a new tensor)."""
        numel = self.shape.numel()
        codes = (
            self.codes
            if self.width in _WIDE_CODE_DTYPES
            else unpack_bit_fields(self.codes, self.width, planar=True, numel=numel)
        )
        values = codes.to(self.dtype)
        values += self.offset
        return values.view(self.shape)


def index_width(span: int) -> int | None:
    """The narrowest of :data:`INDEX_WIDTHS` that holds ``0 .. span``, or None if none does."""
    return next((width for width in INDEX_WIDTHS if span < 1 << width), None)


def index_layout(low: int, high: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """``(width, offset)`` of :class:`IndexCodec`'s codes for ``low .. high``; None unless narrower than ``dtype``."""
    width = index_width(high - low)
    if width is None or width >= dtype.itemsize * 8:
        return None
    if width not in _WIDE_CODE_DTYPES:
        return width, low
    # Centred so that every code fits the signed code dtype exactly.
    offset = low + (1 << (width - 1))
    return None if offset > torch.iinfo(dtype).max else (width, offset)


class IndexCodec:
    """Stores integer tensors losslessly in the fewest bits their range needs.

    Values are stored as ``value - low`` in the narrowest of 1, 2, 4, 8, 16 or 32 bits that
    holds ``high - low``; a tensor that would not get narrower than its dtype is kept as it is.

    The range sets the output's size, so it must be known on the host: either the caller
    passes ``value_range``, a bound known without reading the data (e.g. from
    :func:`~lightning_act.optrack.saved_index_range`; a bound that does not hold corrupts the
    tensor), or :meth:`pack` measures it with one ``aminmax`` and a device-to-host copy, which
    on a GPU waits for the queue to drain (the capture engine therefore measures only CPU
    tensors). ``bits`` and ``seed`` of :meth:`pack` are ignored.
    """

    name = "index"

    def pack(
        self, dense: torch.Tensor, bits: int, seed: int, value_range: tuple[int, int] | None = None
    ) -> IndexTensor | StoredTensor:
        """Store a contiguous tensor of one of :data:`INDEX_DTYPES`; ``value_range``: ``(low, high)`` bounding
        every value, if known.

        Raises:
            ValueError: another dtype, not contiguous, or ``value_range`` empty or outside the dtype.
        """
        if dense.dtype not in INDEX_DTYPES:
            allowed = ", ".join(str(dtype) for dtype in INDEX_DTYPES)
            raise ValueError(f"IndexCodec: dtype {dense.dtype} is not supported; allowed: {allowed}")
        if not dense.is_contiguous():
            raise ValueError("IndexCodec: the tensor must be contiguous")
        if dense.numel() == 0:
            return StoredTensor(dense)
        info = torch.iinfo(dense.dtype)
        if value_range is None:
            low, high = torch.stack(torch.aminmax(dense)).tolist()
        else:
            low, high = value_range
            if not info.min <= low <= high <= info.max:
                raise ValueError(
                    f"IndexCodec: value_range={value_range!r} must satisfy {info.min} <= low <= high <= {info.max}"
                )
        layout = index_layout(low, high, dense.dtype)
        if layout is None:
            return StoredTensor(dense)
        width, offset = layout
        flat = dense.reshape(-1)
        if width in _WIDE_CODE_DTYPES:
            codes = (flat - offset).to(_WIDE_CODE_DTYPES[width])
        else:
            # uint8 conversion and subtraction both work mod 256, and value - low is below 256.
            codes = flat.to(torch.uint8) - low % 256
            if width < 8:
                codes = pack_bit_fields(codes, width, planar=True)
        return IndexTensor(codes, offset, width, dense.shape, dense.dtype)
