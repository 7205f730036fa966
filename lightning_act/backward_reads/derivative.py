"""``h(x)`` stored in place of a pointwise op's input ``x`` whose gradient is ``grad * h(x)``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from lightning_act.backward_reads.aten import aten_name, graph_outputs, in_fresh_thread
from lightning_act.backward_reads.walk import Use, Walk

# The interval a derivative's monotone branch is searched on, and its sampling. A derivative
# still moving beyond half of it is not bounded: not stored this way.
_BRANCH_HALF_WIDTH = 32.0
_BRANCH_SAMPLES = 1 << 14
_LEVEL_TOLERANCE = 1e-4  # of the derivative's span, on the outer half of the interval
_STEP_TOLERANCE = 0.02  # of its span, between two samples: a larger step is a jump


class PointwiseDerivative:
    """The derivative ``h`` of a pointwise op whose input gradient is ``grad * h(x)``, with the
    monotone branch of ``h`` that reaches all its values: what lets ``h(x)`` be stored in place
    of ``x`` (:class:`~lightning_act.codecs.derivative.DerivativeSubstitute` stores it)."""

    def __init__(
        self, derivative: Callable, xs: torch.Tensor, hs: torch.Tensor, dtype: torch.dtype, source: str | None = None
    ):
        #: ``h(x, grad)``: the backward evaluated with a gradient of ones gives the derivative.
        self.h = derivative
        #: The branch, float64 on the CPU, ``hs`` ascending; identified by its values.
        self.table_key = _digest(xs, hs)
        self.xs, self.hs = _BRANCHES.setdefault(self.table_key, (xs.clone(), hs.clone()))
        self.dtype = dtype
        self._source = source

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
            return self._source, str(self.dtype)
        if not isinstance(self.h, fx.GraphModule) or any(n.op == "get_attr" for n in self.h.graph.nodes):
            return None
        code = self.h.code
        return (code, str(self.dtype)) if PointwiseDerivative.from_source(code, str(self.dtype)) else None

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


# Branch tables by their values, held once: each layer's GELU, and each rebuilt derivative, find the same.
_BRANCHES: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}


def _digest(*tables: torch.Tensor) -> bytes:
    """What identifies tables (on the CPU) by their values."""
    digest = hashlib.blake2b(digest_size=16)
    for table in tables:
        digest.update(str(table.numel()).encode())
        digest.update(table.contiguous().numpy().tobytes())
    return digest.digest()


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
