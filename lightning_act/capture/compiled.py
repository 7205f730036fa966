"""Compression inside ``torch.compile`` graphs.

A compiled region saves for backward what the compiler's partitioner chose (often other
tensors than eager autograd saves: a pre-activation from which backward recomputes the
activation), from one fused function. Torch inlines saved-tensor hooks given as
``fx.GraphModule`` s into the compiled graphs (AOTAutograd, so under every backend built on
it: ``inductor``, ``aot_eager``): the pack hook is traced once per saved tensor at the end of
the compiled forward, the unpack hook at the start of the compiled backward. While they are
traced, torch tells them which forward node they pack and hands them the backward graph.

:class:`GraphHooks` is such a pair, one per capture, made once (Dynamo guards a compiled
graph on the identity of the hooks, so a new pair recompiles; the capture makes one when its
policy changes). Per saved node, at compile time:

* how the backward reads it comes from :func:`~lightning_act.backward_reads.graph_reads`,
  the same analysis the eager path runs on each call's backward, and what that allows from
  :func:`~lightning_act.capture.decide.decide_saved_node`; the bits from the capture's
  policy and rules, by the module in the node's ``nn_module_stack``;
* the decision becomes a *plan*, a string constant baked into the graph, which the two ops
  below parse (once per process and plan). A plan, not a table index, so a graph loaded
  from torch's AOT autograd cache in a new process still runs.

At run time no hook runs: ``lightning_act::pack_saved`` and ``lightning_act::unpack_saved``
are graph ops, whose common case runs in C++ (:class:`NativeSaves`). Pack quantizes with a fresh seed every call, from the library's own stream
(never torch's generator), and counts what it stored in the capturing session's report;
unpack returns a tensor with exactly the sizes and strides the graph recorded (inductor
asserts them). Boolean masks are packed 8 to a byte. A tensor kept exact is handed back to
the graph as it is.

Outside a compiled region (a model not compiled, a graph break) the same hooks are called
eagerly with no graph: they hand the tensor to the capture's eager path.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import functools
import math
import operator
import re
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.fx as fx
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._dynamo.eval_frame import skip_code
from torch.utils.weak import WeakIdKeyDictionary

from lightning_act import ops
from lightning_act.backward_reads import (
    STATISTIC_RATIO,
    PointwiseDerivative,
    Read,
    Use,
    graph_reads,
    in_fresh_thread,
    is_tangent,
    size_hint,
)
from lightning_act.capture.active import capturing_now, splitmix64
from lightning_act.capture.decide import SOFTMAX_OPS, Decision, Kind, ThresholdCells, decide_saved_node
from lightning_act.capture.group_order import candidate_axes
from lightning_act.capture.records import unpack as unpack_eager
from lightning_act.capture.report import Outcome, ReportDelta, SlotMemory
from lightning_act.codecs.exact import INDEX_DTYPES, IndexCodec, IndexTensor, index_layout
from lightning_act.ops.layout import pack_bit_fields, unpack_bit_fields
from lightning_act.policy import SlotInfo

if TYPE_CHECKING:
    from lightning_act.capture.engine import ActivationCapture

__all__ = ["COMPILED_REGION", "CheaperSaves", "GraphHooks", "GraphPlan", "NativeSaves", "PackedSave", "SeedStream"]

#: Module name of the saves of a compiled module's own forward (outside its modules) where
#: the graph may serve several modules of one class.
COMPILED_REGION = "(compiled)"

_EAGER, _KEPT, _PACKED = "eager", "kept", "packed"


class Plan(NamedTuple):
    """How one saved node of a compiled graph is stored (baked into the graph as a string)."""

    # "quant", "derivative" (a pointwise op's input: the graph packs its derivative), "mask",
    # "index" (integers in fewer bits, exact), "cells" (the cells between constants, exact),
    # "copy" (kept exact as a copy of its own values: a view of part of a larger storage,
    # which kept as it is would hold all of that storage) or "kept" (kept as it is, packed
    # into nothing: it carries :attr:`kept` into the report for a graph that packs no other
    # save)
    form: str
    bits: int
    group_size: int
    module: str
    slot: str
    op: str | None
    min_bits: int
    #: ``(module, bytes, outcome, slot)`` of the graph's saves kept as they are: counted in
    #: the report when this plan's tensor is packed (the graph's first packed save carries
    #: them). ``slot``: ``(name, shape, op)`` of a slot the policy or a rule keeps exact,
    #: listed among the report's slots as eager lists it; None for any other.
    kept: tuple[tuple[str, int, str, tuple | None], ...] = ()
    #: "derivative": :attr:`PointwiseDerivative.source`, what rebuilds it in any process.
    derivative: tuple[str, str] | None = None
    #: "quant": the key under which the capture surveys and chooses the axis its groups run
    #: along (:mod:`~lightning_act.capture.group_order`), at run time; a third part records
    #: the matrices it was read as. None: memory order. The key is the slot and the shape:
    #: graphs split by graph breaks name modules from the frame they compiled, so two
    #: layers' saves can share a slot's name, and one's choice must not serve the other.
    survey: str | None = None
    #: "index": ``(low, high)`` bounding an integer save's values (:func:`index_bound`).
    index_range: tuple[int, int] | None = None
    #: "quant": the axis its groups run along, decided with the plan (``Decision.group_axis``:
    #: a BatchNorm input's batch axis), not surveyed; a third part records the matrices.
    axis: int | None = None
    #: "cells": the constants backward compares the tensor with (:class:`ThresholdCells`).
    cells: tuple[float, ...] | None = None
    #: "quant" with ``axis`` 0 (:attr:`Decision.channels_last`): packed as its memory order
    #: viewed as a matrix of a channel's values by the channels.
    channels_last: bool = False

    @property
    def along_axis(self) -> bool:
        """Whether its groups may run along an axis other than the last (three parts)."""
        return self.survey is not None or self.axis is not None

    def substitute(self) -> PointwiseDerivative | None:
        return None if self.derivative is None else PointwiseDerivative.from_source(*self.derivative)


#: Prefix of a plan written in base64 (see :func:`_encode_plan`).
_BASE64 = "b64:"


@functools.cache
def _parse(plan: str) -> Plan:
    if plan.startswith(_BASE64):
        plan = base64.b64decode(plan[len(_BASE64) :]).decode()
    return Plan(*ast.literal_eval(plan))


class PackedSave(NamedTuple):
    """What one packed save adds to the report: the same at every call of a plan for one
    size, so worked out once per process (it runs for every packed tensor of every step)."""

    plan: Plan
    #: One call: the packed tensor and the kept saves its plan carries (:attr:`Plan.kept`).
    delta: ReportDelta
    #: One call that kept its tensor as it is instead (the batch): the kept saves, and the
    #: tensor counted as alive anyway.
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
            save = _PACKED_SAVES[key] = cls._work_out(_parse(plan), t, parts)
        return save

    @classmethod
    def _work_out(cls, plan: Plan, t: torch.Tensor, parts: list[torch.Tensor]) -> PackedSave:
        kept_alive = cls._carried(plan)
        kept_alive.counts[Outcome.EXTERNAL.value] = 1
        delta = cls._carried(plan)
        if plan.form == "kept":
            return cls(plan, delta, kept_alive, None)
        saved = t.numel() * t.element_size()
        stored = sum(p.untyped_storage().nbytes() for p in parts)
        if plan.form in _LOSSLESS_FORMS:
            delta.note(plan.module, Outcome.LOSSLESS, plan.op, saved, stored).codecs.add(plan.form)
            return cls(plan, delta, kept_alive, None)
        if plan.form == "copy":
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
#: The C++ side's code of each plan form it packs (a derivative save packs as a quantized
#: one and is decoded by a decoder of its own, registered with the derivative's inverse).
_NATIVE_FORMS = {"quant": 0, "derivative": 0, "mask": 1, "index": 2, "copy": 4}
#: Forms stored exactly (the cells between constants are served by Python alone).
_LOSSLESS_FORMS = frozenset({"mask", "index", "cells"})
#: Sets of packed saves whose sum is kept (a few per graph: the steps' drains repeat).
_DELTAS_KEPT = 256

_GRAPH_STREAM = 0x6A09E667F3BCC909  # any constant that differs from the eager stream's


class SeedStream:
    """The rounding seeds of compiled graphs: a counter mixed with the session's seed, so
    each call packs with fresh noise without a seed baked into the graph or a draw from
    torch's generator (which would shift the user's random stream). Once the graph ops' C++
    side is loaded (:class:`NativeSaves`), the counter lives there: it packs without Python."""

    base = 0
    count = 0

    @classmethod
    def restart(cls, seed: int) -> None:
        # A stream of its own: the eager path's seeds are the session seed plus a count, and
        # the same seeds here would round a graph's saves with the noise of the eager saves
        # of the same step (correlated errors, a bias where backward multiplies the two).
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
    """Whether a tensor of these sizes and strides fills one run of memory with no gap and
    no overlap (contiguous, channels-last, any permutation of dense): then its memory is
    stored in order and the tensor comes back as a strided view of what is decoded."""
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


def _restore(flat: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    if _memory_order_of(tuple(size), tuple(stride)):
        return flat.as_strided(size, stride)
    return torch.empty_strided(size, stride, dtype=flat.dtype, device=flat.device).copy_(flat.view(size))


def _as_saved(kept: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """An input kept alive instead of packed, with the sizes and strides of the tensor saved:
    a plan may pack a view of it (a channels-last tensor's memory order as a matrix)."""
    if list(kept.shape) == list(size):
        return kept
    return kept.as_strided(size, stride, kept.storage_offset())


# A tensor's cells, by the constants and dtype of its plan (checked once per process).
_cells_of = functools.lru_cache(maxsize=None)(ThresholdCells.of)

# The library's kernels, resolved once (they run for every packed tensor of every step).
_QUANTIZE_PACK = torch.ops.lightning_act.quantize_pack.default
_UNPACK_DEQUANTIZE = torch.ops.lightning_act.unpack_dequantize.default


def _encode(x: torch.Tensor, plan: Plan, seed: int, axis: int | None = None) -> list[torch.Tensor]:
    if x.requires_grad:  # called eagerly (a compiled graph's tensors need no grad)
        x = x.detach()
    if plan.form == "mask":
        return [pack_bit_fields(_flat(x).view(torch.uint8), 1, planar=True)]
    if plan.form == "kept":
        return [x.new_empty(0)]
    if plan.form == "copy":
        flat = _flat(x)
        return [flat.clone() if x.is_contiguous() or _memory_order(x.shape, x.stride()) else flat]
    if plan.form == "index":
        return [IndexCodec().pack(_flat(x), 0, 0, value_range=plan.index_range).codes]
    if plan.form == "cells":
        cells = _cells_of(plan.cells, x.dtype)
        return [IndexCodec().pack(cells.cell(_flat(x)), 0, 0, value_range=(0, cells.count - 1)).codes]
    if not plan.along_axis:
        return list(_QUANTIZE_PACK(_flat(x), plan.bits, plan.group_size, seed))
    # Groups along ``axis``: read as matrices of its size by the product of the later sizes,
    # column by column (x is contiguous: the plan says so). The matrices' shape goes with
    # the codes, on the host, where unpack reads it without waiting for the device.
    rows = columns = 0
    source = x.view(-1)
    if axis is not None and axis < x.dim() - 1:
        rows, columns = x.shape[axis], x.shape[axis + 1 :].numel()
        source = x.view(-1, rows, columns)
    codes, stats = _QUANTIZE_PACK(source, plan.bits, plan.group_size, seed, rows > 0)
    return [codes, stats, torch.tensor([rows, columns])]


# The graph ops, registered as plain dispatcher kernels (not ``torch.library.custom_op``,
# whose Python autograd layer doubled their cost per call). Pack is tagged as seeded (never
# reordered, merged or recomputed) and as unsafe in a CUDA graph: a replayed graph would
# not run its Python, so it would repeat its seed (the same rounding noise every step, a
# bias) and skip the report. Under ``mode="reduce-overhead"`` inductor keeps it out of its
# CUDA graphs (it partitions the graph around it, or runs the graph without them). Their
# kernels turn torch functions off: the capture's op tracker, a torch function mode, stays on
# the stack while a compiled graph runs, and would see each of their tensor calls (a few us
# each, for nothing: what they do is decided).
_LIBRARY = torch.library.Library("lightning_act", "FRAGMENT")
_LIBRARY.define(
    "pack_saved(Tensor input, str plan) -> Tensor[]",
    tags=(torch.Tag.nondeterministic_seeded, torch.Tag.cudagraph_unsafe),
)
_LIBRARY.define("unpack_saved(Tensor[] parts, SymInt[] size, SymInt[] stride, ScalarType dtype, str plan) -> Tensor")
# The same kernels under names of their own: the C++ side (csrc/graph_saves.cpp) serves the
# two ops above on CPU and CUDA and calls these for every case it leaves to Python.
_LIBRARY.define("pack_saved_python(Tensor input, str plan) -> Tensor[]")
_LIBRARY.define(
    "unpack_saved_python(Tensor[] parts, SymInt[] size, SymInt[] stride, ScalarType dtype, str plan) -> Tensor"
)
# No autograd: a graph calls them with tensors that need no gradient, and torch's fallback for
# ops without an autograd kernel, which checks every input and output for that, took about
# 1.5 us of each call.
for _op in ("pack_saved", "unpack_saved", "pack_saved_python", "unpack_saved_python"):
    _LIBRARY.impl(_op, torch.library.fallthrough_kernel, "Autograd")


# The parts of a graph input the step keeps alive anyway (its batch), each mapped to that
# input: unwritten, they only carry it to unpack (an entry lives as long as its parts).
_KEPT_INPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@torch.library.impl(_LIBRARY, "pack_saved", "CompositeExplicitAutograd")
@torch.library.impl(_LIBRARY, "pack_saved_python", "CompositeExplicitAutograd")
def _pack_saved(input: torch.Tensor, plan: str) -> list[torch.Tensor]:
    """Store a tensor a compiled forward saves, as ``plan`` says; fresh noise each call.

    A graph input that the session knows stays alive for the whole step (the batch, which
    the graph's plan cannot tell from an activation an earlier graph passed on) is not
    stored at all: its parts are left unwritten and unpack hands the input back, as the
    eager path saves the batch as it is (a GCN's Cora features: 15 MiB packed every step)."""
    with torch._C.DisableTorchFunction():
        parsed = _parse(plan)
        ops.ensure_kernels(input.device)
        capture = capturing_now()
        if capture is not None and parsed.form not in ("kept", "copy") and capture.keeps_alive(input):
            parts = [
                torch.empty_like(p, device=input.device) if p.is_meta else p
                for p in _encode(input.detach().to("meta"), parsed, 0)
            ]
            _KEPT_INPUTS[parts[0]] = input.detach()
            NativeSaves.kept(parts[0], input.detach())
            capture.account_compiled(plan, input, parts, kept_alive=True)
            NativeSaves.learn(plan, input, parts, capture, kept_alive=True)
            return parts
        # The plan's group axis; a surveyed slot's, or None (memory order) while its survey
        # runs (first step).
        axis = parsed.axis
        if parsed.survey is not None and capture is not None:
            axis = capture.group_orders.order(parsed.survey, input, parsed.bits)
        parts = _encode(input, parsed, SeedStream.next(), axis)
        if capture is not None:
            capture.account_compiled(plan, input, parts)
            NativeSaves.learn(plan, input, parts, capture)
        return parts


@torch.library.register_fake("lightning_act::pack_saved", lib=_LIBRARY)
def _pack_saved_fake(input: torch.Tensor, plan: str) -> list[torch.Tensor]:
    return _encode(input, _parse(plan), 0)


def _decode(
    parts: list[torch.Tensor], size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, plan: Plan
) -> torch.Tensor:
    numel = math.prod(size)
    if plan.form == "copy":
        flat = parts[0]
    elif plan.form == "mask":
        flat = unpack_bit_fields(parts[0], 1, planar=True, numel=numel).view(torch.bool)
    elif plan.form == "index":
        width, offset = index_layout(*plan.index_range, dtype)
        flat = IndexTensor(parts[0], offset, width, torch.Size([numel]), dtype).unpack()
    elif plan.form == "cells":
        cells = _cells_of(plan.cells, dtype)
        width, offset = index_layout(0, cells.count - 1, torch.uint8)
        flat = cells.unpack(IndexTensor(parts[0], offset, width, torch.Size([numel]), torch.uint8))
    elif plan.form == "derivative":
        flat = plan.substitute().restore_quantized(parts[0], parts[1], plan.bits, plan.group_size, numel, dtype)
    else:
        rows, columns = parts[2].tolist() if plan.along_axis else (0, 0)
        flat = _UNPACK_DEQUANTIZE(parts[0], parts[1], plan.bits, plan.group_size, numel, dtype, rows, columns)
    return _restore(flat, size, stride)


@torch.library.impl(_LIBRARY, "unpack_saved", "CompositeExplicitAutograd")
@torch.library.impl(_LIBRARY, "unpack_saved_python", "CompositeExplicitAutograd")
def _unpack_saved(
    parts: list[torch.Tensor], size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, plan: str
) -> torch.Tensor:
    """The tensor :func:`_pack_saved` stored, with the sizes and strides it had."""
    with torch._C.DisableTorchFunction():
        kept = _KEPT_INPUTS.get(parts[0]) if _KEPT_INPUTS else None  # no weak reference made per unpack
        if kept is not None:
            return _as_saved(kept, size, stride)
        ops.ensure_kernels(parts[0].device)
        return _decode(parts, size, stride, dtype, _parse(plan))


@torch.library.register_fake("lightning_act::unpack_saved", lib=_LIBRARY)
def _unpack_saved_fake(parts, size, stride, dtype, plan) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=parts[0].device)


class NativeSaves:
    """The C++ side of the graph ops (``csrc/graph_saves.cpp``, built with the CPU kernels):
    it packs and unpacks the saves whose plan Python has handled once, with no Python per
    saved tensor, and counts them for the report.

    What it needs from Python, Python hands it: each plan it may pack alone (quantized, in
    memory order or along its decided group axis, or a mask; or only hand back, unwritten, an
    input the session keeps alive) and decode alone (quantized, a mask, a pointwise op's input
    from its derivative), the capture capturing
    now (its kept-alive storages and the token of its group axes), the seed stream, the
    unwritten parts of the inputs Python handed back. At every change of the capture
    capturing now (start, stop, pause, resume) what it counted is added to the report of the
    capture it counted for, summed once per set of counts (:meth:`_delta`). Without the CPU
    kernels (``LIGHTNING_ACT_KERNELS=reference``, a failed build) Python serves every call,
    the same bits, slower.
    """

    #: Off: Python serves every call (to compare the two, and while diagnosing).
    enabled = True
    _loaded = False
    #: The capture the C++ side counts for now.
    owner: ActivationCapture | None = None
    #: By packer id: what one call of that plan at that size adds to the report.
    _entries: list[PackedSave] = []
    _learned: dict[tuple[str, int, int, bool], int] = {}
    #: By the counts of a drain: what they add to the report.
    _deltas: dict[tuple[int, ...], ReportDelta] = {}
    _decoders: set[str] = set()

    @classmethod
    def loaded(cls) -> bool:
        """Whether the C++ side is registered (with the CPU kernels); hands it the seed
        stream the moment it is."""
        if not cls._loaded and ops.loaded_kernels()["cpu"] and hasattr(torch.ops.lightning_act, "graph_native_seeds"):
            cls._loaded = True
            torch.ops.lightning_act.graph_native_seeds(_signed64(SeedStream.base), SeedStream.count)
        return cls._loaded

    @classmethod
    def follow(cls, capture: ActivationCapture | None) -> None:
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
        """What a drain's counts ((packer id, calls) pairs, flattened: of saves packed, of
        inputs handed back unwritten) add to the report: summed once per set (a graph packs
        the same tensors every step)."""
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
    def external(cls, capture: ActivationCapture, storage: int) -> None:
        if cls.owner is capture:
            torch.ops.lightning_act.graph_native_external(storage)

    @classmethod
    def kept(cls, part: torch.Tensor, input: torch.Tensor) -> None:
        """``part`` stands for ``input`` (kept alive anyway): unpack hands ``input`` back."""
        if cls.loaded():
            torch.ops.lightning_act.graph_native_kept(part, input)

    @classmethod
    def learn(
        cls, plan: str, t: torch.Tensor, parts: list[torch.Tensor], capture: ActivationCapture, kept_alive: bool = False
    ) -> None:
        """After Python packed ``t`` by ``plan`` for ``capture`` (or, ``kept_alive``, handed it
        back unwritten): register what the C++ side can do alone from now on."""
        parsed = _parse(plan)
        if cls.owner is not capture or parsed.form not in _NATIVE_FORMS:
            return
        form, bits, offset = _NATIVE_FORMS[parsed.form], parsed.bits, 0
        if parsed.form == "index":
            bits, offset = index_layout(*parsed.index_range, t.dtype)
        if plan not in cls._decoders:
            cls._decoders.add(plan)
            if parsed.form == "derivative":
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
        axis, kept_only = parsed.axis, False
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


# --------------------------------------------------------------------------- the hook pair
_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def _hook_context() -> dict | None:
    """What torch tells a hook while it is inlined into a compiled graph; None when called
    eagerly (no compilation has imported torch's AOT graph compiler yet: importing it costs a
    second, so eager-only runs never do)."""
    module = sys.modules.get(_GRAPH_COMPILE)
    return None if module is None else module._get_saved_tensor_hook_context()


@torch.fx.wrap
def _pack(x: torch.Tensor, state: str) -> Any:
    capture = capturing_now()
    context = _hook_context()
    if context is None:  # called eagerly: an op outside any compiled region
        return (_KEPT, x.detach()) if capture is None else (_EAGER, capture._pack(x))
    plan = None if capture is None else GraphHooks.of(state).plan(context, capture)
    if plan is None:
        return (_KEPT, x)
    stored, parsed = x, _parse(plan)
    if parsed.form == "kept":  # kept as it is; the op counts what the graph keeps
        # ``x`` last: where it is also the graph's output or input, torch keeps its node and
        # moves the backward's input for the op's part before it, and the forward's outputs
        # must list the two in that order (torchvision's Faster R-CNN failed to compile).
        return (_KEPT, torch.ops.lightning_act.pack_saved(x, plan), x)
    if parsed.form == "derivative":
        # Computed by the graph's own ops (traced here, fused by the compiler), in x's
        # layout: the values are stored in x's memory order, and restored in it.
        stored = parsed.substitute().of(x)
        if stored.stride() != x.stride():
            stored = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(stored)
    elif parsed.channels_last:
        # Its memory order as a (values per channel, channels) matrix: a view, whose groups
        # run down each channel; decoded in that order, restored with x's strides.
        stored = x.movedim(1, -1).reshape(-1, x.shape[1])
    return (_PACKED, torch.ops.lightning_act.pack_saved(stored, plan), list(x.shape), list(x.stride()), x.dtype, plan)


@torch.fx.wrap
def _unpack(packed: Any, state: str) -> torch.Tensor:
    tag = packed[0]
    if tag == _EAGER:
        return unpack_eager(packed[1])
    if tag == _KEPT:
        return packed[-1]
    _, parts, size, stride, dtype, plan = packed
    return torch.ops.lightning_act.unpack_saved(parts, size, stride, dtype, plan)


class _Hook(fx.GraphModule):
    """A hook graph. Called eagerly it runs its graph directly: through ``nn.Module.__call__``
    the capture's global module hooks would see it as a module the model runs. Never compiled
    by Dynamo's frame hook: code a compiled frame runs eagerly after a graph break (``nn.GRU``'s
    forward in a model compiled whole) calls it at every save, and Dynamo compiled it there,
    recompiling on each tensor's storage address until its limit. Where no frame hook is set
    (eager code outside any compiled function, the common case) it is called without turning
    the hook off and on around it, which cost 4.5 us per call, a third of the bare hooks' cost."""

    def __call__(self, *args):
        if get_eval_frame_callback() is None:
            return self.forward(*args)
        return self._call_outside_dynamo(*args)

    @torch.compiler.disable
    def _call_outside_dynamo(self, *args):
        return self.forward(*args)


skip_code(_Hook.__call__.__code__)  # Dynamo never traces the check itself


def _pack_function(x):
    return _pack(x, "")


def _unpack_function(packed):
    return _unpack(packed, "")


def _hook_module(function, state: str) -> _Hook:
    # In a thread of its own: FX keeps the frames it traced and compiled from in reference
    # cycles, and the caller's hold the step's batch (a new plan's first step kept the
    # batch of that step alive until the collector ran, 0.5 MiB over a target's peak).
    return in_fresh_thread(lambda: _traced_hook(function, state))


def _traced_hook(function, state: str) -> _Hook:
    traced = fx.symbolic_trace(function)
    for node in traced.graph.nodes:
        if node.op == "call_function":
            node.args = (node.args[0], state)
            node.meta["user_cache_hash"] = state  # what torch's AOT autograd cache keys it by
    traced.recompile()
    return _Hook(traced, traced.graph)


class GraphHooks:
    """The saved-tensor hook pair for one state of the settings (see the module), shared by
    every capture with those settings: a plain ``with compress_activations(...)`` block per
    step makes a new capture each time, and must not recompile each time.

    ``state`` names everything the plans depend on (the library version, the config, the
    rules and the policy's allocation). Torch's AOT autograd cache reuses a graph only for
    the same state.
    """

    _made: dict[str, GraphHooks] = {}

    def __init__(self, state: str):
        self.state = state
        self.pack = _hook_module(_pack_function, state)
        self.unpack = _hook_module(_unpack_function, state)
        self._plans: weakref.WeakKeyDictionary[fx.Graph, GraphPlan] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, state: str) -> GraphHooks:
        hooks = cls._made.get(state)
        if hooks is None:
            hooks = cls._made[state] = GraphHooks(state)
        return hooks

    def plan(self, context: dict, capture: ActivationCapture) -> str | None:
        """The plan of the node torch is inlining the pack hook for (planned per graph)."""
        capture.compiling()
        UnpackWhereRead.install()
        ops.ensure_kernels("cpu")  # the graph ops' C++ side comes with the CPU kernels
        forward = context["_fw_graph"]
        plans = self._plans.get(forward)
        if plans is None:
            plans = self._plans[forward] = GraphPlan(forward, context["_bw_graph"], capture)
        return plans.get(context["_node"])


# ------------------------------------------------------------- decoding where it is read
class UnpackWhereRead:
    """An inductor post-grad pass that moves each ``unpack_saved`` of a compiled backward to
    just before the first node that reads its result.

    Torch inlines every unpack hook at the start of the backward graph, so all saved tensors
    would be decoded at once before backward begins, and the step's peak would be the
    uncompressed one (a compiled ViT's 2-bit peak was 97% of none's). Decoded where it is
    read, each tensor lives as eager's does: from just before the node that needs it until
    backward is done with it. Chained after any post-grad pass already set; installed once
    per process, since backward graphs compile at the first backward, after the session.
    """

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        unpack = torch.ops.lightning_act.unpack_saved.default
        # Unpacks read only the graph's inputs and are read by other nodes, so moving one
        # leaves the order of every other node, and these positions, as they were.
        position = {n: i for i, n in enumerate(graph.nodes)}
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is unpack]:
            if node.users:
                min(node.users, key=position.__getitem__).prepend(node)

    def uuid(self) -> Any:
        from torch._inductor.custom_graph_pass import get_hash_for_files

        chained = self.chained.uuid() if hasattr(self.chained, "uuid") else None
        return (get_hash_for_files((__file__,)), chained)

    @staticmethod
    def install() -> None:
        config = sys.modules.get("torch._inductor.config")
        if config is None or isinstance(config.post_grad_custom_post_pass, UnpackWhereRead):
            return
        from torch._inductor.custom_graph_pass import CustomGraphPass

        CustomGraphPass.register(UnpackWhereRead)  # what inductor's config accepts, with a uuid
        config.post_grad_custom_post_pass = UnpackWhereRead(config.post_grad_custom_post_pass)


# ------------------------------------------------------------- choosing what is saved
class CheaperSaves:
    """Inductor's partitioner (min-cut), then what the forward saves chosen again where
    backward would read a save it can store only at many bits through a recomputation.

    Min-cut saves what is cheapest to keep *uncompressed*, and recomputes the rest in
    backward: attention's scores before the softmax (backward recomputes the softmax from
    them), a pre-activation (it recomputes the activation). Compressed, the choice turns
    around: backward reads the scores through ``exp(s - max)``, so they are kept exact,
    while the softmax itself, which eager autograd saves, is read at 8 bits.

    So, in a session: each saved tensor's storage is decided as its plan will be
    (:func:`GraphPlan`'s analysis); where one costs more bits than the session's own and
    backward recomputes forward ops from it, the outputs of those ops that backward reads
    (the softmax, not its pieces) are marked to be saved (``CheckpointPolicy.MUST_SAVE``,
    which min-cut honours), and so are the equality outcomes backward computes from it
    (:func:`_outcomes`, saved by :func:`_saving_marked_outcomes`); the graph is partitioned
    again. The new partition is kept only if its saves cost fewer bits, as decided; up to
    three rounds. Outside a session, and where the user's activation checkpointing already
    tags what to recompute, this is min-cut as inductor calls it.
    """

    ROUNDS = 3

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch.utils.checkpoint import CheckpointPolicy

        # The user's activation checkpointing tags what to recompute: left as they chose.
        checkpointed = any("recompute" in node.meta for node in joint.graph.nodes)
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        capture = capturing_now()
        if capture is None or checkpointed:
            return forward, backward
        bits = capture.nominal_bits
        cost, candidates = _saves_cost(forward, backward, capture, bits)
        marked: set[str] = set()
        for _ in range(self.ROUNDS):
            # Recomputed results first, then equality outcomes: each kept only where it pays,
            # so one that does not cannot cost the other its round.
            for names in candidates:
                nodes = [n for n in joint.graph.nodes if n.name in names - marked]
                if not nodes:
                    continue
                for node in nodes:
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked |= names
                try:
                    with _saving_marked_outcomes():
                        forward_again, backward_again = min_cut_rematerialization_partition(
                            joint, joint_inputs, **kwargs
                        )
                    cost_again, candidates_again = _saves_cost(forward_again, backward_again, capture, bits)
                except Exception:  # a partition min-cut cannot make: the one it made stands
                    cost_again = math.inf
                if cost_again < cost:
                    forward, backward, cost, candidates = forward_again, backward_again, cost_again, candidates_again
                    break
                for node in nodes:
                    node.meta.pop("recompute", None)
            else:
                break  # nothing left that pays
        return forward, backward

    def uuid(self) -> Any:
        """What inductor's caches key its partitions by: the code that chooses them."""
        from torch._inductor.custom_graph_pass import get_hash_for_files

        return get_hash_for_files(
            (__file__, sys.modules[graph_reads.__module__].__file__, sys.modules[decide_saved_node.__module__].__file__)
        )

    @staticmethod
    def install() -> None:
        """Inductor's partitioner from now on in this process (min-cut outside sessions),
        unless the user set one of their own."""
        config = sys.modules.get("torch._inductor.config")
        if config is None or config.custom_partitioner_fn is not None:
            return
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        CustomPartitionerFn.register(CheaperSaves)  # what inductor's config accepts, with a uuid
        config.custom_partitioner_fn = CheaperSaves()


@contextlib.contextmanager
def _saving_marked_outcomes() -> Iterator[None]:
    """Min-cut with the nodes it leaves to backward that are marked ``MUST_SAVE`` saved too.

    Min-cut honours the mark only on forward nodes. A node backward computes from saved
    tensors alone (an equality outcome) is never worth saving to it: its inputs are saved
    anyway for other reads. Saved, it takes those reads' exact copy off them.
    """
    from torch._functorch import partitioners
    from torch.utils.checkpoint import CheckpointPolicy

    choose = partitioners.choose_saved_values_set

    def choose_with_outcomes(joint_graph: fx.Graph, node_info: Any, *args: Any, **kwargs: Any) -> list[fx.Node]:
        saved = choose(joint_graph, node_info, *args, **kwargs)
        return saved + [
            n
            for n in joint_graph.nodes
            if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE and node_info.is_unclaimed(n) and n not in saved
        ]

    partitioners.choose_saved_values_set = choose_with_outcomes
    try:
        yield
    finally:
        partitioners.choose_saved_values_set = choose


def _saves_cost(
    forward: fx.GraphModule, backward: fx.GraphModule, capture: ActivationCapture, bits: int
) -> tuple[float, tuple[set[str], set[str]]]:
    """The bits a partition's saves cost as :class:`GraphPlan` would store them at ``bits``,
    and the nodes worth saving instead of those that cost more (see :class:`CheaperSaves`):
    the forward ops backward recomputes from them, and their equality outcomes."""
    reads = graph_reads(backward.graph, forward.graph)
    computed = {n.name: n for n in forward.graph.nodes if n.op == "call_function"}
    saved = {n.name: n for n in forward.graph.nodes if n.name in reads}
    gradient_free = _free_of_tangents(backward.graph)
    total, results, outcomes = 0.0, set(), set()
    for placeholder in backward.graph.nodes:
        node = saved.get(placeholder.name)
        val = placeholder.meta.get("val")
        if node is None or node.op == "placeholder" or not isinstance(val, torch.Tensor):
            continue  # the graph's inputs are alive anyway, whichever the partition
        decision = decide_saved_node(
            _hinted(val),
            reads[placeholder.name],
            producer(node),
            consumers(node),
            min_numel=capture.config.min_numel,
            group_size=capture.config.group_size,
            statistic=is_statistic(node),
            softmax_row=softmax_row(node),
        )
        if decision.kind is Kind.MASK:
            cost = 1
        elif decision.kind is Kind.CELLS:
            cost = (decision.cells.count - 1).bit_length()
        elif decision.kind is Kind.QUANTIZE:
            cost = max(bits, decision.min_bits)
        else:
            cost = val.element_size() * 8
        total += size_hint(val.numel()) * cost
        if cost > bits:
            results |= _recomputed_results(placeholder, computed)
            outcomes |= _outcomes(placeholder, gradient_free)
    return total, (results, outcomes)


def _free_of_tangents(backward: fx.Graph) -> set[fx.Node]:
    """The nodes of a backward graph computed from saved tensors alone: those a forward can
    compute too."""
    free: set[fx.Node] = set()
    for node in backward.nodes:
        if node.op == "placeholder":
            if not is_tangent(node):
                free.add(node)
        elif node.op == "call_function" and all(n in free for n in node.all_input_nodes):
            free.add(node)
    return free


def _outcomes(saved: fx.Node, gradient_free: set[fx.Node]) -> set[str]:
    """The comparisons backward makes of a saved tensor (or a view of it) with no gradient in
    them, at their widest: boolean nodes computed from saves alone that no boolean node takes
    further (``(x == other) | (isnan(x) & isnan(other))``, not its pieces). Saved in place of
    the tensor they are the outcome eager stores for a match, 1 bit per value, made in the
    forward where both sides exist."""

    def boolean(node: fx.Node) -> bool:
        val = node.meta.get("val")
        return node in gradient_free and isinstance(val, torch.Tensor) and val.dtype == torch.bool

    outcomes, stack, seen = set(), list(saved.users), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if not boolean(node):
            if node in gradient_free and _name_of(node.target) in _VIEWS:
                stack.extend(node.users)
            continue
        wider = [u for u in node.users if boolean(u)]
        if wider:
            stack.extend(wider)
        else:
            outcomes.add(node.name)
    return outcomes


def _recomputed_results(saved: fx.Node, computed: dict[str, fx.Node]) -> set[str]:
    """The forward ops a backward graph recomputes from a saved tensor whose results its own
    nodes read: whole ops' results (a softmax, not the ``exp`` inside it), not views."""
    results, stack, seen = set(), list(saved.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node.name not in computed:
            continue
        seen.add(node)
        recomputed = [u for u in node.users if u.name in computed]
        stack.extend(recomputed)
        read_by_backward = len(recomputed) < len(node.users)
        view = _name_of(node.target) in _VIEWS  # the op itself, not the one it was decomposed from
        if read_by_backward and not view and _whole_op_result(computed[node.name]):
            results.add(node.name)
    return results


def _whole_op_result(node: fx.Node) -> bool:
    """Whether a forward node is the result of the op it was decomposed from: none of the
    nodes reading it comes from the same call of that op."""
    op = (node.meta.get("original_aten"), node.meta.get("seq_nr"))
    return op[0] is not None and all((u.meta.get("original_aten"), u.meta.get("seq_nr")) != op for u in node.users)


# ----------------------------------------------------------------- planning one graph
_VIEWS = frozenset(
    """
    view _unsafe_view reshape permute transpose t expand squeeze unsqueeze select slice alias detach clone
    as_strided
    """.split()
)
_QUALNAME_ACCESS = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]")


def _op_name(node: fx.Node) -> str | None:
    """The aten op a node of a compiled graph computes (before decompositions)."""
    return _name_of(node.meta.get("original_aten") or node.target)


def _name_of(target: Any) -> str | None:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def _function_name(node: fx.Node) -> str | None:
    """The torch function (or method) the model called that a node of a compiled graph comes
    from, as eager's op tracker names it (``linear`` for an ``addmm``, ``ctc_loss`` for
    ``_ctc_loss``): Dynamo's record of it, whose name carries a count from the second call
    on (``linear_1``) where it records a module's class rather than the function."""
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
    while _op_name(node) in _VIEWS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def producer(node: fx.Node) -> str | None:
    """The op that computed a saved node, looking through views of its result."""
    return _op_name(_source(node))


def softmax_row(node: fx.Node) -> int | None:
    """The length of the rows a softmax normalised, where a saved node is its result: from
    ``aten._softmax``'s dimension, or, decomposed (``exp(x - max) / sum``), from the
    dimensions its divisor reduced."""
    source = _source(node)
    val = source.meta.get("val")
    if _op_name(source) not in SOFTMAX_OPS or not isinstance(val, torch.Tensor):
        return None
    if not val.dim():
        return 1
    if _name_of(source.target) in SOFTMAX_OPS:  # the op itself, not a piece of its decomposition
        dim = source.args[1] if len(source.args) > 1 else None
        return size_hint(val.shape[dim]) if isinstance(dim, int) else None
    for argument in source.args[1:]:
        divisor = argument.meta.get("val") if isinstance(argument, fx.Node) else None
        if not isinstance(divisor, torch.Tensor) or divisor.dim() != val.dim():
            continue
        reduced = [size_hint(n) for n, m in zip(val.shape, divisor.shape) if size_hint(m) == 1 and size_hint(n) != 1]
        if reduced:
            return math.prod(reduced)
        # ``_safe_softmax``'s last step, ``where(row all masked, zeros, exp / sum)``: its
        # arguments of the same size reduce nothing themselves; the quotient's divisor does.
        # (Read as rows of one value, or of the zeros' first size, a compiled attention's
        # probabilities were kept exact.)
        if _op_name(argument) in SOFTMAX_OPS and (row := softmax_row(argument)) is not None:
            return row
    return None


def is_statistic(node: fx.Node) -> bool:
    """Whether a saved node is a reduction statistic: an op's second or later result (a
    normalisation's mean and 1 / std, an attention's logsumexp), at least ``STATISTIC_RATIO``
    times smaller than the op's first input, as :func:`~lightning_act.capture.decide.decide`
    tells them in eager mode."""
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
        name = _op_name(user)
        if name in _VIEWS:
            stack.extend(user.users)
        elif name is not None:
            names[name] = user.args
    return names


# Aten ops whose forward checks every value of an index argument against one dimension of
# a source (negative values are errors): name -> (index position, source position, the
# dimension's position; None: the source's first dimension).
_INDEXED_BY = {
    "index_select": (2, 0, 1),
    "gather": (2, 0, 1),
    "scatter": (2, 0, 1),
    "scatter_add": (2, 0, 1),
    "scatter_reduce": (2, 0, 1),
    "index_add": (2, 0, 1),
    "embedding": (1, 0, None),
}
# Aten ops indexing dimension k of their first argument with the k-th of a list of index
# tensors, negative values counting from the end (checked too; not the _unsafe_ variants).
_INDEXED_BY_LIST = {"index": 1, "index_put": 1}


def index_bound(node: fx.Node) -> tuple[int, int] | None:
    """``(low, high)`` bounding every value of an integer node of a forward graph, where the
    graph itself reads all of them as indices into dimensions of fixed sizes (the forward
    checked them, so the bound holds): the node whole, or each of its rows (PyG's
    ``edge_index[0]`` and ``edge_index[1]``, its gather and scatter indices). None otherwise:
    a size that varies (``dynamic=True``), some values read by nothing that checks them."""
    whole = _whole_index_bound(node)
    if whole is not None:
        return whole
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not isinstance(val.shape[0], int):
        return None
    rows: dict[int, tuple[int, int]] = {}
    for user in node.users:
        if (
            _name_of(user.target) == "select"
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


# Views that hold every value of the tensor they view (an index reshaped or broadcast for
# a scatter is read whole).
_WHOLE_VIEWS = frozenset(
    """
    view _unsafe_view reshape expand unsqueeze squeeze permute transpose t alias clone
    """.split()
)


def _whole_index_bound(node: fx.Node) -> tuple[int, int] | None:
    """The tightest bound among the ops reading the node, whole (or through views that hold
    all its values), as an index into a fixed size."""
    bound = None
    for user in node.users:
        name = _name_of(user.target)
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


def _backward_readers(placeholder: fx.Node) -> list[tuple[int, int, dict]]:
    """``(forward sequence number, order found, forward module stack)`` of each backward node
    reading ``placeholder`` (views and detaches of it looked through): which forward op's
    backward each is, as torch records it. An op of the compiled module's own forward has an
    empty module stack, and is a reader all the same (its name is what an ``op:`` rule
    matches)."""
    readers, stack, seen = [], list(placeholder.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        order = user.meta.get("seq_nr")
        if order is not None and "fwd_nn_module_stack" in user.meta:
            readers.append((int(order), len(readers), user.meta["fwd_nn_module_stack"] or {}))
        elif _op_name(user) in _VIEWS:
            stack.extend(user.users)
    return readers


def module_qualname(stack: dict | None) -> str | None:
    """The qualified name, relative to the compiled module, of the innermost module of a
    node's ``nn_module_stack`` (``layer1.0.conv1``), as Dynamo records it."""
    if not stack:
        return None
    qualname = str(list(stack.values())[-1][0])
    # ``L['self']``, or for a module compiled in place ``L['fn'].__self__`` (its bound call).
    qualname = re.sub(r"^L\[['\"]\w+['\"]\](\.__self__)?", "", qualname)
    qualname = _QUALNAME_ACCESS.sub(lambda m: "." + next(g for g in m.groups() if g is not None), qualname)
    parts = [p for p in qualname.split(".") if p and p != "_orig_mod"]
    return ".".join(parts) if parts else ""


def _hinted(val: Any) -> Any:
    """A saved node's value with its sizes as traced (a meta tensor): deciding on symbolic
    sizes under ``dynamic=True`` would guard on them, and recompile for every batch size."""
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided or val.is_nested:
        return val
    size = [size_hint(s) for s in val.shape]
    stride = [size_hint(s) for s in val.stride()]
    return torch.empty_strided(size, stride, dtype=val.dtype, device="meta")


class GraphPlan:
    """The plan of every tensor one compiled forward saves for its backward (None: kept as
    it is), encoded as the graph ops take it.

    The graph's own results are planned at once, so that the first packed one can carry the
    bytes of those kept as they are into the report. Its inputs are planned when the hooks
    are asked about them. Torch hooks every input that is not a parameter or a buffer: an
    activation an earlier graph passed on at a graph break, which must be compressed (a GCN
    split by PyG's data-dependent ops kept 15 of its 15.2 MiB otherwise), and the batch,
    which cannot be told apart from one when the graph is compiled. So both are planned as
    activations; at run time the pack op hands the batch (any input the session knows to
    stay alive for the step) back as it is, as eager does.
    """

    def __init__(self, forward: fx.Graph, backward: fx.Graph, capture: ActivationCapture):
        self._reads = graph_reads(backward, forward)
        self._capture = capture
        # Each save belongs, as in eager, to the module whose op saved it first: of the
        # backward nodes that read it, the one whose forward op ran first (torch records each
        # one's forward sequence number and module stack). The ops that save it, as eager
        # names a save by its op, are those whose backward reads it: by their aten name and
        # by the torch function the model called, eager's name for them.
        forward_ops = {
            int(n.meta["seq_nr"]): {_op_name(n), _function_name(n)} - {None}
            for n in reversed(forward.nodes)
            if n.meta.get("seq_nr") is not None
        }
        self._modules, self._savers = {}, {}
        for node in backward.nodes:
            if node.op == "placeholder":
                readers = _backward_readers(node)
                self._modules[node.name] = module_qualname(min(readers)[2] if readers else None)
                self._savers[node.name] = set().union(*(forward_ops[r[0]] for r in readers if r[0] in forward_ops))
        self._per_module: dict[str, int] = {}
        #: ``(slot, shape, op)`` of each node whose slot the policy or a rule keeps exact.
        self._exact_slots: dict[str, tuple[str, tuple[int, ...], str | None]] = {}
        outputs = forward.output_node().args[0]
        saved = [n for n in outputs if isinstance(n, fx.Node) and n.name in self._reads and n.op != "placeholder"]
        plans: dict[str, Plan | None] = {}
        kept: list[tuple[str, int, str, tuple | None]] = []
        for node in saved:
            plans[node.name], outcome = self._plan(node)
            val = node.meta.get("val")
            if plans[node.name] is None and isinstance(val, torch.Tensor):
                kept.append(
                    (
                        self._module(node),
                        size_hint(val.numel()) * val.element_size(),
                        outcome.value,
                        self._exact_slots.get(node.name),
                    )
                )
        first = next((name for name, plan in plans.items() if plan is not None), None)
        if first is not None:
            plans[first] = plans[first]._replace(kept=tuple(kept))
        elif kept:
            # Nothing packed: a kept save carries the others, or the report would miss them all
            # (a graph whose every save a rule or the policy keeps exact counted nothing).
            carrier = next(node for node in saved if isinstance(node.meta.get("val"), torch.Tensor))
            plans[carrier.name] = Plan("kept", 0, 0, self._module(carrier), "", None, 1, kept=tuple(kept))
        self._encoded = {name: _encode_plan(plan) for name, plan in plans.items()}

    def get(self, node: fx.Node) -> str | None:
        if node.name not in self._encoded:
            self._encoded[node.name] = _encode_plan(self._plan(node)[0])
        return self._encoded[node.name]

    def _plan(self, node: fx.Node) -> tuple[Plan | None, Outcome]:
        capture = self._capture
        val = _hinted(node.meta.get("val"))
        if not isinstance(val, torch.Tensor):
            # A size or a scalar (a data-dependent size top-k pooling saves): nothing to store.
            return None, Outcome.KEPT
        module = self._module(node)
        op = producer(node)
        decision = decide_saved_node(
            val,
            self._reads.get(node.name, Read(Use.EXACT)),
            op,
            consumers(node),
            min_numel=capture.config.min_numel,
            group_size=capture.config.group_size,
            statistic=is_statistic(node),
            index_range=index_bound(node) if val.dtype in INDEX_DTYPES else None,
            softmax_row=softmax_row(node),
        )
        if decision.kind is Kind.MASK:
            return Plan("mask", 1, 0, module, "", op, 1), Outcome.LOSSLESS
        if decision.kind is Kind.INDEX and index_layout(*decision.value_range, val.dtype) is not None:
            return Plan("index", 0, 0, module, "", op, 1, index_range=decision.value_range), Outcome.LOSSLESS
        if decision.kind is Kind.CELLS:
            return Plan("cells", 0, 0, module, "", op, 1, cells=decision.cells.thresholds), Outcome.LOSSLESS
        shape = node.meta["val"].shape
        if decision.group_axis is not None and not all(
            isinstance(size, int) for size in (shape if decision.channels_last else (shape[decision.group_axis],))
        ):
            # Its groups divide that axis's size times the later ones (in channels-last memory,
            # every size but the channels'): another batch size (``dynamic=True``) would move
            # them across channels.
            decision = Decision(Kind.KEEP)
        if decision.kind is not Kind.QUANTIZE:
            return None, Outcome.STATISTIC if decision.kind is Kind.STATISTIC else Outcome.KEPT
        op = self._rule_op(module, op, self._savers.get(node.name, ()))
        index = self._per_module[module] = self._per_module.get(module, -1) + 1
        slot = f"{module}#{index}"
        numel = val.numel()
        group_size = decision.row_group or capture.config.group_size
        info = SlotInfo(
            module=module,
            shape=tuple(val.shape),
            numel=numel,
            groups=-(-numel // group_size),
            element_bits=val.element_size() * 8,
            op=op,
            min_bits=decision.min_bits,
        )
        capture.slots[slot] = info
        bits = capture.policy.bits_for(slot, info)
        if bits is None:  # a rule or the policy says so
            if size_hint(node.meta["val"].untyped_storage().nbytes()) > numel * val.element_size():
                # A view of part of a storage (an attention's value, a third of ``qkv``): kept
                # as it is, it would hold all of ``qkv``; as eager does, a copy of its own.
                return Plan("copy", 0, 0, module, slot, op, decision.min_bits), Outcome.EXACT
            self._exact_slots[node.name] = (slot, info.shape, op)
            return None, Outcome.EXACT
        if decision.substitute is not None:
            return Plan(
                "derivative",
                bits,
                group_size,
                module,
                slot,
                op,
                decision.min_bits,
                derivative=decision.substitute.source,
            ), Outcome.COMPRESSED
        # Its groups' axis surveyed as in eager, where eager would: groups of the tensor's own
        # values (not rows laid out for them), in a tensor stored in its logical order.
        surveyed = (
            capture.chooses_group_axes
            and decision.row_group is None
            and val.is_contiguous()
            and bool(candidate_axes(val, group_size))
        )
        survey = f"{slot} {tuple(val.shape)}" if surveyed else None
        return (
            Plan(
                "quant",
                bits,
                group_size,
                module,
                slot,
                op,
                decision.min_bits,
                survey=survey,
                axis=decision.group_axis,
                channels_last=decision.channels_last,
            ),
            Outcome.COMPRESSED,
        )

    def _rule_op(self, module: str, op: str | None, savers: set[str]) -> str | None:
        """The op a saved node is named by, for its rules and in the report. Eager names a
        save by the op that saves it (GELU's input: ``gelu``; its output: the next layer's),
        and a shared copy serves every save at the bits the most demanding one pins; so of
        the forward ops whose backward reads the node, by aten name or by the torch
        function called, the one whose rule pins the most bits (exact above all). Where none pins any, the op that computed it, unless a rule names
        that op and its backward does not read the node (GELU's output, read by the next
        layer alone: ``op:gelu`` is not about it)."""
        rules, best, most = self._capture.policy.rules, op, 0.0
        for name in sorted(savers, key=str):
            rule = rules.lookup(module, name)
            if rule is not None and rule.pins_bits:
                pinned = math.inf if rule.bits is None else rule.bits
                if pinned > most:
                    best, most = name, pinned
        if most == 0.0 and savers and op not in savers:
            rule = rules.lookup(module, op)
            if rule is not None and rule.pins_bits:
                return min(savers, key=str)
        return best

    def _module(self, node: fx.Node) -> str:
        qualname = self._modules.get(node.name) or module_qualname(node.meta.get("nn_module_stack"))
        return self._capture.module_name(qualname)


def _encode_plan(plan: Plan | None) -> str | None:
    """The plan as the string the graph carries: its tuple's ``repr``, readable in a graph's
    code, or that in base64 where it holds what a C++ string literal would change (inductor's
    C++ wrapper writes it into its source unescaped: a backslash, a double quote), or non-ASCII
    text. A derivative's source code, with its newlines, is always the latter."""
    if plan is None:
        return None
    text = repr(tuple(plan))
    if "\\" in text or '"' in text or not text.isascii():
        return _BASE64 + base64.b64encode(text.encode()).decode()
    return text
