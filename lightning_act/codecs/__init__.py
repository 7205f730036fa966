"""How one saved tensor is stored: each codec turns a dense tensor into a compact record
that can rebuild it, and reports the bytes that record really holds."""

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
    """The codec for floating-point activations named by :class:`CompressionConfig.codec`."""
    if name == "division":
        return DivisionCodec(block=block, group_size=group_size)
    if name == "pool":
        return PoolCodec(kernel=block)
    return GroupQuantCodec(group_size)
