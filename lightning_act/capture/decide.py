"""How one saved tensor must be stored, from what it is and from how its op's backward reads it.

:func:`decide` is every such rule in one place, and pure: it reads the tensor's dtype, shape,
strides and autograd history and the call that saves it (from the
:class:`~lightning_act.optrack.OpTracker`), never the capture's state. The capture engine
dispatches on the :class:`Decision`; the rules (by module and op) and the policy then pick
the codec and bits of a tensor decided :attr:`Kind.QUANTIZE`, never below its floor.

The principle: stochastic rounding makes a stored tensor right on average, so the gradient
is unbiased exactly where backward uses the tensor **linearly** (a matmul's or conv's
input, a normalisation's input given exact statistics, up to a term of order 1/N). Where
backward passes it through a nonlinearity, the noise becomes a bias, which no number of
steps averages out. Each rule below says how backward uses a tensor, read off the call:

* a parameter, a view of one, or a cast copy of one: never compressed. A view of it (or a
  copy in its own dtype) is alive anyway and passes through; autocast's exact cast copy is
  re-created from the parameter at unpack; any other cast copy is kept as it is;
* a tensor the step keeps alive anyway (the input batch, buffers): passes through;
* a boolean mask or integer indices: stored losslessly in the fewest bits they need, with
  the bound their op implies where it does (max-pool indices, the index of an indexing op
  or a loss's class target: :func:`~lightning_act.optrack.saved_index_range`), so without
  a device synchronisation. Without such a bound the range is measured on the CPU; on a
  GPU measuring it would be a host synchronisation per tensor, so the tensor is kept as it
  is. A one-byte integer tensor with no bound is an opaque buffer (an RNN workspace) and is
  kept as it is (see ``_OPAQUE_BYTES``);
* a float tensor that holds one bit per value for its op (LeakyReLU's input, read only
  for its sign; the input of ReLU6, Hardtanh and Hardsigmoid, read only for whether it
  lies inside the op's interval; dropout's noise on the CPU): a 1-bit mask, exact;
* Hardswish's input, whose backward is affine in it on [-3, 3] and constant outside:
  quantized after each value outside is replaced by the point of the affine piece with
  the same derivative (1.5 above, -1.5 below), so backward is linear in every value stored
  and no rounding crosses a switch;
* too small, laid out with overlapping elements (a broadcast/unfolded view whose dense
  copy would be larger), or of a dtype no codec takes (complex): kept as it is. Size is a
  cost rule, not a sensitivity rule: below ``min_numel`` the group statistics and the
  per-tensor work cost more than the bits saved, and what such a tensor adds to the kept
  memory is negligible; how sensitive a tensor is, is decided by the floors below;
* a reduction statistic, at least 8 times smaller than its op's largest input and an
  output of the op itself (LayerNorm's mean and rstd, attention's logsumexp, not a
  recurrent op's per-step state): kept exact, since backward multiplies its noise in;
* anything else: quantized, at no fewer bits than :func:`floor_bits` allows, and, for the
  input of a normalisation that scales each row by its own 1 / std, in groups that never
  span two rows: LayerNorm, RMSNorm, GroupNorm and InstanceNorm rows are runs of memory
  (:func:`normalized_row`); BatchNorm's rows are channels, laid out channel-major for the
  codec where a channel's values are not runs of whole groups (small maps, channels-last):

  - 2 bits for a ReLU output, whose backward reads ``out > 0`` and which the next layer
    saves too: a codec that keeps zeros exact (the quantizer) makes ReLU's gradient exact;
  - 8 bits for what backward puts through an exponential (softmax outputs, attention's
    query and key) or divides by (a ``div``'s denominator by its argument position, the
    saved input or output of ``log``, ``sqrt``, ``rsqrt``, ``reciprocal``, a power below
    1): there a rounding error is amplified without bound and its mean is not zero;
  - 8 bits for a tensor saved outside any op (``ctx.save_for_backward`` of a custom
    autograd function), whose backward is unknown: non-reentrant activation checkpointing
    saves each block's input this way and recomputes the whole block from it, every
    nonlinearity of the block at once. The recomputation runs in backward, where nothing
    is compressed, so what the block saves is exact;
  - 4 bits for what backward is quadratic in: a value computed and saved inside a
    composite op (a recurrent op's gates, run step by step under one call: which backward
    reads it is not known, and the gates' own backward is quadratic in them), and the
    input of LayerNorm, RMSNorm (also written out in pointwise ops), GroupNorm and
    InstanceNorm (``x_hat mean(g x_hat)``);
  - 1 bit otherwise: backward is linear in the tensor, or smooth in it (SiLU, GELU,
    sigmoid, tanh: a bias of the order of the rounding variance times the curvature,
    measured well under the noise at 2 bits on the models tested).

Weighed and not chosen in general: storing a pointwise nonlinearity's derivative instead of
its input (backward is then linear in what is stored). A saved-tensor hook sees only the
tensor, and unpack must return an input whose derivative is the stored one. Where the
derivative is affine on one piece and constant outside it (Hardswish), a point of that
piece carries every derivative, so the input is stored that way (:class:`PiecewiseInput`);
SiLU's and GELU's derivatives have no piece on which backward is linear, so recovering an
input from a rounded derivative would put the rounding back through a nonlinearity. That
needs the op replaced by an autograd function of its own, not a storage rule.

A new rule about how backward reads a saved tensor goes here: a floor for a tensor that
backward passes through a nonlinearity goes in :func:`floor_bits`; a tensor that must be
stored another way gets its own :class:`Kind` (and a branch in the engine's dispatch).
``rules`` may raise any tensor's bits or keep it exact; the floors hold under every rule
and policy.

A :class:`Decision` is a small immutable value. It depends on the tensor's dtype, shape and
strides, on whether it is a parameter in disguise or alive anyway, and on the op's name and
its arguments' sizes and storages; so while a forward repeats its ops and shapes, the
decision of each slot repeats too, and may be computed once and replayed.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import NamedTuple

import torch
from torch import nn

from lightning_act.capture.records import Layout
from lightning_act.codecs.exact import INDEX_DTYPES
from lightning_act.ops.validation import MIN_GROUP_SIZE
from lightning_act.policy.allocation import STATS_BITS_PER_GROUP
from lightning_act.optrack import TrackedCall, call_argument, is_same_tensor, saved_index_range

__all__ = [
    "Decision",
    "Kind",
    "PiecewiseInput",
    "SaturatingInput",
    "decide",
    "floor_bits",
    "normalized_row",
    "source_parameter",
]

# Ops whose backward reads only ``out > 0`` of the output they save, while the next layer
# usually saves the same tensor for its values.
_ZERO_EXACT_OPS = frozenset({"relu", "relu_"})
# Ops that read the tensor they save only for its sign.
_SIGN_ONLY_OPS = frozenset({"leaky_relu", "leaky_relu_"})
# Ops that read the tensor they save only for whether it lies strictly inside an interval
# (their derivative is one constant inside and zero outside), and where the call gives
# that interval: a 1-bit mask is exact where 2-bit rounding near an end flips the gradient.
# On the in-place forms autograd saves a copy of the input, or the output, clamped to the
# ends and so outside too: the mask is the same.
_INTERVAL_OPS = {
    "hardtanh": lambda call: (call_argument(call, 1, "min_val"), call_argument(call, 2, "max_val")),
    "relu6": lambda call: (0.0, 6.0),
    "hardsigmoid": lambda call: (-3.0, 3.0),
}
_INTERVAL_OPS.update({name + "_": interval for name, interval in list(_INTERVAL_OPS.items())})
_HARDTANH_DEFAULT_INTERVAL = (-1.0, 1.0)
# Backward applies a softmax (or its exp) to these saved tensors: the output of softmax,
# log_softmax and cross_entropy (its log-probabilities), and attention's query and key
# (the probabilities are recomputed from them). Through that nonlinearity rounding noise
# becomes a bias, which adds up over steps instead of averaging out: at 2 bits the logits
# of a small transformer cost +25% validation loss, and at 4 bits its query and key kept it
# on its loss plateau. They are stored at 8 bits or more.
_SOFTMAX_OUTPUT_OPS = frozenset({"softmax", "log_softmax", "cross_entropy"})
_ATTENTION_OPS = frozenset({"scaled_dot_product_attention"})
_SOFTMAX_BITS = 8
# Pointwise ops whose backward divides by the tensor they save, or by a power of it: the
# denominator of ``div`` (found by its argument position), ``log``'s input, the outputs of
# ``sqrt``, ``rsqrt``, ``reciprocal`` and ``1 / x``, and ``pow``'s base under an exponent
# below 1 or its exponent tensor. Rounding noise near zero becomes an unbounded error there,
# and its mean is not the exact quotient (E[1/(x+e)] > 1/x): a mean aggregation's neighbour
# count at 2 bits biased a graph network's gradient by 0.9 of its norm, and a scatter
# softmax's per-node sum by 0.3. They are stored at the softmax's 8 bits.
_DIVISION_OPS = frozenset({"div", "div_", "true_divide", "true_divide_", "divide"})
_DIVISOR_SAVING_OPS = frozenset({"log", "log_", "sqrt", "sqrt_", "rsqrt", "rsqrt_", "reciprocal", "reciprocal_",
                                 "__rdiv__", "__rtruediv__"})
_POWER_OPS = frozenset({"pow", "pow_", "float_power", "__pow__", "__rpow__"})
# A tensor saved outside any tracked op: ``ctx.save_for_backward`` of a custom autograd
# function, whose backward may do anything with it. Non-reentrant activation checkpointing
# saves each block's input this way and recomputes the whole block from it in backward
# (normalisations, softmax, activations: every nonlinearity above at once); at 2 bits that
# input alone biased a checkpointed transformer's gradient by 0.22 of its norm. The block
# is recomputed in backward, outside the capture, so its own saves are exact.
_UNKNOWN_USE_BITS = 8
# A value computed inside a composite op and saved there (``nn.GRU`` on the CPU runs its
# cells step by step under the one op ``gru``): some step's backward reads it, but which
# one, and how, the call does not tell. Among them are the gates' sigmoid and tanh outputs,
# whose own backward reads ``y (1 - y)`` and ``1 - y**2``, quadratic in the rounded value:
# at 2 bits they made a GRU's gradient biased (16-seed mean 2.4x closer than one seed, 4x
# when unbiased). At 4 bits the rounding variance, and the bias with it, is 25 times smaller.
# The same holds for the input of a normalisation over rows (LayerNorm and its kin): its
# input gradient ``rstd (g - mean(g) - x_hat mean(g x_hat))`` is quadratic in the rounded
# input, a bias of order variance / row length. On BERT (rows of 64) it made the 2-bit
# gradient biased (2.4x) and carried most of its error: at 4 bits the error fell from 0.055
# to 0.011 (unbiased, 3.9x) for 5% more stored. BatchNorm's rows (a channel over the batch
# and the map) are long, and its inputs are a third of a CNN's memory: it has no floor.
_QUADRATIC_BITS = 4
# Dropout on the CPU saves its noise, bernoulli(1 - p) / (1 - p): a mask and a known scale
# (on a GPU it saves a boolean mask, stored losslessly like any other).
_DROPOUT_OPS = frozenset({"dropout", "dropout_"})
# Normalisations whose backward scales each row's noise by that row's 1 / std. A group of
# the quantizer that spans two rows takes its range from the wider one, and the narrow
# row's rounding noise, amplified by its small std, swamps its gradient: on a ViT, groups
# of 256 values across tokens of 192 made the 2-bit gradient 611x the exact one's norm and
# biased; groups within a token (64) brought it to 0.6, unbiased. The input of these ops is
# therefore quantized in groups that stay within one row. BatchNorm's rows are its channels:
# on MobileNetV3 and EfficientNet, whose 1x1 maps put 256 channels of one sample in a group,
# the 2-bit gradient error was 2e5 and 1e10 times the gradient's norm.
_ROW_NORMALIZING_OPS = frozenset({"layer_norm", "rms_norm", "group_norm", "instance_norm"})
# The same normalisation written out in pointwise ops, as HF's Llama, Mistral and T5 write
# RMSNorm: ``x * rsqrt(mean(x**2) + eps)``. Its ``mul`` saves ``x`` next to a per-row factor
# computed from ``x`` itself, and backward multiplies the two uses of the rounded ``x`` (the
# factor's gradient, ``sum(g x)``, flows back through ``x**2``): a quadratic use, found by
# the factor's autograd history reaching ``x`` within a few nodes. Before it, the 2-bit
# input of a tiny Llama's RMSNorm carried all of its gradient's bias (a 16-seed mean only
# 2.2x closer than one seed).
_SCALING_OPS = frozenset({"mul", "mul_", "multiply", "__mul__", "__rmul__"})
_ROW_FACTOR_HISTORY = 8  # autograd nodes searched from the factor back to x

# A float tensor that its op computed (not one of the op's arguments) and that is at least
# this many times smaller than the op's largest activation argument is a reduction
# statistic (LayerNorm's mean and rstd, attention's logsumexp): the backward scales
# everything else by it, so noise there is not averaged out but multiplied in. It is kept
# exact, which costs little for the same reason. Weights do not count as the op's size: a
# linear layer's small input next to its large weight is an activation, not a statistic.
# A statistic is an output of the op itself: its autograd history, if any, starts at the
# op's inputs. The per-step gates and states that a recurrent op computes step by step (their
# history runs through the earlier steps), each one step's share of its input, are activations.
_STATISTIC_RATIO = 8

# _OPAQUE_BYTES: a one-byte integer tensor with no bound its op implies is kept as it is.
# Such tensors are byte buffers that an op lays out for itself (oneDNN's RNN workspace on the
# CPU, cuDNN's reserve space on a GPU): their bytes span the whole range, so the index codec
# could not store them in fewer bits, and finding that out costs a pass over them and a
# device synchronisation; a copy to give back at unpack would add its size to the peak.

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
    #: A float tensor its op reads only for its sign, or for whether it lies inside an
    #: interval (dropout noise: times a known scale): 1 bit per value, exact, for this op alone.
    SIGN_MASK = "sign_mask"
    #: An integer tensor: the fewest bits its values need, exact.
    INDEX = "index"
    #: A float activation: stored by the codec and bits the rules and policy choose.
    QUANTIZE = "quantize"


class PiecewiseInput(NamedTuple):
    """The input of an op whose backward reads it only through a derivative that is affine
    in it strictly inside ``(low, high)`` and constant outside (Hardswish), stored as a
    tensor inside that piece with the same derivative everywhere: the values at or below
    ``low`` become ``below`` and those at or above ``high`` become ``above``, points of the
    piece with the derivative of the outside values. Backward is then linear in every
    stored value, so stochastic rounding stays unbiased, and no rounding of a value near a
    switch crosses it: decoded values are clamped back inside the piece, where the codec's
    grid, whose ends are rounded outward to bfloat16, would reach it or past it (its low
    end often lands on ``low`` itself, which the CPU kernel already reads as outside)."""

    low: float
    high: float
    below: float
    above: float

    def store(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= self.high, self.above, x).masked_fill_(x <= self.low, self.below)

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded.clamp_(*_inner_ends(self.low, self.high, decoded.dtype))


@functools.cache
def _inner_ends(low: float, high: float, dtype: torch.dtype) -> tuple[float, float]:
    """The values of ``dtype`` next to ``low`` and ``high`` inside ``(low, high)``."""
    ends = torch.tensor([low, high], dtype=dtype)
    inner_low, inner_high = torch.nextafter(ends, ends.flip(0)).tolist()
    return inner_low, inner_high


class SaturatingInput(NamedTuple):
    """The input of an op whose derivative levels off to constants on both sides (SiLU,
    GELU), stored clamped to ``[-limit, limit]``, beyond which the derivative is within
    ``1e-3`` of its limit. Values far out (a BatchNorm output of 40 next to ones of 0.1)
    otherwise stretch their group's range, and the rounding noise of every value in it,
    which backward puts through the derivative's curvature: a bias of the order of the
    noise's variance. Clamped, a group spans at most ``2 * limit``."""

    limit: float

    def store(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-self.limit, self.limit)

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded


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
    #: :attr:`Kind.SIGN_MASK` read for being inside ``(low, high)`` rather than above 0.
    interval: tuple[float, float] | None = None
    #: :attr:`Kind.QUANTIZE`: what is stored in place of the tensor, which the op's backward
    #: reads as it would the tensor; for this op alone.
    substitute: PiecewiseInput | SaturatingInput | None = None
    #: How to lay the tensor out for its codec, for the kinds stored by one.
    layout: Layout | None = None
    #: :attr:`Kind.RECAST_WEIGHT`: the parameter to cast again at unpack.
    parameter: nn.Parameter | None = None
    #: :attr:`Kind.QUANTIZE` of a normalisation's input: the group size (a power of two)
    #: that keeps the quantizer's groups within the rows the op normalises separately, and
    #: the layout that lays those rows out for it (channel-major, padded rows). Other codecs
    #: (DIVISION's and pool's spatial tiles) take the tensor in ``layout``.
    row_group: int | None = None
    row_layout: Layout | None = None


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


def _tensor_arguments(call: TrackedCall) -> list[torch.Tensor]:
    return [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]


def _is_input(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is one of the op's inputs or a view of one."""
    if any(a is t for a in inputs):
        return True  # checked first: it is the common case, and cheap
    storage = t.untyped_storage().data_ptr()
    return any(a.untyped_storage().data_ptr() == storage for a in inputs)


def _is_inside_composite(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is neither an input nor an output of the op but a value computed on the
    way: its autograd history runs through steps inside the op."""
    if t.grad_fn is None:
        return False
    inputs = _tensor_arguments(call)
    return not _is_input(t, inputs) and not _is_direct_output(t, inputs)


def _is_statistic(t: torch.Tensor, call: TrackedCall) -> bool:
    inputs = _tensor_arguments(call)
    # Only a larger activation makes it a statistic; a parameter's size says nothing. Checked
    # first: most saved tensors have no input that much larger, and this is the cheap test.
    larger = [a for a in inputs if a.numel() >= t.numel() * _STATISTIC_RATIO]
    if not larger or all(source_parameter(a)[0] is not None for a in larger):
        return False
    if _is_input(t, inputs):
        return False
    # Not an activation inside a composite op (a recurrent step's gate).
    return t.grad_fn is None or _is_direct_output(t, inputs)


def _is_direct_output(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is an output of the op itself or a copy of an input (its autograd node
    reads the op's inputs, through views and copies at most: GroupNorm's mean, a linear
    layer's reshaped copy of a strided input), not a value computed inside the op from
    other such values (a recurrent op's per-step states)."""
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


def _is_attention_score_input(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is the query or the key of the attention call saving it, or its padded
    copy: the flash kernels need a head dimension that is a multiple of 8 and save copies
    of query, key and value padded to one, in that order. Value's copy has the same shape
    as key's; only its position among the call's saves tells them apart."""
    if call.name not in _ATTENTION_OPS:
        return False
    for position, name in enumerate(("query", "key")):
        source = call_argument(call, position, name)
        if is_same_tensor(source, t) or (call.saves == position and _is_padded_copy(t, source)):
            return True
    return False


def _is_padded_copy(t: torch.Tensor, source) -> bool:
    """``t`` has ``source``'s shape with the last dimension rounded up to a multiple of 8
    (heads may differ: grouped-query attention repeats key and value)."""
    if not isinstance(source, torch.Tensor) or source.dim() < 2 or t.dim() != source.dim():
        return False
    width = source.shape[-1]
    return width % 8 != 0 and t.shape[-1] == width + (-width) % 8 and t.shape[-2] == source.shape[-2]


def _is_divisor(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether backward divides by ``t`` (or by a power of it) for the call saving it."""
    name = call.name
    if name in _DIVISOR_SAVING_OPS:
        return True
    if name in _DIVISION_OPS:
        return is_same_tensor(call_argument(call, 1, "other"), t)
    if name in _POWER_OPS:
        base, exponent = call_argument(call, 0, "input", "self"), call_argument(call, 1, "exponent", "other")
        if name == "__rpow__":  # x.__rpow__(y) is y ** x
            base, exponent = exponent, base
        if is_same_tensor(base, t):
            # x ** n's backward is n * x ** (n - 1): linear in x for n = 2, singular for n < 1.
            return isinstance(exponent, torch.Tensor) or not (isinstance(exponent, (int, float)) and exponent >= 1)
        return True  # the exponent tensor, or the output (b ** x's backward is log(b) * out)
    return False


def _is_first_argument(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is the call's input (its first argument), as a normalisation takes it."""
    return is_same_tensor(call_argument(call, 0, "input"), t)


def _is_scaled_by_own_row_factor(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``call`` multiplies ``t`` by a factor per row of its last dimension that was
    computed from ``t`` itself: a normalisation written out in pointwise ops."""
    if call.name not in _SCALING_OPS or t.dim() < 1 or t.shape[-1] < 2:
        return False
    first, second = call_argument(call, 0, "input", "self"), call_argument(call, 1, "other")
    if is_same_tensor(first, t):
        x, factor = first, second
    elif is_same_tensor(second, t):
        x, factor = second, first
    else:
        return False
    if (not isinstance(factor, torch.Tensor) or not factor.is_floating_point() or factor.grad_fn is None
            or x.grad_fn is None or factor.dim() != t.dim() or factor.shape[-1] != 1
            or factor.shape[:-1] != t.shape[:-1]):
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


def _is_normalisation_input(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is the input a normalisation over rows (an op, or its pointwise form) scales."""
    if call.name in _ROW_NORMALIZING_OPS:
        return _is_first_argument(t, call)
    return _is_scaled_by_own_row_factor(t, call)


def normalized_row(t: torch.Tensor, call: TrackedCall | None) -> int | None:
    """Values per row that ``call`` normalises on its own, when ``t`` is its contiguous
    input and those rows are runs of memory: LayerNorm's and RMSNorm's last dimensions (and
    the last dimension of RMSNorm written out), one GroupNorm group, one InstanceNorm plane.
    None otherwise (BatchNorm's channels are strided, not runs)."""
    if call is None or not t.is_contiguous():
        return None
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


def _row_grouping(row: int, group_size: int, bits: int) -> tuple[int, int]:
    """``(group, padded_row)``: the group size (a power of two from 8 to ``group_size``) and
    the row length padded to whole groups that store a row in the fewest bits at ``bits``
    per value, with a bfloat16 ``(low, step)`` pair per group. ViT's 192-value tokens: groups
    of 64, no padding; a 7x7 map over a batch of 8 (392 values): one padded row of 512."""
    best = None
    group = MIN_GROUP_SIZE
    while group <= group_size:
        padded = -(-row // group) * group
        cost = padded * bits + (padded // group) * STATS_BITS_PER_GROUP
        if best is None or cost <= best[0]:
            best = (cost, group, padded)
        group *= 2
    return best[1], best[2]


def _is_channel_normalized(t: torch.Tensor, call: TrackedCall | None, group_size: int) -> bool:
    """Whether ``t`` is BatchNorm's input and its groups, in memory order, would span
    channels: its channels (dimension 1) are not runs of whole groups (small maps, such as
    1x1 or 7x7, or channels-last memory)."""
    if call is None or call.name != "batch_norm" or t.dim() < 2 or t.shape[1] < 2:
        return False
    if not _is_first_argument(t, call):
        return False
    return not (t.is_contiguous() and math.prod(t.shape[2:]) % group_size == 0)


def floor_bits(t: torch.Tensor, call: TrackedCall | None) -> int:
    """The fewest bits a saved tensor may get from how its op's backward reads it."""
    if call is None:
        return _UNKNOWN_USE_BITS
    if call.name in _ZERO_EXACT_OPS:
        return 2
    if call.name in _SOFTMAX_OUTPUT_OPS or _is_attention_score_input(t, call) or _is_divisor(t, call):
        return _SOFTMAX_BITS
    if _is_normalisation_input(t, call):
        return _QUADRATIC_BITS
    if t.is_floating_point() and _is_inside_composite(t, call):
        return _QUADRATIC_BITS
    return 1


def _is_pointwise_input(t: torch.Tensor, call: TrackedCall) -> bool:
    """Whether ``t`` is what a pointwise activation saves of its input: the input itself,
    or, for the in-place form, the copy of it autograd keeps or the output written over it
    (both read by backward exactly as the input: the activation saves nothing else)."""
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
        return None  # tensor bounds, or an empty interval: quantized like any activation
    return float(low), float(high)


# Ops whose backward reads the saved input only through its derivative, affine in it on
# [low, high] and constant outside, given for each op as (low, high, below, above): the
# points of the affine piece with the derivative of the values below and above it.
_PIECEWISE_AFFINE_OPS = {
    # Hardswish's derivative is x / 3 + 1/2 on [-3, 3], 0 below and 1 above.
    "hardswish": (-3.0, 3.0, -1.5, 1.5),
    "hardswish_": (-3.0, 3.0, -1.5, 1.5),
}


# Ops whose derivative levels off: the input beyond which it is within 1e-3 of its limits
# (SiLU: (|x| - 1) e^-|x| < 5e-4 beyond 10; GELU: |x| phi(x) < 1e-5 beyond 5). On inputs of
# standard deviation 20, clamping took SiLU's 2-bit gradient error from 0.61 to 0.26 and its
# 8-bit error from 0.024 to 0.005.
_SATURATING_OPS = {"silu": 10.0, "silu_": 10.0, "gelu": 5.0, "gelu_": 5.0}


def _substitute(t: torch.Tensor, call: TrackedCall | None) -> PiecewiseInput | SaturatingInput | None:
    if call is None or not (call.name in _PIECEWISE_AFFINE_OPS or call.name in _SATURATING_OPS):
        return None
    if not _is_pointwise_input(t, call):
        return None
    if call.name in _PIECEWISE_AFFINE_OPS:
        return PiecewiseInput(*_PIECEWISE_AFFINE_OPS[call.name])
    return SaturatingInput(_SATURATING_OPS[call.name])


def _dropout_keep_probability(call: TrackedCall) -> float:
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    return 1.0 - float(p)


def decide(
    t: torch.Tensor, call: TrackedCall | None, *, external: bool, min_numel: int, group_size: int = 256
) -> Decision:
    """How to store ``t``, which ``call`` is saving for backward.

    Args:
        t: the saved tensor.
        call: the torch function saving it, None when no tracked function is running.
        external: whether the step keeps ``t``'s storage alive anyway (its input batch).
        min_numel: tensors with fewer distinct elements are kept as they are.
        group_size: the quantizer's group size, which a normalisation's rows are compared with.
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
    interval = _interval(t, call) if floating else None
    if floating:
        reads_one_bit = op in _SIGN_ONLY_OPS or op in _DROPOUT_OPS or interval is not None
        kind = Kind.SIGN_MASK if reads_one_bit else Kind.QUANTIZE
    elif t.dtype == torch.bool:
        kind = Kind.MASK
    elif t.dtype in INDEX_DTYPES:
        value_range = saved_index_range(call, t)
        if value_range is None and t.element_size() == 1:
            return Decision(Kind.KEEP, min_bits)  # an opaque byte buffer: see _OPAQUE_BYTES
        if value_range is None and t.device.type != "cpu":
            # Measuring the range would read it back to the host: a synchronisation per tensor.
            return Decision(Kind.KEEP, min_bits)
        kind = Kind.INDEX
    else:
        return Decision(Kind.KEEP, min_bits)
    layout = Layout.of(t)
    if layout is None or layout.numel < max(min_numel, 1):  # empty: nothing to store
        return Decision(Kind.KEEP, min_bits)
    if kind is Kind.QUANTIZE:
        if call is not None and _is_statistic(t, call):
            return Decision(Kind.STATISTIC, min_bits)
        row, row_layout = normalized_row(t, call), layout
        if row is None and _is_channel_normalized(t, call, group_size):
            # Each channel one run, so that groups can stay within a channel.
            row, row_layout = t.numel() // t.shape[1], Layout.channel_major(t)
        row_group = None
        if row is not None and row % group_size:
            row_group, padded_row = _row_grouping(row, group_size, max(min_bits, 2))
            if padded_row != row:
                row_layout = row_layout.with_padded_rows(t, row, padded_row)
        return Decision(
            kind,
            min_bits,
            keeps_zeros=op in _ZERO_EXACT_OPS,
            layout=layout,
            row_group=row_group,
            row_layout=row_layout if row_group is not None else None,
            substitute=_substitute(t, call),
        )
    if kind is Kind.INDEX:
        return Decision(kind, min_bits, value_range=value_range, layout=layout)
    if kind is Kind.SIGN_MASK and op in _DROPOUT_OPS:
        return Decision(kind, min_bits, divisor=_dropout_keep_probability(call), layout=layout)
    if kind is Kind.SIGN_MASK:
        return Decision(kind, min_bits, interval=interval, layout=layout)
    return Decision(kind, min_bits, layout=layout)
