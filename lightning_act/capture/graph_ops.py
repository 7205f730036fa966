"""The graph run-time: ``lightning_act::pack_saved`` and ``lightning_act::unpack_saved``, the ops
a compiled graph calls where it saves a tensor for backward and where backward reads it, each
told how by a *plan* (:class:`Plan`, a string baked into the graph, so a graph from torch's AOT
autograd cache runs in a new process). The common case runs in C++ (:class:`NativeSaves`). Pack
rounds with fresh noise every call and counts what it stored in the session's report; unpack
returns the sizes the graph recorded, and the strides :func:`unpacked_stride` says (inductor
asserts them)."""

from __future__ import annotations

import ast
import base64
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_act import ops
from lightning_act.backward_reads import (
    PointwiseDerivative,
)
from lightning_act.capture.active import Capture, capturing_now, splitmix64
from lightning_act.capture.decide import Form
from lightning_act.capture.group_order import candidate_axes
from lightning_act.capture.report import Outcome, ReportDelta, SlotMemory
from lightning_act.codecs.derivative import DerivativeSubstitute
from lightning_act.codecs.exact import IndexCodec, IndexTensor, MaskCodec, MaskTensor, index_layout
from lightning_act.codecs.quant import GroupQuantCodec, QuantizedTensor
from lightning_act.codecs.substitutes import ThresholdCells
from lightning_act.policy import SlotInfo

__all__ = ["COMPILED_REGION", "NativeSaves", "PackedSave", "Plan", "SeedStream", "encode_plan", "parse_plan"]

#: Module name of the saves of a compiled module's own forward (outside its modules) where
#: the graph may serve several modules of one class.
COMPILED_REGION = "(compiled)"


class Plan(NamedTuple):
    """How one saved node of a compiled graph is stored (baked into the graph as a string)."""

    #: QUANTIZE (of its :attr:`derivative` where it has one), MASK, INDEX, CELLS, COPY or KEEP
    #: (packed into nothing: it carries :attr:`kept` into the report for a graph that packs
    #: no other save).
    form: Form
    bits: int
    group_size: int
    module: str
    slot: str
    op: str | None
    min_bits: int
    #: ``(module, bytes, outcome, slot)`` of the graph's saves kept as they are, counted when
    #: this plan's tensor is packed (the graph's first packed save carries them). ``slot``:
    #: ``(name, shape, op)`` of a slot the policy or a rule keeps exact; None for any other.
    kept: tuple[tuple[str, int, str, tuple | None], ...] = ()
    #: :attr:`PointwiseDerivative.source`, what rebuilds it in any process.
    derivative: tuple[str, str] | None = None
    #: QUANTIZE: the key under which the capture surveys and chooses the axis its groups run
    #: along (:mod:`~lightning_act.capture.group_order`), at run time; a third part records
    #: the matrices it was read as. None: memory order. The key includes the shape: graphs split
    #: at graph breaks name modules by frame, so two layers' saves can share a slot's name.
    survey: str | None = None
    #: INDEX: ``(low, high)`` bounding an integer save's values (:func:`index_bound`).
    index_range: tuple[int, int] | None = None
    #: QUANTIZE: the axis its groups run along, decided with the plan (``Decision.group_axis``:
    #: a BatchNorm input's batch axis), not surveyed; a third part records the matrices.
    group_axis: int | None = None
    #: CELLS: the constants backward compares the tensor with (:class:`ThresholdCells`).
    cells: tuple[float, ...] | None = None
    #: QUANTIZE with ``axis`` 0 (:attr:`Decision.channels_last`): packed as its memory order
    #: viewed as a matrix of a channel's values by the channels.
    channels_last: bool = False

    @property
    def along_axis(self) -> bool:
        """Whether its groups may run along an axis other than the last (three parts)."""
        return self.survey is not None or self.group_axis is not None

    def substitute(self) -> DerivativeSubstitute | None:
        derivative = None if self.derivative is None else PointwiseDerivative.from_source(*self.derivative)
        return None if derivative is None else DerivativeSubstitute.of(derivative)


#: Prefix of a plan written in base64 (see :func:`encode_plan`).
_BASE64 = "b64:"


@functools.cache
def parse_plan(plan: str) -> Plan:
    if plan.startswith(_BASE64):
        plan = base64.b64decode(plan[len(_BASE64) :]).decode()
    form, *rest = ast.literal_eval(plan)
    return Plan(Form(form), *rest)


class PackedSave(NamedTuple):
    """What one packed save adds to the report: the same at every call of a plan for one size,
    so worked out once per process."""

    plan: Plan
    #: One call: the packed tensor and the kept saves its plan carries (:attr:`Plan.kept`).
    delta: ReportDelta
    #: One call that kept its tensor (the batch) alive instead: the kept saves, and the tensor.
    kept_alive: ReportDelta
    #: For a quantized save (None for a mask or indices): its slot for the policy.
    slot_info: SlotInfo | None

    @classmethod
    def of(cls, plan: str, t: torch.Tensor, parts: list[torch.Tensor]) -> PackedSave:
        key = (plan, t.numel())
        save = _PACKED_SAVES.get(key)
        if save is None:
            if len(_PACKED_SAVES) >= _PACKED_SAVES_KEPT:  # new sizes at every step: dynamic shapes
                _PACKED_SAVES.clear()
            save = _PACKED_SAVES[key] = cls._work_out(parse_plan(plan), t, parts)
        return save

    @classmethod
    def _work_out(cls, plan: Plan, t: torch.Tensor, parts: list[torch.Tensor]) -> PackedSave:
        kept_alive = cls._carried(plan)
        kept_alive.counts[Outcome.EXTERNAL.value] = 1
        delta = cls._carried(plan)
        if plan.form is Form.KEEP:
            return cls(plan, delta, kept_alive, None)
        saved = t.numel() * t.element_size()
        stored = sum(p.untyped_storage().nbytes() for p in parts)
        if plan.form in _LOSSLESS_FORMS:
            delta.note(plan.module, Outcome.LOSSLESS, plan.op, saved, stored).codecs.add(plan.form.value)
            return cls(plan, delta, kept_alive, None)
        if plan.form is Form.COPY:
            delta.note(plan.module, Outcome.EXACT, plan.op, saved, stored).bits.add(None)
            delta.slots[plan.slot] = SlotMemory(plan.module, tuple(t.shape), None, saved, stored, "stored", plan.op)
            return cls(plan, delta, kept_alive, None)
        memory = delta.note(plan.module, Outcome.COMPRESSED, plan.op, saved, stored)
        memory.codecs.add("quant")
        memory.compressed += 1
        memory.bits.add(plan.bits)
        shape = tuple(t.shape)
        delta.slots[plan.slot] = SlotMemory(plan.module, shape, plan.bits, saved, stored, "quant", plan.op)
        info = SlotInfo(plan.module, shape, t.numel(), parts[1].shape[0], t.element_size() * 8, plan.op, plan.min_bits)
        return cls(plan, delta, kept_alive, info)

    @staticmethod
    def _carried(plan: Plan) -> ReportDelta:
        """The graph's saves kept as they are that ``plan`` carries into the report."""
        delta = ReportDelta()
        for module, nbytes, outcome, slot in plan.kept:
            memory = delta.note(module, Outcome(outcome), None if slot is None else slot[2], nbytes, nbytes)
            if slot is not None:
                name, shape, op = slot
                memory.bits.add(None)
                delta.slots[name] = SlotMemory(module, shape, None, nbytes, nbytes, "stored", op)
        return delta


_PACKED_SAVES: dict[tuple[str, int], PackedSave] = {}
_PACKED_SAVES_KEPT = 1 << 14
#: The forms the C++ side packs alone, which it knows by their names (a derivative packs as a
#: quantized save and is decoded by a decoder of its own, registered with the derivative's inverse).
_NATIVE_FORMS = frozenset({Form.QUANTIZE, Form.MASK, Form.INDEX, Form.COPY})
#: Forms stored exactly.
_LOSSLESS_FORMS = frozenset({Form.MASK, Form.INDEX, Form.CELLS})
#: Sets of packed saves whose sum is kept (a few per graph: the steps' drains repeat).
_DELTAS_KEPT = 256

_GRAPH_STREAM = 0x6A09E667F3BCC909  # any constant that differs from the eager stream's


class SeedStream:
    """The rounding seeds of compiled graphs: a counter mixed with the session's seed, so each
    call packs with fresh noise without a seed baked into the graph or a draw from torch's
    generator (which would shift the user's random stream). Once :class:`NativeSaves` is loaded
    the counter lives in C++."""

    base = 0
    count = 0

    @classmethod
    def restart(cls, seed: int) -> None:
        # A stream of its own: the eager path's seeds would correlate a graph's rounding noise
        # with the same step's eager saves (a bias where backward multiplies the two).
        cls.base, cls.count = splitmix64(seed ^ _GRAPH_STREAM), 0
        if NativeSaves.loaded():
            torch.ops.lightning_act.graph_native_seeds.default(_signed64(cls.base), 0)

    @classmethod
    def next(cls) -> int:
        if NativeSaves.loaded():
            return torch.ops.lightning_act.graph_native_next_seed()
        cls.count += 1
        return splitmix64(cls.base + cls.count) >> 1


def _signed64(value: int) -> int:
    """A 64-bit unsigned value as the int64 an op argument holds (the same bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# --------------------------------------------------------------------------- the graph ops
def _memory_order(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of these sizes and strides fills one run of memory with no gap or overlap
    (any permutation of dense): then it is stored in memory order and comes back as a view."""
    expected = 1
    for length, step in sorted(((s, t) for s, t in zip(size, stride) if s != 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= length
    return True


# Asked at every unpack, with the sizes the graph recorded (plain ints when it runs).
_memory_order_of = functools.lru_cache(maxsize=4096)(_memory_order)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in the order :func:`_restore` puts them back in."""
    if x.is_contiguous():  # the common case, without the general check's Python
        return x.view(-1)
    if _memory_order(x.shape, x.stride()):
        return x.as_strided((x.numel(),), (1,))
    return x.contiguous().view(-1)


def unpacked_stride(size: Sequence[int], stride: Sequence[int]) -> Sequence[int]:
    """The strides unpack gives a save of these sizes and strides: its own, unless they leave
    gaps (a part of a larger tensor, as ``split`` hands out), whose span unpack would allocate
    whole; then row-major, which backward's ops take as they take any layout."""
    return stride if _memory_order(size, stride) else torch._prims_common.make_contiguous_strides_for(size)


def _restore(flat: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """The saved tensor from its values in memory order, with :func:`unpacked_stride`."""
    if _memory_order_of(tuple(size), tuple(stride)):
        return flat.as_strided(size, stride)
    return flat.view(size)


def _as_saved(kept: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """An input kept alive instead of packed, as the saved tensor (a plan may pack a view of it)
    with :func:`unpacked_stride`."""
    view = kept if list(kept.shape) == list(size) else kept.as_strided(size, stride, kept.storage_offset())
    return view if _memory_order_of(tuple(view.shape), tuple(view.stride())) else view.contiguous()


# A tensor's cells, by the constants and dtype of its plan (checked once per process).
_cells_of = functools.lru_cache(maxsize=None)(ThresholdCells.of)

_quantizer = functools.cache(GroupQuantCodec)


def _encode(x: torch.Tensor, plan: Plan, seed: int, axis: int | None = None) -> list[torch.Tensor]:
    if x.requires_grad:  # called eagerly (a compiled graph's tensors need no grad)
        x = x.detach()
    if plan.form is Form.MASK:
        return [MaskCodec().pack(_flat(x), 0, 0).packed]
    if plan.form is Form.KEEP:
        return [x.new_empty(0)]
    if plan.form is Form.COPY:
        flat = _flat(x)
        return [flat.clone() if x.is_contiguous() or _memory_order(x.shape, x.stride()) else flat]
    if plan.form is Form.INDEX:
        return [IndexCodec().pack(_flat(x), 0, 0, value_range=plan.index_range).codes]
    if plan.form is Form.CELLS:
        cells = _cells_of(plan.cells, x.dtype)
        return [IndexCodec().pack(cells.cell(_flat(x)), 0, 0, value_range=(0, cells.count - 1)).codes]
    codec = _quantizer(plan.group_size)
    if not plan.along_axis:
        record = codec.pack(_flat(x), plan.bits, seed)
        return [record.codes, record.stats]
    # Groups along ``axis`` (x is contiguous), or in memory order where it is the last. The
    # matrices' shape goes with the codes on the host, so unpack reads it without a device sync.
    along = axis if axis is not None and axis < x.dim() - 1 else None
    record = codec.pack(x if along is not None else x.view(-1), plan.bits, seed, along)
    return [record.codes, record.stats, torch.tensor(record.matrix)]


# The graph ops, registered as plain dispatcher kernels (``torch.library.custom_op``'s Python
# autograd layer is costly per call). Pack is tagged seeded (never reordered, merged or
# recomputed) and CUDA-graph unsafe: a replayed graph would not run its Python, so it would
# repeat its seed (the same noise every step, a bias) and skip the report; under
# ``mode="reduce-overhead"`` inductor keeps it out of its CUDA graphs. Their kernels turn torch
# functions off: the op tracker, a torch function mode, stays on the stack in compiled graphs.
_LIBRARY = torch.library.Library("lightning_act", "FRAGMENT")
_LIBRARY.define(
    "pack_saved(Tensor input, str plan) -> Tensor[]",
    tags=(torch.Tag.nondeterministic_seeded, torch.Tag.cudagraph_unsafe),
)
_LIBRARY.define("unpack_saved(Tensor[] parts, SymInt[] size, SymInt[] stride, ScalarType dtype, str plan) -> Tensor")
# The same kernels, which the C++ side (csrc/graph_saves.cpp) calls for cases it leaves to Python.
_LIBRARY.define("pack_saved_python(Tensor input, str plan) -> Tensor[]")
_LIBRARY.define(
    "unpack_saved_python(Tensor[] parts, SymInt[] size, SymInt[] stride, ScalarType dtype, str plan) -> Tensor"
)
# No autograd: graphs call them with tensors that need no gradient, and torch's fallback for
# ops without an autograd kernel checks every input and output for that at each call.
for _op in ("pack_saved", "unpack_saved", "pack_saved_python", "unpack_saved_python"):
    _LIBRARY.impl(_op, torch.library.fallthrough_kernel, "Autograd")


# Unwritten parts standing for a graph input the step keeps alive anyway (its batch), mapped to
# that input for unpack (an entry lives as long as its parts).
_KEPT_INPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@torch.library.impl(_LIBRARY, "pack_saved", "CompositeExplicitAutograd")
@torch.library.impl(_LIBRARY, "pack_saved_python", "CompositeExplicitAutograd")
def _pack_saved(input: torch.Tensor, plan: str) -> list[torch.Tensor]:
    """Store a tensor a compiled forward saves, as ``plan`` says; fresh noise each call.

    A graph input the session knows stays alive for the whole step (the batch, which a plan
    cannot tell from an activation an earlier graph passed on) is not stored: its parts are
    left unwritten and unpack hands the input back, as eager saves the batch as it is."""
    with torch._C.DisableTorchFunction():
        parsed = parse_plan(plan)
        ops.ensure_kernels(input.device)
        capture = capturing_now()
        if capture is not None and parsed.form not in (Form.KEEP, Form.COPY) and capture.keeps_alive(input):
            parts = [
                torch.empty_like(p, device=input.device) if p.is_meta else p
                for p in _encode(input.detach().to("meta"), parsed, 0)
            ]
            _KEPT_INPUTS[parts[0]] = input.detach()
            NativeSaves.kept(parts[0], input.detach())
            capture.account_compiled(plan, input, parts, kept_alive=True)
            NativeSaves.learn(plan, input, parts, capture, kept_alive=True)
            return parts
        # The plan's group axis, or a surveyed slot's (None, memory order, while surveyed).
        axis = parsed.group_axis
        if parsed.survey is not None and capture is not None:
            axis = capture.group_orders.order(parsed.survey, input, parsed.bits)
        parts = _encode(input, parsed, SeedStream.next(), axis)
        if capture is not None:
            capture.account_compiled(plan, input, parts)
            NativeSaves.learn(plan, input, parts, capture)
        return parts


@torch.library.register_fake("lightning_act::pack_saved", lib=_LIBRARY)
def _pack_saved_fake(input: torch.Tensor, plan: str) -> list[torch.Tensor]:
    return _encode(input, parse_plan(plan), 0)


def _decode(
    parts: list[torch.Tensor], size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, plan: Plan
) -> torch.Tensor:
    numel = math.prod(size)
    if plan.form is Form.COPY:
        flat = parts[0]
    elif plan.form is Form.MASK:
        flat = MaskTensor(parts[0], torch.Size([numel])).unpack()
    elif plan.form is Form.INDEX:
        width, offset = index_layout(*plan.index_range, dtype)
        flat = IndexTensor(parts[0], offset, width, torch.Size([numel]), dtype).unpack()
    elif plan.form is Form.CELLS:
        cells = _cells_of(plan.cells, dtype)
        width, offset = index_layout(0, cells.count - 1, torch.uint8)
        flat = cells.unpack(IndexTensor(parts[0], offset, width, torch.Size([numel]), torch.uint8))
    elif plan.derivative is not None:
        flat = plan.substitute().restore_quantized(parts[0], parts[1], plan.bits, plan.group_size, numel, dtype)
    else:
        matrix = tuple(parts[2].tolist()) if plan.along_axis else (0, 0)
        flat = QuantizedTensor(parts[0], parts[1], plan.bits, plan.group_size, torch.Size([numel]), dtype, matrix)
        flat = flat.unpack()
    return _restore(flat, size, stride)


@torch.library.impl(_LIBRARY, "unpack_saved", "CompositeExplicitAutograd")
@torch.library.impl(_LIBRARY, "unpack_saved_python", "CompositeExplicitAutograd")
def _unpack_saved(
    parts: list[torch.Tensor], size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, plan: str
) -> torch.Tensor:
    """The tensor :func:`_pack_saved` stored, with its sizes and :func:`unpacked_stride`."""
    with torch._C.DisableTorchFunction():
        kept = _KEPT_INPUTS.get(parts[0]) if _KEPT_INPUTS else None  # no weak reference made per unpack
        if kept is not None:
            return _as_saved(kept, size, stride)
        ops.ensure_kernels(parts[0].device)
        return _decode(parts, size, stride, dtype, parse_plan(plan))


@torch.library.register_fake("lightning_act::unpack_saved", lib=_LIBRARY)
def _unpack_saved_fake(parts, size, stride, dtype, plan) -> torch.Tensor:
    return torch.empty_strided(size, unpacked_stride(size, stride), dtype=dtype, device=parts[0].device)


class NativeSaves:
    """The C++ side of the graph ops (``csrc/graph_saves.cpp``, built with the CPU kernels): it
    packs and unpacks the saves whose plan Python handled once, with no Python per tensor, and
    counts them for the report.

    Python hands it each plan it may pack and decode alone, the capture capturing now (its
    kept-alive storages, its group axes' token), the seed stream and the unwritten parts of
    inputs kept alive. At every change of the capture capturing now (start, stop, pause,
    resume) its counts go to the report of the capture they were made for (:meth:`_delta`).
    Without the CPU kernels Python serves every call: the same bits, slower.
    """

    #: Off: Python serves every call (to compare the two, and while diagnosing).
    enabled = True
    _loaded = False
    #: The capture the C++ side counts for now.
    owner: Capture | None = None
    #: By packer id: what one call of that plan at that size adds to the report.
    _entries: list[PackedSave] = []
    _learned: dict[tuple[str, int, int, bool], int] = {}
    #: By the counts of a drain: what they add to the report.
    _deltas: dict[tuple[int, ...], ReportDelta] = {}
    _decoders: set[str] = set()

    @classmethod
    def loaded(cls) -> bool:
        """Whether the C++ side is registered; hands it the seed stream the moment it is."""
        if not cls._loaded and ops.loaded_kernels()["cpu"] and hasattr(torch.ops.lightning_act, "graph_native_seeds"):
            cls._loaded = True
            torch.ops.lightning_act.graph_native_seeds(_signed64(SeedStream.base), SeedStream.count)
        return cls._loaded

    @classmethod
    def follow(cls, capture: Capture | None) -> None:
        """Count for ``capture`` (the one capturing now, None when none is) from now on."""
        if not cls.loaded():
            return
        native = torch.ops.lightning_act
        if cls.owner is not None:
            counts, kept_counts, stats, stat_ids = native.graph_native_drain.default(cls.owner.estimator is not None)
            if counts or kept_counts:
                cls.owner.account_packed(
                    cls._delta(counts, kept_counts), stats, [cls._entries[packer] for packer in stat_ids]
                )
        cls.owner = capture if cls.enabled else None
        if cls.owner is None:
            native.graph_native_session.default(False, 0, [])
        else:
            native.graph_native_session.default(True, capture.group_orders.token, capture.external_storages())

    @classmethod
    def _delta(cls, counts: list[int], kept_counts: list[int]) -> ReportDelta:
        """What a drain's counts (flattened (packer id, calls) pairs: saves packed, inputs handed
        back unwritten) add to the report, summed once per set (graphs repeat every step)."""
        key = (tuple(counts), tuple(kept_counts))
        delta = cls._deltas.get(key)
        if delta is None:
            if len(cls._deltas) >= _DELTAS_KEPT:
                cls._deltas.clear()
            delta = cls._deltas[key] = ReportDelta()
            for packer, count in zip(counts[::2], counts[1::2]):
                delta.add(cls._entries[packer].delta, count)
            for packer, count in zip(kept_counts[::2], kept_counts[1::2]):
                delta.add(cls._entries[packer].kept_alive, count)
        return delta

    @classmethod
    def external(cls, capture: Capture, storage: int) -> None:
        if cls.owner is capture:
            torch.ops.lightning_act.graph_native_external(storage)

    @classmethod
    def kept(cls, part: torch.Tensor, input: torch.Tensor) -> None:
        """``part`` stands for ``input`` (kept alive anyway): unpack hands ``input`` back."""
        if cls.loaded():
            torch.ops.lightning_act.graph_native_kept(part, input)

    @classmethod
    def learn(
        cls, plan: str, t: torch.Tensor, parts: list[torch.Tensor], capture: Capture, kept_alive: bool = False
    ) -> None:
        """After Python packed ``t`` by ``plan`` (or handed it back, ``kept_alive``): register
        what the C++ side can do alone from now on."""
        parsed = parse_plan(plan)
        if cls.owner is not capture or parsed.form not in _NATIVE_FORMS:
            return
        form, bits, offset = parsed.form.value, parsed.bits, 0
        if parsed.form is Form.INDEX:
            bits, offset = index_layout(*parsed.index_range, t.dtype)
        if plan not in cls._decoders:
            cls._decoders.add(plan)
            if parsed.derivative is not None:
                inverse = parsed.substitute().inverse_grid(t.device)
                codes, width = ops.every_code(bits, t.device)
                torch.ops.lightning_act.graph_native_derivative_decoder(
                    plan,
                    bits,
                    parsed.group_size,
                    codes,
                    width,
                    inverse.low,
                    inverse.step,
                    inverse.starts,
                    inverse.slopes,
                )
            else:
                torch.ops.lightning_act.graph_native_decoder(
                    plan, form, bits, parsed.group_size, parsed.along_axis, offset
                )
        axis, kept_only = parsed.group_axis, False
        if parsed.survey is not None:
            orders = capture.group_orders
            if parsed.survey in orders.axis:
                axis = orders.axis[parsed.survey]
            elif candidate_axes(t, parsed.group_size):
                if not kept_alive:
                    return  # its survey runs: decided when the session stops
                kept_only = True  # its survey never ran (an input kept alive needs no axis)
        token = capture.group_orders.token
        key = (plan, t.numel(), token, kept_only)
        if key in cls._learned:
            return
        if len(cls._entries) >= _PACKED_SAVES_KEPT:  # new sizes at every step: dynamic shapes
            cls.follow(cls.owner)  # what was counted under the old ids first
            torch.ops.lightning_act.graph_native_forget_packers()
            cls._entries, cls._learned, cls._deltas = [], {}, {}
        cls._learned[key] = packer = len(cls._entries)
        cls._entries.append(PackedSave.of(plan, t, parts))
        torch.ops.lightning_act.graph_native_packer(
            plan,
            packer,
            kept_only,
            form,
            bits,
            parsed.group_size,
            -1 if axis is None else axis,
            parsed.along_axis,
            t.numel(),
            token,
            offset,
        )


def encode_plan(plan: Plan | None) -> str | None:
    """The plan as the string the graph carries: its tuple's ``repr``, or that in base64 where it
    holds a backslash, a double quote or non-ASCII text (inductor's C++ wrapper writes it into
    its source unescaped), as a derivative's source always does."""
    if plan is None:
        return None
    text = repr((plan.form.value, *plan[1:]))
    if "\\" in text or '"' in text or not text.isascii():
        return _BASE64 + base64.b64encode(text.encode()).decode()
    return text
