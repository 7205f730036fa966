"""The library's tensor ops: typed wrappers over ``torch.ops.lightning_act``.

* :mod:`~lightning_act.ops.schemas`: every op's schema and fake (for ``torch.compile`` and meta tensors);
* :mod:`~lightning_act.ops.reference`: the pure-PyTorch implementation for every device, and the
  bit-exact oracle for the kernels;
* ``csrc/``: fused C++ and CUDA kernels, built on first use by :mod:`~lightning_act.ops.extension` and
  overriding the reference on their device (a failed build warns once and keeps the reference);
* :mod:`~lightning_act.ops.validation`: argument checks; :mod:`~lightning_act.ops.layout`: layout rules.
"""

from __future__ import annotations

import torch

from lightning_act.ops import reference, schemas  # noqa: F401 - registers the schemas and the reference
from lightning_act.ops.extension import ensure_kernels, loaded_kernels
from lightning_act.ops.layout import pack_bit_fields
from lightning_act.ops.reference import count_nonfinite_groups
from lightning_act.ops.validation import LFC_DTYPES, MIN_GROUP_SIZE, SUPPORTED_BITS, check_quant_args

__all__ = [
    "LFC_DTYPES",
    "SUPPORTED_BITS",
    "check_quant_args",
    "count_nonfinite_groups",
    "division_pack",
    "division_unpack",
    "ensure_kernels",
    "every_code",
    "group_levels",
    "lookup_levels",
    "loaded_kernels",
    "quantize_pack",
    "unpack_dequantize",
]


def quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, seed: int, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous float tensor to ``bits`` per value with stochastic rounding.

    Args:
        x: float32, float16 or bfloat16, contiguous, any shape.
        bits: one of :data:`SUPPORTED_BITS`.
        group_size: values sharing one (low, step) pair; a power of two in [8, 65536].
        seed: selects the rounding noise (0 <= seed < 2**63); equal seeds give equal codes.
        column_major: read ``x`` (at least 2-D) as ``x.transpose(-2, -1)``: groups run down columns.

    Returns:
        ``(codes, stats)``: packed uint8 codes and bfloat16 ``[groups, 2]`` statistics
        (format: :mod:`lightning_act.ops.reference`).

    Raises:
        RuntimeError: an argument is out of range; the message says what is allowed.
    """
    ensure_kernels(x.device)
    return torch.ops.lightning_act.quantize_pack(x, bits, group_size, seed, column_major)


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
    """Decode :func:`quantize_pack`'s output.

    Args:
        codes, stats, bits, group_size: as packed.
        numel: values to decode, at most ``groups * group_size``.
        dtype: float32, float16 or bfloat16.
        rows, columns: for a ``column_major`` pack, the input's last two sizes (values come back in
            the input's memory order).

    Returns:
        A new 1-D tensor of ``numel`` values of ``dtype``.

    Raises:
        RuntimeError: codes, stats and the sizes do not fit together.
    """
    ensure_kernels(codes.device)
    return torch.ops.lightning_act.unpack_dequantize(codes, stats, bits, group_size, numel, dtype, rows, columns)


def group_levels(stats: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``[groups, 2**bits]`` of ``dtype``: entry ``[g, c]`` is what :func:`unpack_dequantize` decodes code ``c``
    of group ``g`` to, bit for bit. With :func:`lookup_levels`, ``f`` of the decoded values costs one
    evaluation per level instead of per value: ``lookup_levels(codes, f(group_levels(...)), ...)``.
    """
    one_group, width = every_code(bits, stats.device)
    groups = stats.shape[0]
    decoded = unpack_dequantize(one_group.repeat(groups), stats, bits, width, groups * width, dtype)
    return decoded.view(groups, width)[:, : 1 << bits]


def every_code(bits: int, device: torch.device | str) -> tuple[torch.Tensor, int]:
    """One group's packed codes cycling through ``0 .. 2**bits - 1`` (up to a valid group size), and that
    size: what :func:`group_levels` decodes with each group's stats."""
    levels = 1 << bits
    width = max(levels, MIN_GROUP_SIZE)
    codes = torch.arange(width, device=device).remainder_(levels).to(torch.uint8)
    return pack_bit_fields(codes, bits, planar=False), width


def lookup_levels(codes: torch.Tensor, levels: torch.Tensor, bits: int, group_size: int, numel: int) -> torch.Tensor:
    """``levels[g, c]`` for each of the first ``numel`` values (group ``g``, code ``c``) of a memory-order
    :func:`quantize_pack` output, in one pass (1-D, of ``levels``' dtype). ``levels`` is typically
    ``f(group_levels(stats, bits, dtype))``.

    Raises:
        RuntimeError: codes, levels and the sizes do not fit together.
    """
    ensure_kernels(codes.device)
    return torch.ops.lightning_act.lookup_levels(codes, levels, bits, group_size, numel)


def division_pack(
    x: torch.Tensor, block_h: int, block_w: int, bits: int, group_size: int, seed: int, lfc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split planes into a 16-bit low-frequency component and a quantized residual (DIVISION).

    Args:
        x: float32, float16 or bfloat16, contiguous, ``[planes, height, width]``.
        block_h, block_w: tile rows and columns (>= 1); ``block_w = 1`` pools along the height only.
        bits, group_size, seed: the residual's, as for :func:`quantize_pack`.
        lfc_dtype: one of :data:`LFC_DTYPES`.

    Returns:
        ``(lfc, codes, stats)``: ``lfc`` is ``[planes, tiles_h, tiles_w]`` of ``lfc_dtype``; ``codes`` and
        ``stats`` are :func:`quantize_pack`'s output for the float32 residual (format:
        :mod:`lightning_act.ops.reference`).

    Raises:
        RuntimeError: an argument is out of range; the message says what is allowed.
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
    """Decode :func:`division_pack`'s output.

    Args:
        lfc, codes, stats: :func:`division_pack`'s output.
        height, width: the size of each plane.
        block_h, block_w, bits, group_size: as packed.
        dtype: float32, float16 or bfloat16.

    Returns:
        A new ``[planes, height, width]`` tensor of ``dtype``.

    Raises:
        RuntimeError: the LFC, codes, stats and the sizes do not fit together.
    """
    ensure_kernels(lfc.device)
    return torch.ops.lightning_act.division_unpack(
        lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype
    )
