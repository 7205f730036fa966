"""How one saved tensor must be stored, from what it is and how backward reads it.

:func:`decide_site` holds every rule and is pure: it decides from a :class:`SaveSite`, read off an eager call
(:func:`~lightning_act.capture.call_sites.decide`) or a compiled graph's node
(:func:`~lightning_act.capture.graph_nodes.decide_saved_node`). Rules and policy then pick codec and bits.

How backward reads a float tensor is traced from the saving call's backward (:mod:`lightning_act.backward_reads`).
Stochastic rounding keeps the gradient unbiased only where that read is linear; otherwise:

* compared for equality with a value computed from the call's other saves (``amax``'s ``x == result``): the
  outcome, 1 bit per value (:class:`~lightning_act.backward_reads.Match`);
* compared in any other way, cast, rounded, divided by, put through a log/root/power below 1, written after it was
  saved, read by an op not known to be linear in it, or untraceable: exact. A rounded divisor is unbounded near
  zero and biased (E[1/(x+e)] > 1/x), and a rounded value can leave its domain (NaN);
* compared only with constants: a 1-bit mask (hand rules), else the value's cell (:class:`ThresholdCells`);
* read quadratically (a normalisation's input, recurrent gates, sigmoid's/tanh's output): at least 4 bits;
* through a smooth nonlinearity (exp: log-probabilities, attention's query and key): at least 8 bits; ``-inf``, or
  a mask value as large, becomes a finite stand-in plus a 1-bit mask (:class:`MinusInfinityStandIn`);
* input of a pointwise op with gradient ``grad * h(x)`` (SiLU, GELU, ...): ``h(x)`` is stored instead, so backward
  is linear in what is stored (:class:`~lightning_act.backward_reads.PointwiseDerivative`);
* linear: 1 bit and up, as the policy decides.

Hand rules, where the one call cannot show enough: ReLU's output is quantized with zeros exact (2 bits and up), not
masked, so the next layer's save of it shares the copy; LeakyReLU's, ReLU6's, Hardtanh's and Hardsigmoid's inputs
and CPU dropout noise are 1-bit masks; softmax's output 8 bits; BatchNorm's input no floor over channels of
``LONG_CHANNEL`` values or more; RMSNorm written in pointwise ops (found by its factor's autograd history) 4 bits;
a tensor saved outside any tracked call (``ctx.save_for_backward``: activation checkpointing's block input) 8 bits,
exact if the op tracker was off; a normalisation's input over rows shorter than ``SHORT_ROW`` 8 bits; whatever a
normalisation or softmax over rows shorter than 8 values saves, exact (a group would span rows).

Never compressed: parameters and their views or cast copies (autocast's exact cast is re-made at unpack), tensors
alive anyway (batch, buffers), a reduction statistic (an op's own output ``STATISTIC_RATIO`` times smaller than its
largest activation argument, e.g. LayerNorm's rstd: backward multiplies its noise into everything), and tensors too
small (``min_numel``), overlapping, not strided or of a dtype no codec takes. Masks and integers are stored
losslessly in the fewest bits, bounded by their op or else measured, on the CPU only (a GPU would synchronise);
one-byte integers with no bound (an op's workspace) are kept. A normalisation's input is quantized in groups that
never span two of its rows (:class:`Normalized`). ``rules`` may raise bits or keep a tensor exact; the floors hold
under every rule and policy. A :class:`Decision` depends only on the tensor's dtype, shape, strides and role and on
the call's signature, so eager saves cache it per call (:func:`~lightning_act.capture.call_sites.call_key`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import nn

from lightning_act.backward_reads import (
    ATTENTION_MASK,
    Match,
    Read,
    Recompute,
    Use,
)
from lightning_act.capture.records import Layout
from lightning_act.codecs.derivative import DerivativeSubstitute
from lightning_act.codecs.exact import INDEX_DTYPES
from lightning_act.codecs.substitutes import FiniteStandIn, MinusInfinityStandIn, ThresholdCells
from lightning_act.ops.validation import FLOAT_DTYPES, MIN_GROUP_SIZE
from lightning_act.policy.allocation import STATS_BITS_PER_GROUP

__all__ = [
    "Decision",
    "MinusInfinityStandIn",
    "Form",
    "LONG_CHANNEL",
    "Normalized",
    "SaveSite",
    "decide_site",
]

# The floor of each way backward reads a tensor (see the module notes).
_QUADRATIC_BITS = 4
#: A BatchNorm channel (values over the batch and the map) this long or longer stores its
#: input with no floor: the bias its rounding adds is of order variance / channel length.
LONG_CHANNEL = 1024
#: A normalisation over rows shorter than this stores its input at the nonlinear floor, not
#: the quadratic one: the bias of its rounding is of order (step / std)^2 / row length.
SHORT_ROW = 64
NONLINEAR_BITS = 8
_FLOORS = {
    Use.NONE: 1,
    Use.LINEAR: 1,
    Use.QUADRATIC: _QUADRATIC_BITS,
    Use.SMOOTH: NONLINEAR_BITS,
}

# ReLU's backward reads only ``out > 0`` of its output, which the next layer usually saves
# for its values: one copy with zeros kept exact serves both.
ZERO_EXACT_OPS = frozenset({"relu", "relu_"})
#: The most cells between constants stored in place of a tensor (:class:`ThresholdCells`).
MOST_CELLS = 8
SOFTMAX_OPS = frozenset({"softmax", "softmax_", "_softmax", "_safe_softmax"})
_UNKNOWN_USE_BITS = NONLINEAR_BITS
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


class Form(enum.Enum):
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
    #: Kept exact as a copy of its own values: a view of part of a larger storage, which kept as
    #: it is would hold all of that storage.
    COPY = "copy"
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


_MINUS_INFINITY_STAND_IN = MinusInfinityStandIn()


_FINITE_STAND_IN = FiniteStandIn()
# The reads (the analysis's reason) through which backward exponentiates a saved tensor.
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


def exact_form(storage_bytes: int, own_bytes: int) -> Form:
    """How a save that a rule or the policy keeps exact is held: as it is, or, where it views
    part of a larger storage (an attention's value, a third of ``qkv``), as a copy of its own
    values, since the view would hold the whole storage for backward."""
    return Form.COPY if storage_bytes > own_bytes else Form.KEEP


class Decision(NamedTuple):
    """How one saved tensor is stored, and what its codec must respect."""

    form: Form
    #: The fewest bits any copy serving this save may have (rules and policies included).
    min_bits: int = 1
    #: The codec must decode zeros to exact zeros and positives to positives (ReLU's output).
    keeps_zeros: bool = False
    #: :attr:`Form.INDEX`: ``(low, high)`` bounding the values, when the op tells.
    value_range: tuple[int, int] | None = None
    #: :attr:`Form.SIGN_MASK` of dropout noise: the keep probability the mask is divided by.
    divisor: float | None = None
    #: :attr:`Form.SIGN_MASK` read for being inside ``(low, high)`` rather than above 0.
    interval: tuple[float, float] | None = None
    #: :attr:`Form.QUANTIZE`: what is stored in place of the tensor (its ``store`` gives
    #: the tensor to encode and what restores it at unpack); for this op alone.
    substitute: DerivativeSubstitute | MinusInfinityStandIn | FiniteStandIn | None = None
    #: How to lay the tensor out for its codec, for the kinds stored by one.
    layout: Layout | None = None
    #: :attr:`Form.RECAST_WEIGHT`: the parameter to cast again at unpack.
    parameter: nn.Parameter | None = None
    #: :attr:`Form.QUANTIZE` of a normalisation's input: the group size (a power of two) that
    #: keeps the quantizer's groups within its rows, and the layout of those rows (channel-major,
    #: padded). Other codecs take the tensor in ``layout``.
    row_group: int | None = None
    row_layout: Layout | None = None
    #: :attr:`Form.MATCH`: what backward compares the tensor with.
    match: Match | None = None
    #: :attr:`Form.QUANTIZE` of a tensor that matched saves of its call are compared with
    #: (:attr:`~lightning_act.backward_reads.Read.match_partner`): their save numbers. Stored at
    #: its bits once all of them stored their outcome against it, else exact.
    match_partner: tuple[int, ...] = ()
    #: :attr:`Form.RECOMPUTE`: how.
    recompute: Recompute | None = None
    #: :attr:`Form.CELLS`: the constants backward compares the tensor with, and their cells.
    cells: ThresholdCells | None = None
    #: Compiled graphs only (eager uses ``row_layout``): the axis the groups (of ``row_group``)
    #: run down, the tensor read as matrices of that axis's size by the later sizes' product.
    group_axis: int | None = None
    #: With ``group_axis`` 0: a channels-last BatchNorm input, read in memory order as one
    #: matrix of a channel's values by the channels, so each group holds one channel.
    channels_last: bool = False
    #: Kept whole because its call's backward could not be traced: why.
    untraced: str | None = None


def row_grouping(row: int, group_size: int, bits: int) -> tuple[int, int]:
    """``(group, padded_row)``: the group size (a power of two from 8 to ``group_size``) and
    the row length padded to whole groups that store a row in the fewest bits at ``bits``
    per value, counting each group's statistics."""
    best = None
    group = MIN_GROUP_SIZE
    while group <= group_size:
        padded = -(-row // group) * group
        cost = padded * bits + (padded // group) * STATS_BITS_PER_GROUP
        if best is None or cost <= best[0]:
            best = (cost, group, padded)
        group *= 2
    return best[1], best[2]


class Normalized(NamedTuple):
    """A normalisation reads the saved tensor as its input, one row at a time."""

    #: Values per row it normalises on its own: a LayerNorm token, one GroupNorm group, one
    #: InstanceNorm plane, one BatchNorm channel over the batch and the map.
    row: int
    #: BatchNorm: its rows are channels, strided in memory (no floor from ``LONG_CHANNEL`` on).
    channels: bool = False


class SaveSite(NamedTuple):
    """What the decision about one saved tensor depends on, read off an eager call or a
    compiled graph's node: :func:`decide_site` decides both paths from it alone."""

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
    #: Why its call's backward could not be traced (its saves are then kept whole).
    untraced: str | None = None


def decide_site(site: SaveSite, *, min_numel: int) -> Decision:
    """How to store a saved tensor that is neither a parameter nor alive anyway (the module
    notes' rules): its form, floor and lossless layout. The path lays a stored tensor out."""
    stored = site.laid_out and site.numel >= max(min_numel, 1)
    if site.dtype == torch.bool:
        return Decision(Form.MASK if stored else Form.KEEP)
    if site.dtype in INDEX_DTYPES:
        if not stored or (site.index_range is None and not site.measures_range):
            return Decision(Form.KEEP)  # a device synchronisation, or an opaque byte buffer
        return Decision(Form.INDEX, value_range=site.index_range)
    if site.dtype not in FLOAT_DTYPES or site.short_rows:
        return Decision(Form.KEEP)
    read = site.read
    if read is None:
        if site.seen:
            return _exact(site)  # backward unseen: kept exact
        return Decision(Form.QUANTIZE, _UNKNOWN_USE_BITS) if stored else Decision(Form.KEEP)
    if read.recompute is not None:
        return Decision(Form.RECOMPUTE, recompute=read.recompute)
    if read.match is not None and stored and site.contiguous:
        return Decision(Form.MATCH, match=read.match)
    if read.match_partner and stored:
        return Decision(Form.QUANTIZE, match_partner=read.match_partner, substitute=_FINITE_STAND_IN)
    if site.zero_exact and read.thresholds == (0.0,) and (read.use is Use.REGION or read.value_use is not None):
        floor = max(2, _FLOORS[read.value_use or Use.LINEAR])  # ReLU's output: see ZERO_EXACT_OPS
    elif read.use >= Use.SINGULAR:
        return _exact(site)  # read exactly, or divided by
    elif site.dropout_keep is not None:
        return Decision(Form.SIGN_MASK, divisor=site.dropout_keep) if stored else Decision(Form.KEEP)
    elif read.use is Use.REGION:
        # A mask only for the comparisons the op's hand rule names; else the cells.
        if not stored:
            return Decision(Form.KEEP)
        if site.sign_only and read.thresholds == (0.0,):
            return Decision(Form.SIGN_MASK)
        if site.interval is not None and set(read.thresholds) <= set(site.interval):
            return Decision(Form.SIGN_MASK, interval=site.interval)
        cells = ThresholdCells.of(read.thresholds, site.dtype)
        if cells is None or cells.count > MOST_CELLS:
            return Decision(Form.KEEP)
        return Decision(Form.CELLS, cells=cells)
    elif read.derivative is not None:
        floor = _FLOORS[read.use]  # h(x) stored in place of x: linear in it, unbiased at any bits
    elif site.normalized is not None and site.normalized.channels and read.use >= Use.SMOOTH:
        # Normalised, then through a nonlinearity backward recomputes (a compiled ReLU after
        # BatchNorm): rounding moves values across its kinks, a bias at any width.
        return _exact(site)
    elif site.softmax:
        floor = NONLINEAR_BITS
    elif site.normalized is not None and site.normalized.channels and site.normalized.row >= LONG_CHANNEL:
        floor = 1
    else:
        floor = _FLOORS[read.use]
    if not stored:
        return Decision(Form.KEEP)
    if site.statistic:
        return Decision(Form.STATISTIC)
    if read.derivative is not None:
        return Decision(Form.QUANTIZE, floor, substitute=DerivativeSubstitute.of(read.derivative))
    if site.normalized is not None and (not site.normalized.channels or site.normalized.row < LONG_CHANNEL):
        # A row's noise times its 1 / std, twice.
        floor = max(floor, NONLINEAR_BITS if site.normalized.row < SHORT_ROW else _QUADRATIC_BITS)
    substitute = None
    if read.use is Use.SMOOTH and read.reason in _EXPONENTIATING:
        substitute = _MINUS_INFINITY_STAND_IN
    return Decision(Form.QUANTIZE, floor, keeps_zeros=site.zero_exact, substitute=substitute)


def _exact(site: SaveSite) -> Decision:
    return Decision(Form.STATISTIC if site.statistic else Form.KEEP, untraced=site.untraced)
