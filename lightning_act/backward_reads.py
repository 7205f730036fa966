"""How backward reads each saved tensor, read off the backward itself.

Stochastic rounding stores a tensor right on average, so a gradient computed from it is
unbiased exactly where backward reads the tensor *linearly*. Everywhere else, how backward
reads the tensor decides how it may be stored. Rather than a list of ops, this module looks
at the backward: an aten graph in which each saved tensor is one node, whose uses are
followed to the gradients.

* :func:`classify` is the analysis. It takes one saved tensor's node in an aten graph (the
  backward of one op here; the backward graph of a compiled region likewise) and returns a
  :class:`Read`: how backward reads that tensor, by a degree algebra over the aten ops
  (views, sums and additions keep the degree; a product adds degrees; comparisons,
  casts, divisions and transcendental functions are recorded as what they are).
* :func:`graph_reads` gives it a compiled region's backward graph, whose placeholders are the
  tensors the compiled forward saves: the backward kernels in it are decomposed as in
  eager mode first, so both paths read the same aten ops.
* :func:`call_reads` gives it the graph in eager mode: it traces the call that saves (the
  torch function the :class:`~lightning_act.optrack.OpTracker` reports) forward and
  backward with ``make_fx`` on fake tensors and torch's core decompositions, with
  saved-tensor hooks that mark where backward reads each saved tensor. One trace per call
  signature (function, and per argument its dtype, rank, broadcast dimensions and whether
  it requires grad; the non-tensor arguments), cached for the process.

What a :class:`Use` means for storage (:mod:`lightning_act.capture.decide` applies it):

========== ====================================================== ==========================
use        backward                                               stored
========== ====================================================== ==========================
NONE       reads no value of it (its shape at most)                by the policy
REGION     only compares it with constants (``x <= 0``)            exact, unless a codec keeps
                                                                   the comparisons (masks)
LINEAR     is linear in it                                         by the policy, any bits
QUADRATIC  multiplies two uses of it (a normalisation's input,     4 bits or more
           a recurrent op's gates, ``y (1 - y)``)
SMOOTH     puts it through a smooth nonlinearity (exp, sigmoid,    8 bits or more; a pointwise
           erf, clamps) or compares it and reads its value          derivative is stored instead
SINGULAR   divides by it, or takes its log, root or a power        exact
           below 1, or an aten op not described here and not
           measured linear in it
EXACT      compares it with another value (``amax``'s              exact (an equality with
           ``x == result``), casts it to an integer or rounds it,  other saves: its outcome)
           passes it to an op outside aten (``torchvision::*``)
           not measured linear in it, or the backward could not
           be traced
========== ====================================================== ==========================

An op the algebra does not describe (another library's, such as
``torchvision::_deform_conv2d_backward``, or an aten op torch adds) is measured instead: run on
random values in a forked copy of the process, is it linear in each argument
(:func:`linear_arguments`)? It counts as multilinear in those; where it is not, or cannot be
measured (integer tensor arguments, a crash), the strict reading above holds.

A saved input of a pointwise op whose input gradient is ``grad * h(x)`` (SiLU, GELU, Mish,
Hardswish, softplus, ELU) gets a :class:`PointwiseDerivative`: ``h(x)`` is stored instead
of ``x``, so backward is linear in what is stored, and at unpack the input on ``h``'s
monotone branch with that derivative is handed back. It is found from the graph (pointwise
ops only, linear in the incoming gradient), and ``h`` is the backward itself evaluated with
a gradient of ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import faulthandler
import functools
import hashlib
import logging
import math
import operator
import os
import select
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lightning_act import ops
from lightning_act.codecs.quant import QuantizedTensor
from lightning_act.optrack import arguments_key

__all__ = [
    "ATTENTION_MASK",
    "STATISTIC_RATIO",
    "Match",
    "PointwiseDerivative",
    "Read",
    "Use",
    "call_reads",
    "classify",
    "graph_reads",
    "size_hint",
]

#: A float tensor an op computed that holds at least this many times fewer values than the
#: op's largest activation argument is a reduction statistic (LayerNorm's mean and 1 / std,
#: attention's logsumexp): kept exact (see :mod:`lightning_act.capture.decide`).
STATISTIC_RATIO = 8


class Use(enum.IntEnum):
    """How backward reads a saved tensor, from the mildest to the strictest; see the module."""

    NONE = 0
    REGION = 1
    LINEAR = 2
    QUADRATIC = 3
    SMOOTH = 4
    SINGULAR = 5
    EXACT = 6


class Read(NamedTuple):
    """How backward reads one saved tensor."""

    use: Use
    #: :attr:`Use.REGION`: the constants it is compared with.
    thresholds: tuple[float, ...] = ()
    #: For a pointwise op's input read only through its derivative: what to store instead.
    derivative: PointwiseDerivative | None = None
    #: Why it is :attr:`Use.SMOOTH` or stricter: the aten op that made it so (or the rule,
    #: such as ``"a power of three or more"``).
    reason: str | None = None
    #: Where it is both compared with constants and read for its value (:attr:`reason`
    #: ``"comparison"``): how backward reads it if a codec keeps the comparisons exact.
    #: :attr:`thresholds` then names the constants.
    value_use: Use | None = None
    #: :attr:`Use.EXACT` of a tensor backward only tests for equality with a value computed
    #: from the call's other saves: how to compute that value, so that the outcome alone
    #: (one bit per element) can be stored.
    match: Match | None = None
    #: :attr:`Use.EXACT` of a tensor backward reads only as the other side of equality tests
    #: whose compared saves, all saved before it, carry a :attr:`match`: those saves' numbers.
    #: Any values serve it, so long as their outcomes were taken against its own and their
    #: stand-ins are rebuilt from what is stored (``scatter_reduce`` amax's result, beside
    #: its messages stored as their outcomes).
    match_partner: tuple[int, ...] = ()
    #: An output of a fused attention that its call's earlier saves (query, key, value, mask)
    #: compute again: how, so that backward reads the output and logsumexp of the values it
    #: reads as query, key and value, not of others.
    recompute: Recompute | None = None


class Recompute(NamedTuple):
    """A fused attention's saved output (its result, its rows' logsumexp) computed again from
    the saves its inputs are stored in. Its backward takes ``rowsum(dO * O)`` from the output
    and ``dO V^T`` from the value, which nearly cancel on a saturated row, and recomputes the
    probabilities from the query and key against the logsumexp: each stored apart, at 2
    bits, the gradient's error was 4.1 of its norm with logits up to 51, and 0.79 with the
    output and logsumexp recomputed from the stored values (``benchmarks/fused_attention.py``).
    The output is then not stored at all, for one more forward of the attention in backward."""

    #: The forward op.
    target: torch._ops.OpOverload
    #: Its arguments (args, kwargs), each tensor one as the number of the save holding it.
    arguments: tuple
    #: Which of its outputs the save is.
    output: int
    #: The numbers of the saves it reads, in order.
    inputs: tuple[int, ...]

    def run(self, values: Sequence[torch.Tensor]) -> tuple:
        """The op's outputs from the saves' values (in :attr:`inputs` order)."""
        by_save = dict(zip(self.inputs, values))
        args, kwargs = pytree.tree_map(lambda a: by_save[a.save] if isinstance(a, _SaveOf) else a, self.arguments)
        with torch.no_grad():
            return self.target(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _SaveOf:
    """In :attr:`Recompute.arguments`, a tensor argument: the number of the save holding it
    (a dataclass, which pytree keeps whole)."""

    save: int


class Match(NamedTuple):
    """Backward reads a saved tensor ``x`` only as ``x == other`` (or ``!=``), and perhaps as
    ``isnan(x) & isnan(other)``, where ``other`` is computed from other tensors the same call
    saves: ``scatter_reduce``'s and ``amax``'s ``x == result`` (gathered by the index, or with
    the reduced dimension put back); ``max()``'s ``(x == result) | (isnan(x) & isnan(result))``,
    which on a CPU reads ``isnan(x)`` alone where the result is NaN. The outcome ``matches``
    stores, one bit per element, gives backward the same comparisons through :meth:`stand_in`."""

    #: The call's save numbers ``other`` is computed from, in the order ``compute`` takes them.
    partners: tuple[int, ...]
    #: ``other`` from the tensor's shape and the partners' values (an aten graph cut from the
    #: traced backward, its views to the trace's sizes made views to the tensor's own).
    compute: fx.GraphModule
    #: Whether backward also reads ``isnan(x)``: then both being NaN counts as a match.
    reads_nan: bool = False

    def matches(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """Where ``x`` equals ``other`` (or, where backward reads ``isnan(x)``, both are NaN)."""
        equal = torch.eq(x, other)
        return equal.logical_or_(torch.isnan(x).logical_and_(torch.isnan(other))) if self.reads_nan else equal

    def stand_in(self, matched: torch.Tensor, partners: list[torch.Tensor]) -> torch.Tensor:
        """What backward compares in place of the tensor: ``other`` where it matched, else a
        value neither equal to ``other`` nor NaN where ``other`` is (NaN where it is not, 0
        where it is); so ``x == other`` and ``isnan(x) & isnan(other)`` come out as for the
        tensor itself, and ``isnan(x)`` too where ``other`` is NaN."""
        other = self.compute(matched.shape, *partners)
        nan = torch.tensor(float("nan"), dtype=other.dtype, device=other.device)
        return torch.where(matched, other, torch.where(torch.isnan(other), torch.zeros_like(nan), nan))


# --------------------------------------------------------------------------- the aten algebra
# How each aten op carries a saved tensor's degree from its arguments to its result. Ops are
# named by their overload packet; what is not here is read as SINGULAR (the strict side of
# what an aten kernel can do with a float: aten checks its indices, so nothing is EXACT).

# Only the shape or dtype of these arguments is read.
_SHAPE_ONLY = frozenset(
    """
    full_like zeros_like ones_like empty_like rand_like randn_like new_zeros new_ones new_empty new_full
    empty_strided sym_size sym_stride sym_numel sym_storage_offset size stride isnan isinf isfinite isposinf
    isneginf fill zero
    """.split()
)
# Backward kernels that read some arguments for their shape alone (by schema name).
_SHAPE_ONLY_ARGUMENTS = {
    "max_pool2d_with_indices_backward": {"self"},
    "max_pool3d_with_indices_backward": {"self"},
    "avg_pool2d_backward": {"self"},
    "avg_pool3d_backward": {"self"},
    "_adaptive_avg_pool2d_backward": {"self"},
    "_adaptive_avg_pool3d_backward": {"self"},
    "adaptive_max_pool2d_backward": {"self"},
    "adaptive_max_pool3d_backward": {"self"},
    "nll_loss_backward": {"self"},
    "nll_loss2d_backward": {"self"},
    "fractional_max_pool2d_backward": {"self"},
}
# Linear in every tensor argument: the result's degree is the largest of theirs.
_LINEAR = frozenset(
    """
    alias view _unsafe_view reshape _reshape_alias permute transpose t expand squeeze unsqueeze slice select clone
    contiguous flip roll repeat narrow unfold diagonal diag_embed as_strided constant_pad_nd neg sum mean cumsum
    _to_copy convert_element_type detach lift_fresh_copy index_select gather index slice_scatter select_scatter
    diagonal_scatter as_strided_scatter cat stack split split_with_sizes unbind chunk copy masked_fill index_put
    index_add scatter_add scatter add sub rsub where avg_pool1d avg_pool2d avg_pool3d avg_pool2d_backward
    avg_pool3d_backward _adaptive_avg_pool2d _adaptive_avg_pool3d _adaptive_avg_pool2d_backward
    _adaptive_avg_pool3d_backward upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_bilinear2d
    upsample_linear1d upsample_bicubic2d upsample_trilinear3d _upsample_nearest_exact2d reflection_pad1d
    reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d replication_pad3d im2col col2im
    pixel_shuffle pixel_unshuffle channel_shuffle tril triu trace sum_to_size expand_copy view_copy permute_copy
    squeeze_copy unsqueeze_copy t_copy transpose_copy alias_copy slice_copy select_copy unbind_copy split_copy
    embedding_dense_backward max_pool2d_with_indices_backward max_pool3d_with_indices_backward
    adaptive_max_pool2d_backward adaptive_max_pool3d_backward nll_loss_backward nll_loss2d_backward index_copy
    masked_scatter put take movedim real imag view_as_real view_as_complex resolve_conj resolve_neg conj _conj
    conj_physical nan_to_num prod_backward _pad_packed_sequence _pack_padded_sequence_backward unsafe_split fft_r2c
    fft_c2r fft_c2c _fft_r2c _fft_c2r _fft_c2c block_diag renorm_backward lerp_scalar clone_preserve_strides
    repeat_interleave _index_put_impl index_fill new_empty_strided _local_scalar_dense _unsafe_index_put
    _unsafe_masked_index_put_accumulate _unsafe_masked_index _unsafe_index
    """.split()
)
# Products: the result's degree is the sum of the multiplied arguments' degrees.
_BILINEAR = frozenset(
    """
    mul mm bmm matmul dot vdot mv outer ger convolution _convolution cross kron cumprod_backward _weight_int8pack_mm
    _grouped_mm
    """.split()
)  # _grouped_mm: a mixture of experts' matmuls, one per group of rows
# ``bias + a @ b``: the first argument added, the next two multiplied.
_ADD_PRODUCT = frozenset({"addmm", "baddbmm", "addbmm", "addmv", "addr", "addcmul"})
# ``a * b + c``: the first two multiplied, the third added (inductor's decompositions use it).
_PRODUCT_ADD = frozenset({"fma"})
# Comparisons: a REGION read against a Python constant; with another tensor, an EXACT one.
_COMPARISONS = frozenset(
    """
    lt le gt ge eq ne maximum minimum fmax fmin
    """.split()
)
_ORDER_WITH_CONSTANT = frozenset({"sign", "sgn", "signbit", "heaviside"})
# Ops whose result holds some of their first argument's values, unchanged: a constant a
# result of theirs is compared with is the same constant on the argument.
_SAME_VALUES = frozenset(
    """
    alias view _unsafe_view reshape _reshape_alias permute transpose t expand squeeze unsqueeze slice select clone
    contiguous flip roll repeat narrow unfold diagonal as_strided detach lift_fresh_copy index_select gather index
    _unsafe_index movedim expand_copy view_copy permute_copy squeeze_copy unsqueeze_copy t_copy transpose_copy
    alias_copy slice_copy select_copy _to_copy convert_element_type clone_preserve_strides
    """.split()
)
#: A comparison's outcome that does not depend on the compared values (``relu(x) < -1``).
_CONSTANT_OUTCOME = object()
# Ops whose results jump with their argument, so that a rounded argument changes them by a
# whole step: read exactly.
_DISCONTINUOUS = frozenset(
    """
    floor ceil round trunc fix floor_divide remainder fmod frac
    """.split()
)
# Nonlinear and bounded in slope where their argument is finite.
_SMOOTH = frozenset(
    """
    exp exp2 expm1 sigmoid tanh erf erfc sin cos sinh cosh atan atan2 abs softplus elu gelu silu mish hardtanh
    hardsigmoid hardswish relu leaky_relu threshold clamp clamp_min clamp_max amax amin max min sort topk logsumexp
    _softmax _safe_softmax _log_softmax softmax log_softmax cummax cummin logcumsumexp _log_softmax_backward_data
    _softmax_backward_data sinc erfcx prelu _prelu_kernel log_sigmoid_forward glu hypot logaddexp logaddexp2 median
    nanmedian kthvalue mode _cdist_forward cdist norm linalg_vector_norm special_erfcx special_ndtr
    native_dropout_backward lerp copysign nextafter clamp_tensor max_pool2d_with_indices max_pool3d_with_indices
    adaptive_max_pool2d adaptive_max_pool3d
    """.split()
)
_EXPONENTIALS = frozenset({"exp", "exp2", "expm1"})
# Logarithms, by their pole.
_LOGARITHMS = {"log": 0.0, "log2": 0.0, "log10": 0.0, "log1p": -1.0}
# Views a divisor is followed back through to the values it holds (an ``expand`` repeats them).
_DIVISOR_VIEWS = frozenset(
    """
    expand expand_copy view reshape _unsafe_view unsqueeze squeeze permute transpose alias detach
    """.split()
)
# Backward kernels that aten does not decompose, by schema argument name.
_ATTENTION_SCORES = frozenset({"query", "key", "logsumexp"})
_ATTENTION_MASKS = frozenset({"attn_bias", "attn_mask"})
#: :attr:`Read.reason` of a fused attention backward's mask or bias: added to the scores and
#: exponentiated with them, and ``-inf`` where a position is masked.
ATTENTION_MASK = "attention mask"
_RECURRENT_BACKWARD = frozenset(
    """
    mkldnn_rnn_layer_backward _cudnn_rnn_backward miopen_rnn_backward _thnn_fused_lstm_cell_backward_impl
    _thnn_fused_lstm_cell_backward _thnn_fused_gru_cell_backward lstm_mps_backward mkldnn_rnn_backward
    """.split()
)
_CONVOLUTION_BACKWARD = frozenset(
    {
        "convolution_backward",
        "mkldnn_convolution_backward",
        "cudnn_convolution_backward",
        "_slow_conv2d_backward",
        "slow_conv_transpose2d_backward",
        "convolution_backward_overrideable",
    }
)
# Namespaces whose ops are aten's own or this module's markers.
_ATEN_NAMESPACES = frozenset({"aten", "prims"})


def _name(target) -> str:
    """An aten op's name, its in-place form read as the op (``masked_fill_`` as ``masked_fill``)."""
    if not isinstance(target, torch._ops.OpOverload):
        return str(target)
    name = target.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _schema_names(target) -> list[str]:
    return [a.name for a in target._schema.arguments]


def _arguments(node: fx.Node) -> list[tuple[str | None, Any]]:
    """``(schema name, value)`` of each argument of an aten call node, keywords included."""
    target = node.target
    names = _schema_names(target) if isinstance(target, torch._ops.OpOverload) else []
    out = [(names[i] if i < len(names) else None, a) for i, a in enumerate(node.args)]
    out.extend(node.kwargs.items())
    return out


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in val)
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


class Saves(NamedTuple):
    """A backward graph's saved tensors' nodes (sets, shared by every walk of one graph), and
    what its forward tells of them."""

    #: Every one: what ``exp(x - result)`` reads besides the target.
    all: Collection[fx.Node] = ()
    #: Those an op never negative computed (an ``exp``).
    nonnegative: Collection[fx.Node] = ()
    #: Those that are the forward's own inputs: parameters, the batch, an earlier graph's
    #: activation.
    inputs: Collection[fx.Node] = ()


class _Walk:
    """One forward pass over a graph from a saved tensor's node: degrees and what was seen."""

    def __init__(self, target: fx.Node, saves: Saves = Saves()):
        self.target = target
        self.saves = saves
        self.degree: dict[fx.Node, int] = {target: 1}
        #: Every node computed from the saved tensor, masks of it included (degree 0).
        self.reached = _downstream(target)
        self.worst = Use.NONE
        self.reason: str | None = None
        self.thresholds: set[float] = set()
        #: A threshold is the kink of a ReLU backward recomputes from the target.
        self.kinked = False
        self.compared = False
        for node in self.reached:
            degree = self._step(node)
            if degree:
                self.degree[node] = degree

    def _from_another_save(self, node: fx.Node, rounded_alike: bool = False) -> bool:
        """Whether ``node`` is, or is computed from, a saved tensor other than the target: a
        search back through its inputs that stops at saved tensors and gradients. ``rounded_alike``:
        only a save rounded wherever the target is. A forward's input (a parameter, kept as it
        is) counts only for a target that is one too: then the other save, read from the
        target's side, counts and is kept."""
        stack, seen = [node], set()
        skipped = self.saves.inputs if rounded_alike and self.target not in self.saves.inputs else ()
        while stack:
            current = stack.pop()
            if current in seen or current is self.target:
                continue
            seen.add(current)
            if current in self.saves.all:
                if current not in skipped and not (rounded_alike and self._reduces_target(current)):
                    return True
                continue
            if not _is_marker(current):
                stack.extend(current.all_input_nodes)
        return False

    def _reduces_target(self, save: fx.Node) -> bool:
        """Whether ``save`` holds at least ``STATISTIC_RATIO`` times fewer values than the
        target: a reduction (a maximum, a log-sum) that the capture keeps exact, as a
        statistic or, read as ``exp(x - s)`` beside the larger target, as singular itself.
        ``exp(x - max - log)`` (a log-softmax's backward where a compiled graph saves its
        input) then rounds only ``x``, as a softmax's output is rounded."""
        small, large = save.meta.get("val"), self.target.meta.get("val")
        if not isinstance(small, torch.Tensor) or not isinstance(large, torch.Tensor):
            return False
        return size_hint(large.numel()) >= STATISTIC_RATIO * size_hint(small.numel())

    def _exponent_adds_another_save(self, exponent: Any) -> bool:
        """Whether ``exponent`` (through views, negation and scaling) adds what the target
        reaches to what another save rounded alike does: ``x - result``. A product
        (``exp(A * dt)``, a state space model's decay) or a parameter added (``x + bias``)
        rounds nothing a second time."""
        while isinstance(exponent, fx.Node) and exponent.op == "call_function":
            name = _name(exponent.target)
            if (
                name in _DIVISOR_VIEWS
                or name == "neg"
                or name in ("mul", "div")
                and len(exponent.args) == 2
                and not self._deg(exponent.args[1])
            ):
                exponent = exponent.args[0]
            elif name == "mul" and len(exponent.args) == 2 and not self._deg(exponent.args[0]):
                exponent = exponent.args[1]
            else:
                break
        if not isinstance(exponent, fx.Node) or exponent.op != "call_function":
            return False
        if _name(exponent.target) not in ("add", "sub", "rsub"):
            return False
        terms = [t for t in exponent.args[:2] if isinstance(t, fx.Node)]
        return any(self._deg(t) for t in terms) and any(
            not self._deg(t) and self._from_another_save(t, rounded_alike=True) for t in terms
        )

    def _counts(self, node: fx.Node) -> bool:
        """Whether ``node`` is computed from boolean and integer saves alone: a count (how
        many values matched a maximum), at least 1 wherever a quotient by it is read, which
        shrinks a rounding step rather than stretching it."""
        stack, seen = list(node.all_input_nodes), set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if current is self.target:
                return False
            if current in self.saves.all or _is_marker(current):
                value = current.meta.get("val")
                if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
                    return False
                continue
            stack.extend(current.all_input_nodes)
        return True

    def _divides_by_another_save_elementwise(self, node: fx.Node) -> bool:
        """Whether ``node`` (a ``div``) divides value by value by a tensor computed from
        another save: a divisor broadcast from fewer values (a normalisation's statistic, a
        norm) scales whole rows alike, and their rounding is measured against that scale."""
        divisor = node.args[1]
        if not isinstance(divisor, fx.Node) or not self._from_another_save(divisor) or self._counts(divisor):
            return False
        bound = _lower_bound(divisor, self.saves.nonnegative)
        if bound is not None and bound >= 1:
            return False  # ``g * e / (1 + e)`` (softplus's backward): divided by 1 or more, a step shrinks
        # Back through views, and through a read marker to the forward's tensor it reads
        # (the marker's own value is laid out anew).
        while divisor.op == "call_function" and (_is_marker(divisor) or _name(divisor.target) in _DIVISOR_VIEWS):
            divisor = divisor.args[0]
            if not isinstance(divisor, fx.Node):
                return False
        value, result = divisor.meta.get("val"), node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
            return False
        # A save that is itself a broadcast view (``norm.expand_as(x)``) holds fewer values.
        held = math.prod(size for size, stride in zip(value.shape, value.stride()) if stride != 0)
        return held == result.numel()

    def _record(self, use: Use, node: fx.Node, reason: str | None = None) -> None:
        if use > self.worst:
            self.worst, self.reason = use, reason or _name(node.target)

    def _deg(self, value: Any) -> int:
        if isinstance(value, fx.Node):
            return self.degree.get(value, 0)
        if isinstance(value, (list, tuple)):
            return max((self._deg(v) for v in value), default=0)
        return 0

    def _step(self, node: fx.Node) -> int:
        target = node.target
        if target is operator.getitem:
            return self._deg(node.args[0])
        if not isinstance(target, torch._ops.OpOverload):
            self._record(Use.EXACT, node)
            return 1
        if target.namespace not in _ATEN_NAMESPACES:
            if target.namespace == _MARKER_NAMESPACE:
                return 0  # another saved tensor's read, or a gradient
            # An op outside aten (torchvision's): linear in what it is measured linear in,
            # else unknown, and so exact.
            return self._step_probed(node, Use.EXACT)
        name = _name(target)
        arguments = _arguments(node)
        if name in _SHAPE_ONLY:
            return 0
        if not _is_float(node):
            return self._step_to_integer(node, name, arguments)
        shape_only = _SHAPE_ONLY_ARGUMENTS.get(name, ())
        degrees = [0 if n in shape_only else self._deg(a) for n, a in arguments]
        if name in _LINEAR:
            return max(degrees)
        if name in _BILINEAR:
            return sum(degrees)
        if name in _ADD_PRODUCT:
            return max(degrees[0], sum(degrees[1:3]) if len(degrees) >= 3 else 0)
        if name in _PRODUCT_ADD:
            return max(sum(degrees[:2]), max(degrees[2:], default=0))
        if name in _CONVOLUTION_BACKWARD:
            return degrees[0] + max(degrees[1:3], default=0)
        if name == "div":
            if len(degrees) > 1 and degrees[1]:
                # A denominator that cannot come near zero (``1 + exp(-x)``, a sigmoid written
                # out) is a smooth function of what it is computed from; any other is singular.
                bound = _lower_bound(node.args[1], self.saves.nonnegative)
                self._record(Use.SMOOTH if bound is not None and bound > 0 else Use.SINGULAR, node)
                return 1
            if node.kwargs.get("rounding_mode") is not None or len(node.args) > 2:
                self._record(Use.EXACT, node)
            elif degrees[0] and self._divides_by_another_save_elementwise(node):
                # ``result / input`` (a product's, a cumulative product's backward): the
                # result's rounding, a step of its group's range, is divided by the small
                # inputs its small values came from. Products of ten values of +-9 span eight
                # orders of magnitude in a group: 8 bits made scatter_reduce's gradient 3.3
                # times the exact one.
                self._record(Use.SINGULAR, node, "divided by another saved tensor")
            return degrees[0]
        if name in ("pow", "float_power", "square"):
            return self._step_power(node, name, degrees)
        if name in _COMPARISONS:  # maximum and minimum of two floats: an order and a value
            self.compared = True
            self._record(Use.SMOOTH, node)
            return max(degrees)
        if name in _ORDER_WITH_CONSTANT:
            self._compare(node, arguments[0][1], 0.0)
            return 0
        if name in _DISCONTINUOUS:
            self._record(Use.EXACT, node)
            return 1
        if name in _SMOOTH:
            if name in _EXPONENTIALS and self._exponent_adds_another_save(node.args[0]):
                # exp(x - result): the difference of two rounded values, each far larger than
                # it, exponentiated (logsumexp's and logcumsumexp's backward).
                self._record(Use.SINGULAR, node)
            else:
                self._record(Use.SMOOTH, node)
            return 1
        if name in _LOGARITHMS:
            # Smooth, with a slope of at most 1, where its argument stays 1 clear of its pole:
            # ``log1p(exp(x))`` (softplus, recomputed in a compiled backward from its saved
            # ``exp``), ``log(1 + x**2)``.
            bound = _lower_bound(node.args[0], self.saves.nonnegative)
            clear = bound is not None and bound >= _LOGARITHMS[name] + 1
            self._record(Use.SMOOTH if clear else Use.SINGULAR, node)
            return 1
        if "attention" in name and "backward" in name:
            for (arg_name, _), degree in zip(arguments, degrees):
                if degree and arg_name in _ATTENTION_SCORES:
                    self._record(Use.SMOOTH, node)
                elif degree and arg_name in _ATTENTION_MASKS:
                    self._record(Use.SMOOTH, node, ATTENTION_MASK)
            return max(degrees)
        if name in _RECURRENT_BACKWARD:
            # Linear in the incoming gradients, quadratic in what the cells saved.
            grads = [d for (arg_name, _), d in zip(arguments, degrees) if arg_name and arg_name.startswith("grad")]
            saves = [
                d for (arg_name, _), d in zip(arguments, degrees) if not (arg_name and arg_name.startswith("grad"))
            ]
            return max(max(grads, default=0), 2 * max(saves, default=0))
        return self._step_probed(node, Use.SINGULAR)  # an aten op not described here

    def _step_probed(self, node: fx.Node, otherwise: Use) -> int:
        """An op the algebra does not describe: multilinear in the arguments it is measured
        linear in (:func:`linear_arguments`); ``otherwise`` where the target reaches any other."""
        flat = [a for a in pytree.tree_leaves((node.args, node.kwargs))]
        reached = [i for i, a in enumerate(flat) if self._deg(a)]
        linear = linear_arguments(node)
        if linear is None or not set(reached) <= linear:
            self._record(otherwise, node)
            return 1
        return sum(self._deg(flat[i]) for i in reached)

    def _step_to_integer(self, node: fx.Node, name: str, arguments) -> int:
        """A node whose result is boolean or integer, computed from the saved tensor."""
        if not any(self._deg(a) for _, a in arguments):
            return 0  # of masks of it, already accounted for
        if name in _COMPARISONS and len(arguments) >= 2:
            other = arguments[1][1]
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                self._compare(node, arguments[0][1], float(other))
                return 0
            self._record(Use.EXACT, node)  # compared with another value: x == amax(x)
            return 0
        if name in _ORDER_WITH_CONSTANT:
            self._compare(node, arguments[0][1], 0.0)
            return 0
        self._record(Use.EXACT, node)  # cast to an integer, an argmax, a sort's indices
        return 0

    def _compare(self, node: fx.Node, compared: Any, constant: float) -> None:
        """``compared``, computed from the target, compared with ``constant``: a threshold on
        the target's own values where one is the same comparison (views of it, ``x * 2 > 1``
        as ``x > 0.5``, ``relu(x) <= 0`` as ``x <= 0``); else read exactly, as no cells of its
        values keep the outcomes (recorded as on ``x`` itself, ``x * 2 > 1`` kept ``x``'s
        side of 1, not of 0.5, and ``relu(x) <= 0`` recomputed from a rounded ``x`` switched
        a gradient off wherever rounding moved a value across 0: a compiled graph network's
        8-bit gradient error 0.019 from that one tensor)."""
        threshold = self._threshold_on_target(compared, constant)
        if threshold is None:
            self._record(Use.EXACT, node, f"compared after {_name(compared.target)}")
        elif threshold is not _CONSTANT_OUTCOME:
            self.thresholds.add(threshold)
            if compared is not self.target and _name(compared.target) in ("relu", "clamp_min"):
                self.kinked = True

    def _threshold_on_target(self, value: Any, constant: float) -> Any:
        """The constant that comparing the target with decides what comparing ``value`` with
        ``constant`` does; ``_CONSTANT_OUTCOME`` where no value decides it; None where no one
        constant does."""
        while value is not self.target:
            if not isinstance(value, fx.Node) or not isinstance(value.target, torch._ops.OpOverload):
                return None
            name, args = _name(value.target), value.args
            other = args[1] if len(args) > 1 else None
            number = isinstance(other, (int, float)) and not isinstance(other, bool)
            if name in _SAME_VALUES:
                pass
            elif name == "neg":
                constant = -constant
            elif name in ("add", "sub") and number and value.kwargs.get("alpha", 1) == 1:
                constant = constant - other if name == "add" else constant + other
            elif name == "mul" and number and other != 0:
                constant = constant / other
            elif name == "div" and number and other != 0 and not value.kwargs.get("rounding_mode"):
                constant = constant * other
            elif name == "relu" or (name == "clamp_min" and number):
                if constant < (0.0 if name == "relu" else other):
                    return _CONSTANT_OUTCOME  # every value of the result is at least its floor
            else:
                return None
            value = args[0]
        return constant

    def _step_power(self, node: fx.Node, name: str, degrees: list[int]) -> int:
        if name == "square":
            return 2 * degrees[0]
        base, exponent = node.args[0], node.args[1] if len(node.args) > 1 else None
        if isinstance(base, (int, float)):  # scalar ** x: an exponential of x
            self._record(Use.SMOOTH, node)
            return 1
        if isinstance(exponent, (int, float)) and float(exponent).is_integer() and exponent >= 0:
            return degrees[0] * int(exponent)
        if isinstance(exponent, fx.Node) and self._deg(exponent) and not self._deg(base):
            self._record(Use.SMOOTH, node)
            return 1
        self._record(Use.SINGULAR, node)  # a root, a negative power, or a tensor exponent
        return 1

    def result(self, outputs: Iterable[Any], whole_graph: bool = False) -> Read:
        """The read, from the degrees reaching ``outputs``. ``whole_graph``: the walk is over
        a compiled region's whole backward, not one op's."""
        degree = max((self._deg(o) for o in outputs), default=0)
        use = self.worst
        if degree >= 3 and whole_graph:
            # A compiled backward recomputes chains of forward ops from one save (a state
            # space block's step sizes, inputs and gates from one projection), and their
            # products raise its degree where no one value is read more than smoothly: the
            # nonlinear floor.
            use, self.reason = max(use, Use.SMOOTH), self.reason or "a product of three or more"
        elif degree >= 3:
            # Cubed or more by one op's backward (a normalisation's 1 / std, read as
            # rstd**3): its rounding error is multiplied into every value three times over.
            use, self.reason = max(use, Use.SINGULAR), self.reason or "a power of three or more"
        elif degree >= 2:
            use = max(use, Use.QUADRATIC)
        elif degree == 1:
            use = max(use, Use.LINEAR)
        value_use = None
        if self.kinked and use >= Use.SMOOTH:
            # Compared at the kink of a ReLU recomputed from it, and read through it: the
            # outcome switches a gradient on or off, and no codec keeps it while rounding
            # the values (a zero-preserving one does for a ReLU's output alone).
            use, self.reason = Use.SINGULAR, "compared at the kink of a ReLU recomputed from it"
        elif self.thresholds and use >= Use.LINEAR:
            # Compared and read for its value: rounding across a threshold switches the value read.
            if use < Use.SMOOTH:
                use, value_use, self.reason = Use.SMOOTH, use, "comparison"
        elif self.thresholds:
            use = max(use, Use.REGION)
        compared = use is Use.REGION or value_use is not None
        thresholds = tuple(sorted(self.thresholds)) if compared else ()
        reason = self.reason if use >= Use.SMOOTH else None
        return Read(use, thresholds, None, reason, value_use)


# Ops whose result is never negative, whatever their (finite) argument.
_NONNEGATIVE = frozenset(
    """
    exp exp2 sigmoid abs relu square softplus cosh
    """.split()
)


def _lower_bound(value: Any, nonnegative: Collection[fx.Node] = ()) -> float | None:
    """A bound ``value`` never falls below, where one is seen: a constant; 0 for an op that is
    never negative or a save the forward computed with one (``nonnegative``); a constant plus
    something bounded (``1 + exp(-x)``: 1). None where none is seen."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, fx.Node):
        return None
    if value in nonnegative or (value.op == "call_function" and _name(value.target) in _NONNEGATIVE):
        return 0.0
    if value.op != "call_function" or _name(value.target) != "add" or len(value.args) != 2:
        return None
    if value.kwargs.get("alpha", 1) != 1:
        return None
    bounds = [_lower_bound(term, nonnegative) for term in value.args]
    return None if None in bounds else bounds[0] + bounds[1]


def _outputs(graph: fx.Graph) -> list:
    """What the graph returns (its output node is its last)."""
    return pytree.tree_leaves(next(reversed(graph.nodes)).args)


_positions: weakref.WeakKeyDictionary[fx.Graph, dict[fx.Node, int]] = weakref.WeakKeyDictionary()


def _downstream(target: fx.Node) -> list[fx.Node]:
    """The call nodes computed from ``target``, in graph order: found through the nodes'
    users, so that classifying every saved tensor of a long graph (a recurrent op's steps)
    costs what each one reaches, not the whole graph each time."""
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


def classify(
    target: fx.Node, tangents: Iterable[fx.Node] = (), saves: Saves = Saves(), *, compiled: bool = False
) -> Read:
    """How the graph of ``target`` reads it, from ``target`` to the graph's outputs.

    ``target`` is a saved tensor's node in an aten graph (a read marker in a traced
    backward, or a placeholder of a compiled backward); ``tangents`` are the nodes of the
    incoming gradients, which a pointwise derivative is checked against; ``saves`` are the
    graph's saved tensors. ``compiled``: the graph is a compiled region's whole backward,
    where the gradient a pointwise op's backward multiplies may be computed from the tangents.
    """
    tangents = list(tangents)
    walk = _Walk(target, saves)
    read = walk.result(_outputs(target.graph), whole_graph=compiled)
    if Use.QUADRATIC <= read.use <= Use.SINGULAR and not walk.compared:
        derivative = PointwiseDerivative.find(target, tangents, walk, compiled)
        if derivative is not None:
            return Read(Use.LINEAR, derivative=derivative)
    return read


# ---------------------------------------------------------- ops the algebra does not know
# Measured once per op and argument signature: random values, and each float tensor argument
# moved by a random step as large as its values (a 2-bit rounding's size, so that a function
# linear only within cells, such as bilinear sampling at learned offsets, shows it). Linear in
# an argument, the op's change from that step doubles with the step, to round-off. Random
# values may be out of range for an argument the op reads as an index (``roi_align``'s
# boxes, whose image index its CPU backward writes through unchecked), so the measurement
# runs in a forked copy of the process: a crash or a corrupted heap there reads as "cannot
# be measured", and the training process is untouched.
_PROBE_NUMEL = 1 << 24  # all arguments together: beyond, unmeasured (exact)
_PROBE_SECONDS = 30.0  # a measurement still running then is given up (exact): a child stuck on a lock
_PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_probed: dict[Any, frozenset[int] | None] = {}
_probe_cost = {"ops": 0, "seconds": 0.0}
_log = logging.getLogger(__name__)


def linear_arguments(node: fx.Node) -> frozenset[int] | None:
    """The positions, among the flattened arguments of ``node`` (an op the degree algebra does
    not describe: another library's, or an aten op torch added), of the tensors it is linear
    in, each with the others held. None where it cannot be measured: an integer tensor
    argument (indices or offsets with no value to draw), arguments too large, or an error.
    Cached per op and signature; the time spent is logged (:func:`probe_cost`)."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
    key = (node.target, tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for v in vals))
    try:
        hash(key)
    except TypeError:
        return None
    if key not in _probed:
        started = time.perf_counter()
        _probed[key] = _in_forked_child(lambda: _measure_linearity(node.target, vals, spec))
        elapsed = time.perf_counter() - started
        _probe_cost["ops"] += 1
        _probe_cost["seconds"] += elapsed
        _log.info(
            "lightning_act: measured how %s reads its arguments in %.1f ms: linear in %s",
            node.target,
            elapsed * 1e3,
            "nothing measurable" if _probed[key] is None else sorted(_probed[key]),
        )
    return _probed[key]


def probe_cost() -> dict[str, float]:
    """How many op signatures :func:`linear_arguments` measured in this process, and the time."""
    return dict(_probe_cost)


def _measure_linearity(op: Callable, vals: list, spec) -> frozenset[int] | None:
    tensors = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    if any(not vals[i].is_floating_point() for i in tensors):
        return None
    if sum(vals[i].numel() for i in tensors) > _PROBE_NUMEL:
        return None
    for dtype in (torch.float64, torch.float32):
        generator = torch.Generator().manual_seed(0)
        values = list(vals)
        for i in tensors:
            values[i] = torch.randn(vals[i].shape, dtype=dtype, generator=generator)

        def run(moved: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            args, kwargs = pytree.tree_unflatten([moved.get(i, v) for i, v in enumerate(values)], spec)
            out = op(*args, **kwargs)
            return [
                o.double() for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()
            ]

        try:
            with torch.no_grad():
                base = run({})
                linear = set()
                for i in tensors:
                    step = torch.randn(vals[i].shape, dtype=dtype, generator=generator)
                    once = run({i: values[i] + step})
                    twice = run({i: values[i] + 2 * step})
                    if all(_doubles(b, o, t, _PROBE_TOLERANCE[dtype]) for b, o, t in zip(base, once, twice)):
                        linear.add(i)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue  # no float64 kernel: the dtype it runs in
        return frozenset(linear)
    return None


def _in_forked_child(work: Callable[[], frozenset[int] | None]) -> frozenset[int] | None:
    """``work()`` in a forked copy of this process (one CPU thread, never a GPU), its result
    sent back through a pipe; None where it crashed, hung or this platform cannot fork."""
    if not hasattr(os, "fork"):
        return None
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking a threaded process: the child runs one
        pid = os.fork()
    if pid == 0:  # the child: what it does never returns here
        status = 1
        try:
            os.close(read_end)
            faulthandler.disable()  # a crash here is an answer, not an error to print
            silent = os.open(os.devnull, os.O_WRONLY)
            os.dup2(silent, 1)
            os.dup2(silent, 2)
            torch.set_num_threads(1)  # the parent's OpenMP pool does not exist in a forked child
            result = work()
            os.write(write_end, b"-" if result is None else ",".join(map(str, sorted(result))).encode() + b".")
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    answer, deadline = b"", time.monotonic() + _PROBE_SECONDS
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], max(deadline - time.monotonic(), 0.0))
            chunk = os.read(read_end, 1 << 16) if ready else b""
            if not chunk:
                break
            answer += chunk
    finally:
        os.close(read_end)
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if status != 0 or not answer.endswith(b".") or answer == b"-":
        return None
    text = answer[:-1].decode()
    return frozenset(int(i) for i in text.split(",")) if text else frozenset()


def _doubles(base: torch.Tensor, once: torch.Tensor, twice: torch.Tensor, tolerance: float) -> bool:
    """Whether ``twice - base`` is twice ``once - base``, to ``tolerance`` of its size."""
    change = once - base
    scale = max(change.abs().max().item(), base.abs().max().item(), 1e-30)
    return bool(((twice - base) - 2 * change).abs().max().item() <= tolerance * scale)


# ------------------------------------------------------------------- pointwise derivatives
# The interval on which a derivative's monotone branch is searched, and its sampling. A
# derivative whose values still move beyond half of it is not bounded: not stored this way.
_BRANCH_HALF_WIDTH = 32.0
_BRANCH_SAMPLES = 1 << 14
_LEVEL_TOLERANCE = 1e-4  # of the derivative's span, on the outer half of the interval
_STEP_TOLERANCE = 0.02  # of its span, between two samples: a larger step is a jump


class PointwiseDerivative:
    """The input of a pointwise op whose gradient is ``grad * h(x)``, stored as ``h(x)``.

    Backward is then linear in what is stored, so stochastic rounding leaves the gradient
    unbiased at any bits. At unpack, the input on ``h``'s monotone branch whose derivative
    is the decoded value is handed back (a table of ``h`` over the branch, inverted by
    linear interpolation), so backward, which evaluates ``h`` again, reads the decoded
    derivative. Decoded values are first clamped into ``h``'s range (the codec's grid ends
    are rounded outward). The same object serves :meth:`store` and :meth:`restore` as a
    substitute for :class:`~lightning_act.capture.decide.Decision`. What it stores is not
    the input, so it serves this op's save alone.
    """

    for_its_op_alone = True

    def __init__(
        self, derivative: Callable, xs: torch.Tensor, hs: torch.Tensor, dtype: torch.dtype, source: str | None = None
    ):
        self._h = derivative
        # float64 on the CPU, hs ascending; held once per table (see ``_TABLES``), xs apart
        # from the wider grid it may view
        self._table_key = _digest(xs, hs)
        self._xs, self._hs = _shared(("branch", self._table_key), lambda: (xs.clone(), hs.clone()))
        self._dtype = dtype
        self._source = source
        # This derivative's grids, by use and device: the shared ones, found without a digest.
        self._grids: dict[tuple[str, torch.device], _Grid | None] = {}

    @staticmethod
    def find(
        target: fx.Node, tangents: list[fx.Node], walk: _Walk, compiled: bool = False
    ) -> PointwiseDerivative | None:
        """The derivative of the pointwise op whose backward reads ``target``, if it is one."""
        found = _pointwise_backward(target, tangents, walk, compiled)
        return None if found is None else _branch(*found)

    @property
    def source(self) -> tuple[str, str] | None:
        """``h`` as Python source over aten ops, with the dtype it computes in: what rebuilds
        this derivative in another process (:meth:`from_source`; a compiled graph's plan
        carries it). None where ``h`` holds anything but ops and numbers."""
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
        """``h(x)`` by ``h``'s own ops, in ``x``'s dtype: what a compiled graph computes in
        its forward (traced there, fused by the compiler), where :meth:`store` would run
        them, or a lookup, on their own."""
        return self._h(x, torch.ones((), dtype=x.dtype, device=x.device)).to(x.dtype)

    def store(self, x: torch.Tensor) -> tuple[torch.Tensor, PointwiseDerivative]:
        """What to encode in place of ``x``, and what restores it at unpack.

        A smooth ``h`` is read from a grid over the searched interval instead of running its
        ops (within 1e-6 of its span; a few passes and two lookups per value, 1.6 times as fast
        as GELU's ops on the CPU); any other is evaluated."""
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
        """:meth:`restore` of what :func:`~lightning_act.ops.unpack_dequantize` decodes from
        these codes, bit for bit, with the inverse taken once per level of each group
        (``2**bits`` values per group, not one per value) and read back by code: a lookup per
        value instead of the grid's passes. Where a group has at least as many levels as
        values (8 bits in groups of 256), of the values themselves: a table of levels would
        take as many inversions, and held beside the values it doubled the decode's memory."""
        if 1 << bits >= group_size:
            return self.restore(ops.unpack_dequantize(codes, stats, bits, group_size, numel, dtype))
        levels = self.restore(ops.group_levels(stats, bits, dtype).contiguous())
        return ops.lookup_levels(codes, levels, bits, group_size, numel)

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        """The input whose derivative is ``decoded``, written over ``decoded``.

        The inverse is read from a grid uniform in ``h`` (a multiply and two lookups per
        value, not a search of the table): the input handed back has a derivative within
        one grid step, ``span / 65536``, of the decoded value."""
        inverse = self.inverse_grid(decoded.device)
        flat = decoded.view(-1)
        for h, target in _chunks(flat, flat):
            target.copy_(inverse(h))
        return decoded

    def inverse_grid(self, device: torch.device) -> _Grid:
        """The inverse of ``h`` on its branch, on a grid uniform in ``h`` (its pieces placed
        by position on the whole grid, not ``exact``), on ``device``: what :meth:`restore`
        reads, and the graph ops' C++ side with it."""
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
        """``h`` on a grid uniform over the searched interval, if interpolating it is exact
        to 1e-6 of its span at every piece's middle and it keeps its ends' values beyond
        (None where it has a kink or a jump: Hardswish's, ELU's)."""
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
        its two points (float64). Values of ``h`` within 1e-12 of its span of zero are zero
        (a flat tail: any input there has that derivative), so that no piece is so narrow in
        float32 that its slope overflows."""
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

# A derivative's tables (its branch's samples, its grids on each device), by their values:
# each layer's GELU, and each compiled graph's derivative rebuilt from its plan, tabulate the
# same function. Held by each derivative object, a compiled ViT's six GELUs held 4.5 MiB of
# copies, and 0.8 MiB more with each new plan: memory every step's peak counted.
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
    #: Place values by their distance to their piece's start, not by their position on the
    #: whole grid: exact where the grid's points are (a step of a power of two from a round
    #: ``low``), so float32 places a value to its last bit even among 65,536 pieces, at the
    #: cost of three more passes.
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


# Grid points a table is computed at at once: a table is made at a step's first store or
# decode, and computed whole, its temporaries (the points, the pieces they fall in, the lines
# read there) came to five times the table, 2.5 MiB at that step's peak.
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


# The derivative is evaluated and inverted a chunk at a time, so that the temporaries (the
# table's int32 piece indices, the gathered lines) live for one chunk, never for the whole
# tensor: at most 16 chunks, of at least 16,384 values.
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
    """Whether ``node`` casts element by element to another dtype (a bfloat16 SiLU's backward
    computes in float32 between two of them), with nothing else changed."""
    return _name(node.target) == "_to_copy" and set(node.kwargs) <= {"dtype", "memory_format"}


def _is_reshape(node: fx.Node, val: torch.Tensor) -> bool:
    """Whether ``node`` reshapes a tensor of value ``val`` keeping the order of its values."""
    out = node.meta.get("val")
    return (
        node.op == "call_function"
        and _name(node.target) in _RESHAPES
        and isinstance(out, torch.Tensor)
        and out.numel() == val.numel()
        and val.is_contiguous()
    )


def _pointwise_backward(target: fx.Node, tangents: list[fx.Node], walk: _Walk, compiled: bool = False):
    """``(x, grad) -> grad * h(x)`` as a graph of its own, with the dtype it computes in, when
    every node of the backward computed from ``target`` is a pointwise op of ``target``, one
    gradient and scalar constants, ending in one output; None otherwise."""
    val = target.meta.get("val")
    if not isinstance(val, torch.Tensor) or not tangents:
        return None
    outputs = [o for o in _outputs(target.graph) if isinstance(o, fx.Node)]
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {target: x}
    # A compiled graph often saves a matmul's output as a matrix and reads it reshaped
    # (``view(addmm, (batch, tokens, features))`` before GELU's backward): an elementwise
    # ``h`` reads the reshaped values one for one, so the reshapes stand for ``x`` itself.
    aliases = [u for u in target.users if _is_reshape(u, val)] if compiled else []
    env.update((alias, x) for alias in aliases)
    shapes = {val.shape, *(alias.meta["val"].shape for alias in aliases)}
    grad = graph.placeholder("grad")
    used_tangents = set()

    def pointwise(node: fx.Node) -> bool:
        out = node.meta.get("val")
        return (
            isinstance(node.target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in node.target.tags or _name(node.target) in _ELEMENTWISE_COPIES or _is_cast(node))
            and isinstance(out, torch.Tensor)
            and out.shape in shapes
        )

    def bring(node: fx.Node) -> bool:
        """Map an input from outside the reached nodes: the gradient, a scalar constant, or
        a pointwise function of those. In a compiled backward the gradient reaching the
        pointwise op is computed from the tangents (a matmul's): any one value of the
        target's shape computed without the target serves as it (the factor it multiplies
        is what is checked below)."""
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
            # Taken whole, before looking inside: SiLU's gradient is ``grad * up`` in a
            # gated MLP, a product of two values, either of which would count as a second
            # gradient.
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
    target: fx.Node, aliases: list[fx.Node], walk: _Walk, outputs: list[fx.Node], pointwise: Callable
) -> tuple[list[fx.Node], list[fx.Node]]:
    """In a compiled region's whole backward: the pointwise nodes computed from ``target``
    (or ``aliases``, reshapes of it) and the gradient before anything else reads it, and the
    one of them the rest of the backward reads (``grad * h(x)``), provided the rest reads it
    linearly and reads ``target`` through it alone. ``([], [])`` otherwise.

    The region is the shortest run of such nodes, in the backward's order, that closes this
    way: the pointwise nodes after it may be the next op's, reading ``target`` again
    (BatchNorm's backward multiplies SiLU's gradient by ``x - mean``, recomputed from the
    same saved input), and a region that took them in would have no single result."""
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
        downstream = _Walk(result, walk.saves)
        if downstream.result(outputs).use > Use.LINEAR or downstream.thresholds:
            continue
        return list(region), [result]
    return [], []


def _reads_a_gradient(region: list[fx.Node], reached: set[fx.Node], inside: set[fx.Node], result: fx.Node) -> bool:
    """Whether ``region`` multiplies in a value of its result's shape computed without the
    saved tensor (the gradient reaching the op): a region of ``h(x)`` alone is not yet
    ``grad * h(x)``."""
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


# ------------------------------------------------------------------------ eager: trace a call
_MARKER_NAMESPACE = "lightning_act_reads"
_marker_library = torch.library.Library(_MARKER_NAMESPACE, "DEF")
_marker_library.define("read(Tensor t, int slot) -> Tensor")


@torch.library.impl(_marker_library, "read", "CompositeExplicitAutograd")
def _read(t: torch.Tensor, slot: int) -> torch.Tensor:
    return t.clone()


@torch.library.register_fake(f"{_MARKER_NAMESPACE}::read", lib=_marker_library)
def _read_fake(t: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(t)


_TANGENT_SLOTS = -1  # tangents are marked with slots -1, -2, ...


def _is_marker(node: fx.Node) -> bool:
    """A read of a saved tensor, or a gradient, as the eager trace marks them."""
    return node.op == "call_function" and node.target is torch.ops.lightning_act_reads.read.default


class _Traced(NamedTuple):
    reads: tuple[Read, ...]
    #: (dtype, rank) of each traced save, checked against the real ones.
    saves: tuple[tuple[torch.dtype, int], ...]


_cache: dict[Any, _Traced | None] = {}
_cache_lock = threading.Lock()


def _signature(value: Any) -> Any:
    """The trace's key for arguments: a tensor by its dtype, rank, dimensions of size one,
    whether it needs a gradient, layout and device type; a module or generator by its type."""
    return arguments_key(value, _tensor_signature, lambda other: type(other).__qualname__)


def _tensor_signature(t: torch.Tensor) -> tuple:
    return ("T", t.dtype, t.dim(), tuple(s == 1 for s in t.shape), t.requires_grad, t.layout, t.device.type)


def _sharing(flat: list, positions: list[int]) -> list[int]:
    """For each tensor argument, the index of the first argument that is the same tensor
    object (numbered in order of first appearance). A call may branch on it:
    ``multi_head_attention_forward`` projects ``query is key is value`` with one matmul and
    saves other tensors than for three."""
    first: dict[int, int] = {}
    return [first.setdefault(id(flat[i]), len(first)) for i in positions]


def call_reads(
    func: Callable, args: tuple, kwargs: dict, autocast: tuple = ()
) -> tuple[tuple[Read, ...], tuple] | None:
    """How backward reads each tensor the call ``func(*args, **kwargs)`` saves, in the order it
    saves them, with the ``(dtype, rank)`` of each; None if the call cannot be traced.
    ``autocast`` is the autocast the call runs under
    (:func:`~lightning_act.optrack.autocast_state`), which decides what it casts and saves."""
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
    """Torch's core decompositions of backward kernels (``native_layer_norm_backward``,
    ``silu_backward``, ``_softmax_backward_data``) into the aten ops they compute with. Forward
    ops are left whole: what a decomposition of one returns may differ from what the kernel
    returns beside its result (a flash attention's logsumexp), and autograd saves those."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if "backward" in op.name()}


def in_fresh_thread(work: Callable[[], Any]) -> Any:
    """``work()`` in a thread of its own. A trace starts from clean per-thread state: a pack
    hook runs inside the saving op's dispatch, where autocast's dispatch key is excluded and
    the caller's saved-tensor hooks and torch function modes are active. And what FX keeps of
    the stack it traced from (frames, in reference cycles until the collector runs) is this
    thread's, not the caller's with its tensors."""
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
            # The call's own autocast, so that it casts, and saves, as it does for real.
            for device, dtype, cache in autocast:
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
            gm = make_fx(joint, tracing_mode="fake", decomposition_table=_backward_decompositions())(
                *[flat[i] for i in distinct]
            )
    except Exception:
        return None
    finally:
        torch.random.set_rng_state(rng)
    markers = [n for n in gm.graph.nodes if _is_marker(n)]
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
            # Saved, then written by the call itself (``rrelu``'s noise, which its kernel fills
            # after autograd saved the empty buffer): only the tensor itself holds what
            # backward will read.
            reads.append(Read(Use.EXACT, reason="written after it is saved"))
        elif not any(_used(n) for n in nodes):
            unused.append(slot)
            reads.append(Read(Use.NONE))
        else:  # read twice (a double backward): the stricter
            reads.append(max((classify(n, tangents, Saves(saved)) for n in nodes), key=lambda r: r.use))
    if unused:
        # Unpacked, and reaching no gradient as traced: torch's formula may branch on what it
        # is given (prod's backward, for a tensor subclass such as the fake ones traced,
        # avoids dividing by the input; for real ones it reads ``result / input``).
        read_for_real = _slots_read_for_real(
            func, flat, spec, positions, shared, requires, autocast, len(saves), unused
        )
        for slot in unused:
            if read_for_real is None or slot in read_for_real:
                reads[slot] = Read(Use.SINGULAR, reason=_UNTRACED_BRANCH)
    given = {v for v in flat if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return _Traced(_with_recomputes(_with_matches(reads, slots), slots, saves, given), tuple(saves))


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
    handed back as NaN, then as other values; a gradient that turns NaN (read through
    arithmetic) or changes (read through a comparison, where NaN compares false) read it.
    Run once per call signature, beside its trace (a thread of its own, outside the
    capture's hooks), on CPU copies of the call's own arguments: values the call already ran
    on, so no forked process is needed (nor can one run backward once autograd's threads
    have started). None where it cannot be measured (an op with no CPU kernel, a call that
    saves other tensors than its ``saves`` traced ones on the CPU)."""
    tensors = [flat[i] for i in positions]
    if sum(t.numel() for t in tensors) > _PROBE_NUMEL:
        return None
    copies = [t.detach().to("cpu", copy=True) for t in tensors]
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
            for device, dtype, cache in autocast:
                if device == "cpu":
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
    return any(user.op == "output" for node in (marker, *_downstream(marker)) for user in node.users)


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
# The ops through which backward computes what it compares a saved tensor with, from the
# call's other saves. None takes a size, which the trace would have fixed at its shapes,
# but a view of a reduction's result with the reduced dimensions put back (as ones): that
# is rebuilt from the compared tensor's own shape (:func:`_put_back_dims`).
_MATCH_OTHER_OPS = frozenset({"detach", "alias", "gather", "index_select", "unsqueeze", "squeeze", "clone"})
_MATCH_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})
_MATCH_PASS = frozenset({"detach", "alias"})
_EQUALITY = frozenset({"eq", "ne"})
_AND = frozenset({"logical_and", "logical_and_", "bitwise_and", "bitwise_and_"})


def _with_recomputes(
    reads: tuple[Read, ...], slots: dict[int, list[fx.Node]], saves: list[tuple[torch.dtype, int]], given: set
) -> tuple[Read, ...]:
    """``reads`` with a :class:`Recompute` on each float output of a fused attention (an op
    of the trace whose name holds ``attention``) without dropout, whose tensor arguments are
    all saved by the call before it. Its other arguments must be flags, zero, or numbers the
    call was ``given``: a trace serves every call of the same signature, whatever its sizes,
    so a number the call computed from a size (a scale from the head's width) would be
    another call's."""
    source = {nodes[0].args[0]: slot for slot, nodes in slots.items()}
    found = list(reads)
    for slot, nodes in slots.items():
        value = nodes[0].args[0]
        if value.target is not operator.getitem or not saves[slot][0].is_floating_point:
            continue
        op, output = value.args
        if not (isinstance(op, fx.Node) and isinstance(op.target, torch._ops.OpOverload)):
            continue
        name = _name(op.target)
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
        arguments = pytree.tree_map(lambda a: _SaveOf(source[a]) if isinstance(a, fx.Node) else a, (op.args, op.kwargs))
        inputs = tuple(dict.fromkeys(source[a] for a in tensors))
        found[slot] = found[slot]._replace(recompute=Recompute(op.target, arguments, output, inputs))
    return tuple(found)


def _put_back_dims(result: torch.Tensor, shape: torch.Size, reduced: tuple[int, ...]) -> torch.Tensor:
    """``result`` viewed as ``shape`` with the ``reduced`` dimensions of size one."""
    return result.view([1 if d in reduced else size for d, size in enumerate(shape)])


def _with_matches(reads: list[Read], slots: dict[int, list[fx.Node]]) -> tuple[Read, ...]:
    """``reads`` with a :class:`Match` on each save backward only tests for equality with a
    value computed from other saves. Of two saves compared with each other (``amax``'s input
    and result), only the larger is stored as its match; the other stays as it is."""
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
    reads it only for those comparisons (every path from it ends in one) and they are saved
    before it (so that their outcomes are taken when it arrives); else none. Not where a
    comparison also reads ``isnan``: a stored copy need not keep NaN where the tensor had it."""
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
            if not (isinstance(user.target, torch._ops.OpOverload) and _name(user.target) in _EQUALITY):
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
            name = _name(user.target) if isinstance(user.target, torch._ops.OpOverload) else None
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
        name = _name(node.target)
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
        name = _name(user.target) if isinstance(user.target, torch._ops.OpOverload) else None
        if name not in _AND or len(user.args) != 2 or user.kwargs:
            return None
        partner = user.args[1] if user.args[0] is isnan else user.args[0]
        if not (
            isinstance(partner, fx.Node)
            and isinstance(partner.target, torch._ops.OpOverload)
            and _name(partner.target) == "isnan"
            and isinstance(partner.args[0], fx.Node)
        ):
            return None
        found.add(partner.args[0])
    return found.pop() if len(found) == 1 else None


def _reduced_dims(sizes: Any, traced: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dimensions a view to ``sizes`` puts back as ones, where ``sizes`` is the compared
    tensor's traced shape ``traced`` with those dimensions one; None for any other view."""
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(traced):
        return None
    if not all(isinstance(size, int) and size in (1, full) for size, full in zip(sizes, traced)):
        return None
    return tuple(d for d, (size, full) in enumerate(zip(sizes, traced)) if size == 1 and full != 1)


# --------------------------------------------------------------- compiled: a backward graph
_graph_cache: weakref.WeakKeyDictionary[fx.Graph, dict[str, Read]] = weakref.WeakKeyDictionary()


def graph_reads(backward: fx.Graph, forward: fx.Graph | None = None) -> dict[str, Read]:
    """How a compiled region's backward graph reads each tensor its forward saves, by the
    name of the placeholder that receives it (the saved forward node's name).

    Read once per graph, on the graph as it was first seen: torch inlines the unpack hooks
    into it while it is read tensor by tensor. Backward kernels the compiler left whole
    (``native_batch_norm_backward`` under ``aot_eager``) are decomposed first, by the same
    table as the eager trace's, on fake tensors; where that fails the graph is read as it is
    (an op the algebra does not know is read as singular: kept exact). ``forward``, the
    region's forward graph, tells which saves an op never negative computed.
    """
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
    # What the forward computed each save with: the partitioner saves softplus's ``exp(x)``
    # and divides by ``1 + exp(x)`` in backward; a forward input is a parameter or the like.
    made_by = {n.name: n for n in forward.nodes} if forward is not None else {}
    saves = Saves(
        set(saved.values()),
        {
            n
            for name, n in saved.items()
            if name in made_by and made_by[name].op == "call_function" and _name(made_by[name].target) in _NONNEGATIVE
        },
        {n for name, n in saved.items() if name in made_by and made_by[name].op == "placeholder"},
    )
    return {name: classify(n, tangents, saves, compiled=True) for name, n in saved.items()}


def size_hint(value: Any) -> int:
    """A size, symbolic or not, as traced (1 where a symbolic one has no hint)."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return optimization_hint(value, fallback=1)


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
