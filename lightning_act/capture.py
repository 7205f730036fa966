"""The capture engine: for every tensor autograd saves for backward, decide how it is
stored, store it at once, attribute it to the module that saved it, and account its bytes.

Framework-free: :class:`ActivationCapture` works with any ``nn.Module`` (or none), and the
Lightning callback is a thin scheduler around it. The decision for one saved tensor:

* a boolean mask or integer indices: stored losslessly in the fewest bits they need
  (max-pool indices with the bound their op implies, so without a device synchronisation);
* a float tensor that holds one bit per value for its op (LeakyReLU's input, read only
  for its sign; dropout's noise on the CPU): a 1-bit mask, exact;
* too small, or laid out with overlapping elements (a broadcast/unfolded view whose dense
  copy would be larger): kept as it is;
* a reduction statistic, at least 8 times smaller than its op's largest input (LayerNorm's
  mean and rstd, attention's logsumexp): kept exact, since backward multiplies its noise in;
* a parameter, a view of one, or a tensor that belongs to the step's input batch: kept
  *and not counted*, because its owner keeps it alive whatever autograd does;
* a cast copy of a parameter (autocast's bf16/fp16 weights): not kept at all; it is cast
  again from the parameter when backward needs it, which is exact;
* anything else: compressed now, at pack time (a deferred copy would miss in-place
  changes, which autograd no longer detects once hooks are installed), by the codec and
  bits that the rules (by module and by op) and the policy choose. A ReLU output, whose
  backward reads ``out > 0`` and which the next layer saves too, is stored once by a codec
  that keeps zeros exact (the quantizer, at 2 bits or more), so ReLU's gradient is exact.

Which op saves a tensor comes from an :class:`~lightning_act.optrack.OpTracker` entered
for the session.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_act.codecs import (
    DivisionCodec,
    GroupQuantCodec,
    IndexCodec,
    MaskCodec,
    SignMaskCodec,
    StoredTensor,
    make_codec,
)
from lightning_act.codecs.exact import INDEX_DTYPES
from lightning_act.config import CODECS, CompressionConfig
from lightning_act.ops import count_nonfinite_groups
from lightning_act.optrack import OpTracker, saved_index_range
from lightning_act.policy import BitPolicy, FixedBits, SlotInfo
from lightning_act.policy.bits import bits_name
from lightning_act.policy.estimators import GradientSensitivity, probe_sensitivities, update_weights

OUTSIDE_MODULES = "<outside modules>"

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


def _is_statistic(t: torch.Tensor, call) -> bool:
    storage = t.untyped_storage().data_ptr()
    inputs = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(a.untyped_storage().data_ptr() == storage for a in inputs):
        return False  # the op saves one of its inputs
    # Only a larger activation makes it a statistic; a parameter's size says nothing.
    larger = (a for a in inputs if a.numel() >= t.numel() * _STATISTIC_RATIO)
    return any(_source_parameter(a)[0] is None for a in larger)


def _is_attention_score_input(t: torch.Tensor, call) -> bool:
    """Whether ``t`` is the query or the key of the attention call saving it."""
    if call is None or call.name not in _ATTENTION_OPS:
        return False
    query = call.kwargs.get("query", call.args[0] if call.args else None)
    key = call.kwargs.get("key", call.args[1] if len(call.args) > 1 else None)
    return any(
        isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr() and a.shape == t.shape for a in (query, key)
    )


def _min_bits(t: torch.Tensor, call) -> int:
    """The fewest bits a saved tensor may get from its op (rules and policies included)."""
    if call is None:
        return 1
    if call.name in _ZERO_EXACT_OPS:
        return 2
    if call.name in _SOFTMAX_OUTPUT_OPS or _is_attention_score_input(t, call):
        return _SOFTMAX_BITS
    return 1


def _dropout_keep_probability(call) -> float:
    p = call.kwargs.get("p", call.args[1] if len(call.args) > 1 else 0.5)
    return 1.0 - float(p)

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

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class ModuleMemory:
    """Bytes one module's saved tensors would have kept, and what is stored instead."""

    saved_bytes: int = 0
    stored_bytes: int = 0
    tensors: int = 0
    compressed: int = 0
    bits: set = field(default_factory=set)
    codecs: set = field(default_factory=set)

    def bits_label(self) -> str:
        """The bit widths used, e.g. ``"2"`` or ``"2,8,exact"`` (``-`` when none applied)."""
        return ",".join(bits_name(b) for b in sorted(self.bits, key=lambda b: 99 if b is None else b)) or "-"

    def codecs_label(self) -> str:
        """How its tensors are stored, e.g. ``"quant"`` or ``"division,quant,index"``."""
        return ",".join(sorted(self.codecs)) or "-"


@dataclass
class SlotMemory:
    """One stored tensor: where and by which op it was saved, its shape, codec, bits and bytes."""

    module: str
    shape: tuple[int, ...]
    bits: int | None
    saved_bytes: int
    stored_bytes: int
    codec: str = "stored"
    op: str | None = None


@dataclass
class CompressionReport:
    """What one captured forward saved for backward, per module and in total.

    ``saved_bytes`` counts each storage autograd would have kept alive once (views and
    expanded tensors share storage); ``stored_bytes`` counts what is really allocated for
    backward instead. Tensors that stay alive anyway (parameters, the input batch) are in
    neither. ``nonfinite_groups`` is a device tensor (reading it synchronizes).
    """

    saved_bytes: int = 0
    stored_bytes: int = 0
    modules: dict[str, ModuleMemory] = field(default_factory=dict)
    slots: dict[str, SlotMemory] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    nonfinite_groups: torch.Tensor | int = 0

    @property
    def ratio(self) -> float:
        """``saved_bytes / stored_bytes`` (1.0 when nothing was saved)."""
        return self.saved_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def summary(self, max_modules: int = 20) -> str:
        """A fixed-width table of the modules that save the most, then the totals."""
        rows = sorted(self.modules.items(), key=lambda kv: kv[1].saved_bytes, reverse=True)
        width = max([len("module")] + [len(name) for name, _ in rows[:max_modules]])
        lines = [f"{'module':<{width}}  {'saved MiB':>10}  {'stored MiB':>10}  {'ratio':>7}  {'tensors':>7}  {'bits':<8}  codec"]
        for name, m in rows[:max_modules]:
            ratio = m.saved_bytes / m.stored_bytes if m.stored_bytes else float("inf")
            lines.append(
                f"{name:<{width}}  {m.saved_bytes / 2**20:>10.3f}  {m.stored_bytes / 2**20:>10.3f}"
                f"  {ratio:>6.2f}x  {m.tensors:>7}  {m.bits_label():<8}  {m.codecs_label()}"
            )
        if len(rows) > max_modules:
            lines.append(f"... {len(rows) - max_modules} more modules")
        lines.append(
            f"{'total':<{width}}  {self.saved_bytes / 2**20:>10.3f}  {self.stored_bytes / 2**20:>10.3f}"
            f"  {self.ratio:>6.2f}x  {sum(m.tensors for m in self.modules.values()):>7}"
        )
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return "\n".join(lines + [f"saved tensors by decision: {counts}"])


class _Layout:
    """How to lay a saved tensor out densely for a codec, and how to give it back.

    Dense tensors of any memory format are read in memory order (a permuted view, no copy)
    and restored with their original strides; broadcast dimensions (stride 0) are stored
    once and expanded again; other non-overlapping views (slices such as q, k, v of a fused
    projection) are copied to a dense tensor and come back dense.
    """

    __slots__ = ("expand_to", "inverse_perm")

    def __init__(self, expand_to: torch.Size | None, inverse_perm: tuple[int, ...] | None):
        self.expand_to = expand_to
        self.inverse_perm = inverse_perm

    @staticmethod
    def dense_view(t: torch.Tensor) -> tuple[torch.Tensor, _Layout] | None:
        """A contiguous tensor holding ``t``'s distinct elements, or None if they overlap."""
        if t.is_contiguous():
            return t, _Layout(None, None)
        expand_to = None
        if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
            expand_to = t.shape
            t = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
        perm = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        permuted = t.permute(perm)
        if not permuted.is_contiguous():
            extent = 1
            for d in reversed(perm):
                if t.size(d) > 1:
                    if t.stride(d) < extent:
                        return None
                    extent = t.stride(d) * t.size(d)
            permuted = permuted.contiguous()
        identity = all(p == i for i, p in enumerate(perm))
        inverse = None if identity else tuple(sorted(range(len(perm)), key=perm.__getitem__))
        return permuted, _Layout(expand_to, inverse)

    def restore(self, dense: torch.Tensor) -> torch.Tensor:
        t = dense if self.inverse_perm is None else dense.permute(self.inverse_perm)
        return t if self.expand_to is None else t.expand(self.expand_to)


def _storage_region(t: torch.Tensor) -> tuple[int, int] | None:
    """``(offset, numel)`` when ``t``'s elements fill exactly that run of its storage, else None.

    Such a tensor, read in memory order, is that run; so are its other views of the same run
    (a transpose, a reshape), which can therefore share one stored copy.
    """
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != extent:
            return None
        extent *= size
    return t.storage_offset(), t.numel()


class _RegionView:
    """What autograd holds for a view of a run of storage that another view already stored."""

    __slots__ = ("record", "size", "stride")

    def __init__(self, record, t: torch.Tensor):
        self.record = record
        self.size = t.shape
        self.stride = t.stride()

    def unpack(self) -> torch.Tensor:
        return self.record.unpack().reshape(-1).as_strided(self.size, self.stride)


class _Shared(NamedTuple):
    """A stored save, for the later saves of the same tensor that may share it."""

    storage: StorageWeakRef
    #: ``(shape, strides)`` of the view stored: the same view gets ``saved`` itself.
    view: tuple
    saved: Any
    #: For a run of storage, its record in memory order, from which other views are restored.
    record: Any
    #: The fewest bits any reader gets from it; another view needing more is stored again.
    guaranteed: float


class _Compressed:
    """What autograd holds instead of a compressed tensor."""

    __slots__ = ("record", "layout")

    def __init__(self, record, layout: _Layout):
        self.record = record
        self.layout = layout

    def unpack(self) -> torch.Tensor:
        return self.layout.restore(self.record.unpack())


class _RecastWeight:
    """What autograd holds instead of autocast's low-precision copy of a parameter."""

    __slots__ = ("param", "version", "dtype", "size", "stride", "offset")

    def __init__(self, param: nn.Parameter, saved: torch.Tensor):
        self.param = param
        self.version = param._version
        self.dtype = saved.dtype
        self.size = saved.shape
        self.stride = saved.stride()
        self.offset = saved.storage_offset()

    def unpack(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                f"lightning_act: a parameter of shape {tuple(self.param.shape)} was modified in place between "
                "forward and backward, so its autocast copy cannot be re-created exactly. Run the optimizer "
                "step after backward, or exclude this module from compression."
            )
        return self.param.detach().to(self.dtype).as_strided(self.size, self.stride, self.offset)


def _unpack(saved: Any) -> torch.Tensor:
    return saved if isinstance(saved, torch.Tensor) else saved.unpack()


def _storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef]:
    storage = t.untyped_storage()
    return storage.data_ptr(), StorageWeakRef(storage)


def _source_parameter(t: torch.Tensor) -> tuple[nn.Parameter | None, bool]:
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


class _ProbeRecord:
    """Probe mode: the exact dense tensor, quantized at unpack only when its slot is probed."""

    __slots__ = ("probe", "slot", "dense")

    def __init__(self, probe: _Probe, slot: str, dense: torch.Tensor):
        self.probe = probe
        self.slot = slot
        self.dense = dense

    def unpack(self) -> torch.Tensor:
        if self.probe.noisy_slot != self.slot:
            return self.dense
        return self.probe.codec.pack(self.dense, self.probe.bits, self.probe.next_seed()).unpack()


class _KeptRecord:
    """A run of storage kept as it is, in memory order, for the other views that share it."""

    __slots__ = ("dense",)

    def __init__(self, dense: torch.Tensor):
        self.dense = dense

    def unpack(self) -> torch.Tensor:
        return self.dense


class _Probe:
    """The handle :meth:`ActivationCapture.probing` yields: which slot is quantized now."""

    def __init__(self, codec: GroupQuantCodec, seed: int):
        self.codec = codec
        self.slots: list[str] = []
        self.noisy_slot: str | None = None
        self.bits = 2
        self._seed = seed
        self._draws = 0

    def quantize_only(self, slot: str | None, bits: int) -> None:
        """Quantize ``slot`` alone at ``bits`` in the following backward passes."""
        self.noisy_slot = slot
        self.bits = bits

    def next_seed(self) -> int:
        self._draws += 1
        return splitmix64(self._seed + self._draws) >> 1


class ActivationCapture:
    """Compresses what autograd saves while a forward runs inside :meth:`capturing`.

    Args:
        config: group size, size threshold and seed (and the bits of the default policy).
        model: names the modules in the report (qualified names); without it, modules are
            named by class. Its parameters and buffers are never compressed either way.
        policy: decides each saved tensor's bits; default ``FixedBits(config.bits)``.

    Example::

        capture = ActivationCapture(CompressionConfig(bits=2), model)
        with capture.capturing(inputs=(x,)):
            loss = model(x).sum()
        loss.backward()
        print(capture.report.summary())
    """

    def __init__(
        self,
        config: CompressionConfig | None = None,
        model: nn.Module | None = None,
        policy: BitPolicy | None = None,
    ):
        self.config = config or CompressionConfig()
        self._codecs = {name: make_codec(name, self.config.group_size, self.config.block) for name in CODECS}
        #: The codec of float tensors that no rule assigns another.
        self.codec = self._codecs[self.config.codec]
        self._index_codec = IndexCodec()
        self._sign_codec = SignMaskCodec()
        self._lossless_codecs = {torch.bool: MaskCodec(), **{dtype: self._index_codec for dtype in INDEX_DTYPES}}
        self._tracker = OpTracker()
        self.policy = policy or FixedBits(self.config.bits)
        self.model = model
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        if model is not None:
            for name, module in model.named_modules():
                self._names[module] = name or type(module).__name__
        #: Every slot seen so far, with what the policy needs to allocate bits to it.
        self.slots: dict[str, SlotInfo] = {}
        #: Set by the caller for the sessions whose statistics feed a recalibration.
        self.estimator: GradientSensitivity | None = None
        self.report = CompressionReport()
        self.total_nonfinite_groups: torch.Tensor | int = 0
        self._sessions = 0
        self._active = False
        self._paused = False
        self._probe: _Probe | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._module_hooks: weakref.finalize | None = None
        self._stack: list[str] = []
        self._reset_session(seed=0)

    # ----------------------------------------------------------------- session control
    def _reset_session(self, seed: int) -> None:
        self.report = CompressionReport()
        self._seed = seed
        self._packs = 0
        self._slot_counts: dict[str, int] = {}
        self._dedup: dict[tuple, _Shared] = {}
        self._saved_storages: dict[int, StorageWeakRef] = {}
        self._kept_storages: dict[int, StorageWeakRef] = {}
        self._external: dict[int, StorageWeakRef] = {}
        self._stats: list[torch.Tensor] = []

    def start(self, inputs: Any = None, seed: int | None = None) -> None:
        """Start capturing: every tensor saved from now on is considered.

        Args:
            inputs: tensors (or nested lists/tuples/dicts of them) alive for the whole step,
                such as the batch: saving them costs nothing, so they are not compressed.
            seed: the rounding-noise stream of this session; by default, the config's seed
                mixed with a session counter, so every step draws fresh noise.
        """
        if self._active:
            raise RuntimeError("ActivationCapture.start() called twice without stop()")
        self._sessions += 1
        if seed is None:
            seed = splitmix64(self.config.seed ^ splitmix64(self._sessions))
        self._reset_session(seed)
        self.mark_external(inputs)
        if self.model is not None:
            self.mark_external(list(self.model.buffers()))
        if self._module_hooks is None:
            self._module_hooks = _SharedModuleHooks.acquire(self)
        _SharedModuleHooks.capturing.append(self)
        self._tracker.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self._active = True
        self._paused = False

    def stop(self) -> CompressionReport:
        """Stop capturing and return the report of this session. Safe to call twice."""
        if not self._active:
            return self.report
        self._active = False
        try:
            self._hooks.__exit__(None, None, None)
        finally:
            self._tracker.__exit__(None, None, None)
            self._hooks = None
            _SharedModuleHooks.capturing.remove(self)
            self._stack.clear()
        if self._stats:
            found = torch.stack([count_nonfinite_groups(s) for s in self._stats]).sum()
            self.report.nonfinite_groups = found
            self.total_nonfinite_groups = self.total_nonfinite_groups + found
        self._stats = []
        self._dedup = {}
        return self.report

    def close(self) -> None:
        """Stop, and release the process-wide module hooks that the capture shares with others
        (they are released anyway when the capture is garbage collected)."""
        self.stop()
        if self._module_hooks is not None:
            self._module_hooks()
            self._module_hooks = None

    def pause(self) -> None:
        """Let saved tensors pass through untouched (for backward) until :meth:`resume`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    @property
    def active(self) -> bool:
        return self._active

    def capturing(self, inputs: Any = None, seed: int | None = None) -> _CaptureContext:
        """Context manager around :meth:`start` / :meth:`stop` (stops on exceptions too)."""
        return _CaptureContext(self, inputs, seed)

    @contextlib.contextmanager
    def probing(self, inputs: Any = None, seed: int = 0):
        """Probe mode for sensitivity estimation: tensors that would be compressed are kept
        exact, and the yielded handle chooses which one slot is quantized at unpack."""
        probe = _Probe(self.codec, seed)
        self._probe = probe
        try:
            with self.capturing(inputs, seed):
                yield probe
        finally:
            self._probe = None

    def measure_sensitivity(
        self,
        loss_fn: Callable[[], torch.Tensor],
        inputs: Any = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> dict[str, dict[int, float]]:
        """GACT's probes (:func:`~lightning_act.policy.estimators.probe_sensitivities`) on the
        model, leaving no trace: the random state (dropout), the buffers (BatchNorm running
        statistics), train/eval mode and ``.grad`` are as they were.

        Args:
            loss_fn: runs the forward on a small batch (a few samples) and returns the loss.
            inputs: that batch's tensors, alive for the whole probe (not compressed).
            optimizers: the optimizers that will apply the gradients: the variance measured
                is then that of the raw gradient and of their update (Adam's per-element
                scaling included, see :func:`~lightning_act.policy.estimators.update_weights`)
                together, each relative to uniform 2 bits; without, the raw gradient's alone.

        Returns:
            Per slot, the variance it adds at each bit width.
        """
        if self.model is None:
            raise ValueError("measure_sensitivity needs the model: ActivationCapture(config, model, policy)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        weights = update_weights(optimizers, params) if optimizers else None
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
        was_training = self.model.training
        try:
            with torch.random.fork_rng(devices=devices):
                return probe_sensitivities(self, loss_fn, params, inputs=inputs, weights=weights)
        finally:
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    b.copy_(buffers[name])
            self.model.train(was_training)

    def calibrate(
        self,
        loss_fn: Callable[[], torch.Tensor],
        inputs: Any = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> dict[str, int | None]:
        """Probe (:meth:`measure_sensitivity`) and re-solve the adaptive policy's allocation.

        Example::

            capture = ActivationCapture(model=model, policy=AdaptiveBits(budget=2.0))
            capture.calibrate(lambda: criterion(model(x[:8]), y[:8]), inputs=x[:8], optimizers=[optimizer])
            with capture.capturing(inputs=x):
                loss = criterion(model(x), y)
            loss.backward()

        Returns:
            The new bits per slot (None: kept exact).
        """
        if not hasattr(self.policy, "update"):
            raise TypeError(f"calibrate needs an adaptive policy (AdaptiveBits), not {type(self.policy).__name__}")
        return self.policy.update(self.measure_sensitivity(loss_fn, inputs, optimizers), self.slots)

    def mark_external(self, obj: Any) -> None:
        """Declare tensors alive for the whole step: they are saved as they are, uncounted."""
        if isinstance(obj, torch.Tensor):
            ptr, ref = _storage_key(obj)
            self._external[ptr] = ref
        elif isinstance(obj, dict):
            for value in obj.values():
                self.mark_external(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                self.mark_external(value)
        elif hasattr(obj, "to_dict"):  # torch_geometric Data / Batch
            self.mark_external(obj.to_dict())

    # ----------------------------------------------------------------- module attribution
    def _enter_module(self, module: nn.Module) -> None:
        self._stack.append(self._names.get(module) or type(module).__name__)

    def _leave_module(self, module: nn.Module, output: Any) -> None:
        if not self._stack:
            return
        name = self._stack.pop()
        if self.estimator is not None and isinstance(output, torch.Tensor) and not self._paused:
            self.estimator.observe_output(name, output)

    # ----------------------------------------------------------------- the pack hook
    @staticmethod
    def _live(table: dict[int, StorageWeakRef], ptr: int) -> bool:
        ref = table.get(ptr)
        return ref is not None and not ref.expired()

    def _account(self, module: str, t: torch.Tensor, decision: str, stored: int) -> ModuleMemory:
        """Add one saved tensor to the report; its storage counts once however often saved."""
        report = self.report
        report.counts[decision] = report.counts.get(decision, 0) + 1
        stats = report.modules.get(module)
        if stats is None:
            stats = report.modules[module] = ModuleMemory()
        stats.tensors += 1
        ptr, ref = _storage_key(t)
        if not self._live(self._saved_storages, ptr):
            self._saved_storages[ptr] = ref
            nbytes = t.untyped_storage().nbytes()
            report.saved_bytes += nbytes
            stats.saved_bytes += nbytes
        if decision in ("kept", "exact", "statistic"):
            if self._live(self._kept_storages, ptr):
                return stats
            self._kept_storages[ptr] = ref
            stored = t.untyped_storage().nbytes()
        elif decision in ("compressed", "lossless"):
            stats.compressed += 1
        report.stored_bytes += stored
        stats.stored_bytes += stored
        return stats

    def _count_uncounted(self, decision: str) -> None:
        """Count a tensor that stays alive anyway: it is in neither byte total."""
        self.report.counts[decision] = self.report.counts.get(decision, 0) + 1

    def _next_slot(self, module: str) -> str:
        index = self._slot_counts.get(module, 0)
        self._slot_counts[module] = index + 1
        return f"{module}#{index}"

    def _pack(self, t: torch.Tensor) -> Any:
        if self._paused or torch._C._current_graph_task_id() != -1 or torch.compiler.is_compiling():
            return t.detach()  # a detached alias, never t itself: returning t can leak it
        module = self._stack[-1] if self._stack else OUTSIDE_MODULES
        floating = t.is_floating_point()
        if floating:
            param, recastable = _source_parameter(t)
            if param is not None:
                if recastable:
                    self._account(module, t, "recast", 0)
                    return _RecastWeight(param, t)
                if param.dtype == t.dtype:
                    self._count_uncounted("parameter")
                else:
                    self._account(module, t, "kept", 0)
                return t.detach()
        ptr = t.untyped_storage().data_ptr()
        if self._live(self._external, ptr):
            self._count_uncounted("external")
            return t.detach()
        call = self._tracker.current_call()
        op = None if call is None else call.name
        as_mask = floating and (op in _SIGN_ONLY_OPS or op in _DROPOUT_OPS)
        # A view that fills a run of storage is keyed by that run, so that its other views (a
        # transpose, a reshape) find its copy; any other view by its own layout. A mask serves
        # only its op: the same tensor saved by another op is stored again.
        region = _storage_region(t)
        where = region if region is not None else (t.storage_offset(), t.shape, t.stride())
        key = (ptr, where, t.dtype, t._version, as_mask)
        cached = self._dedup.get(key)
        if cached is not None and not cached.storage.expired():
            if cached.view == (t.shape, t.stride()):
                self._account(module, t, "deduplicated", 0)
                return cached.saved
            if cached.guaranteed >= self._bits_needed(t, module, call):
                self._account(module, t, "deduplicated", 0)
                return _RegionView(cached.record, t)
        # Masks and indices are stored losslessly in fewer bits; other dtypes (complex) as they are.
        lossless = self._sign_codec if as_mask else None if floating else self._lossless_codecs.get(t.dtype)
        laid_out = _Layout.dense_view(t) if floating or lossless is not None else None
        if laid_out is None or laid_out[0].numel() < max(self.config.min_numel, 1):  # empty: nothing to store
            self._account(module, t, "kept", 0)
            return t.detach()
        dense, layout = laid_out
        if lossless is None and call is not None and _is_statistic(t, call):
            self._account(module, t, "statistic", 0)
            return t.detach()
        if lossless is None:
            saved = self._store(t, dense, layout, module, call)
        else:
            if lossless is self._index_codec:
                record = lossless.pack(dense, 0, 0, value_range=saved_index_range(call))
            elif op in _DROPOUT_OPS:
                record = lossless.pack(dense, 0, 0, divisor=_dropout_keep_probability(call))
            else:
                record = lossless.pack(dense, 0, 0)
            self._account(module, t, "lossless", record.nbytes).codecs.add(record.codec)
            saved = _Compressed(record, layout)
        run_record, guaranteed = None, 0.0
        if region is not None:
            # Read in memory order, the stored dense tensor is the run itself: other views of
            # it may share it, unless they need more bits than it guarantees (attention's
            # query read through a 2-bit copy made for another op). The guarantee is the
            # floor and rule, not the policy's bits, so which saves share a copy is the same
            # under any policy and in probes. A pooled copy has lost detail other ops may
            # need: it guarantees nothing.
            run_record = saved.record if isinstance(saved, _Compressed) else _KeptRecord(dense)
            if lossless is not None:
                guaranteed = math.inf
            elif self._codec_for(module, op).unbiased:
                guaranteed = self._bits_needed(t, module, call)
        storage = StorageWeakRef(t.untyped_storage())
        self._dedup[key] = _Shared(storage, (t.shape, t.stride()), saved, run_record, guaranteed)
        return saved

    def _bits_needed(self, t: torch.Tensor, module: str, call) -> float:
        """The fewest bits a copy stored for another save may have to serve this one: the
        op's floor, or more where a rule pins this module or op to more (or to exact)."""
        needed = _min_bits(t, call)
        rule = self.policy.rules.lookup(module, None if call is None else call.name)
        if rule is not None and rule.pins_bits:
            needed = math.inf if rule.bits is None else max(needed, rule.bits)  # None: exact
        return needed

    def _codec_for(self, module: str, op: str | None):
        rule = self.policy.rules.lookup(module, op)
        codec = self._codecs[rule.codec] if rule is not None and rule.codec else self.codec
        # ReLU's backward reads its output's zeros, and the next layer's record is that same one.
        return self._codecs["quant"] if op in _ZERO_EXACT_OPS and not codec.keeps_zeros else codec

    def _store(self, t: torch.Tensor, dense: torch.Tensor, layout: _Layout, module: str, call) -> Any:
        """A floating-point tensor: its slot, then its codec and bits from the rules and policy."""
        op = None if call is None else call.name
        slot = self._next_slot(module)
        info = self.slots[slot] = SlotInfo(
            module=module,
            shape=tuple(t.shape),
            numel=dense.numel(),
            groups=-(-dense.numel() // self.config.group_size),
            element_bits=dense.element_size() * 8,
            op=op,
            min_bits=_min_bits(t, call),
        )
        if self._probe is not None:
            if not self.policy.pins_bits(info):  # a rule decides its bits: nothing to measure
                self._probe.slots.append(slot)
            self._account(module, t, "exact", 0)
            return _Compressed(_ProbeRecord(self._probe, slot, dense.detach()), layout)
        bits = self.policy.bits_for(slot, info)
        dense_bytes = dense.numel() * dense.element_size()
        if bits is None:
            memory = self._account(module, t, "exact", 0)
            memory.bits.add(None)
            self.report.slots[slot] = SlotMemory(module, tuple(t.shape), None, dense_bytes, dense_bytes, "stored", op)
            return t.detach()
        codec = self._codec_for(module, op)
        self._packs += 1
        record = codec.pack(dense, bits, splitmix64(self._seed + self._packs) >> 1)
        if isinstance(record, StoredTensor):  # a shape the codec does not compress (pool on 2-D)
            self._account(module, t, "kept", 0)
            return t.detach()
        self._stats.append(record.stats)
        if self.estimator is not None and isinstance(codec, (GroupQuantCodec, DivisionCodec)):
            self.estimator.observe_stats(slot, module, record.stats, bits, codec.group_size)
        memory = self._account(module, t, "compressed", record.nbytes)
        memory.bits.add(bits)
        memory.codecs.add(record.codec)
        self.report.slots[slot] = SlotMemory(module, tuple(t.shape), bits, dense_bytes, record.nbytes, record.codec, op)
        return _Compressed(record, layout)


class _SharedModuleHooks:
    """One pair of global module hooks, registered while any capture is open, that tells the
    capturing captures which module is running.

    Registered once, not per session: Dynamo guards a compiled module on the global hooks,
    so hooks registered anew every step would recompile it every step (and run it eagerly
    past the recompile limit). Inside a graph being compiled the hooks do nothing, so the
    graph has no trace of them and its saves belong to the compiled module as one.
    """

    capturing: list[ActivationCapture] = []
    _open = 0
    _handles: list[torch.utils.hooks.RemovableHandle] = []

    @classmethod
    def acquire(cls, capture: ActivationCapture) -> weakref.finalize:
        """Hold the hooks for ``capture``: calling the result, or collecting ``capture``, releases them."""
        if cls._open == 0:
            cls._handles = [
                nn.modules.module.register_module_forward_pre_hook(cls._enter),
                nn.modules.module.register_module_forward_hook(cls._leave, always_call=True),
            ]
        cls._open += 1
        return weakref.finalize(capture, cls._release)

    @classmethod
    def _release(cls) -> None:
        cls._open -= 1
        if cls._open == 0:
            for handle in cls._handles:
                handle.remove()
            cls._handles = []

    @classmethod
    def _enter(cls, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        for capture in cls.capturing:
            capture._enter_module(module)

    @classmethod
    def _leave(cls, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        for capture in cls.capturing:
            capture._leave_module(module, output)


class _CaptureContext:
    def __init__(self, capture: ActivationCapture, inputs: Any, seed: int | None, close: bool = False):
        self.capture = capture
        self.inputs = inputs
        self.seed = seed
        self.close = close

    def __enter__(self) -> ActivationCapture:
        self.capture.start(self.inputs, self.seed)
        return self.capture

    def __exit__(self, *exc) -> None:
        if self.close:
            self.capture.close()
        else:
            self.capture.stop()


def compress_activations(
    model: nn.Module | None = None, inputs: Any = None, config: CompressionConfig | None = None, **settings
) -> _CaptureContext:
    """Compress every activation saved by the forward run inside the ``with`` block.

    Plain PyTorch, no Lightning needed. Backward may run inside or after the block.

    Args:
        model: names modules in the report; its parameters and buffers are never compressed.
        inputs: tensors alive for the whole step (the batch), saved as they are.
        config: a :class:`CompressionConfig`; or pass its fields as keywords (``bits=2``).

    Returns:
        A context manager whose ``__enter__`` gives the :class:`ActivationCapture`; after
        the block, ``capture.report`` holds per-module and total byte figures.

    Example::

        with compress_activations(model, inputs=x, bits=2) as capture:
            loss = criterion(model(x), y)
        loss.backward()
        print(capture.report.ratio)
    """
    if config is not None and settings:
        raise ValueError(f"pass either config or keyword settings, not both (got {sorted(settings)})")
    capture = ActivationCapture(config or CompressionConfig(**settings), model)
    return _CaptureContext(capture, inputs, seed=None, close=True)
