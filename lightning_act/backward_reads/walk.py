"""The degree algebra: how backward reads one saved tensor, walked from its node to the gradients."""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from lightning_act.backward_reads.aten import (
    ATEN_NAMESPACES,
    MARKER_NAMESPACE,
    aten_name,
    downstream,
    is_float,
    is_marker,
    node_arguments,
    size_hint,
)
from lightning_act.backward_reads.linearity import linear_arguments

#: A float tensor an op computed with this many times fewer values than its largest activation
#: argument is a reduction statistic (a norm's 1 / std, a logsumexp), kept exact.
STATISTIC_RATIO = 8


class Use(enum.IntEnum):
    """How backward reads a saved tensor, mildest to strictest; see the package."""

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
    #: A pointwise op's input read only through its derivative: what to store instead.
    derivative: Any = None  # a PointwiseDerivative
    #: Why it is :attr:`Use.SMOOTH` or stricter: the aten op or rule that made it so.
    reason: str | None = None
    #: Compared with constants and read for its value (:attr:`reason` ``"comparison"``): how
    #: backward reads it if a codec keeps the comparisons (:attr:`thresholds`) exact.
    value_use: Use | None = None
    #: :attr:`Use.EXACT` read only as ``x == other``: how to compute ``other``, so that the outcome alone is stored.
    match: Match | None = None
    #: :attr:`Use.EXACT` read only as the other side of earlier saves' :attr:`match`: their numbers
    #: (any values serve, so long as those outcomes were taken against its own).
    match_partner: tuple[int, ...] = ()
    #: A fused attention's output that the call's earlier saves compute again: how.
    recompute: Recompute | None = None


class Recompute(NamedTuple):
    """A fused attention's saved output (its result, its rows' logsumexp) computed again from
    the saves its inputs are stored in. Backward takes ``rowsum(dO * O)`` from the output and
    ``dO V^T`` from the value, which nearly cancel on a saturated row, and recomputes the
    probabilities against the logsumexp: all must come from the same stored values, not be
    rounded apart. The output is then not stored, for one more forward in backward."""

    target: torch._ops.OpOverload
    #: Its (args, kwargs), each tensor as a :class:`SaveOf`.
    arguments: tuple
    #: Which of its outputs the save is.
    output: int
    #: The numbers of the saves it reads, in order.
    inputs: tuple[int, ...]

    def run(self, values: Sequence[torch.Tensor]) -> tuple:
        """The op's outputs from the saves' values (in :attr:`inputs` order)."""
        by_save = dict(zip(self.inputs, values))
        args, kwargs = pytree.tree_map(lambda a: by_save[a.save] if isinstance(a, SaveOf) else a, self.arguments)
        with torch.no_grad():
            return self.target(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class SaveOf:
    """In :attr:`Recompute.arguments`, the save holding a tensor argument (a dataclass: pytree keeps it whole)."""

    save: int


class Match(NamedTuple):
    """Backward reads a saved tensor ``x`` only as ``x == other`` (or ``!=``), perhaps with
    ``isnan(x) & isnan(other)``, where ``other`` is computed from the call's other saves
    (``amax``'s, ``max()``'s, ``scatter_reduce``'s ``x == result``). :meth:`matches` is stored,
    one bit per element, and :meth:`stand_in` gives backward the same comparisons."""

    #: The save numbers ``other`` is computed from, in the order ``compute`` takes them.
    partners: tuple[int, ...]
    #: ``other`` from the tensor's shape and the partners' values (cut from the traced backward).
    compute: fx.GraphModule
    #: Whether backward also reads ``isnan(x)``: then both being NaN counts as a match.
    reads_nan: bool = False

    def matches(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """Where ``x`` equals ``other`` (or, where backward reads ``isnan(x)``, both are NaN)."""
        equal = torch.eq(x, other)
        return equal.logical_or_(torch.isnan(x).logical_and_(torch.isnan(other))) if self.reads_nan else equal

    def stand_in(self, matched: torch.Tensor, partners: list[torch.Tensor]) -> torch.Tensor:
        """What backward compares in place of the tensor: ``other`` where it matched, else a
        value neither equal to ``other`` nor NaN where ``other`` is, so that ``x == other`` and
        ``isnan(x) & isnan(other)`` come out as for the tensor itself."""
        other = self.compute(matched.shape, *partners)
        nan = torch.tensor(float("nan"), dtype=other.dtype, device=other.device)
        return torch.where(matched, other, torch.where(torch.isnan(other), torch.zeros_like(nan), nan))


# How each aten op, by overload packet, carries a saved tensor's degree to its result. What is
# not here is read as SINGULAR: aten checks its indices, so nothing it does with a float is EXACT.

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
)
# ``bias + a @ b``: the first argument added, the next two multiplied.
_ADD_PRODUCT = frozenset({"addmm", "baddbmm", "addbmm", "addmv", "addr", "addcmul"})
# ``a * b + c``: the first two multiplied, the third added.
_PRODUCT_ADD = frozenset({"fma"})
# Comparisons: a REGION read against a Python constant; with another tensor, an EXACT one.
_COMPARISONS = frozenset(
    """
    lt le gt ge eq ne maximum minimum fmax fmin
    """.split()
)
_ORDER_WITH_CONSTANT = frozenset({"sign", "sgn", "signbit", "heaviside"})
# Ops whose result holds some of their first argument's values unchanged: a constant compared
# with the result is the same constant on the argument.
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
# Results that jump with their argument, so that rounding changes them by a whole step: exact.
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


class Saves(NamedTuple):
    """A backward graph's saved tensors' nodes (shared by its walks), and what its forward tells of them."""

    all: Collection[fx.Node] = ()
    #: Those an op never negative computed (an ``exp``).
    nonnegative: Collection[fx.Node] = ()
    #: The forward's own inputs: parameters, the batch, an earlier graph's activation.
    inputs: Collection[fx.Node] = ()


class Walk:
    """One forward pass over a graph from a saved tensor's node: degrees and what was seen."""

    def __init__(self, target: fx.Node, saves: Saves = Saves()):
        self.target = target
        self.saves = saves
        self.degree: dict[fx.Node, int] = {target: 1}
        #: Every node computed from the saved tensor, masks of it included (degree 0).
        self.reached = downstream(target)
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
        """Whether ``node`` is, or is computed from, a saved tensor other than the target.
        ``rounded_alike``: only a save rounded wherever the target is (a forward input, kept as
        it is, counts only for a target that is one too)."""
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
            if not is_marker(current):
                stack.extend(current.all_input_nodes)
        return False

    def _reduces_target(self, save: fx.Node) -> bool:
        """Whether ``save`` holds ``STATISTIC_RATIO`` times fewer values than the target: a
        statistic kept exact, so that ``exp(x - max - log)`` rounds only ``x``."""
        small, large = save.meta.get("val"), self.target.meta.get("val")
        if not isinstance(small, torch.Tensor) or not isinstance(large, torch.Tensor):
            return False
        return size_hint(large.numel()) >= STATISTIC_RATIO * size_hint(small.numel())

    def _exponent_adds_another_save(self, exponent: Any) -> bool:
        """Whether ``exponent`` (through views, negation and scaling) adds what the target
        reaches to what another save rounded alike does: ``x - result``. A product
        (``exp(A * dt)``) or a parameter added (``x + bias``) rounds nothing a second time."""
        while isinstance(exponent, fx.Node) and exponent.op == "call_function":
            name = aten_name(exponent.target)
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
        if aten_name(exponent.target) not in ("add", "sub", "rsub"):
            return False
        terms = [t for t in exponent.args[:2] if isinstance(t, fx.Node)]
        return any(self._deg(t) for t in terms) and any(
            not self._deg(t) and self._from_another_save(t, rounded_alike=True) for t in terms
        )

    def _counts(self, node: fx.Node) -> bool:
        """Whether ``node`` is computed from boolean and integer saves alone: a count, at
        least 1 wherever a quotient by it is read, which shrinks a rounding step."""
        stack, seen = list(node.all_input_nodes), set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if current is self.target:
                return False
            if current in self.saves.all or is_marker(current):
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
        # Back through views and read markers to the forward's tensor (a marker's is laid out anew).
        while divisor.op == "call_function" and (is_marker(divisor) or aten_name(divisor.target) in _DIVISOR_VIEWS):
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
            self.worst, self.reason = use, reason or aten_name(node.target)

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
        if target.namespace not in ATEN_NAMESPACES:
            if target.namespace == MARKER_NAMESPACE:
                return 0  # another saved tensor's read, or a gradient
            # Outside aten (torchvision's): linear where measured so, else unknown and so exact.
            return self._step_probed(node, Use.EXACT)
        name = aten_name(target)
        arguments = node_arguments(node)
        if name in _SHAPE_ONLY:
            return 0
        if not is_float(node):
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
                # A denominator that cannot near zero (``1 + exp(-x)``) is smooth; any other singular.
                bound = _lower_bound(node.args[1], self.saves.nonnegative)
                self._record(Use.SMOOTH if bound is not None and bound > 0 else Use.SINGULAR, node)
                return 1
            if node.kwargs.get("rounding_mode") is not None or len(node.args) > 2:
                self._record(Use.EXACT, node)
            elif degrees[0] and self._divides_by_another_save_elementwise(node):
                # ``result / input`` (a product's backward): the result's rounding, a step of
                # its group's range, is divided by the small inputs its small values came from.
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
                # exp(x - result) (logsumexp's backward): the difference of two rounded values,
                # each far larger than it, exponentiated.
                self._record(Use.SINGULAR, node)
            else:
                self._record(Use.SMOOTH, node)
            return 1
        if name in _LOGARITHMS:
            # Smooth, of slope at most 1, where its argument stays 1 clear of its pole
            # (``log1p(exp(x))``, ``log(1 + x**2)``).
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
        the target's own values where one is the same comparison (``x * 2 > 1`` as ``x > 0.5``,
        ``relu(x) <= 0`` as ``x <= 0``); else read exactly, as no cells of the target's values
        would keep the outcomes."""
        threshold = self._threshold_on_target(compared, constant)
        if threshold is None:
            self._record(Use.EXACT, node, f"compared after {aten_name(compared.target)}")
        elif threshold is not _CONSTANT_OUTCOME:
            self.thresholds.add(threshold)
            if compared is not self.target and aten_name(compared.target) in ("relu", "clamp_min"):
                self.kinked = True

    def _threshold_on_target(self, value: Any, constant: float) -> Any:
        """The constant on the target equivalent to comparing ``value`` with ``constant``;
        ``_CONSTANT_OUTCOME`` where no value decides it; None where no one constant does."""
        while value is not self.target:
            if not isinstance(value, fx.Node) or not isinstance(value.target, torch._ops.OpOverload):
                return None
            name, args = aten_name(value.target), value.args
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
        """The read, from the degrees reaching ``outputs``; ``whole_graph``: a compiled region's backward."""
        degree = max((self._deg(o) for o in outputs), default=0)
        use = self.worst
        if degree >= 3 and whole_graph:
            # A compiled backward recomputes chains of forward ops from one save, whose products
            # raise the degree where no one value is read more than smoothly.
            use, self.reason = max(use, Use.SMOOTH), self.reason or "a product of three or more"
        elif degree >= 3:
            # Cubed or more by one op's backward (a normalisation's rstd**3): its rounding error
            # is multiplied in three times over.
            use, self.reason = max(use, Use.SINGULAR), self.reason or "a power of three or more"
        elif degree >= 2:
            use = max(use, Use.QUADRATIC)
        elif degree == 1:
            use = max(use, Use.LINEAR)
        value_use = None
        if self.kinked and use >= Use.SMOOTH:
            # Compared at the kink of a ReLU recomputed from it, and read through it: the outcome
            # switches a gradient on or off, and no codec keeps it while rounding the values.
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


# Never negative, whatever their (finite) argument.
NONNEGATIVE = frozenset(
    """
    exp exp2 sigmoid abs relu square softplus cosh
    """.split()
)


def _lower_bound(value: Any, nonnegative: Collection[fx.Node] = ()) -> float | None:
    """A lower bound of ``value`` where one is seen: a constant; 0 for a never-negative op or
    save (``nonnegative``); the sum of bounded terms (``1 + exp(-x)``: 1). Else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, fx.Node):
        return None
    if value in nonnegative or (value.op == "call_function" and aten_name(value.target) in NONNEGATIVE):
        return 0.0
    if value.op != "call_function" or aten_name(value.target) != "add" or len(value.args) != 2:
        return None
    if value.kwargs.get("alpha", 1) != 1:
        return None
    bounds = [_lower_bound(term, nonnegative) for term in value.args]
    return None if None in bounds else bounds[0] + bounds[1]
