"""The algebra's graphs: an eager call traced on fake tensors, or a compiled region's backward."""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lightning_act.backward_reads.aten import aten_name, downstream, graph_outputs, in_fresh_thread, is_marker
from lightning_act.backward_reads.derivative import PointwiseDerivative
from lightning_act.backward_reads.linearity import PROBE_NUMEL
from lightning_act.backward_reads.walk import NONNEGATIVE, Match, Read, Recompute, SaveOf, Saves, Use, Walk
from lightning_act.optrack import arguments_key

# ------------------------------------------------------------------------ eager: trace a call
_TANGENT_SLOTS = -1  # tangents are marked with slots -1, -2, ...


class _Traced(NamedTuple):
    reads: tuple[Read, ...]
    #: (dtype, rank) of each traced save, checked against the real ones.
    saves: tuple[tuple[torch.dtype, int], ...]


_cache: dict[Any, _Traced | None] = {}
# Why a function's calls could not be traced at all, by function (the first reason met).
_UNTRACED: dict[Any, str] = {}


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Without torch's log of a fake kernel that raised: the call is then traced another way."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def untraced_reason(func: Any) -> str | None:
    """Why calls of ``func`` could be traced neither on fake tensors nor on their own values."""
    return _UNTRACED.get(func)


_cache_lock = threading.Lock()


def _signature(value: Any) -> Any:
    """The trace's key for arguments: a tensor by its dtype, rank, dimensions of size one,
    requires_grad, layout and device type; a module or generator by its type."""
    return arguments_key(value, _tensor_signature, lambda other: type(other).__qualname__)


def _tensor_signature(t: torch.Tensor) -> tuple:
    return ("T", t.dtype, t.dim(), tuple(s == 1 for s in t.shape), t.requires_grad, t.layout, t.device.type)


def _sharing(flat: list, positions: list[int]) -> list[int]:
    """For each tensor argument, the number of the first that is the same object (in order of
    first appearance): a call may branch on it (``query is key is value`` in attention)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(flat[i]), len(first)) for i in positions]


def call_reads(
    func: Callable, args: tuple, kwargs: dict, autocast: tuple = ()
) -> tuple[tuple[Read, ...], tuple] | None:
    """How backward reads each tensor ``func(*args, **kwargs)`` saves, in order, with the
    ``(dtype, rank)`` of each; None if the call cannot be traced. ``autocast`` is the call's
    (:func:`~lightning_act.optrack.autocast_state`): it decides what is cast and saved."""
    try:
        flat = pytree.tree_leaves((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        key = (func, _signature(args), _signature(kwargs), autocast, tuple(_sharing(flat, positions)))
        hash(key)
    except TypeError:
        return None
    with _cache_lock:
        if key in _cache:
            traced = _cache[key]
            return None if traced is None else (traced.reads, traced.saves)
    traced = in_fresh_thread(lambda: _trace(func, args, kwargs, autocast))
    with _cache_lock:
        _cache[key] = traced
    return None if traced is None else (traced.reads, traced.saves)


@functools.cache
def _backward_decompositions() -> dict:
    """Torch's core decompositions of backward kernels. Forward ops are left whole: a
    decomposition may return other extras than the kernel (a flash attention's logsumexp),
    and autograd saves those."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if "backward" in op.name()}


def _trace(func: Callable, args: tuple, kwargs: dict, autocast: tuple) -> _Traced | None:
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    if any(flat[i].layout != torch.strided or flat[i].is_nested for i in positions):
        return None
    shared = _sharing(flat, positions)
    distinct = [positions[shared.index(k)] for k in range(max(shared, default=-1) + 1)]
    requires = [flat[i].requires_grad for i in distinct]
    saves: list[tuple[torch.dtype, int]] = []
    autocasts = [autocast]  # the autocast each trace runs the call under

    def joint(*tensors):
        saves.clear()
        values, leaves, traced = list(flat), [], []
        for t, grad in zip(tensors, requires):
            if grad:
                leaf = t.detach().requires_grad_(True)
                leaves.append(leaf)
                t = leaf.clone()  # not a leaf, so in-place calls may write it
            traced.append(t)
        for i, k in zip(positions, shared):  # one tensor passed twice stays one tensor
            values[i] = traced[k]
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)

        def pack(saved: torch.Tensor):
            saves.append((saved.dtype, saved.dim()))
            return len(saves) - 1, saved

        def unpack(packed):
            slot, saved = packed
            return torch.ops.lightning_act_reads.read(saved, slot)

        with contextlib.ExitStack() as stack:
            # The call's own autocast, so that it casts and saves as it does for real.
            for device, dtype, cache in autocasts[0]:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            out = func(*call_args, **call_kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        if not outs or not leaves:
            return ()
        tangents = [
            torch.ops.lightning_act_reads.read(torch.ones_like(o), _TANGENT_SLOTS - k) for k, o in enumerate(outs)
        ]
        return torch.autograd.grad(outs, leaves, tangents, allow_unused=True)

    rng = torch.random.get_rng_state()
    try:
        with torch.enable_grad():
            try:
                with _quiet_fake_tensors():
                    gm = make_fx(joint, tracing_mode="fake", decomposition_table=_backward_decompositions())(
                        *[flat[i] for i in distinct]
                    )
            except Exception as error:
                # A fake kernel narrower than the real one (a dtype it refuses, a data-dependent
                # shape, an extension op with none): the call is traced on its own values instead,
                # CPU copies of them (no device memory), with the CPU's autocast alone.
                copies = _cpu_copies([flat[i] for i in distinct])
                if copies is None:
                    raise RuntimeError("too large to trace on its own values") from error
                autocasts[0] = _cpu_autocast(autocast)
                gm = make_fx(joint, tracing_mode="real", decomposition_table=_backward_decompositions())(*copies)
    except Exception as error:
        _UNTRACED.setdefault(func, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
        return None
    finally:
        torch.random.set_rng_state(rng)
    markers = [n for n in gm.graph.nodes if is_marker(n)]
    tangents = [n for n in markers if n.args[1] <= _TANGENT_SLOTS]
    slots: dict[int, list[fx.Node]] = {}
    for n in markers:
        if n.args[1] >= 0:
            slots.setdefault(n.args[1], []).append(n)
    saved = {n for marked in slots.values() for n in marked}
    written = _written(gm.graph)
    reads, unused = [], []
    for slot in range(len(saves)):
        nodes = slots.get(slot, [])
        if not nodes:
            reads.append(Read(Use.NONE))  # saved and never read in backward
        elif any(n.args[0] in written for n in nodes):
            # Saved, then written by the call itself (``rrelu``'s noise): only the tensor
            # itself holds what backward will read.
            reads.append(Read(Use.EXACT, reason="written after it is saved"))
        elif not any(_used(n) for n in nodes):
            unused.append(slot)
            reads.append(Read(Use.NONE))
        else:  # read twice (a double backward): the stricter
            reads.append(max((classify(n, tangents, Saves(saved)) for n in nodes), key=lambda r: r.use))
    if unused:
        # Unpacked, and reaching no gradient as traced: torch's formula may branch on fake
        # tensors (prod's backward avoids ``result / input`` for a tensor subclass).
        read_for_real = _slots_read_for_real(
            func, flat, spec, positions, shared, requires, autocast, len(saves), unused
        )
        for slot in unused:
            if read_for_real is None or slot in read_for_real:
                reads[slot] = Read(Use.SINGULAR, reason=_UNTRACED_BRANCH)
    given = {v for v in flat if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return _Traced(_with_recomputes(_with_matches(reads, slots), slots, saves, given), tuple(saves))


def _cpu_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """CPU copies of a call's own tensors, to run it on values it already ran on (no device
    memory, no forked process); None beyond ``PROBE_NUMEL`` values in all."""
    if sum(t.numel() for t in tensors) > PROBE_NUMEL:
        return None
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _cpu_autocast(autocast: tuple) -> tuple:
    """The CPU's part of a call's autocast, which its CPU copies run under."""
    return tuple(entry for entry in autocast if entry[0] == "cpu")


#: :attr:`Read.reason` of a save the traced backward does not use and the real one reads.
_UNTRACED_BRANCH = "read by a branch the trace did not take"


def _slots_read_for_real(
    func: Callable,
    flat: list,
    spec,
    positions: list[int],
    shared: list[int],
    requires: list[bool],
    autocast: tuple,
    saves: int,
    slots: list[int],
) -> frozenset[int] | None:
    """Of ``slots``, the saves whose values the call's real backward reads: each in turn is
    handed back as NaN, then as other values; a gradient that turns NaN or changes read it.
    Run on CPU copies of the call's own arguments, values it already ran on, so no forked
    process is needed (nor could one run backward once autograd's threads have started).
    None where it cannot be measured (no CPU kernel, other saves than traced)."""
    copies = _cpu_copies([flat[i] for i in positions])
    if copies is None:
        return None
    generator = torch.Generator().manual_seed(0)

    def gradients(
        slot: int | None = None, replace: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> list | None:
        values, distinct, leaves = list(flat), {}, []
        for i, k, copy in zip(positions, shared, copies):
            if k not in distinct:
                distinct[k] = copy.clone()
                if requires[k] and (copy.is_floating_point() or copy.is_complex()):
                    leaf = copy.clone().requires_grad_(True)
                    leaves.append(leaf)
                    distinct[k] = leaf.clone()  # not a leaf, as the traced call's are not
            values[i] = distinct[k]
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        count = [0]

        def pack(t: torch.Tensor):
            count[0] += 1
            return count[0] - 1, t

        def unpack(packed):
            index, t = packed
            return replace(t) if index == slot and t.is_floating_point() else t

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for device, dtype, cache in _cpu_autocast(autocast):
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            out = func(*call_args, **call_kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        if count[0] != saves or not outs or not leaves:
            return None  # not the call traced
        return list(torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True))

    def nan(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan"))

    def other(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=generator, dtype=t.dtype) * (1 + t.abs().amax()) if t.numel() else t

    def read_slots() -> frozenset[int] | None:
        exact = gradients()
        if exact is None:
            return None
        found = set()
        for slot in slots:
            poisoned, moved = gradients(slot, nan), gradients(slot, other)
            if poisoned is None or moved is None:
                return None
            if any(
                g is not None and (bool(torch.isnan(g).any()) or not torch.equal(g, m)) for g, m in zip(poisoned, moved)
            ) or any(
                (g is None) != (e is None) or (g is not None and not torch.equal(g, e)) for g, e in zip(moved, exact)
            ):
                found.add(slot)
        return frozenset(found)

    rng = torch.random.get_rng_state()
    try:
        return read_slots()
    except Exception:
        return None
    finally:
        torch.random.set_rng_state(rng)


def _used(marker: fx.Node) -> bool:
    """Whether ``marker``'s value, or its shape, reaches a gradient backward returns."""
    return any(user.op == "output" for node in (marker, *downstream(marker)) for user in node.users)


def _written(graph: fx.Graph) -> set[fx.Node]:
    """The values an op of ``graph`` writes into (an argument its schema marks mutable)."""
    written = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for argument, value in zip(node.target._schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
                written.add(value)
    return written


# -------------------------------------------------------------- equality with other saves
# The ops through which backward computes, from the call's other saves, what it compares a
# save with. None takes a size (fixed at the trace's shapes) but a view putting a reduction's
# dimensions back, rebuilt from the compared tensor's own shape (:func:`_put_back_dims`).
_MATCH_OTHER_OPS = frozenset({"detach", "alias", "gather", "index_select", "unsqueeze", "squeeze", "clone"})
_MATCH_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})
_MATCH_PASS = frozenset({"detach", "alias"})
_EQUALITY = frozenset({"eq", "ne"})
_AND = frozenset({"logical_and", "logical_and_", "bitwise_and", "bitwise_and_"})


def _with_recomputes(
    reads: tuple[Read, ...], slots: dict[int, list[fx.Node]], saves: list[tuple[torch.dtype, int]], given: set
) -> tuple[Read, ...]:
    """``reads`` with a :class:`Recompute` on each float output of a fused attention without
    dropout whose tensor arguments the call saved before it. Its other arguments must be
    flags, zero, or numbers the call was ``given``: a trace serves every call of its
    signature, so a number computed from a size would be another call's."""
    source = {nodes[0].args[0]: slot for slot, nodes in slots.items()}
    found = list(reads)
    for slot, nodes in slots.items():
        value = nodes[0].args[0]
        if value.target is not operator.getitem or not saves[slot][0].is_floating_point:
            continue
        op, output = value.args
        if not (isinstance(op, fx.Node) and isinstance(op.target, torch._ops.OpOverload)):
            continue
        name = aten_name(op.target)
        if "attention" not in name or "backward" in name:
            continue
        schema = {argument.name: a for argument, a in zip(op.target._schema.arguments, op.args)}
        schema.update(op.kwargs)
        if schema.get("dropout_p", 0.0) != 0.0:
            continue  # its random mask is drawn again: not the one backward reads
        leaves = pytree.tree_leaves((op.args, op.kwargs))
        tensors = [a for a in leaves if isinstance(a, fx.Node)]
        if not all(a in source and source[a] < slot for a in tensors):
            continue
        numbers = [a for a in leaves if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if any(a != 0 and a not in given for a in numbers):
            continue
        arguments = pytree.tree_map(lambda a: SaveOf(source[a]) if isinstance(a, fx.Node) else a, (op.args, op.kwargs))
        inputs = tuple(dict.fromkeys(source[a] for a in tensors))
        found[slot] = found[slot]._replace(recompute=Recompute(op.target, arguments, output, inputs))
    return tuple(found)


def _put_back_dims(result: torch.Tensor, shape: torch.Size, reduced: tuple[int, ...]) -> torch.Tensor:
    """``result`` viewed as ``shape`` with the ``reduced`` dimensions of size one."""
    return result.view([1 if d in reduced else size for d, size in enumerate(shape)])


def _with_matches(reads: list[Read], slots: dict[int, list[fx.Node]]) -> tuple[Read, ...]:
    """``reads`` with a :class:`Match` on each save backward only tests for equality with a
    value computed from other saves. Of two saves compared with each other, only the larger
    is stored as its match."""
    found = {
        slot: _match(slot, slots)
        for slot, read in enumerate(reads)
        if read.use is Use.EXACT and read.reason in _EQUALITY
    }
    matches = {slot: match for slot, (match, _) in found.items() if match is not None}
    covered = {slot: nodes for slot, (match, nodes) in found.items() if match is not None}

    def numel(slot: int) -> int:
        val = slots[slot][0].meta.get("val")
        return val.numel() if isinstance(val, torch.Tensor) else 0

    for slot, match in list(matches.items()):
        for partner in match.partners:
            if (
                partner in matches
                and slot in matches[partner].partners
                and (numel(slot), -slot) < (numel(partner), -partner)
            ):
                matches.pop(slot, None)
                covered.pop(slot, None)
    partners = {
        slot: _matched_against(slot, slots, matches, covered)
        for slot, read in enumerate(reads)
        if slot not in matches and read.use is Use.EXACT and read.reason in _EQUALITY
    }
    return tuple(
        read._replace(match=matches.get(slot), match_partner=partners.get(slot, ())) for slot, read in enumerate(reads)
    )


def _matched_against(
    slot: int, slots: dict[int, list[fx.Node]], matches: dict[int, Match], covered: dict[int, frozenset[fx.Node]]
) -> tuple[int, ...]:
    """The saves stored as their match that save ``slot`` is compared with, where backward
    reads it only for those comparisons and they are saved before it (their outcomes are
    taken when it arrives); else none. Not where a comparison also reads ``isnan``: a stored
    copy need not keep NaN where the tensor had it."""
    dependents = tuple(sorted(other for other, match in matches.items() if slot in match.partners))
    if not dependents or dependents[-1] > slot or any(matches[other].reads_nan for other in dependents):
        return ()
    reads = frozenset().union(*(covered[other] for other in dependents))
    frontier, seen = list(slots[slot]), set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user not in reads:
                return ()
            if not (isinstance(user.target, torch._ops.OpOverload) and aten_name(user.target) in _EQUALITY):
                frontier.append(user)
    return dependents


def _match(slot: int, slots: dict[int, list[fx.Node]]) -> tuple[Match | None, frozenset[fx.Node]]:
    """The :class:`Match` of save ``slot`` if every read of it is ``x == other`` or
    ``isnan(x) & isnan(other)``, with one ``other`` computed from other saves, else None;
    with the nodes that compute ``other`` and compare it."""
    none = None, frozenset()
    others, nan_others, frontier, comparisons = set(), set(), list(slots[slot]), set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            name = aten_name(user.target) if isinstance(user.target, torch._ops.OpOverload) else None
            if name in _MATCH_PASS:
                frontier.append(user)
            elif name in _EQUALITY and len(user.args) == 2 and not user.kwargs:
                other = user.args[1] if user.args[0] is node else user.args[0]
                if not isinstance(other, fx.Node) or other is node:
                    return none
                others.add(other)
                comparisons.add(user)
            elif name == "isnan":
                nan_other = _and_isnan_of(user)
                if nan_other is None:
                    return none
                nan_others.add(nan_other)
                comparisons.add(user)
            else:
                return none
    traced = slots[slot][0].meta.get("val")
    if len(others) != 1 or not nan_others <= others or not isinstance(traced, torch.Tensor):
        return none
    (other,) = others
    marker_slots = {n: s for s, nodes in slots.items() for n in nodes}
    needed, stack, partners, reduced = set(), [other], set(), {}
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if node in marker_slots:
            if marker_slots[node] == slot:
                return none  # compared with a value of its own
            partners.add(marker_slots[node])
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return none
        name = aten_name(node.target)
        if name in _MATCH_VIEWS:
            dims = _reduced_dims(node.args[1], tuple(traced.shape))
            if dims is None:
                return none
            reduced[node] = dims
        elif name not in _MATCH_OTHER_OPS:
            return none
        stack.extend(node.all_input_nodes)
    order = sorted(partners)
    graph = fx.Graph()
    shape = graph.placeholder("shape")
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {s: graph.placeholder(f"save_{s}") for s in order}
    for node in other.graph.nodes:  # in graph order, so that inputs come first
        if node not in needed:
            continue
        if node in marker_slots:
            env[node] = placeholders[marker_slots[node]]
        elif node in reduced:
            env[node] = graph.call_function(_put_back_dims, (env[node.args[0]], shape, reduced[node]))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[other])
    match = Match(tuple(order), fx.GraphModule(torch.nn.Module(), graph), bool(nan_others))
    return match, frozenset(needed | comparisons)


def _and_isnan_of(isnan: fx.Node) -> fx.Node | None:
    """``o`` where every use of ``isnan`` is ``isnan & isnan(o)``, else None."""
    found = set()
    for user in isnan.users:
        name = aten_name(user.target) if isinstance(user.target, torch._ops.OpOverload) else None
        if name not in _AND or len(user.args) != 2 or user.kwargs:
            return None
        partner = user.args[1] if user.args[0] is isnan else user.args[0]
        if not (
            isinstance(partner, fx.Node)
            and isinstance(partner.target, torch._ops.OpOverload)
            and aten_name(partner.target) == "isnan"
            and isinstance(partner.args[0], fx.Node)
        ):
            return None
        found.add(partner.args[0])
    return found.pop() if len(found) == 1 else None


def _reduced_dims(sizes: Any, traced: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dimensions a view to ``sizes`` puts back as ones, where ``sizes`` is the traced
    shape with those dimensions one; None for any other view."""
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(traced):
        return None
    if not all(isinstance(size, int) and size in (1, full) for size, full in zip(sizes, traced)):
        return None
    return tuple(d for d, (size, full) in enumerate(zip(sizes, traced)) if size == 1 and full != 1)


# --------------------------------------------------------------- compiled: a backward graph
_graph_cache: weakref.WeakKeyDictionary[fx.Graph, dict[str, Read]] = weakref.WeakKeyDictionary()


def graph_reads(backward: fx.Graph, forward: fx.Graph | None = None) -> dict[str, Read]:
    """How a compiled region's backward graph reads each tensor its forward saves, by the
    name of the placeholder that receives it. Read once per graph, as first seen: torch
    inlines the unpack hooks into it later. ``forward`` tells which saves are never negative."""
    reads = _graph_cache.get(backward)
    if reads is None:
        reads = _graph_cache[backward] = in_fresh_thread(lambda: _read_graph(backward, forward))
    return reads


def is_tangent(node: fx.Node) -> bool:
    """A placeholder of a compiled backward that receives a gradient (not a saved tensor)."""
    return node.name.startswith("tangents")


def _read_graph(backward: fx.Graph, forward: fx.Graph | None) -> dict[str, Read]:
    placeholders = [n for n in backward.nodes if n.op == "placeholder"]
    decomposed = _decomposed(backward, placeholders)
    nodes = placeholders if decomposed is None else [n for n in decomposed.nodes if n.op == "placeholder"]
    tangents = [n for p, n in zip(placeholders, nodes) if is_tangent(p)]
    saved = {p.name: n for p, n in zip(placeholders, nodes) if not is_tangent(p)}
    # What the forward computed each save with (``exp(x)``, divided by ``1 + exp(x)`` in backward).
    made_by = {n.name: n for n in forward.nodes} if forward is not None else {}
    saves = Saves(
        set(saved.values()),
        {
            n
            for name, n in saved.items()
            if name in made_by
            and made_by[name].op == "call_function"
            and aten_name(made_by[name].target) in NONNEGATIVE
        },
        {n for name, n in saved.items() if name in made_by and made_by[name].op == "placeholder"},
    )
    return {name: classify(n, tangents, saves, compiled=True) for name, n in saved.items()}


def _decomposed(backward: fx.Graph, placeholders: list[fx.Node]) -> fx.Graph | None:
    """``backward`` retraced with its backward kernels decomposed, placeholders in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int

    copied = fx.Graph()
    copied.output(copied.graph_copy(backward, {}))
    module = fx.GraphModule(backward.owning_module or torch.nn.Module(), copied)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            inputs = []
            for node in placeholders:
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    size = [hint_int(s) for s in val.shape]
                    stride = [hint_int(s) for s in val.stride()]
                    inputs.append(torch.empty_strided(size, stride, dtype=val.dtype, device=val.device))
                elif isinstance(val, (int, torch.SymInt)):
                    inputs.append(hint_int(val))
                else:
                    return None
        with mode:
            return make_fx(fx.Interpreter(module).run, decomposition_table=_backward_decompositions())(*inputs).graph
    except Exception:
        return None


def classify(
    target: fx.Node, tangents: Iterable[fx.Node] = (), saves: Saves = Saves(), *, compiled: bool = False
) -> Read:
    """How the graph of ``target``, a saved tensor's node, reads it on the way to the outputs.
    ``tangents``: the incoming gradients' nodes; ``compiled``: a compiled region's whole backward."""
    tangents = list(tangents)
    walk = Walk(target, saves)
    read = walk.result(graph_outputs(target.graph), whole_graph=compiled)
    if Use.QUADRATIC <= read.use <= Use.SINGULAR and not walk.compared:
        derivative = PointwiseDerivative.find(target, tangents, walk, compiled)
        if derivative is not None:
            return Read(Use.LINEAR, derivative=derivative)
    return read
