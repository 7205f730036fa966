"""The schema of every op of the ``lightning_act`` library, each with its fake.

Implementations register elsewhere (:mod:`~lightning_act.ops.reference` for every device, the ``csrc/``
kernels for theirs). A fake checks the arguments as the implementations do and returns empty outputs of the
right shapes, for ``torch.compile`` and meta tensors.
"""

from __future__ import annotations

import torch

from lightning_act.ops import validation
from lightning_act.ops.layout import num_groups, tile_grid

__all__ = ["LIBRARY"]

LIBRARY = torch.library.Library("lightning_act", "DEF")
LIBRARY.define(
    "quantize_pack(Tensor input, int bits, int group_size, int seed, bool column_major=False)"
    " -> (Tensor codes, Tensor stats)"
)
LIBRARY.define(
    "unpack_dequantize(Tensor codes, Tensor stats, int bits, int group_size, int numel, ScalarType dtype,"
    " int rows=0, int columns=0) -> Tensor"
)
LIBRARY.define("lookup_levels(Tensor codes, Tensor levels, int bits, int group_size, int numel) -> Tensor")
LIBRARY.define(
    "division_pack(Tensor input, int block_h, int block_w, int bits, int group_size, int seed, ScalarType lfc_dtype)"
    " -> (Tensor lfc, Tensor codes, Tensor stats)"
)
LIBRARY.define(
    "division_unpack(Tensor lfc, Tensor codes, Tensor stats, int height, int width, int block_h, int block_w,"
    " int bits, int group_size, ScalarType dtype) -> Tensor"
)


def _empty_codes_and_stats(input: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = num_groups(input.numel(), group_size)
    codes = input.new_empty(groups * group_size * bits // 8, dtype=torch.uint8)
    return codes, input.new_empty(groups, 2, dtype=torch.bfloat16)


@torch.library.register_fake("lightning_act::quantize_pack")
def _quantize_pack_fake(input, bits, group_size, seed, column_major=False):
    validation.check_quantize_pack(input, bits, group_size, column_major)
    return _empty_codes_and_stats(input, bits, group_size)


@torch.library.register_fake("lightning_act::unpack_dequantize")
def _unpack_dequantize_fake(codes, stats, bits, group_size, numel, dtype, rows=0, columns=0):
    validation.check_unpack_dequantize(codes, stats, bits, group_size, numel, dtype, rows=rows, columns=columns)
    return codes.new_empty(numel, dtype=dtype)


@torch.library.register_fake("lightning_act::lookup_levels")
def _lookup_levels_fake(codes, levels, bits, group_size, numel):
    validation.check_lookup_levels(codes, levels, bits, group_size, numel)
    return levels.new_empty(numel)


@torch.library.register_fake("lightning_act::division_pack")
def _division_pack_fake(input, block_h, block_w, bits, group_size, seed, lfc_dtype):
    validation.check_division_pack(input, block_h, block_w, bits, group_size, lfc_dtype)
    planes, height, width = input.shape
    lfc = input.new_empty(planes, *tile_grid(height, width, block_h, block_w), dtype=lfc_dtype)
    return lfc, *_empty_codes_and_stats(input, bits, group_size)


@torch.library.register_fake("lightning_act::division_unpack")
def _division_unpack_fake(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype):
    validation.check_division_unpack(lfc, codes, stats, height, width, block_h, block_w, bits, group_size, dtype)
    return lfc.new_empty(lfc.shape[0], height, width, dtype=dtype)
