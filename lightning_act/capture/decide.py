"""How one saved tensor must be stored, from what it is and from how backward reads it.

:func:`decide_site` is every such rule in one place, eager or compiled, and pure: it decides
from a :class:`SaveSite`, what the tensor is and how backward reads it, never from the
capture's state. :func:`decide` reads the site off the eager call that saves a tensor (from
the :class:`~lightning_act.optrack.OpTracker`), :func:`decide_saved_node` off a node of a
compiled forward graph; each then lays the decision out for its path, and says where that
path cannot store what was decided. The capture engine and the graph plans dispatch on the
:class:`Decision`; the rules (by module and op) and the policy then pick the codec and bits
of a tensor decided :attr:`Kind.QUANTIZE`, never below its floor.

How backward reads a saved float tensor is not looked up in a list of ops: it is read off
the backward of the call that saves it, traced once per call signature
(:mod:`lightning_act.backward_reads`, the same analysis the compiled path applies to a
compiled backward graph). Stochastic rounding keeps the gradient unbiased exactly where
backward reads the tensor linearly; the analysis says where it does not:

* compared for equality only, with a value computed from other saves of the call
  (``scatter_reduce`` amax's ``x == result.gather(index)``, ``amax``'s ``x == result``):
  the outcome at 1 bit per value, made once those saves exist
  (:class:`~lightning_act.backward_reads.Match`);
* compared with another value in any other way, cast to an integer or rounded, read by an
  op outside aten not measured linear in it (``roi_align``'s box indices, a deformable
  convolution's offsets), divided by or put through a log, a root or a power below 1 (a
  denominator, ``asin``'s and ``log1p``'s input), written by the call after it was saved,
  or a call whose backward could not be traced: kept exact. Correct before compressed. Rounding
  a divisor is amplified without bound near zero and its mean is not the exact quotient
  (E[1/(x+e)] > 1/x), and a rounded value can cross the edge of a domain (NaN): at 8 bits
  such tensors still gave OpInfo gradients off by 0.4 to 13 of their norm. They are small
  in models (a neighbour count, a per-row sum);
* compared only with constants: a 1-bit mask where a codec keeps the comparisons (see the
  hand rules below), else the cell each value falls in between the constants
  (:class:`ThresholdCells`, 2 to 4 bits, exact for those comparisons);
* read quadratically (a normalisation's input, a recurrent op's gates, a sigmoid's or
  tanh's output): at least 4 bits. At 2 bits LayerNorm's input biased a BERT's gradient
  (16-seed mean 2.4x closer than one seed, 4x when unbiased) and a GRU's gates likewise; at
  4 bits the rounding variance, and the bias with it, is 25 times smaller;
* through a smooth nonlinearity (exp: softmax's log-probabilities, attention's query and
  key): at least 8 bits, where rounding noise amplified through the curvature stays under
  the noise of the linear reads. A tensor read through an exponential may hold ``-inf``
  (a masked log-softmax), or a finite mask value as large: those are stored as a finite
  stand-in and a 1-bit mask (:class:`MinusInfinityStandIn`);
* the input of a pointwise op whose gradient is ``grad * h(x)`` (SiLU, GELU, Mish,
  Hardswish, ELU): ``h(x)`` is stored instead, so backward is linear in what is stored, and
  unbiased at any bits (:class:`~lightning_act.backward_reads.PointwiseDerivative`);
* linear: 1 bit and up, as the policy decides.

Hand rules remain where a measurement, or something the one call cannot show, says more:

* ReLU's output is stored by the quantizer with zeros exact (2 bits and up), not as a
  mask: the next layer saves the same tensor for its values, and one copy serves both;
* LeakyReLU's input, and the input of ReLU6, Hardtanh and Hardsigmoid (compared with 0, or
  with the ends of an interval the call gives), and dropout's noise on the CPU: 1-bit masks;
* softmax's output: 8 bits. Backward is quadratic in it, but at 2 bits the logits of a small
  transformer cost +25% validation loss, and 4 bits kept its query and key on their loss
  plateau. Over rows shorter than 8 values it is kept exact: a group then spans rows, its
  step is set by the rows' largest probabilities, and a saturated row's gradient,
  ``y (g - <g, y>)``, shrinks with what the row leaves beside its largest (multi-head
  attention over 3 tokens lost 0.39 of its gradient at 8 bits, a softmin over 5 values 0.71);
* BatchNorm's input: no floor where its rows (a channel over the batch and the map) hold
  ``LONG_CHANNEL`` values or more. Backward is quadratic in it like any normalisation's, but
  the bias is of order variance / row length, and its inputs are a third of a CNN's memory.
  Over shorter channels, the late stages of a CNN on small images or small batches, the
  other normalisations' floor: a torchvision RegNetY on CIFAR (batch 8, 1x1 maps: channels
  of 8 values) had a 2-bit bias of 0.39 of its gradient's norm from BatchNorm's inputs alone;
* RMSNorm written out in pointwise ops (``x * rsqrt(mean(x**2) + eps)``, as HF's Llama, Mistral
  and T5 write it): its ``mul`` reads ``x`` linearly, but ``x`` reaches the per-row factor
  through other calls, so backward multiplies two uses of it. Found by the factor's autograd
  history; 4 bits;
* a tensor saved outside any tracked call (``ctx.save_for_backward`` of a custom autograd
  function): 8 bits. Non-reentrant activation checkpointing saves each block's input this
  way and recomputes the whole block from it in backward; at 2 bits that input biased a
  checkpointed transformer's gradient by 0.22 of its norm; one saved while the op tracker
  is off (eager code a compiled module runs at a graph break, whose op went unseen): exact;
* a normalisation's input over rows shorter than ``SHORT_ROW`` values (64): 8 bits, as
  the bias its rounding adds grows as its rows shorten;
* everything a normalisation over rows shorter than 8 values saves: exact (its rows are too
  short for groups of their own, and a rounded mean no longer cancels ``x - mean``); a
  softmax's output over such rows, as above;
* a reduction statistic (LayerNorm's mean and rstd, attention's logsumexp): kept exact, as
  backward multiplies its noise into everything and it costs little (a cost rule);
* parameters, tensors alive anyway, masks and indices, dtypes, layouts and overlapping views
  no codec takes: as below.

In full, by what the tensor is:

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
* too small, laid out with overlapping elements (a broadcast/unfolded view whose dense
  copy would be larger), not strided (sparse, nested), or of a dtype no codec takes
  (float64, complex): kept as it is. Size is a cost rule, not a sensitivity rule: below
  ``min_numel`` the group statistics and the per-tensor work cost more than the bits saved;
* the input of a normalisation that scales each row by its own 1 / std is quantized in
  groups that never span two rows: LayerNorm, RMSNorm, GroupNorm and InstanceNorm rows are
  runs of memory (:class:`Normalized`); BatchNorm's rows are channels, laid out
  channel-major for the codec where a channel's values are not runs of whole groups.

``rules`` may raise any tensor's bits or keep it exact; the floors hold under every rule
and policy. A :class:`Decision` is a small immutable value. It depends on the tensor's
dtype, shape and strides, on whether it is a parameter in disguise or alive anyway, and on
the call's function, its arguments' signatures and the save's position; so while a forward
repeats its ops and shapes, the decision of each slot repeats too, and :func:`decide` finds
it again (``decided``, keyed by :func:`call_key`) rather than deciding it again.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_act.backward_reads import (
    ATTENTION_MASK,
    STATISTIC_RATIO,
    Match,
    PointwiseDerivative,
    Read,
    Recompute,
    Use,
    call_reads,
)
from lightning_act.capture.records import Layout
from lightning_act.codecs.exact import INDEX_DTYPES, MaskCodec
from lightning_act.ops.validation import FLOAT_DTYPES, MIN_GROUP_SIZE
from lightning_act.optrack import (
    LOOK_UP,
    PLAIN_TYPES,
    TrackedCall,
    arguments_key,
    call_argument,
    is_same_tensor,
    saved_index_range,
)
from lightning_act.policy.allocation import STATS_BITS_PER_GROUP

__all__ = [
    "Decision",
    "MinusInfinityStandIn",
    "Kind",
    "LONG_CHANNEL",
    "Normalized",
    "SaveSite",
    "decide",
    "decide_saved_node",
    "decide_site",
    "read_of",
    "site_of_call",
    "source_parameter",
]

# The floor of each way backward reads a tensor (see the module notes).
_QUADRATIC_BITS = 4
#: A BatchNorm channel (values over the batch and the map) this long or longer stores its
#: input with no floor: the bias its rounding adds is of order variance / channel length.
#: ResNet-18 on CIFAR at batch 64 has channels of 1,024 values on its last 4 x 4 maps.
LONG_CHANNEL = 1024
#: A normalisation over rows shorter than this stores its input at the nonlinear floor, not
#: the quadratic one: the bias of its rounding is of order (step / std)^2 / row length, and at
#: 4 bits a Segformer's LayerNorm over 16 channels biased the whole gradient by 0.015 of its
#: norm, a fifth of its 2-bit error (32 seeds 3.90x closer than one, 5.66 unbiased).
SHORT_ROW = 64
_NONLINEAR_BITS = 8
_FLOORS = {
    Use.NONE: 1,
    Use.LINEAR: 1,
    Use.QUADRATIC: _QUADRATIC_BITS,
    Use.SMOOTH: _NONLINEAR_BITS,
}

# Hand rules: ops whose comparisons a codec keeps. ReLU's backward reads only ``out > 0``
# of the output it saves, while the next layer usually saves the same tensor for its values.
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
# Dropout on the CPU saves its noise, bernoulli(1 - p) / (1 - p): a mask and a known scale
# (on a GPU it saves a boolean mask, stored losslessly like any other).
_DROPOUT_OPS = frozenset({"dropout", "dropout_"})
# Hand floors (see the module notes).
SOFTMAX_OPS = frozenset({"softmax", "softmax_", "_softmax", "_safe_softmax"})
_UNKNOWN_USE_BITS = _NONLINEAR_BITS
# BatchNorm, as its functional form and as the aten ops it reaches (called directly).
# Recurrent calls run their cells step by step under one call (``nn.GRU`` on the CPU): their
# trace grows with the sequence (11 s for 64 steps of a two-layer GRU, and classifying its
# 1,154 saves as long again), so they are not traced. Their float saves read as the trace of
# a short sequence reads them (``tests/test_decide.py``): quadratically at most (the gates'
# ``y (1 - y)`` and ``1 - y**2``), 4 bits or more.
_RECURRENT_OPS = frozenset({"gru", "lstm", "rnn_tanh", "rnn_relu"})
_RECURRENT_READ = Read(Use.QUADRATIC)
BATCH_NORM_OPS = frozenset(
    {
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_batch_norm_with_update",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
    }
)

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
# (The ratio, STATISTIC_RATIO, is the analysis's too: what ``exp(x - s)`` rounds twice.)

# _OPAQUE_BYTES: a one-byte integer tensor with no bound its op implies is kept as it is.
# Such tensors are byte buffers that an op lays out for itself (oneDNN's RNN workspace on the
# CPU, cuDNN's reserve space on a GPU): their bytes span the whole range, so the index codec
# could not store them in fewer bits, and finding that out costs a pass over them and a
# device synchronisation; a copy to give back at unpack would add its size to the peak.

# Autograd nodes that only view or cast their single input: following them from a saved
# tensor tells whether it is a parameter in disguise.
_VIEW_OR_CAST_NODES = frozenset(
    """
    AliasBackward0 CloneBackward0 ExpandBackward0 PermuteBackward0 ReshapeAliasBackward0 SelectBackward0
    SliceBackward0 SqueezeBackward0 SqueezeBackward1 SqueezeBackward2 TBackward0 ToCopyBackward0 TransposeBackward0
    UnsafeViewBackward0 UnsqueezeBackward0 ViewBackward0
    """.split()
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
    #: A float tensor backward only compares for equality with a value computed from other
    #: saves of its call: the outcome, 1 bit per value, exact (:attr:`Decision.match`).
    MATCH = "match"
    #: A fused attention's output, computed again from the call's earlier saves when backward
    #: needs it (:attr:`Decision.recompute`): nothing stored.
    RECOMPUTE = "recompute"
    #: A float tensor backward only compares with constants: the cell each value falls in
    #: between them, a few bits per value, exact for those comparisons (:attr:`Decision.cells`).
    CELLS = "cells"


class ThresholdCells(NamedTuple):
    """A tensor backward only compares with constants (``clamp(min=eps)``'s ``x >= eps``, a
    threshold): stored as the cell each value falls in (below the first constant, equal to
    it, between it and the next, ..., above the last, NaN), so ``2 k + 2`` cells for ``k``
    constants (2 bits for one), and decoded to a value in that cell. Every comparison of the
    decoded tensor with those constants, strict or not, comes out as with the tensor itself.
    Use :meth:`of`, which checks that each cell has a value in the tensor's dtype."""

    thresholds: tuple[float, ...]
    #: A value in each cell, in the tensor's dtype (as floats; NaN last).
    values: tuple[float, ...]
    dtype: torch.dtype

    #: The stored cells serve this op alone: another op's save of the tensor is stored again.
    for_its_op_alone = True

    @staticmethod
    def of(thresholds: tuple[float, ...], dtype: torch.dtype) -> ThresholdCells | None:
        """The cells between ``thresholds`` for a tensor of ``dtype``; None where a cell has no
        value of its own in that dtype (constants one rounding apart, or not finite)."""
        if not thresholds or not all(math.isfinite(c) for c in thresholds):
            return None
        # Worked out on real CPU tensors, also while a graph is traced under fake tensors.
        with unset_fake_temporarily():
            return ThresholdCells._work_out(thresholds, dtype)

    @staticmethod
    def _work_out(thresholds: tuple[float, ...], dtype: torch.dtype) -> ThresholdCells | None:
        constants = torch.tensor(sorted(set(thresholds)), dtype=torch.float64).to(dtype)
        if constants.unique().numel() != len(set(thresholds)):
            return None  # two constants the same in this dtype: their comparisons differ
        edges = constants.tolist()
        values = [edges[0] - max(1.0, abs(edges[0]))]
        for low, high in zip(edges, edges[1:]):
            values += [low, low + (high - low) / 2]
        values += [edges[-1], edges[-1] + max(1.0, abs(edges[-1]))]
        inside = torch.tensor(values, dtype=torch.float64).to(dtype)
        if not bool(inside.isfinite().all()):
            return None
        expected = ThresholdCells(tuple(edges), (), dtype).cell(inside)
        if not torch.equal(expected, torch.arange(len(values), dtype=torch.uint8)):
            return None  # a value that rounds out of its cell in this dtype
        return ThresholdCells(tuple(edges), tuple(inside.tolist()) + (math.nan,), dtype)

    @property
    def count(self) -> int:
        return 2 * len(self.thresholds) + 2

    def cell(self, x: torch.Tensor) -> torch.Tensor:
        """The cell of each value of ``x``: ``uint8``, NaN in the last."""
        cells = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for constant in self.thresholds:
            cells += (x > constant).to(torch.uint8) * 2 + (x == constant).to(torch.uint8)
        return cells.masked_fill_(x.isnan(), 2 * len(self.thresholds) + 1)

    def unpack(self, record) -> torch.Tensor:
        """A tensor in the recorded cells, from the record of :meth:`cell`."""
        cells = record.unpack()
        values = torch.tensor(self.values, dtype=self.dtype, device=cells.device)
        return values[cells.long()]


class MinusInfinityStandIn:
    """A tensor backward reads through an exponential (log-probabilities, a running
    log-sum-exp, an attention mask), whose masked positions (probability zero: ``-inf``, or
    a finite mask value as large, such as ``torch.finfo(dtype).min``) are stored as the
    tensor's smallest other value, with a 1-bit mask of where they were, and put back at
    unpack. The codec decodes a group holding a non-finite value, or spanning more than its
    statistics hold, as NaN (so that a NaN or an overflow never turns into a finite, wrong
    gradient); a mask value there is a value, not a fault. Masked positions are put back as
    the tensor's smallest value: exact where they hold one value (a mask's), and exponentiated
    to zero next to any unmasked one otherwise. On a GPU the stand-in and the mask are
    computed on the device, whether or not a masked value is there (looking would read back
    to the host); on the CPU only where one is. The copy decodes to the tensor itself, so
    other saves of it may share it."""

    for_its_op_alone = False

    @staticmethod
    def store(x: torch.Tensor) -> tuple[torch.Tensor, _MinusInfinity | None]:
        # Half the dtype's most negative value: no sum of scores reaches it.
        masked = x <= torch.finfo(x.dtype).min / 2
        if x.device.type == "cpu" and not masked.any():
            return x, None  # on the CPU, looking costs no synchronisation: no mask needed
        low = torch.where(masked, torch.inf, x).amin()
        low = torch.where(low.isinf(), 0.0, low)  # every value masked: any stand-in will do
        return torch.where(masked, low, x), _MinusInfinity(MaskCodec().pack(masked, 0, 0), x.amin())


class _MinusInfinity(NamedTuple):
    mask: object  # a MaskCodec record
    fill: torch.Tensor  # the tensor's smallest value, 0-dim, on its device

    def unpack(self, record) -> torch.Tensor:
        """The tensor backward reads, from the record its stand-in was stored in."""
        return self.restore(record.unpack())

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded.masked_fill_(self.mask.unpack().view(decoded.shape), self.fill)


_MINUS_INFINITY_STAND_IN = MinusInfinityStandIn()


class FiniteStandIn:
    """What a match partner (:attr:`Decision.match_partner`) stores: its values with NaN and
    infinities as 0. The codec decodes a group holding a non-finite value as NaN throughout,
    which would turn the matches of its finite neighbours into mismatches. Where the tensor
    is not finite, the stand-ins come out alike: a NaN matched nothing, and an infinity that
    matched is rebuilt from the same stored 0 that backward compares it with. Other saves of
    the tensor read its values, so they do not share this copy."""

    for_its_op_alone = True

    @staticmethod
    def store(x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), None


_FINITE_STAND_IN = FiniteStandIn()
# The reads through which backward exponentiates a saved tensor (the analysis's reason): aten
# ops, and a fused attention's mask.
_EXPONENTIATING = frozenset(
    {
        "exp",
        "exp2",
        "logsumexp",
        "logcumsumexp",
        "_softmax",
        "_log_softmax",
        "softmax",
        "log_softmax",
        "logaddexp",
        "logaddexp2",
        "_log_softmax_backward_data",
        ATTENTION_MASK,
    }
)


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
    #: :attr:`Kind.QUANTIZE`: what is stored in place of the tensor (its ``store`` gives
    #: the tensor to encode and what restores it at unpack); for this op alone.
    substitute: PointwiseDerivative | MinusInfinityStandIn | FiniteStandIn | None = None
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
    #: :attr:`Kind.MATCH`: what backward compares the tensor with.
    match: Match | None = None
    #: :attr:`Kind.QUANTIZE` of a tensor read only as what matched saves of its call are
    #: compared with (:attr:`~lightning_act.backward_reads.Read.match_partner`): their save
    #: numbers. Stored at its bits once every one of them has stored its outcome against
    #: it, else exact.
    match_partner: tuple[int, ...] = ()
    #: :attr:`Kind.RECOMPUTE`: how.
    recompute: Recompute | None = None
    #: :attr:`Kind.CELLS`: the constants backward compares the tensor with, and their cells.
    cells: ThresholdCells | None = None
    #: A compiled graph's :attr:`Kind.QUANTIZE` whose groups (of ``row_group``) run down this
    #: axis: the tensor read as matrices of its size by the product of the later sizes,
    #: column by column (eager lays such a tensor out in ``row_layout`` instead).
    group_axis: int | None = None
    #: With ``group_axis`` 0: a BatchNorm input in channels-last memory, read in its memory
    #: order as one matrix of a channel's values (rows) by the channels (columns), so that
    #: each group holds values of one channel (eager copies it channel-major instead).
    channels_last: bool = False


def source_parameter(t: torch.Tensor) -> tuple[nn.Parameter | None, bool]:
    """The parameter ``t`` views or casts, and whether ``t`` is an exact cast copy of it."""
    base = t._base
    if base is None:
        base = t
    if type(base) is not torch.Tensor and _is_parameter(base):  # a plain tensor told at once: most saves
        return base, False
    node = base.grad_fn
    if node is None:
        return None, False  # a leaf that is not a parameter
    name = node.name()
    if name not in _VIEW_OR_CAST_NODES:
        return None, False  # an activation: most saves, answered without the walk below
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
    """``isinstance(t, nn.Parameter)``, answered without the Python-level instance check of
    Parameter's metaclass for a plain tensor (0.4 us, at every save)."""
    kind = type(t)
    return kind is nn.Parameter or (kind is not torch.Tensor and isinstance(t, nn.Parameter))


def _tensor_arguments(call: TrackedCall) -> list[torch.Tensor]:
    return [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]


def _is_input(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is one of the op's inputs or a view of one."""
    if any(a is t for a in inputs):
        return True  # checked first: it is the common case, and cheap
    storage = t.untyped_storage().data_ptr()
    return any(a.untyped_storage().data_ptr() == storage for a in inputs)


def _is_statistic(t: torch.Tensor, call: TrackedCall) -> bool:
    inputs = _tensor_arguments(call)
    # Only a larger activation makes it a statistic; a parameter's size says nothing. Checked
    # first: most saved tensors have no input that much larger, and this is the cheap test.
    larger = [a for a in inputs if a.numel() >= t.numel() * STATISTIC_RATIO]
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
    """Values per row that ``call`` normalises on its own, when ``t`` is its input:
    LayerNorm's and RMSNorm's last dimensions (and the last dimension of RMSNorm written
    out), one GroupNorm group, one InstanceNorm plane. None otherwise (BatchNorm's rows are
    its channels: :func:`_batch_norm_row`)."""
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


# Cells a tensor compared with constants is stored in at most (three constants, 3 bits).
_MOST_CELLS = 8
#: Decisions :func:`decide` keeps; more distinct ones than this (shapes that change at
#: every step) start the table again.
_DECISIONS_KEPT = 4096


def call_key(call: TrackedCall | None) -> tuple | None:
    """What a decision about one of ``call``'s saves depends on besides that tensor's dtype,
    shape and strides, computed at its first save: the function, each argument's value, or
    for a tensor its dtype, shape, strides, whether it needs a gradient, is a leaf or a
    parameter in disguise (which decide what counts as a statistic), and which arguments
    are one tensor; the autocast in force; for a ``mul``, which arguments it scales by a
    factor computed from themselves (their history, which no signature shows). ``()`` for
    no call; None for an argument of a type it does not know (a module, a generator)."""
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
    """A call's positional arguments (a tuple) or keywords (a dict) for :func:`call_key`; the
    common arguments (tensors and plain values) told inline, as this runs at every call that
    saves: through :func:`arguments_key`'s general walk it cost a third more."""
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
    """One tensor argument of a call, for :func:`call_key`: ``index`` numbers the distinct
    tensors of the call, so that one tensor passed twice is told from two alike."""
    if t.layout is not torch.strided or t.is_nested:
        return index, t.dtype, t.layout, t.requires_grad
    base = t._base
    if base is None and type(t) is not torch.Tensor and _is_parameter(t):
        # A parameter itself (most tensor arguments of layers): a leaf with no history to walk.
        return index, t.dtype, t.shape, t.stride(), t.requires_grad, True, True, t.device
    node = t.grad_fn
    # A tensor no view or cast made, and no parameter, is none in disguise: told without
    # the look at its history (most arguments of most calls).
    if base is None and (node is None or node.name() not in _VIEW_OR_CAST_NODES):
        disguised = False
    else:
        disguised = source_parameter(t)[0] is not None
    return index, t.dtype, t.shape, t.stride(), t.requires_grad, node is None, disguised, t.device


def _normalizes_short_rows(call: TrackedCall) -> bool:
    """Whether ``call`` normalises rows of fewer than ``MIN_GROUP_SIZE`` values. Every float
    tensor it saves is then kept exact: its rows are too short for groups of their own or for
    rounding to average out over, and backward multiplies a row's noise by its 1 / std. The
    input alone is not enough: on a row of one value, ``x - mean`` is exactly 0 and a rounded
    mean (a row's statistic is as large as the input there) made LayerNorm's input gradient
    1e8 times the exact one."""
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


#: The autograd nodes of :data:`SOFTMAX_OPS` (``_safe_softmax``: the attention of
#: ``scaled_dot_product_attention``'s math kernel, which runs with dropout on the CPU).
_SOFTMAX_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})


def _softmax_row(t: torch.Tensor) -> int | None:
    """The length of the rows a softmax normalised, where ``t`` is its result; read off the
    autograd node that made ``t``, so that a softmax inside a composite call (multi-head
    attention, a masked softmin) is found as well as a call of its own."""
    node = t.grad_fn
    if node is None or node.name() not in _SOFTMAX_NODES:
        return None
    if not t.dim():
        return 1
    dim = node._saved_dim  # read back as unsigned: -1 comes as 2**64 - 1
    return int(t.shape[dim - (1 << 64) if dim >= 1 << 63 else dim])


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


def _batch_norm_row(t: torch.Tensor, call: TrackedCall | None) -> int | None:
    """Values per channel when ``t`` is BatchNorm's input (its rows are its channels)."""
    if call is None or call.name not in BATCH_NORM_OPS or t.dim() < 2 or not _is_first_argument(t, call):
        return None
    return t.numel() // max(t.shape[1], 1)


def read_of(t: torch.Tensor, call: TrackedCall | None) -> Read | None:
    """How the backward of ``call`` reads ``t``, its save number ``call.saves``: from the
    traced backward of the call (:func:`~lightning_act.backward_reads.call_reads`). None when
    there is no call, or its backward could not be traced or saves something else there."""
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
        return None  # tensor bounds, or an empty interval: no mask keeps the comparisons
    return float(low), float(high)


def _dropout_keep_probability(call: TrackedCall) -> float:
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    return 1.0 - float(p)


class Normalized(NamedTuple):
    """A normalisation reads the saved tensor as its input, one row at a time."""

    #: Values per row it normalises on its own: a LayerNorm token, one GroupNorm group, one
    #: InstanceNorm plane, one BatchNorm channel over the batch and the map.
    row: int
    #: BatchNorm: its rows are channels, strided in memory, and usually long (no floor from
    #: ``LONG_CHANNEL`` values on; see the notes).
    channels: bool = False


class SaveSite(NamedTuple):
    """What the decision about one saved tensor depends on. Read off the eager call that
    saves it (:func:`decide`) or off a node of a compiled forward graph
    (:func:`decide_saved_node`), and decided from by :func:`decide_site` alone: one rule for
    both paths. Only what a path cannot store differs, and the path's reader says why."""

    dtype: torch.dtype
    #: Values a codec would store (a broadcast view's once).
    numel: int
    #: The path can lay it out densely (no two indices on one element it cannot store once).
    laid_out: bool
    contiguous: bool
    #: How backward reads it; None where no op is seen saving it, or its backward was not read.
    read: Read | None
    #: An op was seen saving it (False: ``ctx.save_for_backward`` of a custom autograd function).
    seen: bool = True
    #: ReLU's output: the quantizer keeps its zeros, and so every comparison with 0.
    zero_exact: bool = False
    #: Softmax's output.
    softmax: bool = False
    #: The input of a normalisation.
    normalized: Normalized | None = None
    #: Saved by a normalisation over rows too short for groups of their own.
    short_rows: bool = False
    #: A reduction statistic of its op (a normalisation's mean and 1 / std, a logsumexp).
    statistic: bool = False
    #: Hand rules: read only for its sign, or for lying inside ``interval``.
    sign_only: bool = False
    interval: tuple[float, float] | None = None
    #: Dropout's noise on the CPU: the keep probability its mask is divided by.
    dropout_keep: float | None = None
    #: An integer tensor: the bound its op implies, where it does; whether its range may be
    #: measured instead (on the CPU: no device synchronisation).
    index_range: tuple[int, int] | None = None
    measures_range: bool = False


def decide_site(site: SaveSite, *, min_numel: int) -> Decision:
    """How to store a saved tensor that is neither a parameter nor alive anyway: every rule
    of the module notes, from ``site`` alone. The kind, the floor and the form a lossless
    copy takes; the path lays a stored tensor out (eager: :attr:`Decision.layout`, a graph:
    its plan)."""
    stored = site.laid_out and site.numel >= max(min_numel, 1)
    if site.dtype == torch.bool:
        return Decision(Kind.MASK if stored else Kind.KEEP)
    if site.dtype in INDEX_DTYPES:
        if not stored or (site.index_range is None and not site.measures_range):
            return Decision(Kind.KEEP)  # a device synchronisation, or an opaque byte buffer
        return Decision(Kind.INDEX, value_range=site.index_range)
    if site.dtype not in FLOAT_DTYPES or site.short_rows:
        return Decision(Kind.KEEP)
    read = site.read
    if read is None:
        if site.seen:
            return _exact(site)  # backward unseen: kept exact
        return Decision(Kind.QUANTIZE, _UNKNOWN_USE_BITS) if stored else Decision(Kind.KEEP)
    if read.recompute is not None:
        return Decision(Kind.RECOMPUTE, recompute=read.recompute)
    if read.match is not None and stored and site.contiguous:
        return Decision(Kind.MATCH, match=read.match)
    if read.match_partner and stored:
        return Decision(Kind.QUANTIZE, match_partner=read.match_partner, substitute=_FINITE_STAND_IN)
    if site.zero_exact and read.thresholds == (0.0,) and (read.use is Use.REGION or read.value_use is not None):
        floor = max(2, _FLOORS[read.value_use or Use.LINEAR])  # ReLU's output: see _ZERO_EXACT_OPS
    elif read.use >= Use.SINGULAR:
        return _exact(site)  # read exactly, or divided by
    elif site.dropout_keep is not None:
        return Decision(Kind.SIGN_MASK, divisor=site.dropout_keep) if stored else Decision(Kind.KEEP)
    elif read.use is Use.REGION:
        # A mask keeps the comparisons only where they are the ones the op's hand rule names;
        # any others, the cells between the constants.
        if not stored:
            return Decision(Kind.KEEP)
        if site.sign_only and read.thresholds == (0.0,):
            return Decision(Kind.SIGN_MASK)
        if site.interval is not None and set(read.thresholds) <= set(site.interval):
            return Decision(Kind.SIGN_MASK, interval=site.interval)
        cells = ThresholdCells.of(read.thresholds, site.dtype)
        if cells is None or cells.count > _MOST_CELLS:
            return Decision(Kind.KEEP)
        return Decision(Kind.CELLS, cells=cells)
    elif read.derivative is not None:
        floor = _FLOORS[read.use]  # h(x) stored in place of x: linear in it, unbiased at any bits
    elif site.normalized is not None and site.normalized.channels and read.use >= Use.SMOOTH:
        # Normalised, then put through a nonlinearity backward recomputes from it (a compiled
        # ReLU or Hardswish after BatchNorm): rounding moves values across its kinks, a bias
        # at any width.
        return _exact(site)
    elif site.softmax:
        floor = _NONLINEAR_BITS
    elif site.normalized is not None and site.normalized.channels and site.normalized.row >= LONG_CHANNEL:
        floor = 1
    else:
        floor = _FLOORS[read.use]
    if not stored:
        return Decision(Kind.KEEP)
    if site.statistic:
        return Decision(Kind.STATISTIC)
    if read.derivative is not None:
        return Decision(Kind.QUANTIZE, floor, substitute=read.derivative)
    if site.normalized is not None and (not site.normalized.channels or site.normalized.row < LONG_CHANNEL):
        # A row's noise times its 1 / std, twice.
        floor = max(floor, _NONLINEAR_BITS if site.normalized.row < SHORT_ROW else _QUADRATIC_BITS)
    substitute = None
    if read.use is Use.SMOOTH and read.reason in _EXPONENTIATING:
        substitute = _MINUS_INFINITY_STAND_IN
    return Decision(Kind.QUANTIZE, floor, keeps_zeros=site.zero_exact, substitute=substitute)


def _exact(site: SaveSite) -> Decision:
    return Decision(Kind.STATISTIC if site.statistic else Kind.KEEP)


# ------------------------------------------------------------------------------ eager calls
# The decisions that depend on nothing but their kind, made once: a NamedTuple of this many
# fields takes microseconds to build, and every parameter is saved at every step.
_KEEP, _PARAMETER, _CAST_PARAMETER, _EXTERNAL = (
    Decision(kind) for kind in (Kind.KEEP, Kind.PARAMETER, Kind.CAST_PARAMETER, Kind.EXTERNAL)
)


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
        t: the saved tensor.
        call: the torch function saving it, None when no tracked function is running.
        external: whether the step keeps ``t``'s storage alive anyway (its input batch).
        unseen: the op tracker was off when ``t`` was saved (eager code a compiled module runs
            at a graph break): whatever op saved it went unseen, so a float tensor is kept
            exact. A compiled CTC loss's ``log_alpha``, ``-inf`` where no alignment reaches,
            stored at the 8 bits of a save outside any op, made every gradient NaN.
        min_numel: tensors with fewer distinct elements are kept as they are.
        group_size: the quantizer's group size, which a normalisation's rows are compared with.
        decided: earlier decisions by what they depend on besides identity (the call's
            :func:`call_key`, the save's position, dtype, shape and strides), filled and
            read here, so that a step that repeats its calls repeats no decision work.
    """
    if t.layout != torch.strided or t.is_nested:
        return _KEEP  # sparse, nested: no codec takes them
    floating = t.is_floating_point()
    if floating or t.is_complex():  # a complex parameter's view (a spectral layer's weights) too
        param, recastable = source_parameter(t)
        if param is not None:
            if recastable:
                return Decision(Kind.RECAST_WEIGHT, parameter=param)
            # Memory decides, not the dtype: a view of the parameter's own storage (a
            # spectral layer's ``view_as_complex`` of its real weight) costs nothing; a cast
            # or a clone is a copy of its own, kept.
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
    """The decision for a tensor that is neither a parameter nor alive anyway: from the
    call's signature, the save's position and the tensor's dtype, shape and strides alone."""
    layout = Layout.of(t)
    site = site_of_call(t, call, layout)
    decision = decide_site(site, min_numel=min_numel)
    if decision.kind in (Kind.KEEP, Kind.STATISTIC, Kind.MATCH):
        return decision
    if call is None:
        # Saved outside any call (a custom autograd function's, a graph's that eager hooks see): its
        # backward may rely on the strides it saved (inductor asserts them), so a view copied
        # dense comes back with its own.
        layout = layout.with_strides(t)
    if decision.kind is not Kind.QUANTIZE or site.normalized is None:
        return decision._replace(layout=layout)
    # A normalisation's input in groups within its rows: runs of memory, or each channel one
    # run (BatchNorm, where its channels are not runs of whole groups).
    normalized = site.normalized
    row, row_layout = (normalized.row if t.is_contiguous() else None), layout
    if normalized.channels:
        row = None
        if t.shape[1] >= 2 and not (t.is_contiguous() and math.prod(t.shape[2:]) % group_size == 0):
            row, row_layout = normalized.row, Layout.channel_major(t)
    row_group = None
    if row is not None and row % group_size:
        row_group, padded_row = _row_grouping(row, group_size, max(decision.min_bits, 2))
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
    return SaveSite(
        t.dtype,
        numel,
        layout is not None,
        contiguous,
        read_of(t, call),
        zero_exact=call.name in _ZERO_EXACT_OPS,
        softmax=call.name in SOFTMAX_OPS or softmax_row is not None,
        normalized=normalized,
        short_rows=_normalizes_short_rows(call) or (softmax_row is not None and softmax_row < MIN_GROUP_SIZE),
        statistic=_is_statistic(t, call),
        sign_only=call.name in _SIGN_ONLY_OPS,
        interval=_interval(t, call),
        dropout_keep=_dropout_keep_probability(call) if call.name in _DROPOUT_OPS else None,
    )


# ----------------------------------------------------------------------- compiled graphs
# The aten ops (in a compiled forward) that normalise each row of their input on its own,
# with the rows of their first argument: LayerNorm's last dimension, one GroupNorm group.
_GRAPH_ROW_NORMALIZING_OPS = frozenset({"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"})
_GRAPH_GROUP_NORMALIZING_OPS = frozenset({"native_group_norm", "group_norm"})
_BATCH_NORM_BACKWARD_OPS = frozenset({"native_batch_norm_backward", "batch_norm_backward"})


def _graph_normalization(
    val: torch.Tensor, producer: str | None, consumers: dict[str, tuple]
) -> tuple[Normalized | None, bool]:
    """How a normalisation reading ``val`` in a compiled forward groups it, and whether each
    of its rows is a run of ``val``'s memory: the normalised shape for LayerNorm and RMSNorm,
    one group's channels and map for GroupNorm, a channel for BatchNorm (strided: handled by
    the caller). A BatchNorm's input centred or normalised in the forward for its backward
    (a partition that saves it in the input's place) is read as the input is."""
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
    """The rows a LayerNorm or RMSNorm reading ``val`` normalises: the last dimension of the
    view of ``val`` it reads, which may differ from ``val``'s (a convolution's output
    transposed to tokens: rows of its channels, strided in ``val``'s memory). The graph's
    normalisation is decomposed; its ops that read ``val`` are named by it, and the view is
    the argument as large as ``val``. Where sizes are symbolic, ``val``'s last dimension."""
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
    """Whether ``val`` (at least 2-D) has dimension 1 innermost and the others dense outside
    it: ``val.movedim(1, -1)`` is contiguous (a convolution's output in channels-last memory)."""
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
    shows of it, laid out as a graph's plan can store it.

    Args:
        val: the node's fake value.
        read: how the compiled backward reads it (:func:`~lightning_act.backward_reads.graph_reads`).
        producer: the aten op that computed it (views looked through): where eager names the
            op that saves an output (ReLU's, softmax's).
        consumers: the forward ops that read it, each with its arguments: where eager names
            the op that saves an input (BatchNorm's, LayerNorm's).
        min_numel: smaller tensors are kept as they are.
        group_size: the quantizer's group size.
        statistic: the node is a reduction statistic of its op (a normalisation's 1 / std).
        softmax_row: the length of the rows a softmax normalised, where the node is its result.
        index_range: an integer node's bound, where the graph implies one
            (:func:`~lightning_act.capture.compiled.index_bound`).

    What a graph's plan cannot store, and so keeps:

    * a tensor read through an equality test: its other side is computed from other saves,
      and a graph's pack op sees one tensor (the partition saves the test's outcome in its
      place: :class:`~lightning_act.capture.compiled.CheaperSaves`);
    * the ``-inf`` stand-in's mask (a second record per tensor): a tensor read through an
      exponential is quantized at 8 bits, and a fused attention's float mask, ``-inf``
      wherever it masks, is kept;
    * a pointwise op's derivative with no source code to rebuild it in another process:
      the input itself at 8 bits;
    * a normalisation's rows that are not runs of whole groups (eager pads them): kept.

    The site names no hand-ruled op (a sign or interval mask, dropout's noise): a tensor
    compared only with constants is stored as the cells between them (2 or 3 bits).
    """
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided or val.is_nested:
        return Decision(Kind.KEEP)
    normalized, runs = _graph_normalization(val, producer, consumers) if val.dtype in FLOAT_DTYPES else (None, True)
    site = SaveSite(
        val.dtype,
        int(val.numel()),
        not _overlaps(val),
        val.is_contiguous(),
        read,
        zero_exact=producer in _ZERO_EXACT_OPS,
        softmax=producer in SOFTMAX_OPS,
        normalized=normalized,
        short_rows=(normalized is not None and normalized.row < MIN_GROUP_SIZE)
        or (softmax_row is not None and softmax_row < MIN_GROUP_SIZE),
        statistic=statistic,
        index_range=index_range,
    )
    decision = decide_site(site, min_numel=min_numel)
    if decision.kind is Kind.MATCH:
        return Decision(Kind.KEEP)
    if decision.kind is not Kind.QUANTIZE:
        return decision
    substitute = decision.substitute
    if isinstance(substitute, PointwiseDerivative):
        if substitute.source is not None:
            return decision
        decision = decision._replace(min_bits=_NONLINEAR_BITS, substitute=None)
    elif substitute is not None:
        if read.reason == ATTENTION_MASK:
            return Decision(Kind.KEEP)
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
                return Decision(Kind.KEEP)
            return decision._replace(row_group=row_group, group_axis=0, channels_last=True)
        # Groups within one sample's map of a channel, in memory order. A map too small for a
        # group of its own (2 x 2, 7 x 7, 14 x 14) is read channel-major instead, as eager lays
        # it out: down the batch axis of (batch, channels * map) matrices, where a channel's
        # values of every sample follow each other. Other memory orders are kept.
        plane = math.prod(int(s) for s in val.shape[2:]) if val.is_contiguous() else 0
        row_group, axis = min(plane & -plane, group_size), None
        if row_group < MIN_GROUP_SIZE and plane > 0 and val.shape[0] > 1:
            channel = int(val.shape[0]) * plane
            row_group, axis = min(channel & -channel, group_size), 0
    elif not runs:
        # Rows strided in memory: groups in memory order at the rows' floor, as eager stores
        # a LayerNorm's input transposed from a convolution's output.
        return decision
    else:
        # Groups within rows: the largest power of two dividing a row, up to group_size.
        row_group, axis = min(normalized.row & -normalized.row, group_size), None
    if row_group < MIN_GROUP_SIZE:
        return Decision(Kind.KEEP)
    return decision._replace(row_group=row_group, group_axis=axis)
