"""DIVISION's dual-precision ops: a 16-bit low-frequency component plus a quantized residual.

A map is read as ``planes`` independent ``height x width`` planes (``N * C`` planes of a
convolution activation; for a ``(N, T, D)`` sequence activation, ``N`` planes of ``T x D``
with one-column tiles, so only the sequence axis is pooled). Each plane is cut into tiles of
``block_h x block_w``; tiles on the bottom and right edges hold only the rows and columns
the plane really has.

Storage format of ``division_pack`` (shared with ``csrc/division.h``):

* ``lfc[p, i, j]``: the mean of tile ``(i, j)`` of plane ``p`` over its *real* pixels,
  rounded (to nearest even) to ``lfc_dtype``. The sum runs in float32 in a fixed order, row
  by row and left to right within the tile, starting from +0.0, and is divided once by the
  tile's pixel count; that order is part of the format, so the kernels reproduce the
  reference bit for bit;
* ``hfc = x - upsample(lfc)``, computed in float32 against the *rounded* LFC (so the LFC's
  rounding error moves into the residual instead of biasing the result), stored exactly
  as :func:`lightning_act.ops.quantize_pack` stores a float32 tensor: the same groups of
  ``group_size`` consecutive values in memory order, the same statistics, the same noise
  stream of ``seed``;
* ``division_unpack`` returns ``upsample(lfc) + dequantize(hfc)`` (one float32 addition)
  converted to the requested dtype. Stochastic rounding of the residual is unbiased, so
  the decoded tensor is an unbiased estimate of ``x``.

A tile holding NaN or Inf has a non-finite mean, which makes every residual of the tile
non-finite and every group touching it a NaN group (counted by ``count_nonfinite_groups``):
a non-finite activation decodes to NaN, never to a finite, wrong value. The same holds for
a finite tile whose float32 sum overflows (values near 3e38), and for a ``float16`` LFC of a
mean beyond 65504: use the default ``bfloat16`` (float32's range) for such data.
"""

from __future__ import annotations

import torch

from lightning_act.ops import reference
from lightning_act.ops.extension import ensure_kernels

__all__ = [
    "LFC_DTYPES",
    "check_division_args",
    "division_pack",
    "division_unpack",
    "reference_pack",
    "reference_unpack",
    "tile_grid",
]

#: Dtypes the low-frequency component can be stored in.
LFC_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_LIBRARY = torch.library.Library("lightning_act", "FRAGMENT")
_LIBRARY.define(
    "division_pack(Tensor input, int block_h, int block_w, int bits, int group_size, int seed, ScalarType lfc_dtype)"
    " -> (Tensor lfc, Tensor codes, Tensor stats)"
)
_LIBRARY.define(
    "division_unpack(Tensor lfc, Tensor codes, Tensor stats, int height, int width, int block_h, int block_w,"
    " int bits, int group_size, ScalarType dtype) -> Tensor"
)


def tile_grid(height: int, width: int, block_h: int, block_w: int) -> tuple[int, int]:
    """Tiles per plane along each axis; edge tiles count even when partial."""
    return -(-height // block_h), -(-width // block_w)


def check_division_args(block_h: int, block_w: int, bits: int, group_size: int) -> None:
    """Raises ValueError naming the first bad argument and what is allowed."""
    reference.check_quant_args(bits, group_size)
    for name, block in (("block_h", block_h), ("block_w", block_w)):
        if block < 1:
            raise ValueError(f"{name}={block!r} must be >= 1")


def _tile_means(planes: torch.Tensor, block_h: int, block_w: int) -> torch.Tensor:
    """float32 ``[planes, tiles_h, tiles_w]`` means over real pixels, summed in the format's order."""
    count, height, width = planes.shape
    tiles_h, tiles_w = tile_grid(height, width, block_h, block_w)
    # Zero padding leaves every sum unchanged: the sum starts at +0.0 and never becomes -0.0
    # (round-to-nearest gives +0.0 for x + (-x)), and adding +0.0 to anything else is exact.
    padded = torch.nn.functional.pad(planes.float(), (0, tiles_w * block_w - width, 0, tiles_h * block_h - height))
    tiles = padded.view(count, tiles_h, block_h, tiles_w, block_w)
    total = torch.zeros(count, tiles_h, tiles_w, dtype=torch.float32, device=planes.device)
    for row in range(block_h):
        for column in range(block_w):
            total = total + tiles[:, :, row, :, column]
    rows = torch.clamp(height - torch.arange(tiles_h, device=planes.device) * block_h, max=block_h)
    columns = torch.clamp(width - torch.arange(tiles_w, device=planes.device) * block_w, max=block_w)
    pixels = (rows[:, None] * columns[None, :]).to(torch.float32)
    return total / pixels


def _upsample(lfc: torch.Tensor, height: int, width: int, block_h: int, block_w: int) -> torch.Tensor:
    """float32 ``[planes, height, width]``: each pixel gets its tile's LFC."""
    rows = torch.arange(height, device=lfc.device) // block_h
    columns = torch.arange(width, device=lfc.device) // block_w
    return lfc.float()[:, rows[:, None], columns[None, :]]


def _check_input(x: torch.Tensor, lfc_dtype: torch.dtype) -> None:
    if x.dtype not in reference.FLOAT_DTYPES:
        raise ValueError(f"division_pack: input dtype {x.dtype} is not supported; allowed: float32, float16, bfloat16")
    if x.dim() != 3:
        raise ValueError(f"division_pack: input must be 3-D [planes, height, width]; got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("division_pack: input must be contiguous")
    if lfc_dtype not in LFC_DTYPES:
        raise ValueError(f"division_pack: lfc_dtype {lfc_dtype} is not supported; allowed: bfloat16, float16, float32")


def reference_pack(x, block_h, block_w, bits, group_size, seed, lfc_dtype):
    """Pure-PyTorch :func:`division_pack`: the default on every device and the kernels' oracle."""
    check_division_args(block_h, block_w, bits, group_size)
    _check_input(x, lfc_dtype)
    _, height, width = x.shape
    lfc = _tile_means(x, block_h, block_w).to(lfc_dtype)
    residual = x.float() - _upsample(lfc, height, width, block_h, block_w)
    codes, stats = reference.quantize_pack(residual, bits, group_size, seed)
    return lfc, codes, stats


def _check_decode(lfc, height, width, block_h, block_w, dtype) -> None:
    if lfc.dtype not in LFC_DTYPES:
        raise ValueError(
            f"division_unpack: lfc dtype {lfc.dtype} is not supported; allowed: bfloat16, float16, float32"
        )
    if dtype not in reference.FLOAT_DTYPES:
        raise ValueError(f"division_unpack: dtype {dtype} is not supported; allowed: float32, float16, bfloat16")
    if height < 0 or width < 0:
        raise ValueError(f"division_unpack: height={height} and width={width} must be >= 0")
    expected = tile_grid(height, width, block_h, block_w)
    if lfc.dim() != 3 or tuple(lfc.shape[1:]) != expected:
        raise ValueError(
            f"division_unpack: lfc must have shape [planes, {expected[0]}, {expected[1]}] for {height}x{width} "
            f"planes in {block_h}x{block_w} tiles; got {tuple(lfc.shape)}"
        )


def reference_unpack(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype):
    """Pure-PyTorch :func:`division_unpack`: the default on every device and the kernels' oracle."""
    check_division_args(block_h, block_w, bits, group_size)
    _check_decode(lfc, height, width, block_h, block_w, dtype)
    shape = (lfc.shape[0], height, width)
    residual = reference.unpack_dequantize(codes, stats, bits, group_size, lfc.shape[0] * height * width, torch.float32)
    return (_upsample(lfc, height, width, block_h, block_w) + residual.view(shape)).to(dtype)


_LIBRARY.impl("division_pack", reference_pack, "CompositeExplicitAutograd")
_LIBRARY.impl("division_unpack", reference_unpack, "CompositeExplicitAutograd")


@torch.library.register_fake("lightning_act::division_pack")
def _division_pack_fake(input, block_h, block_w, bits, group_size, seed, lfc_dtype):
    planes, height, width = input.shape
    tiles_h, tiles_w = tile_grid(height, width, block_h, block_w)
    groups = reference.num_groups(input.numel(), group_size)
    lfc = input.new_empty(planes, tiles_h, tiles_w, dtype=lfc_dtype)
    codes = input.new_empty(groups * group_size * bits // 8, dtype=torch.uint8)
    return lfc, codes, input.new_empty(groups, 2, dtype=torch.bfloat16)


@torch.library.register_fake("lightning_act::division_unpack")
def _division_unpack_fake(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype):
    return lfc.new_empty(lfc.shape[0], height, width, dtype=dtype)


def division_pack(
    x: torch.Tensor, block_h: int, block_w: int, bits: int, group_size: int, seed: int, lfc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split planes into a 16-bit low-frequency component and a quantized residual.

    Args:
        x: float32, float16 or bfloat16, contiguous, ``[planes, height, width]``.
        block_h: tile rows (>= 1).
        block_w: tile columns (>= 1); 1 pools along the height axis only.
        bits: bits per residual value, one of :data:`lightning_act.ops.SUPPORTED_BITS`.
        group_size: residual values sharing one (low, step) pair; a power of two in [8, 65536].
        seed: selects the rounding noise (0 <= seed < 2**63); equal seeds give equal codes.
        lfc_dtype: one of :data:`LFC_DTYPES`.

    Returns:
        ``(lfc, codes, stats)``: ``lfc`` is ``[planes, tiles_h, tiles_w]`` of ``lfc_dtype``;
        ``codes`` and ``stats`` are :func:`lightning_act.ops.quantize_pack`'s output for the
        float32 residual.
    """
    ensure_kernels(x.device)
    return torch.ops.lightning_act.division_pack(x, block_h, block_w, bits, group_size, seed, lfc_dtype)


def division_unpack(
    lfc: torch.Tensor,
    codes: torch.Tensor,
    stats: torch.Tensor,
    height: int,
    width: int,
    block_h: int,
    block_w: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode :func:`division_pack`'s output into a new ``[planes, height, width]`` tensor of ``dtype``."""
    ensure_kernels(lfc.device)
    return torch.ops.lightning_act.division_unpack(
        lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype
    )
