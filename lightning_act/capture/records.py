"""What autograd holds instead of a saved tensor, and how a saved tensor is laid out for a codec.

Each record's ``unpack()`` gives back a tensor of the saved tensor's shape, strides, dtype and device.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_act.codecs.exact import MaskCodec


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous()`` from the shape and strides alone."""
    if 0 in shape:
        return True
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1:
            if st != expected:
                return False
            expected *= size
    return True


class Layout(NamedTuple):
    """How to lay a saved tensor out densely for a codec, and how to give it back.

    Dense tensors are read in memory order (a permuted view) and restored with their strides;
    broadcast dimensions are stored once; other non-overlapping views are copied dense and come
    back dense. Computed from shape and strides alone: one layout serves every tensor alike.
    """

    #: The saved tensor's shape when it broadcasts, else None.
    expand_to: torch.Size | None
    #: The dimensions in memory order, None when they already are.
    perm: tuple[int, ...] | None
    #: Whether the memory-order view still has gaps, so a dense copy is made.
    copy: bool
    inverse_perm: tuple[int, ...] | None
    #: The saved tensor's distinct elements.
    numel: int
    #: Whether the dense tensor is the storage in memory order, so other views of it may decode
    #: from it (not so for :meth:`channel_major` or padded rows).
    memory_order: bool = True
    #: Rows of ``row`` values padded to ``padded_row`` by repeating the last value (leaving the
    #: range unchanged), so no codec group spans two rows; None when not padded.
    row: int | None = None
    padded_row: int | None = None
    unpadded_shape: tuple[int, ...] | None = None
    #: ``(shape, strides)`` of a copied view that must come back with its own strides: a save
    #: whose backward is unknown (a compiled graph's asserts them).
    strided: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @staticmethod
    def as_it_is() -> Layout:
        """The layout of a tensor handed back as it was stored (a view kept as it is)."""
        return _AS_IT_IS

    @staticmethod
    def of(t: torch.Tensor) -> Layout | None:
        """The layout of ``t`` (from its shape and strides), or None if its elements overlap."""
        if t.is_contiguous():
            return Layout(None, None, False, None, t.numel())
        shape, stride = t.shape, t.stride()
        expand_to = None
        if any(st == 0 and sz > 1 for st, sz in zip(stride, shape)):
            expand_to = shape
            shape = tuple(1 if st == 0 else sz for st, sz in zip(stride, shape))
        perm = tuple(sorted(range(len(shape)), key=lambda d: -stride[d]))
        copy = not _is_contiguous(tuple(shape[d] for d in perm), tuple(stride[d] for d in perm))
        if copy:
            extent = 1
            for d in reversed(perm):
                if shape[d] > 1:
                    if stride[d] < extent:
                        return None
                    extent = stride[d] * shape[d]
        identity = all(p == i for i, p in enumerate(perm))
        inverse = None if identity else tuple(sorted(range(len(perm)), key=perm.__getitem__))
        return Layout(expand_to, None if identity else perm, copy, inverse, math.prod(shape))

    @staticmethod
    def channel_major(t: torch.Tensor) -> Layout:
        """Channels first, ``(C, N, ...)``, each channel one run: always a copy."""
        perm = (1, 0, *range(2, t.dim()))
        return Layout(None, perm, True, perm, t.numel(), memory_order=False)

    def with_padded_rows(self, t: torch.Tensor, row: int, padded_row: int) -> Layout:
        """This layout with its dense tensor's rows of ``row`` values padded to ``padded_row``."""
        shape = tuple(t.shape[d] for d in self.perm) if self.perm is not None else tuple(t.shape)
        return self._replace(memory_order=False, row=row, padded_row=padded_row, unpadded_shape=shape)

    def with_strides(self, t: torch.Tensor) -> Layout:
        """This layout, restoring ``t``'s own strides where it copies ``t`` dense."""
        return self._replace(strided=(tuple(t.shape), tuple(t.stride()))) if self.copy else self

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s distinct elements as one contiguous tensor (a view where no copy is needed)."""
        if self.expand_to is not None:
            t = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
        if self.perm is not None:
            t = t.permute(self.perm)
        t = t.contiguous() if self.copy else t
        if self.padded_row is None:
            return t
        rows = t.reshape(-1, self.row)
        return torch.cat([rows, rows[:, -1:].expand(-1, self.padded_row - self.row)], dim=1)

    def restore(self, dense: torch.Tensor) -> torch.Tensor:
        if self.padded_row is not None:
            dense = dense.reshape(-1, self.padded_row)[:, : self.row].reshape(self.unpadded_shape)
        t = dense if self.inverse_perm is None else dense.permute(self.inverse_perm)
        t = t if self.expand_to is None else t.expand(self.expand_to)
        if self.strided is None:
            return t
        size, stride = self.strided
        return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


_AS_IT_IS = Layout(None, None, False, None, 0)


def storage_region(t: torch.Tensor) -> tuple[int, int] | None:
    """``(offset, numel)`` when ``t``'s elements fill exactly that run of its storage, else None:
    other views of the same run (a transpose, a reshape) can share one stored copy."""
    if t.is_contiguous():  # the common case, checked in C++
        return t.storage_offset(), t.numel()
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != extent:
            return None
        extent *= size
    return t.storage_offset(), t.numel()


def storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef]:
    storage = t.untyped_storage()
    return storage.data_ptr(), StorageWeakRef(storage)


def unpack(saved: Any) -> torch.Tensor:
    """The unpack hook: a tensor passed through as it is, or a record's rebuilt tensor."""
    return saved if isinstance(saved, torch.Tensor) else saved.unpack()


class Compressed:
    """What autograd holds instead of a compressed tensor: its record, its layout, and the
    substitute (if any) that turns decoded values back into what backward reads."""

    __slots__ = ("record", "layout", "substitute", "slot")

    def __init__(self, record, layout: Layout, substitute=None, slot: str | None = None):
        self.record = record
        self.layout = layout
        self.substitute = substitute
        #: The policy's slot of a rounded save, else None: the report row to move where a
        #: later save's copy supersedes this one.
        self.slot = slot

    def unpack(self) -> torch.Tensor:
        if self.substitute is None:
            return self.layout.restore(self.record.unpack())
        return self.layout.restore(self.substitute.unpack(self.record))


class RegionView:
    """What autograd holds for a view of a run of storage that another view already stored."""

    __slots__ = ("record", "size", "stride")

    def __init__(self, record, t: torch.Tensor):
        self.record = record
        self.size = t.shape
        self.stride = t.stride()

    def unpack(self) -> torch.Tensor:
        return self.record.unpack().reshape(-1).as_strided(self.size, self.stride)


class KeptRecord:
    """A run of storage kept as it is, in memory order, for the other views that share it."""

    __slots__ = ("dense",)

    def __init__(self, dense: torch.Tensor):
        self.dense = dense

    def unpack(self) -> torch.Tensor:
        return self.dense


class MatchedSave:
    """A tensor backward only compares for equality with a value computed from other saves
    (:class:`~lightning_act.backward_reads.Match`): once settled, the 1-bit outcome, unpacked as
    ``other`` where it matched and a value matching nothing elsewhere; else the tensor itself."""

    __slots__ = ("match", "tensor", "matched", "partners", "shape")

    def __init__(self, t: torch.Tensor, match):
        self.match = match
        self.tensor: torch.Tensor | None = t.detach()
        self.matched = None
        self.partners: list | None = None
        self.shape = t.shape

    def settle(self, partners: list) -> int | None:
        """Store the outcome against ``partners`` (exact records): the bytes stored, or None
        where the tensor stays (a shape or dtype the traced comparison does not hold for)."""
        try:
            other = self.match.compute(self.shape, *[unpack(p) for p in partners])
            if other.dtype != self.tensor.dtype or torch.broadcast_shapes(other.shape, self.shape) != self.shape:
                return None
        except RuntimeError:  # a view the traced comparison made that this call's sizes cannot take
            return None
        self.matched = MaskCodec().pack(self.match.matches(self.tensor, other).contiguous(), 0, 0)
        self.partners, self.tensor = partners, None
        return self.matched.nbytes

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        return self.match.stand_in(self.matched.unpack().view(self.shape), [unpack(p) for p in self.partners])


class Recomputation:
    """One fused attention call's saved outputs, recomputed from its inputs' records when
    backward unpacks the first, and let go once each was taken."""

    __slots__ = ("recompute", "inputs", "saved", "waiting", "outputs")

    def __init__(self, recompute, inputs: list):
        self.recompute = recompute
        self.inputs = inputs
        self.saved: set[int] = set()  # the outputs autograd holds
        self.waiting: set[int] = set()  # those not yet taken in this backward
        self.outputs: tuple | None = None

    def hold(self, index: int) -> None:
        self.saved.add(index)
        self.waiting.add(index)

    def output(self, index: int) -> torch.Tensor:
        if self.outputs is None:
            self.outputs = self.recompute.run([unpack(saved) for saved in self.inputs])
        value = self.outputs[index]
        self.waiting.discard(index)
        if not self.waiting:  # each taken: a retained graph's next backward computes them again
            self.waiting, self.outputs = set(self.saved), None
        return value


class RecomputedOutput:
    """One output of a :class:`Recomputation`, in the layout the call saved it in."""

    __slots__ = ("recomputation", "index", "size", "stride")

    def __init__(self, recomputation: Recomputation, index: int, saved: torch.Tensor):
        self.recomputation = recomputation
        self.index = index
        self.size = saved.shape
        self.stride = saved.stride()
        recomputation.hold(index)

    def unpack(self) -> torch.Tensor:
        value = self.recomputation.output(self.index)
        if value.shape == self.size and value.stride() != self.stride:
            value = torch.empty_strided(self.size, self.stride, dtype=value.dtype, device=value.device).copy_(value)
        return value


class RecastWeight:
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


class ProbeRecord:
    """Probe mode: the exact dense tensor, quantized at unpack (with ``codec``) only when
    ``probe`` (:class:`~lightning_act.capture.engine.Probe`) probes its slot."""

    __slots__ = ("probe", "slot", "dense", "codec", "group_axis")

    def __init__(self, probe, slot: str, dense: torch.Tensor, codec, group_axis: int | None = None):
        self.probe = probe
        self.slot = slot
        self.dense = dense
        self.codec = codec
        self.group_axis = group_axis

    def unpack(self) -> torch.Tensor:
        probe = self.probe
        if probe.readers is not None:
            node = torch._C._current_autograd_node()
            readers = probe.readers.setdefault(self.slot, [])
            if node is not None and node not in readers:
                readers.append(node)
        if probe.noisy_slot != self.slot:
            # A copy: what decodes a record owns the tensor, and a substitute restores it in place.
            return self.dense.clone()
        if probe.decoded is not None:
            return probe.decoded.clone()
        return self.codec.pack(self.dense, probe.bits, probe.next_seed(), self.group_axis).unpack()


class Shared(NamedTuple):
    """A stored save, for the later saves of the same tensor that may share it."""

    storage: StorageWeakRef
    #: ``(shape, strides)`` of the view stored: the same view gets ``saved`` itself.
    view: tuple
    saved: Any
    #: For a run of storage, its record in memory order, which other views are restored from.
    record: Any
    #: The fewest bits a save of the same view gets from it; one needing more is stored again.
    view_guaranteed: float
    #: The same for another view of the run, read through ``record`` (0 without one).
    run_guaranteed: float
    #: A rounded copy's ``(row_group, row_layout)``; None for an exact copy.
    rows: tuple | None = None
    #: Whether another view of the run decodes from ``record``.
    viewed: bool = False
