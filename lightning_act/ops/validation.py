"""Every argument check of :mod:`lightning_act.ops`.

* Settings a user chooses (``bits``, ``group_size``, a codec's ``lfc_dtype``) are checked when a config or
  codec is built, and raise :class:`ValueError`.
* Op arguments are checked by the reference and the fakes with ``torch._check`` (:class:`RuntimeError`),
  mirroring the kernels' ``TORCH_CHECK`` (``csrc/quant_args.h``, ``csrc/division.h``), so every device
  rejects the same inputs with the same messages.
"""

from __future__ import annotations

import torch

from lightning_act.ops.layout import tile_grid

__all__ = [
    "FLOAT_DTYPES",
    "LFC_DTYPES",
    "MAX_GROUP_SIZE",
    "MIN_GROUP_SIZE",
    "SUPPORTED_BITS",
    "check_division_pack",
    "check_division_unpack",
    "check_lookup_levels",
    "check_quant_args",
    "check_quantize_pack",
    "check_unpack_dequantize",
]

#: Bits per value the quantizer stores.
SUPPORTED_BITS = (1, 2, 4, 8)
#: Dtypes the ops read and write.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Dtypes DIVISION's low-frequency component can be stored in.
LFC_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The smallest and largest group sizes of the quantizer.
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 8, 1 << 16


def _allowed(values) -> str:
    return ", ".join(str(value) for value in values)


def _quant_args_error(bits: int, group_size: int) -> str | None:
    if bits not in SUPPORTED_BITS:
        return f"bits={bits!r} is not supported; allowed: {_allowed(SUPPORTED_BITS)}"
    if not MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE or group_size & (group_size - 1):
        return f"group_size={group_size!r} must be a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}]"
    return None


def check_quant_args(bits: int, group_size: int) -> None:
    """Checks a quantizer setting.

    Raises:
        ValueError: ``bits`` is not in :data:`SUPPORTED_BITS` or ``group_size`` is not a
            power of two in [8, 65536].
    """
    message = _quant_args_error(bits, group_size)
    if message is not None:
        raise ValueError(message)


def _check(condition: bool, op: str, message: str) -> None:
    torch._check(condition, lambda: f"lightning_act.{op}: {message}")


def _check_quant_op_args(op: str, bits: int, group_size: int) -> None:
    message = _quant_args_error(bits, group_size)
    _check(message is None, op, message or "")


def _check_float(op: str, what: str, dtype: torch.dtype, allowed=FLOAT_DTYPES) -> None:
    _check(dtype in allowed, op, f"{what} is {dtype}; allowed: {_allowed(allowed)}")


def _check_contiguous(op: str, what: str, tensor: torch.Tensor) -> None:
    _check(
        tensor.is_contiguous(),
        op,
        f"{what} must be contiguous; got shape {tuple(tensor.shape)} with strides {tensor.stride()}",
    )


def check_quantize_pack(input: torch.Tensor, bits: int, group_size: int, column_major: bool = False) -> None:
    """Checks ``quantize_pack``'s arguments (RuntimeError naming the first bad one)."""
    _check_quant_op_args("quantize_pack", bits, group_size)
    _check_float("quantize_pack", "input dtype", input.dtype)
    _check_contiguous("quantize_pack", "input", input)
    _check(
        not column_major or input.dim() >= 2,
        "quantize_pack",
        "column_major=True reads matrices column by column: input must be at least 2-D; "
        f"got shape {tuple(input.shape)}",
    )


def check_unpack_dequantize(
    codes: torch.Tensor,
    stats: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    op: str = "unpack_dequantize",
    rows: int = 0,
    columns: int = 0,
) -> None:
    """Checks ``unpack_dequantize``'s arguments (``rows`` and ``columns``: both 0, or both positive and
    dividing ``numel`` into whole matrices)."""
    _check_quant_op_args(op, bits, group_size)
    _check(codes.dtype == torch.uint8, op, f"codes dtype is {codes.dtype}; allowed: torch.uint8")
    _check_contiguous(op, "codes", codes)
    _check(stats.dtype == torch.bfloat16, op, f"stats dtype is {stats.dtype}; allowed: torch.bfloat16")
    _check(stats.dim() == 2 and stats.shape[1] == 2, op, f"stats must have shape [groups, 2]; got {tuple(stats.shape)}")
    _check_contiguous(op, "stats", stats)
    _check(codes.device == stats.device, op, f"codes are on {codes.device} but stats are on {stats.device}")
    _check_groups(op, codes, stats.shape[0], bits, group_size, numel)
    _check_float(op, "dtype", dtype)
    plain = rows == 0 and columns == 0
    _check(
        plain or (rows > 0 and columns > 0 and numel % (rows * columns) == 0),
        op,
        f"rows={rows}, columns={columns}: allowed are both 0 (values in memory order) or both positive with "
        f"numel={numel} a multiple of rows * columns (whole matrices packed column by column)",
    )


def _check_groups(op: str, codes: torch.Tensor, groups: int, bits: int, group_size: int, numel: int) -> None:
    """The codes' bytes and ``numel`` against ``groups`` groups of ``group_size`` at ``bits``."""
    expected = groups * group_size * bits // 8
    _check(
        codes.numel() == expected,
        op,
        f"codes hold {codes.numel()} bytes; {groups} groups of {group_size} values at {bits} bits need {expected}",
    )
    _check(
        0 <= numel <= groups * group_size,
        op,
        f"numel={numel} must be in [0, {groups * group_size}] for {groups} groups of {group_size}",
    )


def check_lookup_levels(codes: torch.Tensor, levels: torch.Tensor, bits: int, group_size: int, numel: int) -> None:
    """Checks ``lookup_levels``'s arguments: codes, a ``[groups, 2**bits]`` float table, ``numel``."""
    op = "lookup_levels"
    _check_quant_op_args(op, bits, group_size)
    _check(codes.dtype == torch.uint8, op, f"codes dtype is {codes.dtype}; allowed: torch.uint8")
    _check_contiguous(op, "codes", codes)
    _check_float(op, "levels dtype", levels.dtype)
    _check(
        levels.dim() == 2 and levels.shape[1] == 1 << bits,
        op,
        f"levels must have shape [groups, {1 << bits}] at bits={bits}; got {tuple(levels.shape)}",
    )
    _check_contiguous(op, "levels", levels)
    _check(codes.device == levels.device, op, f"codes are on {codes.device} but levels are on {levels.device}")
    _check_groups(op, codes, levels.shape[0], bits, group_size, numel)


def _check_blocks(op: str, block_h: int, block_w: int) -> None:
    for name, block in (("block_h", block_h), ("block_w", block_w)):
        _check(block >= 1, op, f"{name}={block!r} must be >= 1")


def check_division_pack(
    input: torch.Tensor, block_h: int, block_w: int, bits: int, group_size: int, lfc_dtype: torch.dtype
) -> None:
    """Checks ``division_pack``'s arguments (RuntimeError naming the first bad one)."""
    op = "division_pack"
    _check_quant_op_args(op, bits, group_size)
    _check_blocks(op, block_h, block_w)
    _check_float(op, "input dtype", input.dtype)
    _check(input.dim() == 3, op, f"input must be 3-D [planes, height, width]; got shape {tuple(input.shape)}")
    _check_contiguous(op, "input", input)
    _check_float(op, "lfc_dtype", lfc_dtype, LFC_DTYPES)


def check_division_unpack(
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
) -> None:
    """Checks ``division_unpack``'s arguments: the LFC against the planes, then the residual."""
    op = "division_unpack"
    _check_blocks(op, block_h, block_w)
    _check(height >= 0 and width >= 0, op, f"height={height} and width={width} must be >= 0")
    _check_float(op, "lfc dtype", lfc.dtype, LFC_DTYPES)
    tiles_h, tiles_w = tile_grid(height, width, block_h, block_w)
    _check(
        lfc.dim() == 3 and tuple(lfc.shape[1:]) == (tiles_h, tiles_w),
        op,
        f"lfc must have shape [planes, {tiles_h}, {tiles_w}] for {height}x{width} planes in {block_h}x{block_w} "
        f"tiles; got {tuple(lfc.shape)}",
    )
    _check(lfc.device == codes.device, op, f"lfc is on {lfc.device} but codes are on {codes.device}")
    planes = lfc.shape[0] if lfc.dim() == 3 else 0
    check_unpack_dequantize(codes, stats, bits, group_size, planes * height * width, dtype, op=op)
