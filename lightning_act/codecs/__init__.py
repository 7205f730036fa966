"""Codecs: each turns a dense tensor into a compact record with ``unpack()``, ``nbytes`` and ``codec`` (its name)."""

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

    Each has ``keeps_zeros`` (zeros decode to zeros and positives to positives, as a ReLU's backward
    needs) and ``unbiased`` (decoded equals original in expectation, so any op may read it).
    """
    if name == "division":
        return DivisionCodec(block=block, group_size=group_size)
    if name == "pool":
        return PoolCodec(kernel=block)
    return GroupQuantCodec(group_size)
