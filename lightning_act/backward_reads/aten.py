"""Reading an aten graph: op names, arguments, outputs, the read markers of a traced backward,
sizes as traced."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

MARKER_NAMESPACE = "lightning_act_reads"
_marker_library = torch.library.Library(MARKER_NAMESPACE, "DEF")
_marker_library.define("read(Tensor t, int slot) -> Tensor")


@torch.library.impl(_marker_library, "read", "CompositeExplicitAutograd")
def _read(t: torch.Tensor, slot: int) -> torch.Tensor:
    return t.clone()


@torch.library.register_fake(f"{MARKER_NAMESPACE}::read", lib=_marker_library)
def _read_fake(t: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(t)


def is_marker(node: fx.Node) -> bool:
    """A read of a saved tensor, or a gradient, as the eager trace marks them."""
    return node.op == "call_function" and node.target is torch.ops.lightning_act_reads.read.default


def in_fresh_thread(work: Callable[[], Any]) -> Any:
    """``work()`` in a thread of its own: a trace needs clean per-thread state (a pack hook runs
    inside the saving op's dispatch, with autocast excluded and the caller's hooks and modes
    active), and the frames FX keeps in reference cycles are then this thread's, not the
    caller's with its tensors."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="lightning_act-trace")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def size_hint(value: Any) -> int:
    """A size, symbolic or not, as traced (1 where a symbolic one has no hint)."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return optimization_hint(value, fallback=1)


ATEN_NAMESPACES = frozenset({"aten", "prims"})


def aten_name(target) -> str:
    """An aten op's name, its in-place form read as the op (``masked_fill_`` as ``masked_fill``)."""
    if not isinstance(target, torch._ops.OpOverload):
        return str(target)
    name = target.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def schema_names(target) -> list[str]:
    return [a.name for a in target._schema.arguments]


def node_arguments(node: fx.Node) -> list[tuple[str | None, Any]]:
    """``(schema name, value)`` of each argument of an aten call node, keywords included."""
    target = node.target
    names = schema_names(target) if isinstance(target, torch._ops.OpOverload) else []
    out = [(names[i] if i < len(names) else None, a) for i, a in enumerate(node.args)]
    out.extend(node.kwargs.items())
    return out


def is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in val)
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def graph_outputs(graph: fx.Graph) -> list:
    """What the graph returns (its output node is its last)."""
    return pytree.tree_leaves(next(reversed(graph.nodes)).args)


_positions: weakref.WeakKeyDictionary[fx.Graph, dict[fx.Node, int]] = weakref.WeakKeyDictionary()


def downstream(target: fx.Node) -> list[fx.Node]:
    """The call nodes computed from ``target``, in graph order, found through users so that
    each save of a long graph costs what it reaches, not the whole graph."""
    graph = target.graph
    if graph not in _positions:
        _positions[graph] = {node: i for i, node in enumerate(graph.nodes)}
    position = _positions[graph]
    found, stack = set(), list(target.users)
    while stack:
        node = stack.pop()
        if node in found or node.op != "call_function":
            continue
        found.add(node)
        stack.extend(node.users)
    return sorted(found, key=position.__getitem__)
