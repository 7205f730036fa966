"""What a compiled graph's nodes say about a saved tensor: the op and module that made it,
the ops that read it, bounds on an integer save's values."""

from __future__ import annotations

import math
import operator
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from lightning_act.backward_reads import (
    ATTENTION_MASK,
    STATISTIC_RATIO,
    Read,
    size_hint,
)
from lightning_act.capture.decide import (
    BATCH_NORM_OPS,
    NONLINEAR_BITS,
    SOFTMAX_OPS,
    ZERO_EXACT_OPS,
    Decision,
    Form,
    Normalized,
    SaveSite,
    decide_site,
)
from lightning_act.codecs.derivative import DerivativeSubstitute
from lightning_act.ops.validation import FLOAT_DTYPES, MIN_GROUP_SIZE

if TYPE_CHECKING:
    pass


VIEW_OPS = frozenset(
    """
    view _unsafe_view reshape permute transpose t expand squeeze unsqueeze select slice alias detach clone
    as_strided
    """.split()
)
_QUALNAME_ACCESS = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def op_name(node: fx.Node) -> str | None:
    """The aten op a node of a compiled graph computes (before decompositions)."""
    return target_name(node.meta.get("original_aten") or node.target)


def target_name(target: Any) -> str | None:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def function_name(node: fx.Node) -> str | None:
    """The torch function the model called that a graph node comes from, as eager's op tracker
    names it (``linear`` for ``addmm``); a module's class name loses its call count (``_1``)."""
    stack = node.meta.get("source_fn_stack")
    if not stack:
        return None
    name, target = stack[-1]
    if isinstance(target, str):
        return target  # a tensor method
    if not isinstance(target, type):
        return getattr(target, "__name__", None)
    return _CALL_COUNT.sub("", name)


_CALL_COUNT = re.compile(r"_\d+$")


def _source(node: fx.Node) -> fx.Node:
    """The node whose result a saved node is, looking through views of it."""
    while op_name(node) in VIEW_OPS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def producer(node: fx.Node) -> str | None:
    """The op that computed a saved node, looking through views of its result."""
    return op_name(_source(node))


def softmax_row(node: fx.Node) -> int | None:
    """The length of the rows a softmax normalised, where a saved node is its result: from
    ``aten._softmax``'s dimension, or, decomposed, from the dimensions its divisor reduced."""
    source = _source(node)
    val = source.meta.get("val")
    if op_name(source) not in SOFTMAX_OPS or not isinstance(val, torch.Tensor):
        return None
    if not val.dim():
        return 1
    if target_name(source.target) in SOFTMAX_OPS:  # the op itself, not a piece of its decomposition
        dim = source.args[1] if len(source.args) > 1 else None
        return size_hint(val.shape[dim]) if isinstance(dim, int) else None
    for argument in source.args[1:]:
        divisor = argument.meta.get("val") if isinstance(argument, fx.Node) else None
        if not isinstance(divisor, torch.Tensor) or divisor.dim() != val.dim():
            continue
        reduced = [size_hint(n) for n, m in zip(val.shape, divisor.shape) if size_hint(m) == 1 and size_hint(n) != 1]
        if reduced:
            return math.prod(reduced)
        # ``_safe_softmax``'s last step, ``where(all masked, zeros, exp / sum)``: its
        # same-sized arguments reduce nothing themselves; the quotient's divisor does.
        if op_name(argument) in SOFTMAX_OPS and (row := softmax_row(argument)) is not None:
            return row
    return None


def is_statistic(node: fx.Node) -> bool:
    """Whether a saved node is a reduction statistic: an op's second or later result (a
    normalisation's 1 / std, an attention's logsumexp), at least ``STATISTIC_RATIO`` times
    smaller than the op's first input, as eager tells them."""
    node = _source(node)
    if node.target is not operator.getitem or not isinstance(node.args[1], int) or node.args[1] < 1:
        return False
    op, val = node.args[0], node.meta.get("val")
    first = next((a for a in op.args if isinstance(a, fx.Node)), None) if isinstance(op, fx.Node) else None
    source = first.meta.get("val") if first is not None else None
    if not isinstance(val, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    return size_hint(source.numel()) >= STATISTIC_RATIO * size_hint(val.numel())


def consumers(node: fx.Node) -> dict[str, tuple]:
    """The forward ops that read a saved node, with their arguments, looking through views of it."""
    names, stack, seen = {}, list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        name = op_name(user)
        if name in VIEW_OPS:
            stack.extend(user.users)
        elif name is not None:
            names[name] = user.args
    return names


# Aten ops whose forward checks every index value against one dimension of a source (negatives
# are errors): name -> (index position, source position, dimension position; None: dimension 0).
_INDEXED_BY = {
    "index_select": (2, 0, 1),
    "gather": (2, 0, 1),
    "scatter": (2, 0, 1),
    "scatter_add": (2, 0, 1),
    "scatter_reduce": (2, 0, 1),
    "index_add": (2, 0, 1),
    "embedding": (1, 0, None),
}
# Aten ops indexing dimension k of their first argument with the k-th of a list of index tensors,
# negatives counting from the end (checked too; not the _unsafe_ variants).
_INDEXED_BY_LIST = {"index": 1, "index_put": 1}


def index_bound(node: fx.Node) -> tuple[int, int] | None:
    """``(low, high)`` bounding every value of an integer node, where the forward reads all of
    them (whole, or row by row as PyG's ``edge_index``) as indices into fixed-size dimensions:
    checked there, so the bound holds. None otherwise."""
    whole = _whole_index_bound(node)
    if whole is not None:
        return whole
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not isinstance(val.shape[0], int):
        return None
    rows: dict[int, tuple[int, int]] = {}
    for user in node.users:
        if (
            target_name(user.target) == "select"
            and user.args[0] is node
            and user.args[1] in (0, -val.dim())
            and isinstance(user.args[2], int)
        ):
            bound = _whole_index_bound(user)
            if bound is not None:
                row = user.args[2] % val.shape[0]
                rows[row] = _intersection(rows[row], bound) if row in rows else bound
    if not rows or len(rows) < val.shape[0]:
        return None
    return min(low for low, _ in rows.values()), max(high for _, high in rows.values())


def _intersection(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


# Views that hold every value of the tensor they view.
_WHOLE_VIEWS = frozenset(
    """
    view _unsafe_view reshape expand unsqueeze squeeze permute transpose t alias clone
    """.split()
)


def _whole_index_bound(node: fx.Node) -> tuple[int, int] | None:
    """The tightest bound among the ops reading the node whole (through views at most) as an
    index into a fixed size."""
    bound = None
    for user in node.users:
        name = target_name(user.target)
        found = None
        if name in _WHOLE_VIEWS and user.args and user.args[0] is node:
            view = user.meta.get("val")  # a view with no values (expanded to size 0) checks none
            found = _whole_index_bound(user) if isinstance(view, torch.Tensor) and view.numel() else None
        elif name in _INDEXED_BY:
            index_at, source_at, dim_at = _INDEXED_BY[name]
            if len(user.args) > index_at and user.args[index_at] is node:
                dim = 0 if dim_at is None else user.args[dim_at]
                size = _fixed_size(user.args[source_at], dim)
                found = None if size is None else (0, size - 1)
        elif name in _INDEXED_BY_LIST and len(user.args) > _INDEXED_BY_LIST[name]:
            indices = user.args[_INDEXED_BY_LIST[name]]
            if isinstance(indices, (list, tuple)) and node in indices:
                size = _fixed_size(user.args[0], list(indices).index(node))
                found = None if size is None else (-size, size - 1)
        if found is not None:
            bound = found if bound is None else _intersection(bound, found)
    return bound


def _fixed_size(source: Any, dim: Any) -> int | None:
    """The size of ``source``'s dimension ``dim``, where it is a fixed, positive int."""
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or not -val.dim() <= dim < val.dim():
        return None
    size = val.shape[dim]
    return size if isinstance(size, int) and size > 0 else None


def backward_readers(placeholder: fx.Node) -> list[tuple[int, int, dict]]:
    """``(forward sequence number, order found, forward module stack)`` of each backward node
    reading ``placeholder`` through views. The compiled module's own ops have an empty stack
    and count all the same (an ``op:`` rule matches them)."""
    readers, stack, seen = [], list(placeholder.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        order = user.meta.get("seq_nr")
        if order is not None and "fwd_nn_module_stack" in user.meta:
            readers.append((int(order), len(readers), user.meta["fwd_nn_module_stack"] or {}))
        elif op_name(user) in VIEW_OPS:
            stack.extend(user.users)
    return readers


def module_qualname(stack: dict | None) -> str | None:
    """The qualified name (``layer1.0.conv1``), relative to the compiled module, of the innermost
    module of a node's ``nn_module_stack``."""
    if not stack:
        return None
    qualname = str(list(stack.values())[-1][0])
    # ``L['self']``, or for a module compiled in place ``L['fn'].__self__`` (its bound call).
    qualname = re.sub(r"^L\[['\"]\w+['\"]\](\.__self__)?", "", qualname)
    qualname = _QUALNAME_ACCESS.sub(lambda m: "." + next(g for g in m.groups() if g is not None), qualname)
    parts = [p for p in qualname.split(".") if p and p != "_orig_mod"]
    return ".".join(parts) if parts else ""


def hinted(val: Any) -> Any:
    """A saved node's value with its sizes as traced (a meta tensor): deciding on symbolic sizes
    under ``dynamic=True`` would guard on them and recompile for every batch size."""
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided or val.is_nested:
        return val
    size = [size_hint(s) for s in val.shape]
    stride = [size_hint(s) for s in val.stride()]
    return torch.empty_strided(size, stride, dtype=val.dtype, device="meta")


# Aten ops that normalise each row (the last dimension) of their input on its own.
_GRAPH_ROW_NORMALIZING_OPS = frozenset({"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"})


_GRAPH_GROUP_NORMALIZING_OPS = frozenset({"native_group_norm", "group_norm"})


_BATCH_NORM_BACKWARD_OPS = frozenset({"native_batch_norm_backward", "batch_norm_backward"})


def _graph_normalization(
    val: torch.Tensor, producer: str | None, consumers: dict[str, tuple]
) -> tuple[Normalized | None, bool]:
    """How a normalisation reading ``val`` groups it, and whether each row is a run of ``val``'s
    memory. A BatchNorm input centred in the forward for its backward is read as the input is."""
    if consumers.keys() & _GRAPH_ROW_NORMALIZING_OPS and val.dim() >= 1:
        return _rows_normalized(val, consumers)
    for name in consumers.keys() & _GRAPH_GROUP_NORMALIZING_OPS:
        arguments = consumers[name]
        groups = arguments[6] if len(arguments) > 6 else None  # native_group_norm's group
        if isinstance(groups, int) and val.dim() >= 2 and groups >= 1 and int(val.shape[1]) % groups == 0:
            return Normalized(int(val.shape[1]) // groups * math.prod(int(s) for s in val.shape[2:])), True
    if (consumers.keys() & BATCH_NORM_OPS or producer in _BATCH_NORM_BACKWARD_OPS) and val.dim() >= 2:
        return Normalized(int(val.numel()) // max(int(val.shape[1]), 1), channels=True), True
    return None, True


def _rows_normalized(val: torch.Tensor, consumers: dict[str, tuple]) -> tuple[Normalized, bool]:
    """The rows a LayerNorm or RMSNorm reading ``val`` normalises: the last dimension of the view
    it reads (the argument as large as ``val``), maybe strided in ``val``'s memory (a conv output
    transposed to tokens). Where sizes are symbolic, ``val``'s last one."""
    for name in consumers.keys() & _GRAPH_ROW_NORMALIZING_OPS:
        for argument in consumers[name]:
            read = getattr(argument, "meta", {}).get("val")
            if (
                isinstance(read, torch.Tensor)
                and read.dim() >= 1
                and all(type(s) is int for s in (*read.shape, *read.stride()))
                and read.numel() == val.numel()
            ):
                return Normalized(read.shape[-1]), read.shape[-1] == 1 or read.stride()[-1] == 1
    return Normalized(int(val.shape[-1])), True


def _in_channels_last_memory(val: torch.Tensor) -> bool:
    """Whether ``val.movedim(1, -1)`` is contiguous (a convolution's output in channels-last)."""
    return int(val.shape[1]) > 1 and not val.is_contiguous() and val.movedim(1, -1).is_contiguous()


def _overlaps(val: torch.Tensor) -> bool:
    """Whether two indices of ``val`` address one element (an expanded or unfolded view)."""
    extent = 1
    for size, stride in sorted(
        ((int(n), int(s)) for n, s in zip(val.shape, val.stride()) if n != 1), key=lambda d: d[1]
    ):
        if stride < extent:
            return True
        extent = stride * size
    return False


def decide_saved_node(
    val: object,
    read: Read,
    producer: str | None,
    consumers: dict[str, tuple],
    *,
    min_numel: int,
    group_size: int,
    statistic: bool = False,
    index_range: tuple[int, int] | None = None,
    softmax_row: int | None = None,
) -> Decision:
    """How to store a tensor a compiled forward saves: :func:`decide_site` on what the graph
    shows of it, as a graph's plan can store it.

    Args:
        read: how the compiled backward reads it (:func:`~lightning_act.backward_reads.graph_reads`).
        producer: the aten op that computed it (views looked through), as eager names the op
            saving an output.
        consumers: the forward ops that read it, with their arguments, as eager names the op
            saving an input.
        min_numel: smaller tensors are kept as they are.
        statistic: the node is a reduction statistic of its op (a normalisation's 1 / std).
        softmax_row: the length of the rows a softmax normalised, where the node is its result.
        index_range: an integer node's bound, where the graph implies one (:func:`index_bound`).

    A graph's pack op sees one tensor and writes one record, so unlike eager it keeps a tensor
    read through an equality test (:class:`~lightning_act.capture.compiled.CheaperSaves` saves
    the outcome instead), a fused attention's float mask, and rows not runs of whole groups; with
    no ``-inf`` stand-in or portable derivative source, it stores the input at 8 bits.
    """
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided or val.is_nested:
        return Decision(Form.KEEP)
    normalized, runs = _graph_normalization(val, producer, consumers) if val.dtype in FLOAT_DTYPES else (None, True)
    site = SaveSite(
        val.dtype,
        int(val.numel()),
        not _overlaps(val),
        val.is_contiguous(),
        read,
        zero_exact=producer in ZERO_EXACT_OPS,
        softmax=producer in SOFTMAX_OPS,
        normalized=normalized,
        short_rows=(normalized is not None and normalized.row < MIN_GROUP_SIZE)
        or (softmax_row is not None and softmax_row < MIN_GROUP_SIZE),
        statistic=statistic,
        index_range=index_range,
    )
    decision = decide_site(site, min_numel=min_numel)
    if decision.form is Form.MATCH:
        return Decision(Form.KEEP)
    if decision.form is not Form.QUANTIZE:
        return decision
    substitute = decision.substitute
    if isinstance(substitute, DerivativeSubstitute):
        if substitute.source is not None:
            return decision
        decision = decision._replace(min_bits=NONLINEAR_BITS, substitute=None)
    elif substitute is not None:
        if read.reason == ATTENTION_MASK:
            return Decision(Form.KEEP)
        decision = decision._replace(substitute=None)
    if normalized is None:
        return decision
    if normalized.channels:
        if val.dim() < 3:
            return decision
        if _in_channels_last_memory(val):
            channel = int(val.numel()) // int(val.shape[1])
            row_group = min(channel & -channel, group_size)
            if row_group < MIN_GROUP_SIZE:
                return Decision(Form.KEEP)
            return decision._replace(row_group=row_group, group_axis=0, channels_last=True)
        # Groups within one sample's map of a channel; a map too small for a group is read
        # channel-major (down the batch axis), as eager lays it out. Other memory orders: kept.
        plane = math.prod(int(s) for s in val.shape[2:]) if val.is_contiguous() else 0
        row_group, axis = min(plane & -plane, group_size), None
        if row_group < MIN_GROUP_SIZE and plane > 0 and val.shape[0] > 1:
            channel = int(val.shape[0]) * plane
            row_group, axis = min(channel & -channel, group_size), 0
    elif not runs:
        # Rows strided in memory: groups in memory order at the rows' floor, as eager does.
        return decision
    else:
        # Groups within rows: the largest power of two dividing a row, up to group_size.
        row_group, axis = min(normalized.row & -normalized.row, group_size), None
    if row_group < MIN_GROUP_SIZE:
        return Decision(Form.KEEP)
    return decision._replace(row_group=row_group, group_axis=axis)
