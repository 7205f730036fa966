"""How one saved tensor must be stored, from what it is and from how its op's backward reads it.

:func:`decide` is every such rule in one place, and pure: it reads the tensor's dtype, shape,
strides and autograd history and the call that saves it (from the
:class:`~lightning_act.optrack.OpTracker`), never the capture's state. The capture engine
dispatches on the :class:`Decision`; the rules (by module and op) and the policy then pick
the codec and bits of a tensor decided :attr:`Kind.QUANTIZE`, never below its floor.

The rules, in the order they apply:

* a parameter, a view of one, or a cast copy of one: never compressed. A view of it (or a
  copy in its own dtype) is alive anyway and passes through; autocast's exact cast copy is
  re-created from the parameter at unpack; any other cast copy is kept as it is;
* a tensor the step keeps alive anyway (the input batch, buffers): passes through;
* a boolean mask or integer indices: stored losslessly in the fewest bits they need
  (max-pool indices with the bound their op implies, so without a device synchronisation);
* a float tensor that holds one bit per value for its op (LeakyReLU's input, read only
  for its sign; dropout's noise on the CPU): a 1-bit mask, exact;
* too small, laid out with overlapping elements (a broadcast/unfolded view whose dense
  copy would be larger), or of a dtype no codec takes (complex): kept as it is;
* a reduction statistic, at least 8 times smaller than its op's largest input (LayerNorm's
  mean and rstd, attention's logsumexp): kept exact, since backward multiplies its noise in;
* anything else: quantized, at no fewer bits than :func:`floor_bits` allows. A ReLU output,
  whose backward reads ``out > 0`` and which the next layer saves too, needs a codec that
  keeps zeros exact (the quantizer, at 2 bits or more), so ReLU's gradient is exact.

A new rule about how backward reads a saved tensor goes here: a floor for a tensor that
backward passes through a nonlinearity goes in :func:`floor_bits`; a tensor that must be
stored another way gets its own :class:`Kind` (and a branch in the engine's dispatch).

A :class:`Decision` is a small immutable value. It depends on the tensor's dtype, shape and
strides, on whether it is a parameter in disguise or alive anyway, and on the op's name and
its arguments' sizes and storages; so while a forward repeats its ops and shapes, the
decision of each slot repeats too, and may be computed once and replayed.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import nn

from lightning_act.capture.records import Layout
from lightning_act.codecs.exact import INDEX_DTYPES
from lightning_act.optrack import TrackedCall, saved_index_range

__all__ = ["Decision", "Kind", "decide", "floor_bits", "source_parameter"]

# Ops whose backward reads only ``out > 0`` of the output they save, while the next layer
# usually saves the same tensor for its values.
_ZERO_EXACT_OPS = frozenset({"relu", "relu_"})
# Ops that read the tensor they save only for its sign.
_SIGN_ONLY_OPS = frozenset({"leaky_relu", "leaky_relu_"})
# Backward applies a softmax (or its exp) to these saved tensors: the output of softmax,
# log_softmax and cross_entropy (its log-probabilities), and attention's query and key
# (the probabilities are recomputed from them). Through that nonlinearity rounding noise
# becomes a bias, which adds up over steps instead of averaging out: at 2 bits the logits
# of a small transformer cost +25% validation loss, and at 4 bits its query and key kept it
# on its loss plateau. They are stored at 8 bits or more.
_SOFTMAX_OUTPUT_OPS = frozenset({"softmax", "log_softmax", "cross_entropy"})
_ATTENTION_OPS = frozenset({"scaled_dot_product_attention"})
_SOFTMAX_BITS = 8
# Dropout on the CPU saves its noise, bernoulli(1 - p) / (1 - p): a mask and a known scale
# (on a GPU it saves a boolean mask, stored losslessly like any other).
_DROPOUT_OPS = frozenset({"dropout", "dropout_"})

# A float tensor that its op computed (not one of the op's arguments) and that is at least
# this many times smaller than the op's largest activation argument is a reduction
# statistic (LayerNorm's mean and rstd, attention's logsumexp): the backward scales
# everything else by it, so noise there is not averaged out but multiplied in. It is kept
# exact, which costs little for the same reason. Weights do not count as the op's size: a
# linear layer's small input next to its large weight is an activation, not a statistic.
_STATISTIC_RATIO = 8

# Autograd nodes that only view or cast their single input: following them from a saved
# tensor tells whether it is a parameter in disguise.
_VIEW_OR_CAST_NODES = frozenset(
    {
        "AliasBackward0",
        "CloneBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "ToCopyBackward0",
        "TransposeBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


class Kind(enum.Enum):
    """How a saved tensor is stored."""

    #: A parameter or a view of one, in its own dtype: alive anyway, passed through uncounted.
    PARAMETER = "parameter"
    #: Autocast's exact cast copy of a parameter: not kept; cast again from it at unpack.
    RECAST_WEIGHT = "recast_weight"
    #: Another cast copy of a parameter: kept as it is (weights are never compressed).
    CAST_PARAMETER = "cast_parameter"
    #: Alive for the whole step anyway (the batch, buffers): passed through uncounted.
    EXTERNAL = "external"
    #: Kept as it is: too small, overlapping elements, or a dtype no codec takes.
    KEEP = "keep"
    #: A reduction statistic: kept exact.
    STATISTIC = "statistic"
    #: A boolean tensor: 1 bit per value, exact.
    MASK = "mask"
    #: A float tensor its op reads only for its sign (dropout noise: times a known scale):
    #: 1 bit per value, exact, for this op alone.
    SIGN_MASK = "sign_mask"
    #: An integer tensor: the fewest bits its values need, exact.
    INDEX = "index"
    #: A float activation: stored by the codec and bits the rules and policy choose.
    QUANTIZE = "quantize"


class Decision(NamedTuple):
    """How one saved tensor is stored, and what its codec must respect."""

    kind: Kind
    #: The fewest bits any copy serving this save may have (rules and policies included).
    min_bits: int = 1
    #: The codec must decode zeros to exact zeros and positives to positives (ReLU's output).
    keeps_zeros: bool = False
    #: :attr:`Kind.INDEX`: ``(low, high)`` bounding the values, when the op tells.
    value_range: tuple[int, int] | None = None
    #: :attr:`Kind.SIGN_MASK` of dropout noise: the keep probability the mask is divided by.
    divisor: float | None = None
    #: How to lay the tensor out for its codec, for the kinds stored by one.
    layout: Layout | None = None
    #: :attr:`Kind.RECAST_WEIGHT`: the parameter to cast again at unpack.
    parameter: nn.Parameter | None = None


def source_parameter(t: torch.Tensor) -> tuple[nn.Parameter | None, bool]:
    """The parameter ``t`` views or casts, and whether ``t`` is an exact cast copy of it."""
    base = t if t._base is None else t._base
    if isinstance(base, nn.Parameter):
        return base, False
    node = base.grad_fn
    recastable = node is not None and node.name() == "ToCopyBackward0"
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


def _is_statistic(t: torch.Tensor, call: TrackedCall) -> bool:
    inputs = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(a is t for a in inputs):
        return False  # the op saves one of its inputs (checked first: it is the common case, and cheap)
    storage = t.untyped_storage().data_ptr()
    if any(a.untyped_storage().data_ptr() == storage for a in inputs):
        return False  # the op saves a view of one of its inputs
    # Only a larger activation makes it a statistic; a parameter's size says nothing.
    larger = (a for a in inputs if a.numel() >= t.numel() * _STATISTIC_RATIO)
    return any(source_parameter(a)[0] is None for a in larger)


def _is_attention_score_input(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is the query or the key of the attention call saving it."""
    if call.name not in _ATTENTION_OPS:
        return False
    query = call.kwargs.get("query", call.args[0] if call.args else None)
    key = call.kwargs.get("key", call.args[1] if len(call.args) > 1 else None)
    return any(
        isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr() and a.shape == t.shape for a in (query, key)
    )


def floor_bits(t: torch.Tensor, call: TrackedCall | None) -> int:
    """The fewest bits a saved tensor may get from how its op's backward reads it."""
    if call is None:
        return 1
    if call.name in _ZERO_EXACT_OPS:
        return 2
    if call.name in _SOFTMAX_OUTPUT_OPS or _is_attention_score_input(t, call):
        return _SOFTMAX_BITS
    return 1


def _dropout_keep_probability(call: TrackedCall) -> float:
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    return 1.0 - float(p)


def decide(t: torch.Tensor, call: TrackedCall | None, *, external: bool, min_numel: int) -> Decision:
    """How to store ``t``, which ``call`` is saving for backward.

    Args:
        t: the saved tensor.
        call: the torch function saving it, None when no tracked function is running.
        external: whether the step keeps ``t``'s storage alive anyway (its input batch).
        min_numel: tensors with fewer distinct elements are kept as they are.
    """
    floating = t.is_floating_point()
    if floating:
        param, recastable = source_parameter(t)
        if param is not None:
            if recastable:
                return Decision(Kind.RECAST_WEIGHT, parameter=param)
            return Decision(Kind.PARAMETER if param.dtype == t.dtype else Kind.CAST_PARAMETER)
    if external:
        return Decision(Kind.EXTERNAL)
    op = None if call is None else call.name
    min_bits = floor_bits(t, call)
    if floating:
        kind = Kind.SIGN_MASK if op in _SIGN_ONLY_OPS or op in _DROPOUT_OPS else Kind.QUANTIZE
    elif t.dtype == torch.bool:
        kind = Kind.MASK
    elif t.dtype in INDEX_DTYPES:
        kind = Kind.INDEX
    else:
        return Decision(Kind.KEEP, min_bits)
    layout = Layout.of(t)
    if layout is None or layout.numel < max(min_numel, 1):  # empty: nothing to store
        return Decision(Kind.KEEP, min_bits)
    if kind is Kind.QUANTIZE:
        if call is not None and _is_statistic(t, call):
            return Decision(Kind.STATISTIC, min_bits)
        return Decision(kind, min_bits, keeps_zeros=op in _ZERO_EXACT_OPS, layout=layout)
    if kind is Kind.INDEX:
        return Decision(kind, min_bits, value_range=saved_index_range(call), layout=layout)
    if kind is Kind.SIGN_MASK and op in _DROPOUT_OPS:
        return Decision(kind, min_bits, divisor=_dropout_keep_probability(call), layout=layout)
    return Decision(kind, min_bits, layout=layout)
