"""Pooling compression (Barley and Froening 2024): backward gets a down-sampled copy.

The forward pass is exact; what autograd keeps for backward is the average of every
``kernel x kernel`` tile, at the activation's own dtype, and backward sees each tile's
average repeated over the tile (nearest up-sampling). This is LOSSY and BIASED: the
decoded tensor is the same for every seed, and its error ``x - upsample(avg_pool(x))`` is
the activation's within-tile detail, which no number of steps averages away. Only tile
means survive exactly. The paper trades that bias for 29% lower peak memory at the price
of a longer schedule; apply it per layer, where the accuracy cost was measured to be
acceptable.
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
        """One ``[1, 2]`` bfloat16 row, NaN if the pooled copy holds NaN or Inf, else 0.

        The capture engine counts NaN rows as non-finite groups; computed when asked, on the
        device, without synchronising.
        """
        finite = torch.isfinite(self.pooled).all()
        return torch.where(finite, 0.0, float("nan")).to(torch.bfloat16).expand(1, 2)

    def unpack(self) -> torch.Tensor:
        """A new contiguous tensor of the original shape: each tile's mean over the tile."""
        return upsample_tiles(self.pooled, self.shape[-2], self.shape[-1], self.kernel_h, self.kernel_w).view(
            self.shape
        )


class PoolCodec:
    """Stores a ``kernel``-average-pooled copy; lossy and BIASED (see the module docstring).

    * 4-D ``(N, C, H, W)`` activations with ``H >= kernel`` and ``W >= kernel``: the means
      of ``kernel x kernel`` tiles (``kernel**2`` times smaller);
    * 3-D ``(N, T, D)`` activations with ``T >= kernel``: means of runs of ``kernel``
      consecutive positions along ``T`` (``kernel`` times smaller);
    * anything else is kept exactly as it is: pooling another layout has no agreed meaning.

    Tiles on the bottom and right edges of a map whose size is not a multiple of ``kernel``
    average only the rows and columns the map has. ``bits`` and ``seed`` of :meth:`pack` are
    ignored: the pooled copy keeps the activation's dtype and nothing is rounded at random.

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
        # ceil_mode keeps the partial edge tiles; without padding their divisor is the number
        # of pixels they really hold.
        pooled = F.avg_pool2d(maps, (kernel_h, kernel_w), ceil_mode=True, count_include_pad=False)
        if dense.dim() == 3:
            pooled = pooled.squeeze(1)
        return PooledTensor(pooled, kernel_h, kernel_w, dense.shape)
