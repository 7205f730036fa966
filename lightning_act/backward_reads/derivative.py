"""``h(x)`` stored in place of a pointwise op's input ``x`` whose gradient is ``grad * h(x)``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from lightning_act import ops
from lightning_act.backward_reads.aten import aten_name, graph_outputs, in_fresh_thread
from lightning_act.backward_reads.walk import Use, Walk
from lightning_act.codecs.quant import QuantizedTensor

# The interval a derivative's monotone branch is searched on, and its sampling. A derivative
# still moving beyond half of it is not bounded: not stored this way.
_BRANCH_HALF_WIDTH = 32.0
_BRANCH_SAMPLES = 1 << 14
_LEVEL_TOLERANCE = 1e-4  # of the derivative's span, on the outer half of the interval
_STEP_TOLERANCE = 0.02  # of its span, between two samples: a larger step is a jump


class PointwiseDerivative:
    """The input of a pointwise op whose gradient is ``grad * h(x)``, stored as ``h(x)``.

    Backward is then linear in what is stored, so stochastic rounding leaves the gradient
    unbiased at any bits. Unpack hands back the input on ``h``'s monotone branch whose
    derivative is the decoded value, so backward, evaluating ``h`` again, reads the decoded
    derivative. It stands in for a :class:`~lightning_act.capture.decide.Decision`, for
    this op's save alone (what it stores is not the input).
    """

    for_its_op_alone = True

    def __init__(
        self, derivative: Callable, xs: torch.Tensor, hs: torch.Tensor, dtype: torch.dtype, source: str | None = None
    ):
        self._h = derivative
        # float64 on the CPU, hs ascending
        self._table_key = _digest(xs, hs)
        self._xs, self._hs = _shared(("branch", self._table_key), lambda: (xs.clone(), hs.clone()))
        self._dtype = dtype
        self._source = source
        # The shared grids by use and device.
        self._grids: dict[tuple[str, torch.device], _Grid | None] = {}

    @staticmethod
    def find(
        target: fx.Node, tangents: list[fx.Node], walk: Walk, compiled: bool = False
    ) -> PointwiseDerivative | None:
        """The derivative of the pointwise op whose backward reads ``target``, if it is one."""
        found = _pointwise_backward(target, tangents, walk, compiled)
        return None if found is None else _branch(*found)

    @property
    def source(self) -> tuple[str, str] | None:
        """``h`` as Python source over aten ops, with its dtype: what rebuilds it in another
        process (:meth:`from_source`). None where ``h`` holds anything but ops and numbers."""
        if self._source is not None:
            return self._source, str(self._dtype)
        if not isinstance(self._h, fx.GraphModule) or any(n.op == "get_attr" for n in self._h.graph.nodes):
            return None
        code = self._h.code
        return (code, str(self._dtype)) if PointwiseDerivative.from_source(code, str(self._dtype)) else None

    @staticmethod
    @functools.cache
    def from_source(code: str, dtype: str) -> PointwiseDerivative | None:
        """The derivative :attr:`source` describes (None if it does not rebuild)."""
        namespace: dict[str, Any] = {"torch": torch, "inf": float("inf"), "nan": float("nan"), "device": torch.device}

        def build() -> PointwiseDerivative | None:
            exec(code, namespace)  # defines forward(self, x, grad)
            return _branch(functools.partial(namespace["forward"], None), getattr(torch, dtype.split(".")[-1]))

        try:  # in a thread of its own: asked while a compiled graph is traced, under fake tensors
            found = in_fresh_thread(build)
        except Exception:
            return None
        if found is not None:
            found._source = code
        return found

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """``h(x)`` by ``h``'s own ops, in ``x``'s dtype: what a compiled forward traces and fuses."""
        return self._h(x, torch.ones((), dtype=x.dtype, device=x.device)).to(x.dtype)

    def store(self, x: torch.Tensor) -> tuple[torch.Tensor, PointwiseDerivative]:
        """What to encode in place of ``x``, and what restores it at unpack. A smooth ``h``
        is read from a grid (:meth:`_smooth_grid`); any other is evaluated."""
        if ("store", x.device) not in self._grids:
            self._grids["store", x.device] = self._smooth_grid(x.device)
        tabulated = self._grids["store", x.device]
        derivative = torch.empty_like(x, memory_format=torch.contiguous_format)
        one = torch.ones((), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            for source, target in _chunks(x.reshape(-1), derivative.view(-1)):
                target.copy_(self._h(source, one) if tabulated is None else tabulated(source))
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
                ("inverse", device, self._table_key), lambda: self._inverse_grid(device)
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
            return self._h(x, one).double()

        grid = _Grid.empty(-_BRANCH_HALF_WIDTH, 2 * _BRANCH_HALF_WIDTH / _GRID, exact=True)
        ends = torch.tensor([-_BRANCH_HALF_WIDTH, _BRANCH_HALF_WIDTH], dtype=torch.float64)
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
        return _shared(("store", device, _digest(grid.starts, grid.slopes)), lambda: grid.to(device))

    def _line_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table's ends and, for the piece ending at each, the line ``x = a + b h`` through
        its two points (float64). ``h`` within ``_FLAT`` of its span of zero is zero (a flat
        tail), so that no piece is so narrow in float32 that its slope overflows."""
        span = (self._hs[-1] - self._hs[0]).item()
        hs = torch.where(self._hs.abs() > _FLAT * span, self._hs, 0.0).float().double()
        xs = self._xs
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


def _digest(*tables: torch.Tensor) -> bytes:
    """What identifies tables (on the CPU) by their values."""
    digest = hashlib.blake2b(digest_size=16)
    for table in tables:
        digest.update(str(table.numel()).encode())
        digest.update(table.contiguous().numpy().tobytes())
    return digest.digest()


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


_RESHAPES = frozenset({"view", "_unsafe_view", "reshape"})

# Ops that copy or select values element by element without the pointwise tag.
_ELEMENTWISE_COPIES = frozenset({"alias", "clone", "detach", "where"})


def _is_cast(node: fx.Node) -> bool:
    """Whether ``node`` casts element by element to another dtype, with nothing else changed."""
    return aten_name(node.target) == "_to_copy" and set(node.kwargs) <= {"dtype", "memory_format"}


def _is_reshape(node: fx.Node, val: torch.Tensor) -> bool:
    """Whether ``node`` reshapes ``val`` keeping the order of its values."""
    out = node.meta.get("val")
    return (
        node.op == "call_function"
        and aten_name(node.target) in _RESHAPES
        and isinstance(out, torch.Tensor)
        and out.numel() == val.numel()
        and val.is_contiguous()
    )


def _pointwise_backward(target: fx.Node, tangents: list[fx.Node], walk: Walk, compiled: bool = False):
    """``(x, grad) -> grad * h(x)`` as a graph of its own, with the dtype it computes in, when
    every node of the backward computed from ``target`` is a pointwise op of ``target``, one
    gradient and scalar constants, ending in one output; None otherwise."""
    val = target.meta.get("val")
    if not isinstance(val, torch.Tensor) or not tangents:
        return None
    outputs = [o for o in graph_outputs(target.graph) if isinstance(o, fx.Node)]
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {target: x}
    # A compiled graph often saves a matmul's output as a matrix and reads it reshaped: an
    # elementwise ``h`` reads the reshaped values one for one, so those stand for ``x``.
    aliases = [u for u in target.users if _is_reshape(u, val)] if compiled else []
    env.update((alias, x) for alias in aliases)
    shapes = {val.shape, *(alias.meta["val"].shape for alias in aliases)}
    grad = graph.placeholder("grad")
    used_tangents = set()

    def pointwise(node: fx.Node) -> bool:
        out = node.meta.get("val")
        return (
            isinstance(node.target, torch._ops.OpOverload)
            and (
                torch.Tag.pointwise in node.target.tags
                or aten_name(node.target) in _ELEMENTWISE_COPIES
                or _is_cast(node)
            )
            and isinstance(out, torch.Tensor)
            and out.shape in shapes
        )

    def bring(node: fx.Node) -> bool:
        """Map an input from outside the reached nodes: the gradient, a scalar constant, or a
        pointwise function of those. In a compiled backward any one value of the target's
        shape computed without the target serves as the gradient (the factor it multiplies is
        checked below)."""
        if node in env:
            return True
        if node in tangents:
            used_tangents.add(node)
            env[node] = grad
            return True
        if node in walk.reached:
            return False
        constant = (
            node.op == "call_function" and not node.all_input_nodes and isinstance(node.target, torch._ops.OpOverload)
        )
        if constant:
            env[node] = graph.node_copy(node, env.__getitem__)
            return True
        other = node.meta.get("val")
        if compiled and isinstance(other, torch.Tensor) and other.shape in shapes:
            # Taken whole, before looking inside: in a gated MLP SiLU's gradient is ``grad * up``,
            # either factor of which would count as a second gradient.
            used_tangents.add(node)
            env[node] = grad
            return True
        if node.op == "call_function" and pointwise(node) and all(bring(a) for a in node.all_input_nodes):
            env[node] = graph.node_copy(node, env.__getitem__)
            return True
        return False

    if compiled:
        region, results = _pointwise_region(target, aliases, walk, outputs, pointwise)
    else:  # one call's backward: all of it
        region = walk.reached if all(pointwise(node) for node in walk.reached) else []
        results = [o for o in outputs if o in walk.degree]
    if not region or len(results) != 1:
        return None
    for node in region:
        for arg in node.all_input_nodes:
            arg_val = arg.meta.get("val")
            if not bring(arg) or (isinstance(arg_val, torch.Tensor) and arg_val.dim() and arg_val.shape not in shapes):
                return None
        env[node] = graph.node_copy(node, env.__getitem__)
    if len(used_tangents) != 1 or results[0] not in env:
        return None
    graph.output(env[results[0]])
    gm = fx.GraphModule(torch.nn.Module(), graph)
    # Linear in the gradient and nothing else, grad * h(x): checked on random values.
    generator = torch.Generator().manual_seed(0)  # not the user's random stream
    x = torch.randn(256, dtype=torch.float64, generator=generator) * 4
    g = torch.randn(256, dtype=torch.float64, generator=generator)
    try:
        with torch.no_grad():
            h = gm(x, torch.ones((), dtype=torch.float64))
            dtype = h.dtype
            tolerance = 8 * torch.finfo(dtype).eps
            for scale in (1.0, -3.0):
                ok = torch.allclose(
                    gm(x, g * scale).double(),
                    (g * scale * h.double()).to(dtype).double(),
                    rtol=tolerance,
                    atol=tolerance,
                )
                if not ok:
                    return None
    except Exception:  # an op that does not run in float64 on the CPU: not this case
        return None
    return gm, dtype


def _pointwise_region(
    target: fx.Node, aliases: list[fx.Node], walk: Walk, outputs: list[fx.Node], pointwise: Callable
) -> tuple[list[fx.Node], list[fx.Node]]:
    """In a compiled region's whole backward: the pointwise nodes computed from ``target`` (or
    its reshapes ``aliases``) and the gradient, and the one of them (``grad * h(x)``) the rest
    reads, provided the rest reads it linearly and ``target`` through it alone; else
    ``([], [])``. The shortest such run: nodes after it may be the next op's, reading
    ``target`` again (BatchNorm's ``x - mean``), and would leave no single result."""
    reached = set(walk.reached)
    region, inside = [], {target, *aliases}
    for node in walk.reached:
        if node in inside or not pointwise(node):
            continue
        if not all(a in inside or a not in reached for a in node.all_input_nodes):
            continue
        region.append(node)
        inside.add(node)
        leaving = [n for n in region if n in outputs or any(u not in inside for u in n.users)]
        if len(leaving) != 1 or not _reads_a_gradient(region, reached, inside, leaving[0]):
            continue
        result = leaving[0]
        if any(
            n not in inside and any(a in inside and a is not result for a in n.all_input_nodes) for n in walk.reached
        ):
            continue  # the rest still reads target, or a partial result, besides the region's result
        downstream = Walk(result, walk.saves)
        if downstream.result(outputs).use > Use.LINEAR or downstream.thresholds:
            continue
        return list(region), [result]
    return [], []


def _reads_a_gradient(region: list[fx.Node], reached: set[fx.Node], inside: set[fx.Node], result: fx.Node) -> bool:
    """Whether ``region`` multiplies in a value of its result's shape computed without the
    saved tensor: ``h(x)`` alone is not yet ``grad * h(x)``."""
    shape = result.meta["val"].shape
    return any(
        a not in reached
        and a not in inside
        and isinstance(a.meta.get("val"), torch.Tensor)
        and a.meta["val"].shape == shape
        for n in region
        for a in n.all_input_nodes
    )


def _branch(gm: Callable, dtype: torch.dtype) -> PointwiseDerivative | None:
    """The monotone branch of ``h`` that reaches all its values, if ``h`` levels off on both
    sides and has no jump on that branch."""
    xs = torch.linspace(-_BRANCH_HALF_WIDTH, _BRANCH_HALF_WIDTH, _BRANCH_SAMPLES + 1, dtype=torch.float64)
    with torch.no_grad():
        hs = gm(xs, torch.ones((), dtype=torch.float64)).double()
    if not torch.isfinite(hs).all():
        return None
    low, high = hs.min().item(), hs.max().item()
    span = high - low
    if span <= 0:
        return None  # a constant derivative: backward does not read the values
    level = max(_LEVEL_TOLERANCE * span, 4 * torch.finfo(dtype).eps * max(abs(low), abs(high)))
    outer = xs.abs() >= _BRANCH_HALF_WIDTH / 2
    for side, end in ((outer & (xs < 0), 0), (outer & (xs > 0), -1)):
        if (hs[side] - hs[end]).abs().max().item() > level:
            return None  # still moving: unbounded, or bounded far out
    start, stop = sorted((int(hs.argmin()), int(hs.argmax())))
    branch_x, branch_h = xs[start : stop + 1], hs[start : stop + 1]
    if branch_h[0] > branch_h[-1]:
        branch_x, branch_h = branch_x.flip(0), branch_h.flip(0)
    steps = branch_h.diff()
    if (steps < -level).any() or steps.max().item() > _STEP_TOLERANCE * span:
        return None  # not monotone, or a jump that rounding could land inside
    return PointwiseDerivative(gm, branch_x, torch.cummax(branch_h, 0).values, dtype)
