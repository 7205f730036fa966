"""A pointwise op's input ``x`` stored as its derivative ``h(x)``, where backward reads it as
``grad * h(x)``: :class:`DerivativeSubstitute`. Backward is then linear in what is stored,
so stochastic rounding leaves the gradient unbiased at any bits; unpack hands back the input
on ``h``'s monotone branch whose derivative is the decoded value. The derivative itself, its
branch and source, is found by :class:`~lightning_act.backward_reads.PointwiseDerivative`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from lightning_act import ops
from lightning_act.codecs.quant import QuantizedTensor

# ``h`` is tabulated on [-32, 32] and read as constant beyond (checked where the grid is made).
_GRID_HALF_WIDTH = 32.0


class DerivativeSubstitute:
    """Stores ``derivative.h(x)`` in place of ``x`` and restores ``x`` from it. One per
    derivative (:meth:`of`); its grids are held once per function and device."""

    for_its_op_alone = True

    def __init__(self, derivative: Any):
        self.derivative = derivative
        # The shared grids by use and device.
        self._grids: dict[tuple[str, torch.device], _Grid | None] = {}

    @staticmethod
    @functools.cache
    def of(derivative: Any) -> DerivativeSubstitute:
        return DerivativeSubstitute(derivative)

    @property
    def source(self) -> tuple[str, str] | None:
        return self.derivative.source

    def of_input(self, x: torch.Tensor) -> torch.Tensor:
        """``h(x)`` by ``h``'s own ops, in ``x``'s dtype: what a compiled forward traces and fuses."""
        return self.derivative.h(x, torch.ones((), dtype=x.dtype, device=x.device)).to(x.dtype)

    def store(self, x: torch.Tensor) -> tuple[torch.Tensor, DerivativeSubstitute]:
        """What to encode in place of ``x``, and what restores it at unpack. A smooth ``h``
        is read from a grid (:meth:`_smooth_grid`); any other is evaluated."""
        if ("store", x.device) not in self._grids:
            self._grids["store", x.device] = self._smooth_grid(x.device)
        tabulated = self._grids["store", x.device]
        derivative = torch.empty_like(x, memory_format=torch.contiguous_format)
        one = torch.ones((), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            for source, target in _chunks(x.reshape(-1), derivative.view(-1)):
                target.copy_(self.derivative.h(source, one) if tabulated is None else tabulated(source))
        return derivative.view(x.shape), self

    def unpack(self, record) -> torch.Tensor:
        """The input backward reads, from the record its derivative was stored in."""
        if isinstance(record, QuantizedTensor) and record.matrix == (0, 0):
            return self.restore_quantized(
                record.codes, record.stats, record.bits, record.group_size, record.shape.numel(), record.dtype
            ).view(record.shape)
        return self.restore(record.unpack())

    def restore_quantized(
        self, codes: torch.Tensor, stats: torch.Tensor, bits: int, group_size: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """:meth:`restore` of what :func:`~lightning_act.ops.unpack_dequantize` decodes, bit
        for bit, inverting once per level of each group and looking values up by code. Where
        a group has at least as many levels as values, the values are inverted instead: a
        table of levels would take as many inversions and double the decode's memory."""
        if 1 << bits >= group_size:
            return self.restore(ops.unpack_dequantize(codes, stats, bits, group_size, numel, dtype))
        levels = self.restore(ops.group_levels(stats, bits, dtype).contiguous())
        return ops.lookup_levels(codes, levels, bits, group_size, numel)

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        """The input whose derivative is ``decoded`` (to one step of a grid uniform in ``h``),
        written over ``decoded``."""
        inverse = self.inverse_grid(decoded.device)
        flat = decoded.view(-1)
        for h, target in _chunks(flat, flat):
            target.copy_(inverse(h))
        return decoded

    def inverse_grid(self, device: torch.device) -> _Grid:
        """The inverse of ``h`` on its branch, on a grid uniform in ``h``, on ``device``: what
        :meth:`restore` and the graph ops' C++ side read."""
        if ("inverse", device) not in self._grids:
            self._grids["inverse", device] = _shared(
                ("inverse", device, self.derivative.table_key), lambda: self._inverse_grid(device)
            )
        return self._grids["inverse", device]

    def _inverse_grid(self, device: torch.device) -> _Grid:
        ends, intercepts, slopes = self._line_table()

        def inverse(h: torch.Tensor) -> torch.Tensor:
            piece = torch.searchsorted(ends, h).clamp_(1, ends.numel() - 1)
            return intercepts[piece] + slopes[piece] * h

        low = ends[0].item()
        grid = _Grid.empty(low, (ends[-1].item() - low) / _GRID)
        for pieces, values in _on_grid(inverse, grid):
            grid.fill(pieces, values)
        return grid.to(device)

    def _smooth_grid(self, device: torch.device) -> _Grid | None:
        """``h`` on a uniform grid, if interpolating it is exact to 1e-6 of its span at every
        piece's middle and it keeps its ends' values beyond; None for a kink or a jump."""
        one = torch.ones((), dtype=torch.float64)

        def h(x: torch.Tensor) -> torch.Tensor:
            return self.derivative.h(x, one).double()

        grid = _Grid.empty(-_GRID_HALF_WIDTH, 2 * _GRID_HALF_WIDTH / _GRID, exact=True)
        ends = torch.tensor([-_GRID_HALF_WIDTH, _GRID_HALF_WIDTH], dtype=torch.float64)
        far = torch.tensor([-1e6, 1e6], dtype=torch.float64)
        with torch.no_grad():
            errors, lows, highs = [(h(far) - h(ends)).abs().max()], [], []
            for pieces, values in _on_grid(h, grid):
                grid.fill(pieces, values)
                at_middles = h(_grid_points(pieces.start, pieces.stop, grid.low + grid.step / 2, grid.step))
                errors.append((at_middles - (values[1:] + values[:-1]) / 2).abs().max())
                lows.append(values.min())
                highs.append(values.max())
        span = (torch.stack(highs).max() - torch.stack(lows).min()).item()
        if not torch.stack(errors).max().item() <= 1e-6 * span:  # NaN included
            return None
        return _shared(("store", device, self.derivative.table_key), lambda: grid.to(device))

    def _line_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table's ends and, for the piece ending at each, the line ``x = a + b h`` through
        its two points (float64). ``h`` within ``_FLAT`` of its span of zero is zero (a flat
        tail), so that no piece is so narrow in float32 that its slope overflows."""
        span = (self.derivative.hs[-1] - self.derivative.hs[0]).item()
        hs = torch.where(self.derivative.hs.abs() > _FLAT * span, self.derivative.hs, 0.0).float().double()
        xs = self.derivative.xs
        widths = hs.diff()
        flat = widths <= 0
        slopes = torch.where(flat, 0.0, xs.diff() / torch.where(flat, 1.0, widths))
        intercepts = torch.where(flat, xs[1:], xs[:-1] - slopes * hs[:-1])
        pad = torch.zeros(1, dtype=torch.float64)  # piece 0 is never read: indices start at 1
        return hs, torch.cat([pad, intercepts]), torch.cat([pad, slopes])


_FLAT = 1e-12
_GRID = 1 << 16  # pieces of the uniform grids h and its inverse are read from

# Tables by their values, held once: each layer's GELU, and each rebuilt derivative, tabulate the same.
_TABLES: dict[tuple, Any] = {}


def _shared(key: tuple, make: Callable[[], Any]) -> Any:
    """The table held under ``key``, made by ``make`` the first time."""
    if key not in _TABLES:
        _TABLES[key] = make()
    return _TABLES[key]


class _Grid(NamedTuple):
    """A function tabulated on a uniform grid, read by linear interpolation: point ``j`` is
    at ``low + j * step``; outside the grid, its end values. NaN stays NaN."""

    low: float
    step: float
    starts: torch.Tensor  # the function at each piece's start (float32, on the device)
    slopes: torch.Tensor  # its change over each piece
    #: Place values by their distance to their piece's start, not their position on the whole
    #: grid: float32 then places a value to its last bit among many pieces, for three more passes.
    exact: bool = False

    @staticmethod
    def empty(low: float, step: float, exact: bool = False) -> _Grid:
        """A grid from ``low`` in steps of ``step`` (on the CPU), for :meth:`fill`."""
        starts, slopes = (torch.empty(_GRID, dtype=torch.float32) for _ in range(2))
        return _Grid(low, step, starts, slopes, exact)

    def fill(self, pieces: slice, values: torch.Tensor) -> None:
        """Set ``pieces`` from the function's values at their ends (float64)."""
        self.starts[pieces] = values[:-1]
        self.slopes[pieces] = values.diff()

    def to(self, device: torch.device) -> _Grid:
        return self._replace(starts=self.starts.to(device), slopes=self.slopes.to(device))

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        """The function at every value of ``v`` (float32)."""
        v = v.float()
        pieces = self.starts.numel()
        scale = 1 / self.step if self.step > 0 else 0.0
        position = v.sub(self.low).mul_(scale).clamp_(0, pieces)
        piece = position.to(torch.int32).clamp_(0, pieces - 1)
        if self.exact:
            fraction = v.sub(piece.float().mul_(self.step).add_(self.low)).mul_(scale).clamp_(0, 1)
        else:
            fraction = position.sub_(piece)
        return self.starts.index_select(0, piece).addcmul_(self.slopes.index_select(0, piece), fraction)


# Grid points computed at once: a whole table's temporaries would be several times the table.
_GRID_CHUNK = 1 << 10


def _grid_points(first: int, last: int, low: float, step: float) -> torch.Tensor:
    """Points ``first`` to ``last - 1`` of the uniform grid ``low + j * step`` (float64)."""
    return torch.arange(first, last, dtype=torch.float64).mul_(step).add_(low)


def _on_grid(h: Callable[[torch.Tensor], torch.Tensor], grid: _Grid) -> Iterator[tuple[slice, torch.Tensor]]:
    """``h`` at the points of ``grid`` (float64), a chunk of pieces at a time: each chunk's
    pieces and ``h`` at their ends (the last one the next chunk's first)."""
    for first in range(0, _GRID, _GRID_CHUNK):
        last = min(first + _GRID_CHUNK, _GRID)
        yield slice(first, last), h(_grid_points(first, last + 1, grid.low, grid.step))


# Evaluated and inverted in chunks, so that temporaries live for one chunk, not the whole tensor.
_MIN_CHUNK = 1 << 14
_MAX_CHUNKS = 16


def _chunks(source: torch.Tensor, target: torch.Tensor):
    size = max(_MIN_CHUNK, -(-source.numel() // _MAX_CHUNKS))
    for start in range(0, source.numel(), size):
        yield source[start : start + size], target[start : start + size]
