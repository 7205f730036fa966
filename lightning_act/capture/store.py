"""How a save is stored once decided: the codecs, one copy shared by the saves of one tensor,
each slot's codec, bits and report entry, and the bytes accounted. Each
:class:`~lightning_act.capture.engine.ActivationCapture` owns one store."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_act.capture.active import Capture, splitmix64
from lightning_act.capture.decide import Decision, Form, exact_form
from lightning_act.capture.records import (
    Compressed,
    KeptRecord,
    Layout,
    MatchedSave,
    ProbeRecord,
    RecastWeight,
    Recomputation,
    RecomputedOutput,
    RegionView,
    Shared,
    storage_region,
)
from lightning_act.capture.report import (
    NO_BITS,
    Outcome,
    SlotMemory,
)
from lightning_act.codecs import (
    DivisionCodec,
    GroupQuantCodec,
    IndexCodec,
    MaskCodec,
    PoolCodec,
    QuantizedTensor,
    SignMaskCodec,
    StoredTensor,
    make_codec,
)
from lightning_act.config import CODECS
from lightning_act.ops.validation import MIN_GROUP_SIZE
from lightning_act.optrack import TrackedCall
from lightning_act.policy import BitPolicy, SlotInfo

# The kinds of save stored exactly, which a comparison's outcome may be stored against.
_EXACT_FORMS = frozenset(
    {
        Form.KEEP,
        Form.STATISTIC,
        Form.INDEX,
        Form.MASK,
        Form.PARAMETER,
        Form.EXTERNAL,
        Form.CAST_PARAMETER,
        Form.RECAST_WEIGHT,
    }
)


class Probe:
    """The handle :meth:`ActivationCapture.probing` yields: which slot is quantized now."""

    def __init__(self, seed: int):
        self.slots: list[str] = []
        self._held: dict[str, tuple[torch.Tensor, GroupQuantCodec, int | None]] = {}
        self.noisy_slot: str | None = None
        self.bits = 2
        #: The noisy slot's decoded tensor (:meth:`quantize_only`): every read of the slot then
        #: sees the same rounding, as reads of one stored record do.
        self.decoded: torch.Tensor | None = None
        #: While set, the backward nodes that read each slot (slot -> nodes, in order).
        self.readers: dict[str, list] | None = None
        self._seed = seed
        self._draws = 0

    def quantize_only(self, slot: str | None, bits: int, decoded: torch.Tensor | None = None) -> None:
        """Quantize ``slot`` alone at ``bits`` in the following backward passes (a fresh rounding
        per read, or ``decoded``)."""
        self.noisy_slot = slot
        self.bits = bits
        self.decoded = decoded

    def decode(self, slot: str, bits: int, seed: int | None = None) -> torch.Tensor:
        """``slot``'s held tensor rounded once at ``bits``, as its record would decode it."""
        dense, codec, group_axis = self._held[slot]
        return codec.pack(dense, bits, self.next_seed() if seed is None else seed, group_axis).unpack()

    def next_seed(self) -> int:
        self._draws += 1
        return splitmix64(self._seed + self._draws) >> 1

    def add(self, slot: str, dense: torch.Tensor, codec: GroupQuantCodec, group_axis: int | None) -> None:
        """A slot to probe, with the exact tensor its record holds, its quantizer and group axis."""
        self.slots.append(slot)
        self._held[slot] = (dense, codec, group_axis)

    def rounding_energies(self, widths: Sequence[int]) -> torch.Tensor:
        """``||Q_b(x) - x||**2`` of every slot (rows) at every width (columns), one rounding each:
        each slot's noise before backward scales it."""
        rows = []
        for slot in self.slots:
            dense, codec, group_axis = self._held[slot]
            errors = [
                (codec.pack(dense, b, self.next_seed(), group_axis).unpack() - dense).float().square().sum()
                for b in widths
            ]
            rows.append(torch.stack(errors))
        return torch.stack(rows).cpu() if rows else torch.zeros(0, len(widths))


class SaveStore:
    """Stores the saves of one capture (reading its report, policy, slots and probe), one session
    at a time (:meth:`start`)."""

    def __init__(self, capture: Capture):
        self.capture = capture
        config = capture.config
        self._codecs = {name: make_codec(name, config.group_size, config.block) for name in CODECS}
        #: The codec of float tensors that no rule assigns another.
        self.codec = self._codecs[config.codec]
        # Quantizers with smaller groups, for normalisations' rows shorter than a group.
        self._row_codecs: dict[int, GroupQuantCodec] = {}
        self._mask_codec = MaskCodec()
        self._sign_codec = SignMaskCodec()
        self._index_codec = IndexCodec()
        # What each decision means in a module for an op, by (module, op, id(decision)).
        self._terms: dict[tuple[str, str | None, int], _Terms] = {}
        # Per slot, what its saves repeat from step to step.
        self._slot_plans: dict[str, _SlotPlan] = {}
        self.start(seed=0)

    def start(self, seed: int) -> None:
        """Begin a session whose rounding noise is drawn from ``seed``."""
        self._seed = seed
        self._packs = 0
        self._slot_counts: dict[str, int] = {}
        self._dedup: dict[tuple, Shared] = {}
        self._saved_storages: dict[int, StorageWeakRef] = {}
        self._kept_storages: dict[int, StorageWeakRef] = {}
        #: The stored records' group statistics, for the non-finite check at release.
        self.stats: list[torch.Tensor] = []

    def release(self) -> list[torch.Tensor]:
        """Forget the copies kept for sharing (so backward frees each record right after its
        reader) and hand back the statistics."""
        stats, self.stats, self._dedup = self.stats, [], {}
        return stats

    def _account(
        self,
        module: str,
        op: str | None,
        t: torch.Tensor,
        outcome: Outcome,
        stored: int,
        copied: bool = False,
        bits: Any = NO_BITS,
        codec: str | None = None,
        untraced: str | None = None,
    ) -> None:
        """Add one saved tensor, saved by ``op`` in ``module``, to the report, stored at ``bits``
        (None: exact) by ``codec``; its storage counts once however often saved. ``copied``: a
        tensor its outcome keeps, kept as a copy of ``stored`` bytes instead. ``untraced``: why
        its op could not be traced."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        saved = 0
        # A weak reference only for a storage not seen yet: most saves share one.
        seen = self._saved_storages.get(ptr)
        if seen is None or _storage_expired(seen.cdata):
            self._saved_storages[ptr] = seen = StorageWeakRef(storage)
            saved = storage.nbytes()
        if outcome.keeps_storage and not copied:
            if live(self._kept_storages, ptr):
                stored = 0
            else:
                self._kept_storages[ptr] = seen
                stored = storage.nbytes()
        self.capture.report.count(module, op, outcome, saved, stored, bits, codec, untraced)

    def count_uncounted(self, outcome: Outcome) -> None:
        """Count a tensor that stays alive anyway: it is in neither byte total."""
        counts, key = self.capture.report.counts, outcome.key
        counts[key] = counts.get(key, 0) + 1

    def _next_slot(self, module: str) -> str:
        index = self._slot_counts.get(module, 0)
        self._slot_counts[module] = index + 1
        return f"{module}#{index}"

    def store(self, t: torch.Tensor, call: TrackedCall | None, decision: Decision, module: str, ptr: int) -> Any:
        """What autograd holds for ``t``, stored as ``decision`` says."""
        op = None if call is None else call.name
        form = decision.form
        if form is Form.MATCH:
            return self._store_match(t, call, decision, module)
        if form is Form.RECOMPUTE:
            return self._store_recomputed(t, call, decision, module, ptr)
        if form is Form.PARAMETER or form is Form.EXTERNAL:
            self.count_uncounted(Outcome.PARAMETER if form is Form.PARAMETER else Outcome.EXTERNAL)
            return t.detach()
        if form is Form.RECAST_WEIGHT:
            self._account(module, op, t, Outcome.RECAST, 0)
            return RecastWeight(decision.parameter, t)
        if form is Form.CAST_PARAMETER:
            self._account(module, op, t, Outcome.KEPT, 0)
            return t.detach()
        key, region = self._sharing_key(t, ptr, decision)
        shared = self._shared_copy(key, t, module, op, decision)
        if shared is not None:
            self._account(module, op, t, Outcome.DEDUPLICATED, 0)
            return shared
        if form is Form.KEEP or form is Form.STATISTIC:
            if form is Form.STATISTIC:
                self._account(module, op, t, Outcome.STATISTIC, 0)
            elif decision.untraced is None:
                self._account(module, op, t, Outcome.KEPT, 0)
            else:
                self._account(module, op, t, Outcome.UNTRACED, 0, untraced=decision.untraced)
            kept = t.detach()
            self._share(key, region, t, t, kept, decision, None)  # later saves need no copy
            return kept
        dense = decision.layout.dense(t)
        _hold_until_read(t)
        if form is Form.QUANTIZE:
            terms = self._terms_of(module, op, decision)
            saved = self._store_rounded(t, dense, decision, module, op, terms.codec)
        else:
            terms = None
            saved = self._store_lossless(t, dense, decision, module, op)
        self._share(key, region, t, dense, saved, decision, terms)
        return saved

    # ----------------------------------------------------------------- one copy for many saves
    @staticmethod
    def _sharing_key(t: torch.Tensor, ptr: int, decision: Decision) -> tuple[tuple, tuple[int, int] | None]:
        """The key under which saves of one tensor find one stored copy, and the run of storage
        ``t`` fills (None if none). A view filling a run is keyed by the run, so its other views
        (a transpose, a reshape) find its copy; any other view by its own layout. A sign mask,
        cells, or an op's own substitute serve only saves stored in that same form."""
        region = storage_region(t)
        where = region if region is not None else (t.storage_offset(), t.shape, t.stride())
        form = None
        if decision.form is Form.SIGN_MASK or decision.form is Form.CELLS:
            form = (decision.form, decision.divisor, decision.interval, decision.cells)
        elif decision.substitute is not None and decision.substitute.for_its_op_alone:
            form = decision.substitute
        return (ptr, where, t.dtype, t._version, form), region

    def _shared_copy(self, key: tuple, t: torch.Tensor, module: str, op: str | None, decision: Decision) -> Any:
        """What autograd may hold for ``t`` from an earlier save's copy, or None."""
        cached = self._dedup.get(key)
        if cached is None or _storage_expired(cached.storage.cdata):
            return None
        if decision.row_group is not None and cached.rows not in (None, (decision.row_group, decision.row_layout)):
            # Groups spanning a normalisation's rows would put a loud row's noise into a
            # near-constant row, whose 1 / std multiplies it: stored again, in its own rows.
            return None
        needed = self._terms_of(module, op, decision).needed
        if cached.view == (t.shape, t.stride()):
            # A copy with fewer bits than this save needs is stored again at this save's floor
            # (:meth:`_supersede` then frees the old one).
            return cached.saved if cached.view_guaranteed >= needed else None
        if cached.run_guaranteed >= needed:
            if not cached.viewed:
                self._dedup[key] = cached._replace(viewed=True)
            return RegionView(cached.record, t)
        return None

    def _share(
        self,
        key: tuple,
        region: tuple[int, int] | None,
        t: torch.Tensor,
        dense: torch.Tensor,
        saved: Any,
        decision: Decision,
        terms: _Terms | None,
    ) -> None:
        """Offer what was stored for ``t`` to the later saves of the same tensor; ``terms``:
        those of a rounded copy (:meth:`_terms_of`)."""
        # A copy guarantees its floor and rule, not the policy's bits, so sharing is the same
        # under any policy and in probes. Masks, indices and kept tensors are exact; a pooled
        # copy serves its own view's saves (pooling is chosen for every save alike).
        if decision.form is not Form.QUANTIZE:
            view_guaranteed = run_guaranteed = math.inf
        elif terms.codec.unbiased:
            view_guaranteed = run_guaranteed = terms.needed
        else:  # a pooled copy has lost detail other ops may need: it guarantees them nothing
            view_guaranteed, run_guaranteed = math.inf, 0.0
        run_record = None
        in_memory_order = not isinstance(saved, Compressed) or saved.layout.memory_order
        if region is not None and in_memory_order:
            # In memory order the stored dense tensor is the run itself: other views may share
            # it unless they need more bits than it guarantees.
            run_record = saved.record if isinstance(saved, Compressed) else KeptRecord(dense)
        else:
            run_guaranteed = 0.0
        # The storage's weak reference, made when the save was accounted.
        storage = self._saved_storages[key[0]]
        rows = None if decision.form is not Form.QUANTIZE else (decision.row_group, decision.row_layout)
        earlier = self._dedup.get(key)
        self._dedup[key] = later = Shared(
            storage, (t.shape, t.stride()), saved, run_record, view_guaranteed, run_guaranteed, rows
        )
        if earlier is not None:
            self._supersede(earlier, later)

    def _supersede(self, earlier: Shared, later: Shared) -> None:
        """Let an earlier save of the same view read a later save's copy with more bits, and free
        the earlier one: terms backward reads from two differently rounded copies would not cancel
        (RMSNorm written out: ``pow`` saves ``x`` before ``mul``). Only where the later copy serves
        every use the earlier did, no other view decodes the earlier record, and no substitute."""
        old, new = earlier.saved, later.saved
        if (
            _storage_expired(earlier.storage.cdata)
            or earlier.viewed
            or earlier.view != later.view
            or not isinstance(old, Compressed)
            or old.slot is None
            or old.substitute is not None
            or later.view_guaranteed < earlier.view_guaranteed
        ):
            return
        if isinstance(new, torch.Tensor):
            record, layout = KeptRecord(new), Layout.as_it_is()
        elif isinstance(new, Compressed) and new.substitute is None and isinstance(new.record, QuantizedTensor):
            record, layout = new.record, new.layout
        else:
            return
        stored = old.record.nbytes
        old.record, old.layout = record, layout
        report = self.capture.report
        slot = report.slots[old.slot]
        report.slots[old.slot] = dataclasses.replace(slot, stored_bytes=0, codec="shared")
        memory = report.modules[slot.module]
        report.stored_bytes -= stored
        memory.stored_bytes -= stored
        memory.compressed -= 1
        for counts in (report.counts, memory.outcomes):
            counts[Outcome.COMPRESSED.value] -= 1
            counts[Outcome.DEDUPLICATED.value] = counts.get(Outcome.DEDUPLICATED.value, 0) + 1

    def _terms_of(self, module: str, op: str | None, decision: Decision) -> _Terms:
        """The codec and fewest bits of ``decision`` for a save by ``op`` in ``module``, once per
        decision, keyed by its id (the entry holds the decision, so the id stays unique)."""
        key = (module, op, id(decision))
        terms = self._terms.get(key)
        if terms is None or terms.policy is not self.capture.policy:
            if len(self._terms) >= _TERMS_KEPT:  # new decisions at every step: start again
                self._terms.clear()
            terms = self._terms[key] = _Terms(
                decision,
                self.capture.policy,
                self._codec_for(module, op, decision),
                self._bits_needed(module, op, decision),
            )
        return terms

    def _bits_needed(self, module: str, op: str | None, decision: Decision) -> float:
        """The fewest bits a copy stored for another save may have to serve this one: the floor,
        or what a rule pins (exact: inf). A save kept as it is needs it exactly."""
        if decision.form is Form.KEEP or decision.form is Form.STATISTIC:
            return math.inf
        needed = decision.min_bits
        rule = self.capture.policy.rules.lookup(module, op)
        if rule is not None and rule.pins_bits:
            needed = math.inf if rule.bits is None else max(needed, rule.bits)  # None: exact
        return needed

    def _codec_for(self, module: str, op: str | None, decision: Decision):
        rule = self.capture.policy.rules.lookup(module, op)
        codec = self._codecs[rule.codec] if rule is not None and rule.codec else self.codec
        # ReLU's backward reads its output's zeros, and the next layer's record is that same one.
        if decision.keeps_zeros and not codec.keeps_zeros:
            codec = self._codecs["quant"]
        if decision.row_group is not None and isinstance(codec, GroupQuantCodec):
            group_size = min(decision.row_group, codec.group_size)
            if MIN_GROUP_SIZE <= group_size < codec.group_size:  # else rows too short to align to
                codec = self._row_codecs.setdefault(group_size, GroupQuantCodec(group_size))
        return codec

    def _store_match(self, t: torch.Tensor, call: TrackedCall, decision: Decision, module: str) -> MatchedSave:
        """A tensor backward only compares with a value computed from other saves of its call:
        held as it is until those are saved (within the call), then as the comparison's
        outcome; as it is for good where a partner is stored lossy or never comes."""
        saved = MatchedSave(t, decision.match)
        last = max(decision.match.partners)

        def settle(final: bool) -> bool:
            arrived = last < len(call.saved)
            if not arrived and not final:
                return False  # a partner is still to be saved
            partners = [call.saved[p] for p in decision.match.partners] if arrived else []
            stored = None
            if arrived and all(form in _EXACT_FORMS for _, form in partners):
                stored = saved.settle([record for record, _ in partners])
            if stored is None:
                self._account(module, call.name, t, Outcome.KEPT, 0)
            else:
                self._account(module, call.name, t, Outcome.LOSSLESS, stored, codec=MaskCodec.name)
            return True

        if last >= call.saves - 1:  # a partner saved after this tensor
            call.waiting = (call.waiting or []) + [settle]
        else:
            settle(False)
        return saved

    def store_match_partner(self, t: torch.Tensor, call: TrackedCall, decision: Decision, module: str, ptr: int) -> Any:
        """A tensor matched saves of its call are compared with (``scatter_reduce`` amax's result).
        They take their outcomes against ``t`` itself, then ``t`` is stored at its bits and their
        stand-ins are rebuilt from its copy, so comparisons come out as with exact tensors. Exact
        where one cannot store its outcome now, and while probing (rounded again per decode)."""
        index = len(call.saved)
        call.saved.append((t.detach(), Form.KEEP))
        if call.waiting:
            call.waiting = [settle for settle in call.waiting if not settle(False)]
        dependents = [saved for saved, form in (call.saved[d] for d in decision.match_partner) if form is Form.MATCH]
        settled = (
            self.capture.probe is None
            and len(dependents) == len(decision.match_partner)
            and all(saved.matched is not None for saved in dependents)
        )
        final = decision._replace(match_partner=()) if settled else Decision(Form.KEEP)
        if settled and t.device.type == "cpu" and bool(torch.isfinite(t).all()):
            # Nothing to replace (on the CPU looking costs no sync): other saves may share it.
            final = final._replace(substitute=None)
        stored = self.store(t, call, final, module, ptr)
        call.saved[index] = (stored, final.form)
        for saved in dependents:
            if saved.matched is not None:
                saved.partners[saved.match.partners.index(index)] = stored
        return stored

    def _store_recomputed(self, t: torch.Tensor, call: TrackedCall, decision: Decision, module: str, ptr: int) -> Any:
        """A fused attention's output: nothing stored; recomputed in backward from the call's
        stored query, key and value (once for output and logsumexp). Exact where those are absent."""
        recompute = decision.recompute
        if max(recompute.inputs) >= len(call.saved):
            return self.store(t, call, Decision(Form.KEEP), module, ptr)
        inputs = [call.saved[i][0] for i in recompute.inputs]
        recomputation = next(
            (
                saved.recomputation
                for saved, _ in call.saved
                if isinstance(saved, RecomputedOutput)
                and saved.recomputation.recompute.inputs == recompute.inputs
                and saved.recomputation.recompute.target is recompute.target
            ),
            None,
        ) or Recomputation(recompute, inputs)
        self._account(module, call.name, t, Outcome.RECOMPUTED, 0)
        return RecomputedOutput(recomputation, recompute.output, t)

    def _store_lossless(
        self, t: torch.Tensor, dense: torch.Tensor, decision: Decision, module: str, op: str | None
    ) -> Compressed:
        """A mask or indices, stored exactly in fewer bits."""
        form = decision.form
        if form is Form.INDEX:
            record = self._index_codec.pack(dense, 0, 0, value_range=decision.value_range)
        elif form is Form.SIGN_MASK:
            record = self._sign_codec.pack(dense, 0, 0, divisor=decision.divisor, interval=decision.interval)
        elif form is Form.CELLS:
            cells = decision.cells
            record = self._index_codec.pack(cells.cell(dense), 0, 0, value_range=(0, cells.count - 1))
        else:
            record = self._mask_codec.pack(dense, 0, 0)
        name = form.value if form is Form.CELLS else record.codec  # the cells' indices, by what they are
        self._account(module, op, t, Outcome.LOSSLESS, record.nbytes, codec=name)
        return Compressed(record, decision.layout, decision.cells)

    def _store_rounded(
        self,
        t: torch.Tensor,
        dense: torch.Tensor,
        decision: Decision,
        module: str,
        op: str | None,
        codec: GroupQuantCodec | DivisionCodec | PoolCodec,
    ) -> Any:
        """A floating-point tensor in its slot, by ``codec`` (the rules' or the default) at
        the bits the rules and policy give it."""
        layout = laid_out = decision.layout
        kept_copy = dense  # what an exact slot keeps where ``t`` is a view of a larger storage
        slot = self._next_slot(module)
        if decision.row_layout is not None and isinstance(codec, GroupQuantCodec):
            # A normalisation's rows laid out for the quantizer's groups.
            layout = decision.row_layout
            dense = layout.dense(t)
        restorer = None
        if decision.substitute is not None:
            dense, restorer = decision.substitute.store(dense)
        plan = self._slot_plans.get(slot)
        if plan is None or plan.decision is not decision or plan.op != op or plan.codec is not codec:
            # A slot's sizes follow from its decision, op and codec: described once.
            info = SlotInfo(
                module=module,
                shape=tuple(t.shape),
                numel=dense.numel(),
                groups=-(-dense.numel() // getattr(codec, "group_size", self.capture.config.group_size)),
                element_bits=dense.element_size() * 8,
                op=op,
                min_bits=decision.min_bits,
            )
            plan = self._slot_plans[slot] = _SlotPlan(decision, op, codec, info)
        info = plan.info
        probing = self.capture.probe is not None
        if not probing or slot not in self.capture.slots:
            # A probe runs on a few rows of the batch: the policy keeps planning with the
            # training step's sizes, not the probe's smaller ones.
            self.capture.slots[slot] = info
        bits = None if probing else self.capture.policy.bits_for(slot, info)
        # Groups along another axis where that rounds with less noise at the slot's width
        # (while probing, the nominal one).
        group_axis = None
        if codec is self._codecs["quant"] and self.capture.chooses_group_axes and (probing or bits is not None):
            group_axis = self.capture.group_orders.order(slot, dense, bits or self.capture.nominal_bits)
        if probing:
            # Probed through the quantizer with the groups the tensor would be stored in.
            probe_codec = codec if isinstance(codec, GroupQuantCodec) else self._codecs["quant"]
            if not self.capture.policy.pins_bits(info):  # a rule decides its bits: nothing to measure
                self.capture.probe.add(slot, dense.detach(), probe_codec, group_axis)
            self._account(module, op, t, Outcome.EXACT, 0)
            return Compressed(
                ProbeRecord(self.capture.probe, slot, dense.detach(), probe_codec, group_axis), layout, restorer
            )
        dense_bytes = layout.numel * dense.element_size()  # without the padding of rows
        if bits is None:
            return self._store_exact(t, kept_copy, laid_out, module, op, slot, dense_bytes)
        self._packs += 1
        seed = splitmix64(self._seed + self._packs) >> 1
        record = codec.pack(dense, bits, seed) if group_axis is None else codec.pack(dense, bits, seed, group_axis)
        if isinstance(record, StoredTensor):  # a shape the codec does not compress (pool on 2-D)
            self._account(module, op, t, Outcome.KEPT, 0)
            return t.detach()
        self.stats.append(record.stats)
        if self.capture.estimator is not None and isinstance(codec, (GroupQuantCodec, DivisionCodec)):
            self.capture.estimator.observe_stats(slot, module, record.stats, bits, codec.group_size)
        self._account(module, op, t, Outcome.COMPRESSED, record.nbytes, bits=bits, codec=record.codec)
        self.capture.report.slots[slot] = plan.memory_of(bits, dense_bytes, record.nbytes, record.codec)
        return Compressed(record, layout, restorer, slot)

    def _store_exact(
        self,
        t: torch.Tensor,
        dense: torch.Tensor,
        layout: Layout,
        module: str,
        op: str | None,
        slot: str,
        dense_bytes: int,
    ) -> Any:
        """A slot kept exact: ``t`` itself or, where ``t`` views part of a storage nothing else
        keeps (a third of ``qkv``'s output), a copy, as the view would hold the whole storage."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if exact_form(storage.nbytes(), dense_bytes) is Form.KEEP or live(self._kept_storages, ptr):
            self._account(module, op, t, Outcome.EXACT, 0, bits=None)
            saved = t.detach()
        else:
            # ``dense`` is ``t``'s values in memory order: a view where they are one run of the
            # storage, else already a copy.
            copy = dense.clone() if dense.untyped_storage().data_ptr() == ptr else dense
            self._account(module, op, t, Outcome.EXACT, dense_bytes, copied=True, bits=None)
            saved = Compressed(KeptRecord(copy.detach()), layout)
        self.capture.report.slots[slot] = SlotMemory(
            module, tuple(t.shape), None, dense_bytes, dense_bytes, "stored", op
        )
        return saved


class _SlotPlan:
    """What a slot's saves repeat from step to step: decision, op, codec, description and last
    report entry."""

    __slots__ = ("decision", "op", "codec", "info", "memory")

    def __init__(
        self, decision: Decision, op: str | None, codec: GroupQuantCodec | DivisionCodec | PoolCodec, info: SlotInfo
    ):
        self.decision, self.op, self.codec, self.info = decision, op, codec, info
        self.memory: SlotMemory | None = None

    def memory_of(self, bits: int, saved_bytes: int, stored_bytes: int, codec: str) -> SlotMemory:
        """The slot's report entry for this save: the last one where nothing changed."""
        memory = self.memory
        if (
            memory is None
            or memory.bits != bits
            or memory.saved_bytes != saved_bytes
            or memory.stored_bytes != stored_bytes
            or memory.codec != codec
        ):
            info = self.info
            memory = self.memory = SlotMemory(info.module, info.shape, bits, saved_bytes, stored_bytes, codec, info.op)
        return memory


#: ``StorageWeakRef.expired`` without the ``eval`` torch's method runs per call (checked per save).
_storage_expired = torch.UntypedStorage._expired

#: Entries :meth:`SaveStore._terms_of` keeps before it starts again.
_TERMS_KEPT = 4096


class _Terms(NamedTuple):
    """What a decision means for a save by one op in one module, under one policy's rules."""

    decision: Decision  # held: its id keys the entry
    policy: BitPolicy
    codec: GroupQuantCodec | DivisionCodec | PoolCodec
    needed: float


def _hold_until_read(t: torch.Tensor) -> None:
    """Keep ``t``'s memory from reuse until the kernels queued on the current stream read it: the
    caller drops ``t`` at once, which would return it to its own stream's pool."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def live(table: dict[int, StorageWeakRef], ptr: int) -> bool:
    """Whether ``table`` holds a weak reference to the storage at ``ptr`` that is still alive."""
    ref = table.get(ptr)
    return ref is not None and not _storage_expired(ref.cdata)
