"""How one saved tensor is stored: each codec turns a dense tensor into a compact record
that can rebuild it, and reports the bytes that record really holds."""

from lightning_act.codecs.quant import GroupQuantCodec, QuantizedTensor

__all__ = ["GroupQuantCodec", "QuantizedTensor"]
