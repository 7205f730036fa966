"""Pure-PyTorch implementation of every op of :mod:`lightning_act.ops.schemas`.

Registered for every device, and the oracle the ``csrc/`` kernels are tested against *bit for bit*: the
rounding noise is a counter-based hash of (seed, element index), and every floating-point step is a single
IEEE operation.

Format of ``quantize_pack`` (shared with ``csrc/quant_math.h``):

* the flattened input is cut into groups of ``group_size`` values (the last padded with code 0);
* ``stats[g] = (low, step)`` in bfloat16 (float32's range), ``low`` rounded down and ``step`` up, so every
  value lies inside ``[low, low + levels * step]`` and stochastic rounding stays unbiased;
* a *plain* group encodes ``x`` as ``floor((x - low) / step + u)``, ``u ~ U[0, 1)``, codes ``0 .. 2**bits - 1``;
* a *zero-preserving* group (``bits >= 2``, no negative value, at least one exact zero, e.g. a ReLU output)
  reserves code 0 for exact zeros and spreads codes ``1 .. 2**bits - 1`` over ``[smallest positive, max]``:
  a sign mask read in backward stays exact and values stay unbiased. Its ``step`` has the sign bit set;
* a group holding NaN or Inf (or spanning more than float32 holds) stores NaN statistics and decodes to NaN,
  never to a finite, wrong gradient (``count_nonfinite_groups`` counts them);
* ``column_major``: matrices over the last two axes are read column by column (the order of
  ``input.transpose(-2, -1)``), so for a ``(..., tokens, features)`` activation a group spans one feature
  and an outlier feature widens only its own groups; ``unpack_dequantize`` given ``rows`` and ``columns``
  writes the values back in memory order;
* codes are bit-packed little-endian, value ``i`` in byte ``i * bits // 8`` at bit ``i * bits % 8`` (the
  interleaved order of :mod:`lightning_act.ops.layout`).

Format of ``division_pack`` (shared with ``csrc/division.h``): the input is ``planes`` independent
``height x width`` planes (``N * C`` for a convolution activation; ``N`` planes of ``T x D`` with one-column
tiles for a sequence), cut into ``block_h x block_w`` tiles; edge tiles hold only the pixels the plane has.

* ``lfc[p, i, j]``: tile ``(i, j)``'s mean over its real pixels, rounded to nearest even in ``lfc_dtype``;
  the float32 sum runs row by row, left to right, from +0.0, and is divided once by the pixel count (the
  order is part of the format);
* ``hfc = x - upsample(lfc)`` in float32 against the *rounded* LFC (so its rounding error moves into the
  residual instead of biasing the result), stored exactly as :func:`quantize_pack` stores a float32 tensor;
* ``division_unpack`` returns ``upsample(lfc) + dequantize(hfc)`` (one float32 addition) in the requested
  dtype: an unbiased estimate of ``x``.

A non-finite tile (NaN or Inf, a float32 sum that overflows, or a ``float16`` mean beyond 65504) makes every
group touching it a NaN group, so it decodes to NaN, never to a finite, wrong value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lightning_act.ops import validation
from lightning_act.ops.layout import num_groups, pack_bit_fields, tile_grid, unpack_bit_fields, upsample_tiles
from lightning_act.ops.schemas import LIBRARY

__all__ = [
    "count_nonfinite_groups",
    "division_pack",
    "division_unpack",
    "lookup_levels",
    "mix32",
    "quantize_pack",
    "rounding_variance",
    "uniform_noise",
    "unpack_dequantize",
]

_MASK32 = 0xFFFFFFFF
# Elements per pass of the reference: bounds its int64 temporaries, and as a power of two
# that divides 2**32 it keeps the high half of every element index constant within a pass.
_CHUNK = 1 << 22
_MIN_LOOKUP_CHUNK = 1 << 17


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x):
    """A bijective 32-bit integer hash (the "lowbias32" constants); ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _stream_key(seed: int, index_high: int) -> int:
    seed &= (1 << 64) - 1
    return mix32((seed & _MASK32) ^ mix32((seed >> 32) ^ index_high))


def uniform_noise(seed: int, start: int, count: int, device) -> torch.Tensor:
    """The rounding noise ``u`` in ``[0, 1)`` of elements ``start .. start + count - 1``.

    ``start`` and ``start + count - 1`` must share their high 32 bits.
    """
    key = _stream_key(seed, start >> 32)
    index = torch.arange(start & _MASK32, (start & _MASK32) + count, device=device, dtype=torch.int64)
    bits = mix32(index ^ key) >> 8
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def _bf16_bits_rounded(value: torch.Tensor, upward: bool) -> torch.Tensor:
    """int32 bit patterns of ``value`` (float32) rounded to bfloat16 toward -inf or +inf."""
    bits = value.view(torch.int32)
    truncated = bits & -0x10000  # toward zero
    inexact = (bits & 0xFFFF) != 0
    away_from_zero = inexact & ((bits >= 0) if upward else (bits < 0))
    return torch.where(away_from_zero, truncated + 0x10000, truncated)


_NAN_BITS = 0x7FC00000  # positive quiet NaN: its sign bit must not read as "zero-preserving"
_SIGN_BIT = -0x80000000


class _GroupGrid(NamedTuple):
    """The grid :func:`quantize_pack` rounds each group of ``[groups, group_size]`` values to."""

    low: torch.Tensor  # float32 of the stored bfloat16 low
    step: torch.Tensor  # float32 of the stored bfloat16 step (its magnitude)
    levels: torch.Tensor  # largest level (before the zero-preserving shift)
    zero_preserving: torch.Tensor
    finite: torch.Tensor
    low_bits: torch.Tensor  # int32 patterns of low and step, bfloat16 in their high halves
    step_bits: torch.Tensor


def _group_grid(g: torch.Tensor, bits: int) -> _GroupGrid:
    levels_plain = (1 << bits) - 1
    finite = torch.isfinite(g).all(dim=1)
    gmin = g.amin(dim=1)
    gmax = g.amax(dim=1)
    zero_preserving = (gmin == 0) & (bits >= 2)
    pos_min = torch.where(g > 0, g, torch.inf).amin(dim=1)
    low = torch.where(zero_preserving, torch.where(torch.isinf(pos_min), 0.0, pos_min), gmin)
    levels = torch.where(zero_preserving, float(levels_plain - 1), float(levels_plain))

    low_bits = _bf16_bits_rounded(low.contiguous(), upward=False)
    low_r = low_bits.view(torch.float32)
    step_bits = _bf16_bits_rounded(((gmax - low_r) / levels).contiguous(), upward=True)
    step_r = step_bits.view(torch.float32)
    # a group spanning more than float32 can hold is stored as NaN, like a non-finite one
    finite &= torch.isfinite(low_r) & torch.isfinite(step_r)
    return _GroupGrid(low_r, step_r, levels, zero_preserving, finite, low_bits, step_bits)


def _levels(g: torch.Tensor, grid: _GroupGrid) -> torch.Tensor:
    """Each value's offset from its group's low in steps (0 where the step is 0)."""
    q = (g - grid.low[:, None]) / grid.step[:, None]
    return torch.where(grid.step[:, None] > 0, q, 0.0)


def _quantize_chunk(x: torch.Tensor, bits: int, group_size: int, seed: int, start: int):
    """Codes (uint8, one per value) and stats bits (int32, ``[groups, 2]``) of whole groups."""
    g = x.view(-1, group_size)
    grid = _group_grid(g, bits)
    positive = g > 0
    q = _levels(g, grid)
    u = uniform_noise(seed, start, g.numel(), g.device).view_as(g)
    codes = torch.floor(q + u)
    codes = torch.minimum(torch.clamp_min(codes, 0.0), grid.levels[:, None])
    codes = torch.where(grid.zero_preserving[:, None], torch.where(positive, codes + 1.0, 0.0), codes)
    codes = torch.where(grid.finite[:, None], codes, 0.0).to(torch.uint8)

    step_bits = torch.where(grid.zero_preserving, grid.step_bits | _SIGN_BIT, grid.step_bits)
    stats = torch.stack((grid.low_bits, step_bits), dim=1)
    stats = torch.where(grid.finite[:, None], stats, _NAN_BITS)
    return codes.view(-1), stats


def rounding_variance(values: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The summed expected squared error :func:`quantize_pack` at ``bits`` puts into the whole groups of
    ``values`` (1-D, in grouping order; a ragged tail is left out): a value ``f`` of a step above a grid point
    has variance ``step**2 f (1 - f)``, so values on the grid cost nothing, which the groups' ranges alone do
    not tell. NaN when a group holds NaN or Inf."""
    whole = values.numel() // group_size * group_size
    total = torch.zeros((), dtype=torch.float32, device=values.device)
    for start in range(0, whole, _CHUNK):
        g = values[start : min(start + _CHUNK, whole)].float().view(-1, group_size)
        grid = _group_grid(g, bits)
        # A zero-preserving group's zeros lie below its low: clamped to level 0, exact.
        q = torch.minimum(_levels(g, grid).clamp_min(0.0), grid.levels[:, None])
        fraction = q - q.floor()
        per_group = (fraction * (1.0 - fraction)).sum(dim=1) * grid.step.square()
        total += torch.where(grid.finite, per_group, torch.nan).sum()
    return total


def quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, seed: int, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize and bit-pack a float tensor (the format above; arguments as :func:`lightning_act.ops.quantize_pack`).

    Returns ``codes``, uint8 ``[groups * group_size * bits // 8]``, and ``stats``, bfloat16 ``[groups, 2]``.
    """
    validation.check_quantize_pack(x, bits, group_size, column_major)
    flat = (x.transpose(-2, -1) if column_major else x).reshape(-1)
    n = flat.numel()
    groups = num_groups(n, group_size)
    padded = groups * group_size
    codes = torch.empty(padded, dtype=torch.uint8, device=x.device)
    stats_bits = torch.empty(groups, 2, dtype=torch.int32, device=x.device)
    for start in range(0, padded, _CHUNK):
        stop = min(start + _CHUNK, padded)
        chunk = flat[start : min(stop, n)].float()
        if chunk.numel() < stop - start:  # last group: repeat the last value, it moves no statistic
            chunk = torch.cat((chunk, chunk[-1:].expand(stop - start - chunk.numel())))
        c, s = _quantize_chunk(chunk, bits, group_size, seed, start)
        codes[start:stop] = c
        stats_bits[start // group_size : stop // group_size] = s
    codes[n:] = 0
    stats = (stats_bits >> 16).to(torch.int16).view(torch.bfloat16)
    return pack_bit_fields(codes, bits, planar=False), stats


def unpack_dequantize(
    codes: torch.Tensor,
    stats: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    rows: int = 0,
    columns: int = 0,
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack`: a 1-D tensor of ``numel`` values of ``dtype``, in
    memory order; for a column-major pack of ``rows x columns`` matrices, pass both."""
    validation.check_unpack_dequantize(codes, stats, bits, group_size, numel, dtype, rows=rows, columns=columns)
    c = unpack_bit_fields(codes, bits, planar=False).view(-1, group_size).float()
    low = stats[:, 0:1].float()
    signed_step = stats[:, 1:2].float()
    zero_preserving = torch.signbit(signed_step)
    k = c - zero_preserving.float()
    values = low + k * signed_step.abs()
    values = torch.where(zero_preserving & (c == 0), 0.0, values).view(-1)[:numel]
    if rows:
        values = values.view(-1, columns, rows).transpose(1, 2).reshape(-1)
    return values.to(dtype)


def lookup_levels(codes: torch.Tensor, levels: torch.Tensor, bits: int, group_size: int, numel: int) -> torch.Tensor:
    """``levels[g, c]`` for each of the first ``numel`` values (group ``g``, code ``c``) of a memory-order
    :func:`quantize_pack` output. In chunks of a sixteenth of the tensor (at least ``_MIN_LOOKUP_CHUNK``
    values), so the int64 gather positions stay a fraction of the result."""
    validation.check_lookup_levels(codes, levels, bits, group_size, numel)
    table = levels.view(-1)
    looked_up = torch.empty(numel, dtype=levels.dtype, device=levels.device)
    groups_per_chunk = -(-max(_MIN_LOOKUP_CHUNK, -(-numel // 16)) // group_size)
    code_bytes = group_size * bits // 8  # per group
    for first in range(0, levels.shape[0], groups_per_chunk):
        last = min(first + groups_per_chunk, levels.shape[0])
        start, stop = first * group_size, min(last * group_size, numel)
        chunk_codes = unpack_bit_fields(codes[first * code_bytes : last * code_bytes], bits, planar=False)[
            : stop - start
        ]
        rows = torch.arange(first, last, device=codes.device).repeat_interleave(group_size)[: stop - start]
        torch.index_select(table, 0, (rows << bits) + chunk_codes.long(), out=looked_up[start:stop])
    return looked_up


def count_nonfinite_groups(stats: torch.Tensor) -> torch.Tensor:
    """Number of groups stored as NaN because they held NaN or Inf (a device scalar, no sync)."""
    return torch.isnan(stats[:, 0]).sum()


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


def division_pack(
    x: torch.Tensor, block_h: int, block_w: int, bits: int, group_size: int, seed: int, lfc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[planes, height, width]`` into tile means and a quantized residual (the format above)."""
    validation.check_division_pack(x, block_h, block_w, bits, group_size, lfc_dtype)
    _, height, width = x.shape
    lfc = _tile_means(x, block_h, block_w).to(lfc_dtype)
    residual = x.float() - upsample_tiles(lfc.float(), height, width, block_h, block_w)
    codes, stats = quantize_pack(residual, bits, group_size, seed)
    return lfc, codes, stats


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
    """Inverse of :func:`division_pack`: a new ``[planes, height, width]`` tensor of ``dtype``."""
    validation.check_division_unpack(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype)
    shape = (lfc.shape[0], height, width)
    residual = unpack_dequantize(codes, stats, bits, group_size, lfc.shape[0] * height * width, torch.float32)
    return (upsample_tiles(lfc.float(), height, width, block_h, block_w) + residual.view(shape)).to(dtype)


for _name, _impl in (
    ("quantize_pack", quantize_pack),
    ("unpack_dequantize", unpack_dequantize),
    ("lookup_levels", lookup_levels),
    ("division_pack", division_pack),
    ("division_unpack", division_unpack),
):
    LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
