"""Pure-PyTorch implementation of every op.

It is registered as the default implementation on every device, so the library works
wherever torch does, and it is the oracle the C++ and CUDA kernels in ``csrc/`` are tested
against *bit for bit*: the rounding noise comes from a counter-based hash of (seed, element
index) instead of a stateful generator, and every floating-point step is a single IEEE
operation, so the kernels can reproduce it exactly.

Storage format of ``quantize_pack`` (shared with ``csrc/quant_math.h``):

* the flattened input is split into groups of ``group_size`` consecutive values (the last
  group is padded; padding codes are 0);
* ``stats[g] = (low, step)`` in bfloat16. ``low`` is rounded down and ``step`` up from their
  float32 values, so every value of the group lies inside ``[low, low + levels * step]`` and
  stochastic rounding stays unbiased. bfloat16 rather than float16 because it has float32's
  range;
* a *plain* group encodes ``x`` as ``floor((x - low) / step + u)``, ``u ~ U[0, 1)``, codes
  ``0 .. 2**bits - 1``;
* a *zero-preserving* group (``bits >= 2``, no negative value and at least one exact zero,
  e.g. a ReLU output) reserves code 0 for exact zeros and spreads codes ``1 .. 2**bits - 1``
  over ``[smallest positive value, max]``. Zeros stay zeros and positives stay positive, so
  an op that later uses the sign of the tensor (ReLU's backward, ``x > 0`` masks) sees
  exactly the mask it saw in forward, while values stay unbiased. Its ``step`` is stored
  with the sign bit set, which is how ``unpack_dequantize`` recognises it;
* a group holding NaN or Inf (or spanning more than float32 can represent) stores NaN
  statistics: it decodes to NaN, so a non-finite activation can never turn into a finite,
  silently wrong gradient. Such groups are counted
  by the caller (``count_nonfinite_groups``).
* codes are bit-packed little-endian: value ``i`` of the tensor sits in byte
  ``i * bits // 8`` at bit offset ``i * bits % 8``.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK32 = 0xFFFFFFFF
# Elements per pass of the reference: bounds its int64 temporaries, and as a power of two
# that divides 2**32 it keeps the high half of every element index constant within a pass.
_CHUNK = 1 << 22


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


def _quantize_chunk(x: torch.Tensor, bits: int, group_size: int, seed: int, start: int):
    """Codes (uint8, one per value) and stats bits (int32, ``[groups, 2]``) of whole groups."""
    levels_plain = (1 << bits) - 1
    g = x.view(-1, group_size)
    finite = torch.isfinite(g).all(dim=1)
    gmin = g.amin(dim=1)
    gmax = g.amax(dim=1)
    zero_preserving = (gmin == 0) & (bits >= 2)
    positive = g > 0
    pos_min = torch.where(positive, g, torch.inf).amin(dim=1)
    low = torch.where(zero_preserving, torch.where(torch.isinf(pos_min), 0.0, pos_min), gmin)
    levels = torch.where(zero_preserving, float(levels_plain - 1), float(levels_plain))

    low_bits = _bf16_bits_rounded(low.contiguous(), upward=False)
    low_r = low_bits.view(torch.float32)
    step_bits = _bf16_bits_rounded(((gmax - low_r) / levels).contiguous(), upward=True)
    step_r = step_bits.view(torch.float32)
    # a group spanning more than float32 can hold is stored as NaN, like a non-finite one
    finite &= torch.isfinite(low_r) & torch.isfinite(step_r)

    q = (g - low_r[:, None]) / step_r[:, None]
    q = torch.where(step_r[:, None] > 0, q, 0.0)
    u = uniform_noise(seed, start, g.numel(), g.device).view_as(g)
    codes = torch.floor(q + u)
    codes = torch.minimum(torch.clamp_min(codes, 0.0), levels[:, None])
    codes = torch.where(zero_preserving[:, None], torch.where(positive, codes + 1.0, 0.0), codes)
    codes = torch.where(finite[:, None], codes, 0.0).to(torch.uint8)

    step_bits = torch.where(zero_preserving, step_bits | _SIGN_BIT, step_bits)
    stats = torch.stack((low_bits, step_bits), dim=1)
    stats = torch.where(finite[:, None], stats, _NAN_BITS)
    return codes.view(-1), stats


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    per_byte = 8 // bits
    c = codes.view(-1, per_byte)
    packed = c[:, 0].clone()
    for j in range(1, per_byte):
        packed |= c[:, j] << (j * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    fields = [(packed >> (j * bits)) & mask for j in range(8 // bits)]
    return torch.stack(fields, dim=1).view(-1)


def check_quant_args(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {SUPPORTED_BITS}")
    if group_size < 8 or group_size > (1 << 16) or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size!r} must be a power of two in [8, 65536]")


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def quantize_pack(x: torch.Tensor, bits: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize and bit-pack a floating-point tensor (any shape, read in memory order).

    Args:
        x: float32, float16 or bfloat16 tensor, contiguous.
        bits: bits per value, one of 1, 2, 4, 8.
        group_size: values per group (power of two, 8 to 65536).
        seed: selects the rounding noise; the same seed gives the same codes.

    Returns:
        ``codes``: uint8 ``[groups * group_size * bits // 8]``; ``stats``: bfloat16 ``[groups, 2]``.
    """
    check_quant_args(bits, group_size)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize_pack: input dtype {x.dtype} is not supported; allowed: float32, float16, bfloat16")
    if not x.is_contiguous():
        raise ValueError("quantize_pack: input must be contiguous")
    flat = x.reshape(-1)
    n = flat.numel()
    groups = num_groups(n, group_size)
    padded = groups * group_size
    codes = torch.empty(padded, dtype=torch.uint8, device=x.device)
    stats_bits = torch.empty(groups, 2, dtype=torch.int32, device=x.device)
    for start in range(0, padded, _CHUNK):
        stop = min(start + _CHUNK, padded)
        chunk = flat[start:min(stop, n)].float()
        if chunk.numel() < stop - start:  # last group: repeat the last value, it moves no statistic
            chunk = torch.cat((chunk, chunk[-1:].expand(stop - start - chunk.numel())))
        c, s = _quantize_chunk(chunk, bits, group_size, seed, start)
        codes[start:stop] = c
        stats_bits[start // group_size:stop // group_size] = s
    codes[n:] = 0
    stats = (stats_bits >> 16).to(torch.int16).view(torch.bfloat16)
    return _pack(codes, bits), stats


def unpack_dequantize(
    codes: torch.Tensor, stats: torch.Tensor, bits: int, group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack`: a 1-D tensor of ``numel`` values of ``dtype``."""
    check_quant_args(bits, group_size)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unpack_dequantize: dtype {dtype} is not supported; allowed: float32, float16, bfloat16")
    if numel > stats.shape[0] * group_size:
        raise ValueError(f"unpack_dequantize: numel={numel} exceeds the {stats.shape[0]} groups of {group_size} stored")
    c = _unpack(codes, bits).view(-1, group_size).float()
    low = stats[:, 0:1].float()
    signed_step = stats[:, 1:2].float()
    zero_preserving = torch.signbit(signed_step)
    k = c - zero_preserving.float()
    values = low + k * signed_step.abs()
    values = torch.where(zero_preserving & (c == 0), 0.0, values)
    return values.view(-1)[:numel].to(dtype)


def count_nonfinite_groups(stats: torch.Tensor) -> torch.Tensor:
    """Number of groups stored as NaN because they held NaN or Inf (a device scalar, no sync)."""
    return torch.isnan(stats[:, 0]).sum()
