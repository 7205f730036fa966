"""The :class:`~lightning_act.capture.decide.SaveSite` of an eager save, read off the call the op
tracker reports, and the decision made from it (:func:`decide`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_act.backward_reads import (
    STATISTIC_RATIO,
    Read,
    Use,
    call_reads,
    untraced_reason,
)
from lightning_act.capture.decide import (
    BATCH_NORM_OPS,
    SOFTMAX_OPS,
    ZERO_EXACT_OPS,
    Decision,
    Form,
    Normalized,
    SaveSite,
    decide_site,
    row_grouping,
)
from lightning_act.capture.records import Layout
from lightning_act.ops.validation import MIN_GROUP_SIZE
from lightning_act.optrack import (
    LOOK_UP,
    PLAIN_TYPES,
    TrackedCall,
    arguments_key,
    call_argument,
    is_same_tensor,
    saved_index_range,
)

# Ops that read the tensor they save only for its sign.
_SIGN_ONLY_OPS = frozenset({"leaky_relu", "leaky_relu_"})

__all__ = ["call_key", "decide", "read_of", "site_of_call", "source_parameter"]


# Ops whose backward reads the saved tensor only for whether it lies strictly inside an
# interval (given by the call): a 1-bit mask is exact where rounding near an end would flip the
# gradient. The in-place forms save the output, clamped to the ends: the mask is the same.
_INTERVAL_OPS = {
    "hardtanh": lambda call: (call_argument(call, 1, "min_val"), call_argument(call, 2, "max_val")),
    "relu6": lambda call: (0.0, 6.0),
    "hardsigmoid": lambda call: (-3.0, 3.0),
}
_INTERVAL_OPS.update({name + "_": interval for name, interval in list(_INTERVAL_OPS.items())})


_HARDTANH_DEFAULT_INTERVAL = (-1.0, 1.0)


# Dropout on the CPU saves its noise, bernoulli(1 - p) / (1 - p): a mask and a known scale.
_DROPOUT_OPS = frozenset({"dropout", "dropout_"})


# Recurrent ops run every step under one call, so their trace grows with the sequence: not traced.
# A short sequence's trace reads their float saves quadratically at most (``tests/test_decide.py``).
_RECURRENT_OPS = frozenset({"gru", "lstm", "rnn_tanh", "rnn_relu"})


_RECURRENT_READ = Read(Use.QUADRATIC)


# Normalisations whose backward scales each row's noise by its 1 / std: a group spanning two rows
# takes the wider one's range, and the narrow row's amplified noise swamps its gradient. So their
# input is grouped within rows (BatchNorm's rows: its channels).
_ROW_NORMALIZING_OPS = frozenset({"layer_norm", "rms_norm", "group_norm", "instance_norm"})


# RMSNorm written out (HF's Llama, T5): ``x * rsqrt(mean(x**2) + eps)``. Backward multiplies the
# two uses of the rounded ``x`` (quadratic), found by the factor's history reaching ``x``.
_SCALING_OPS = frozenset({"mul", "mul_", "multiply", "__mul__", "__rmul__"})


_ROW_FACTOR_HISTORY = 8  # autograd nodes searched from the factor back to x


# Autograd nodes that only view or cast their single input: walked to find a disguised parameter.
_VIEW_OR_CAST_NODES = frozenset(
    """
    AliasBackward0 CloneBackward0 ExpandBackward0 PermuteBackward0 ReshapeAliasBackward0 SelectBackward0
    SliceBackward0 SqueezeBackward0 SqueezeBackward1 SqueezeBackward2 TBackward0 ToCopyBackward0 TransposeBackward0
    UnsafeViewBackward0 UnsqueezeBackward0 ViewBackward0
    """.split()
)


_KEEP, _PARAMETER, _CAST_PARAMETER, _EXTERNAL = (
    Decision(form) for form in (Form.KEEP, Form.PARAMETER, Form.CAST_PARAMETER, Form.EXTERNAL)
)


def source_parameter(t: torch.Tensor) -> tuple[nn.Parameter | None, bool]:
    """The parameter ``t`` views or casts, and whether ``t`` is an exact cast copy of it."""
    base = t._base
    if base is None:
        base = t
    if type(base) is not torch.Tensor and _is_parameter(base):
        return base, False
    node = base.grad_fn
    if node is None:
        return None, False
    name = node.name()
    if name not in _VIEW_OR_CAST_NODES:
        return None, False  # an activation: most saves, with no walk
    recastable = name == "ToCopyBackward0"
    while node is not None and node.name() in _VIEW_OR_CAST_NODES:
        node = node.next_functions[0][0]
    variable = getattr(node, "variable", None)
    if not isinstance(variable, nn.Parameter):
        return None, False
    exact = (
        recastable
        and node is base.grad_fn.next_functions[0][0]
        and base.shape == variable.shape
        and base.stride() == variable.stride()
        and base.storage_offset() == 0
    )
    return variable, exact


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, skipping the metaclass's slow check for a plain tensor."""
    kind = type(t)
    return kind is nn.Parameter or (kind is not torch.Tensor and isinstance(t, nn.Parameter))


def _tensor_arguments(call: TrackedCall) -> list[torch.Tensor]:
    return [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]


def _is_input(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is one of the op's inputs or a view of one."""
    if any(a is t for a in inputs):
        return True
    storage = t.untyped_storage().data_ptr()
    return any(a.untyped_storage().data_ptr() == storage for a in inputs)


def _is_statistic(t: torch.Tensor, call: TrackedCall) -> bool:
    inputs = _tensor_arguments(call)
    # Only a larger activation (not a parameter) makes it a statistic; the cheap test, first.
    larger = [a for a in inputs if a.numel() >= t.numel() * STATISTIC_RATIO]
    if not larger or all(source_parameter(a)[0] is not None for a in larger):
        return False
    if _is_input(t, inputs):
        return False
    # Not an activation inside a composite op (a recurrent step's gate).
    return t.grad_fn is None or _is_direct_output(t, inputs)


def _is_direct_output(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is the op's output or a copy of an input (its node reads the op's inputs
    through views and copies at most), not a value computed inside it (a recurrent step's)."""
    nodes = {id(a.grad_fn) for a in inputs if a.grad_fn is not None}
    leaves = {id(a) for a in inputs if a.grad_fn is None}

    def reaches_input(node) -> bool:
        while node is not None:
            if id(node) in nodes or id(getattr(node, "variable", None)) in leaves:
                return True
            if node.name() not in _VIEW_OR_CAST_NODES:
                return False
            node = node.next_functions[0][0]
        return False

    node = t.grad_fn
    if node.name() in _VIEW_OR_CAST_NODES and reaches_input(node):
        return True
    return any(reaches_input(parent) for parent, _ in node.next_functions)


def _is_first_argument(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is the call's input (its first argument), as a normalisation takes it."""
    return is_same_tensor(call_argument(call, 0, "input"), t)


def _is_scaled_by_own_row_factor(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``call`` multiplies ``t`` by a factor per row of its last dimension that was
    computed from ``t`` itself: a normalisation written out in pointwise ops."""
    if call.name not in _SCALING_OPS or t.dim() < 1:
        return False
    first, second = call_argument(call, 0, "input", "self"), call_argument(call, 1, "other")
    if is_same_tensor(first, t):
        x, factor = first, second
    elif is_same_tensor(second, t):
        x, factor = second, first
    else:
        return False
    if (
        not isinstance(factor, torch.Tensor)
        or not factor.is_floating_point()
        or factor.grad_fn is None
        or x.grad_fn is None
        or factor.dim() != t.dim()
        or factor.shape[-1] != 1
        or factor.shape[:-1] != t.shape[:-1]
    ):
        return False
    return _history_reaches(factor.grad_fn, x.grad_fn)


def _history_reaches(node, target) -> bool:
    """Whether ``target`` is among the first autograd nodes behind ``node``."""
    frontier, seen = [node], 0
    while frontier and seen < _ROW_FACTOR_HISTORY:
        current = frontier.pop(0)
        seen += 1
        for following, _ in current.next_functions:
            if following is target:
                return True
            if following is not None:
                frontier.append(following)
    return False


def _normalization_row(t: torch.Tensor, call: TrackedCall) -> int | None:
    """Values per row that ``call`` normalises on its own, when ``t`` is its input: LayerNorm's
    and RMSNorm's normalised shape, one GroupNorm group, one InstanceNorm plane. None otherwise
    (BatchNorm: :func:`_batch_norm_row`)."""
    if call.name in _SCALING_OPS:
        return t.shape[-1] if _is_scaled_by_own_row_factor(t, call) else None
    if call.name not in _ROW_NORMALIZING_OPS:
        return None
    if not _is_first_argument(t, call) or t.dim() < 1:
        return None
    if call.name in ("layer_norm", "rms_norm"):
        shape = call_argument(call, 1, "normalized_shape")
        shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
        if not shape or tuple(t.shape[-len(shape) :]) != shape:
            return None
        return math.prod(shape)
    if t.dim() < 2:
        return None
    if call.name == "group_norm":
        groups = call_argument(call, 1, "num_groups")
        if not isinstance(groups, int) or groups < 1 or t.shape[1] % groups:
            return None
        return t.shape[1] // groups * math.prod(t.shape[2:])
    return math.prod(t.shape[2:])  # instance_norm: one plane of one sample


#: Decisions :func:`decide` caches; past this many (shapes changing every step) it starts again.
_DECISIONS_KEPT = 4096


def call_key(call: TrackedCall | None) -> tuple | None:
    """What a decision about one of ``call``'s saves depends on besides the tensor's dtype,
    shape and strides: the function, its arguments, the autocast, and for a ``mul`` which
    arguments it scales by their own row factor (history no signature shows). ``()`` for no
    call; None for an argument of an unknown type (a module, a generator)."""
    if call is None:
        return ()
    if call.key is LOOK_UP:
        same: dict[int, int] = {}
        try:
            arguments = (_arguments_key(call.args, same), _arguments_key(call.kwargs, same) if call.kwargs else ())
        except _Unkeyed:
            call.key = None
            return None
        scaled = ()
        if call.name in _SCALING_OPS:
            scaled = tuple(isinstance(a, torch.Tensor) and _is_scaled_by_own_row_factor(a, call) for a in call.args)
        call.key = (call.func, call.name, arguments, call.autocast, scaled)
    return call.key


class _Unkeyed(Exception):
    pass


def _arguments_key(values: tuple | dict, same: dict[int, int]) -> tuple:
    """A call's arguments or keywords for :func:`call_key`; tensors and plain values inline,
    not through :func:`arguments_key`'s slower walk, as this runs at every call that saves."""
    if type(values) is dict:
        return tuple([(name, _argument_key(value, same)) for name, value in values.items()])
    return tuple([_argument_key(value, same) for value in values])


def _argument_key(value: Any, same: dict[int, int]) -> Any:
    if type(value) in PLAIN_TYPES:
        return value
    if isinstance(value, torch.Tensor):
        return _tensor_key(value, same.setdefault(id(value), len(same)))
    return arguments_key(value, lambda t: _tensor_key(t, same.setdefault(id(t), len(same))), _unkeyed)


def _unkeyed(other):
    raise _Unkeyed


def _tensor_key(t: torch.Tensor, index: int) -> tuple:
    """One tensor argument for :func:`call_key`: by dtype, shape, strides, and whether it needs
    a gradient, is a leaf or a disguised parameter (which decide what counts as a statistic).
    ``index`` tells one tensor passed twice from two alike."""
    if t.layout is not torch.strided or t.is_nested:
        return index, t.dtype, t.layout, t.requires_grad
    base = t._base
    if base is None and type(t) is not torch.Tensor and _is_parameter(t):
        # A parameter itself: a leaf with no history to walk.
        return index, t.dtype, t.shape, t.stride(), t.requires_grad, True, True, t.device
    node = t.grad_fn
    if base is None and (node is None or node.name() not in _VIEW_OR_CAST_NODES):
        disguised = False
    else:
        disguised = source_parameter(t)[0] is not None
    return index, t.dtype, t.shape, t.stride(), t.requires_grad, node is None, disguised, t.device


def _normalizes_short_rows(call: TrackedCall) -> bool:
    """Whether ``call`` normalises rows of fewer than ``MIN_GROUP_SIZE`` values: every float
    tensor it saves is then kept exact, as rows that short leave noise no room to average out,
    and on rows of one value ``x - mean`` is exactly 0, which a rounded mean breaks."""
    if call.name not in _ROW_NORMALIZING_OPS and call.name not in _SCALING_OPS and call.name not in BATCH_NORM_OPS:
        return False
    first = call_argument(call, 0, "input", "self")
    if (
        not isinstance(first, torch.Tensor)
        or not first.is_floating_point()
        or first.layout != torch.strided
        or first.is_nested
    ):
        return False
    row = _normalization_row(first, call)
    if row is None:
        row = _batch_norm_row(first, call)
    return row is not None and row < MIN_GROUP_SIZE


#: The autograd nodes of :data:`SOFTMAX_OPS` (``_safe_softmax``: SDPA's math kernel).
_SOFTMAX_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})


def _softmax_row(t: torch.Tensor) -> int | None:
    """The length of the rows a softmax normalised, where ``t`` is its result; read off ``t``'s
    autograd node, so a softmax inside a composite call (multi-head attention) is found too."""
    node = t.grad_fn
    if node is None or node.name() not in _SOFTMAX_NODES:
        return None
    if not t.dim():
        return 1
    dim = node._saved_dim  # read back as unsigned: -1 comes as 2**64 - 1
    return int(t.shape[dim - (1 << 64) if dim >= 1 << 63 else dim])


def _batch_norm_row(t: torch.Tensor, call: TrackedCall | None) -> int | None:
    """Values per channel when ``t`` is BatchNorm's input (its rows are its channels)."""
    if call is None or call.name not in BATCH_NORM_OPS or t.dim() < 2 or not _is_first_argument(t, call):
        return None
    return t.numel() // max(t.shape[1], 1)


def read_of(t: torch.Tensor, call: TrackedCall | None) -> Read | None:
    """How ``call``'s traced backward (:func:`~lightning_act.backward_reads.call_reads`) reads
    ``t``, its save number ``call.saves``; None where that is unknown."""
    if call is None or call.func is None:
        return None
    if call.name in _RECURRENT_OPS:
        return _RECURRENT_READ if t.is_floating_point() else None
    if call.reads is LOOK_UP:
        call.reads = call_reads(call.func, call.args, call.kwargs, call.autocast)
    traced = call.reads
    if traced is None:
        return None
    reads, saves = traced
    if call.saves >= len(saves) or saves[call.saves] != (t.dtype, t.dim()):
        return None
    return reads[call.saves]


def _is_pointwise_input(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is what a pointwise activation saves of its input: the input, or for the
    in-place form its copy or the output written over it (read by backward as the input)."""
    source = call_argument(call, 0, "input", "self")
    return isinstance(source, torch.Tensor) and source.shape == t.shape and source.dtype == t.dtype


def _interval(t: torch.Tensor, call: TrackedCall | None) -> tuple[float, float] | None:
    """The open interval whose inside alone the call's backward reads of ``t``, or None."""
    if call is None or call.name not in _INTERVAL_OPS or not _is_pointwise_input(t, call):
        return None
    low, high = _INTERVAL_OPS[call.name](call)
    default_low, default_high = _HARDTANH_DEFAULT_INTERVAL
    low, high = default_low if low is None else low, default_high if high is None else high
    if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high):
        return None  # tensor bounds, or an empty interval: no mask keeps the comparisons
    return float(low), float(high)


def _dropout_keep_probability(call: TrackedCall) -> float:
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    return 1.0 - float(p)


def decide(
    t: torch.Tensor,
    call: TrackedCall | None,
    *,
    external: bool,
    min_numel: int,
    group_size: int = 256,
    unseen: bool = False,
    decided: dict | None = None,
) -> Decision:
    """How to store ``t``, which ``call`` is saving for backward.

    Args:
        call: the torch function saving it, None when no tracked function is running.
        external: whether the step keeps ``t``'s storage alive anyway (its input batch).
        unseen: the op tracker was off (eager code at a compiled module's graph break), so a
            float tensor is kept exact: its op went unseen and it may hold ``-inf``.
        min_numel: tensors with fewer distinct elements are kept as they are.
        group_size: the quantizer's group size.
        decided: a cache of decisions keyed by :func:`call_key`, the save's position, dtype,
            shape and strides, so a step that repeats its calls repeats no decision work.
    """
    if t.layout != torch.strided or t.is_nested:
        return _KEEP  # sparse, nested: no codec takes them
    floating = t.is_floating_point()
    if floating or t.is_complex():  # a complex parameter's view (a spectral layer's weights) too
        param, recastable = source_parameter(t)
        if param is not None:
            if recastable:
                return Decision(Form.RECAST_WEIGHT, parameter=param)
            # A view of the parameter's own storage (``view_as_complex``) costs nothing; a
            # cast or a clone is a copy of its own, kept.
            shares = t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            return _PARAMETER if shares else _CAST_PARAMETER
    if external:
        return _EXTERNAL
    if unseen and floating:
        return _KEEP
    if decided is None:
        return _decide_from_call(t, call, min_numel, group_size)
    key = call_key(call)
    if key is None:  # an argument no signature describes: decided afresh
        return _decide_from_call(t, call, min_numel, group_size)
    key = (key, -1 if call is None else call.saves, t.dtype, t.shape, t.stride(), min_numel, group_size)
    decision = decided.get(key)
    if decision is None:
        if len(decided) >= _DECISIONS_KEPT:  # new shapes at every step: start again
            decided.clear()
        decision = decided[key] = _decide_from_call(t, call, min_numel, group_size)
    return decision


def _decide_from_call(t: torch.Tensor, call: TrackedCall | None, min_numel: int, group_size: int) -> Decision:
    """The decision for a tensor that is neither a parameter nor alive anyway: from the call's
    key, the save's position and the tensor's dtype, shape and strides alone (it is cached)."""
    layout = Layout.of(t)
    site = site_of_call(t, call, layout)
    decision = decide_site(site, min_numel=min_numel)
    if decision.form in (Form.KEEP, Form.STATISTIC, Form.MATCH):
        return decision
    if call is None:
        # Saved outside any call: its backward may rely on the saved strides (inductor asserts
        # them), so a view copied dense comes back with its own.
        layout = layout.with_strides(t)
    if decision.form is not Form.QUANTIZE or site.normalized is None:
        return decision._replace(layout=layout)
    # A normalisation's input in groups within its rows: runs of memory, or for BatchNorm
    # (whose channels are not runs of whole groups) each channel laid out as one run.
    normalized = site.normalized
    row, row_layout = (normalized.row if t.is_contiguous() else None), layout
    if normalized.channels:
        row = None
        if t.shape[1] >= 2 and not (t.is_contiguous() and math.prod(t.shape[2:]) % group_size == 0):
            row, row_layout = normalized.row, Layout.channel_major(t)
    row_group = None
    if row is not None and row % group_size:
        row_group, padded_row = row_grouping(row, group_size, max(decision.min_bits, 2))
        if padded_row != row:
            row_layout = row_layout.with_padded_rows(t, row, padded_row)
    return decision._replace(
        layout=layout, row_group=row_group, row_layout=row_layout if row_group is not None else None
    )


def site_of_call(t: torch.Tensor, call: TrackedCall | None, layout: Layout | None) -> SaveSite:
    """What :func:`decide_site` needs to know of ``t``, saved by ``call``."""
    numel = t.numel() if layout is None else layout.numel
    contiguous = t.is_contiguous()
    if not t.is_floating_point():
        return SaveSite(
            t.dtype,
            numel,
            layout is not None,
            contiguous,
            None,
            seen=call is not None,
            index_range=saved_index_range(call, t),
            measures_range=t.device.type == "cpu" and t.element_size() > 1,
        )
    if call is None:
        return SaveSite(t.dtype, numel, layout is not None, contiguous, None, seen=False)
    normalized = None
    row = _normalization_row(t, call)
    if row is not None:
        normalized = Normalized(row)
    elif (channel := _batch_norm_row(t, call)) is not None:
        normalized = Normalized(channel, channels=True)
    softmax_row = _softmax_row(t)
    read = read_of(t, call)
    return SaveSite(
        t.dtype,
        numel,
        layout is not None,
        contiguous,
        read,
        zero_exact=call.name in ZERO_EXACT_OPS,
        softmax=call.name in SOFTMAX_OPS or softmax_row is not None,
        normalized=normalized,
        short_rows=_normalizes_short_rows(call) or (softmax_row is not None and softmax_row < MIN_GROUP_SIZE),
        statistic=_is_statistic(t, call),
        sign_only=call.name in _SIGN_ONLY_OPS,
        interval=_interval(t, call),
        dropout_keep=_dropout_keep_probability(call) if call.name in _DROPOUT_OPS else None,
        untraced=untraced_reason(call.func) if read is None and call.reads is None else None,
    )
