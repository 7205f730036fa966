"""Where values sit in storage: groups, tiles and bit fields, shared by the reference, the fakes and the codecs.

Codes narrower than a byte are packed ``k = 8 // bits`` to a byte, code ``j`` of a byte at bit offset
``j * bits``, in one of two orders:

* *interleaved*: byte ``i`` holds codes ``k * i`` onwards, consecutive ones (the quantizer's format);
* *planar*: for ``n`` codes padded to ``k * m`` (``m = ceil(n / k)``), byte ``i`` holds codes
  ``i, i + m, ..., i + (k - 1) * m``. Every field is then a contiguous slice, which PyTorch vectorizes,
  so the lossless codecs, which pack with PyTorch alone, use it.
"""

from __future__ import annotations

import torch

__all__ = ["num_groups", "pack_bit_fields", "tile_grid", "unpack_bit_fields", "upsample_tiles"]


def num_groups(numel: int, group_size: int) -> int:
    """Groups of ``group_size`` that hold ``numel`` values; the last one may be partial."""
    return -(-numel // group_size)


def tile_grid(height: int, width: int, block_h: int, block_w: int) -> tuple[int, int]:
    """Tiles per plane along each axis; edge tiles count even when partial."""
    return -(-height // block_h), -(-width // block_w)


def _fields(codes: torch.Tensor, per_byte: int, planar: bool) -> torch.Tensor:
    """``[per_byte, bytes]`` view: row ``j`` holds the codes that go to bit field ``j``."""
    return codes.view(per_byte, -1) if planar else codes.view(-1, per_byte).t()


def pack_bit_fields(codes: torch.Tensor, bits: int, planar: bool) -> torch.Tensor:
    """Packs a 1-D uint8 tensor of codes below ``2**bits`` (bits 1, 2, 4 or 8). Interleaved packing needs a
    multiple of ``8 // bits`` codes; planar packing pads with zero codes."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padding = -codes.numel() % per_byte
    if padding and planar:
        codes = torch.cat((codes, codes.new_zeros(padding)))
    fields = _fields(codes, per_byte, planar)
    packed = fields[0].clone()
    for field in range(1, per_byte):
        packed |= fields[field] << (field * bits)
    return packed


def unpack_bit_fields(packed: torch.Tensor, bits: int, planar: bool, numel: int | None = None) -> torch.Tensor:
    """The first ``numel`` (default: all) uint8 codes of :func:`pack_bit_fields`'s output."""
    if bits == 8:
        return packed if numel is None else packed[:numel]
    per_byte = 8 // bits
    codes = torch.empty(packed.numel() * per_byte, dtype=torch.uint8, device=packed.device)
    fields = _fields(codes, per_byte, planar)
    mask = (1 << bits) - 1
    for field in range(per_byte):
        torch.bitwise_and(packed >> (field * bits), mask, out=fields[field])
    return codes if numel is None else codes[:numel]


def upsample_tiles(means: torch.Tensor, height: int, width: int, tile_h: int, tile_w: int) -> torch.Tensor:
    """``[..., height, width]``: every pixel gets the value of its tile in ``means[..., tiles_h, tiles_w]``."""
    rows = torch.arange(height, device=means.device) // tile_h
    columns = torch.arange(width, device=means.device) // tile_w
    return means[..., rows[:, None], columns[None, :]]
