"""How one saved tensor is stored: each codec turns a dense tensor into a compact record
that can rebuild it (``unpack``), reports the bytes that record really holds (``nbytes``)
and names how it is stored (``codec``, as the per-module report shows it)."""

from lightning_act.codecs.division import DivisionCodec, DivisionTensor
from lightning_act.codecs.exact import IndexCodec, MaskCodec, SignMaskCodec, StoredTensor
from lightning_act.codecs.pool import PoolCodec, PooledTensor
from lightning_act.codecs.quant import GroupQuantCodec, QuantizedTensor

__all__ = [
    "DivisionCodec",
    "DivisionTensor",
    "GroupQuantCodec",
    "IndexCodec",
    "MaskCodec",
    "PoolCodec",
    "PooledTensor",
    "QuantizedTensor",
    "SignMaskCodec",
    "StoredTensor",
    "make_codec",
]


def make_codec(name: str, group_size: int, block: int):
    """The codec for floating-point activations named by :class:`CompressionConfig.codec`.

    Every one has ``keeps_zeros``: whether zeros decode to exact zeros and positive values
    to positive ones, which a ReLU output needs (its backward reads ``out > 0``); and
    ``unbiased``: whether a decoded tensor equals the original in expectation, so that any
    op may read it (a pooled copy serves only the op it was made for).
    """
    if name == "division":
        return DivisionCodec(block=block, group_size=group_size)
    if name == "pool":
        return PoolCodec(kernel=block)
    return GroupQuantCodec(group_size)
