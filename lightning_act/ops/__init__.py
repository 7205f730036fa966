"""The library's tensor ops, declared once as ``torch.library`` custom ops.

Each op has a schema, a fake implementation (shapes only, for ``torch.compile`` and meta
tensors), and the pure-PyTorch reference of :mod:`lightning_act.ops.reference` registered
for every device. Fused C++ (CPU) and CUDA kernels from ``csrc/`` are built with ninja on
first use and register themselves for their device, overriding the reference there; if a
build fails, one warning is issued and the reference keeps working.
"""

from __future__ import annotations

import torch

from lightning_act.ops import reference
from lightning_act.ops.extension import ensure_kernels, loaded_kernels
from lightning_act.ops.reference import SUPPORTED_BITS, check_quant_args, count_nonfinite_groups, num_groups

__all__ = [
    "SUPPORTED_BITS",
    "check_quant_args",
    "count_nonfinite_groups",
    "ensure_kernels",
    "loaded_kernels",
    "num_groups",
    "quantize_pack",
    "unpack_dequantize",
]

_LIBRARY = torch.library.Library("lightning_act", "DEF")
_LIBRARY.define("quantize_pack(Tensor input, int bits, int group_size, int seed) -> (Tensor codes, Tensor stats)")
_LIBRARY.define(
    "unpack_dequantize(Tensor codes, Tensor stats, int bits, int group_size, int numel, ScalarType dtype) -> Tensor"
)
_LIBRARY.impl("quantize_pack", reference.quantize_pack, "CompositeExplicitAutograd")
_LIBRARY.impl("unpack_dequantize", reference.unpack_dequantize, "CompositeExplicitAutograd")


@torch.library.register_fake("lightning_act::quantize_pack")
def _quantize_pack_fake(input, bits, group_size, seed):
    groups = num_groups(input.numel(), group_size)
    codes = input.new_empty(groups * group_size * bits // 8, dtype=torch.uint8)
    return codes, input.new_empty(groups, 2, dtype=torch.bfloat16)


@torch.library.register_fake("lightning_act::unpack_dequantize")
def _unpack_dequantize_fake(codes, stats, bits, group_size, numel, dtype):
    return codes.new_empty(numel, dtype=dtype)


def quantize_pack(x: torch.Tensor, bits: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous float tensor to ``bits`` per value with stochastic rounding.

    Args:
        x: float32, float16 or bfloat16, contiguous, any shape (read in memory order).
        bits: one of :data:`SUPPORTED_BITS`.
        group_size: values sharing one (low, step) pair; a power of two in [8, 65536].
        seed: selects the rounding noise (0 <= seed < 2**63); equal seeds give equal codes.

    Returns:
        ``(codes, stats)``: packed uint8 codes and bfloat16 ``[groups, 2]`` statistics; the
        format is described in :mod:`lightning_act.ops.reference`.
    """
    ensure_kernels(x.device)
    return torch.ops.lightning_act.quantize_pack(x, bits, group_size, seed)


def unpack_dequantize(
    codes: torch.Tensor, stats: torch.Tensor, bits: int, group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode :func:`quantize_pack`'s output into a 1-D tensor of ``numel`` values of ``dtype``."""
    ensure_kernels(codes.device)
    return torch.ops.lightning_act.unpack_dequantize(codes, stats, bits, group_size, numel, dtype)
