"""Pooling compression (Barley and Froening 2024): backward gets a down-sampled copy.

Autograd keeps the mean of every ``kernel x kernel`` tile at the activation's dtype, and
backward sees each mean repeated over its tile. This is LOSSY and BIASED: the error (the
within-tile detail) is the same for every seed, so no number of steps averages it away.
Apply it per layer, where its accuracy cost is known to be acceptable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_act.codecs.exact import StoredTensor
from lightning_act.ops.layout import upsample_tiles


class PooledTensor:
    """A tensor stored as the means of its tiles, at its own dtype."""

    codec = "pool"
    __slots__ = ("pooled", "kernel_h", "kernel_w", "shape")

    def __init__(self, pooled: torch.Tensor, kernel_h: int, kernel_w: int, shape: torch.Size):
        self.pooled = pooled
        self.kernel_h = kernel_h
        self.kernel_w = kernel_w
        self.shape = shape

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps allocated (the pooled copy)."""
        return self.pooled.untyped_storage().nbytes()

    @property
    def stats(self) -> torch.Tensor:
        """One ``[1, 2]`` bfloat16 row, NaN (a non-finite group) if the pooled copy holds NaN or Inf, else 0;
        computed on the device without synchronising."""
        finite = torch.isfinite(self.pooled).all()
        return torch.where(finite, 0.0, float("nan")).to(torch.bfloat16).expand(1, 2)

    def unpack(self) -> torch.Tensor:
        """A new contiguous tensor of the original shape: each tile's mean over the tile."""
        return upsample_tiles(self.pooled, self.shape[-2], self.shape[-1], self.kernel_h, self.kernel_w).view(
            self.shape
        )


class PoolCodec:
    """Stores a ``kernel``-average-pooled copy; lossy and BIASED (see the module docstring).

    * 4-D ``(N, C, H, W)`` with ``H, W >= kernel``: means of ``kernel x kernel`` tiles (edge
      tiles average only the pixels they hold);
    * 3-D ``(N, T, D)`` with ``T >= kernel``: means of runs of ``kernel`` positions along ``T``;
    * anything else is kept as it is: pooling another layout has no agreed meaning.

    ``bits`` and ``seed`` of :meth:`pack` are ignored.

    Args:
        kernel: tile side (run length for 3-D activations), >= 2.

    Raises:
        ValueError: ``kernel`` is not an int >= 2.
    """

    name = "pool"
    keeps_zeros = False
    #: Tile means: the detail within a tile is lost, the same for every seed.
    unbiased = False

    def __init__(self, kernel: int = 2):
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 2:
            raise ValueError(f"kernel={kernel!r} must be an int >= 2")
        self.kernel = kernel

    def pack(self, dense: torch.Tensor, bits: int, seed: int) -> PooledTensor | StoredTensor:
        """Keep the tile means of a contiguous float tensor (or the tensor itself; see above)."""
        dense = dense.detach()
        if dense.dim() == 4 and dense.shape[2] >= self.kernel and dense.shape[3] >= self.kernel:
            maps, kernel_h, kernel_w = dense, self.kernel, self.kernel
        elif dense.dim() == 3 and dense.shape[1] >= self.kernel:
            maps, kernel_h, kernel_w = dense.unsqueeze(1), self.kernel, 1
        else:
            return StoredTensor(dense)
        # ceil_mode keeps partial edge tiles; count_include_pad=False divides by the pixels they hold.
        pooled = F.avg_pool2d(maps, (kernel_h, kernel_w), ceil_mode=True, count_include_pad=False)
        if dense.dim() == 3:
            pooled = pooled.squeeze(1)
        return PooledTensor(pooled, kernel_h, kernel_w, dense.shape)
