"""The capture engine: for every tensor autograd saves for backward, ask
:func:`~lightning_act.capture.decide.decide` how it is stored, store it at once, share one
stored copy between the saves of one tensor, attribute it to the module that saved it, and
account its bytes.

Framework-free: :class:`ActivationCapture` works with any ``nn.Module`` (or none), and the
Lightning callback is a thin scheduler around it. A tensor is compressed at pack time: a
deferred copy would miss in-place changes, which autograd no longer detects once hooks are
installed. Which op saves a tensor comes from an :class:`~lightning_act.optrack.OpTracker`
entered for the session.

The session's saved-tensor hooks are the :class:`~lightning_act.capture.compiled.GraphHooks`
pair: torch inlines it into the graphs it compiles in the session, and called eagerly it
hands each tensor to :meth:`ActivationCapture._pack` here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.metadata
import math
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_code_exec_strategy
from torch._dynamo import trace_rules
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_act import backward_reads
from lightning_act.capture import compiled as compiled_module
from lightning_act.capture import decide as decide_module
from lightning_act.capture.active import CAPTURING, capturing_now, splitmix64
from lightning_act.capture.compiled import (
    COMPILED_REGION,
    CheaperSaves,
    GraphHooks,
    NativeSaves,
    PackedSave,
    SeedStream,
)
from lightning_act.capture.decide import Decision, Kind, decide
from lightning_act.capture.group_order import GroupOrders
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
    storage_key,
    storage_region,
)
from lightning_act.capture.report import (
    NO_BITS,
    OUTSIDE_MODULES,
    CompressionReport,
    Outcome,
    ReportDelta,
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
from lightning_act.config import CODECS, CompressionConfig
from lightning_act.ops import count_nonfinite_groups
from lightning_act.ops.validation import MIN_GROUP_SIZE
from lightning_act.optrack import OpTracker, TrackedCall
from lightning_act.policy import AllocatedBits, BitPolicy, FixedBits, SlotInfo, TargetBits
from lightning_act.policy.bits import SaveRules
from lightning_act.policy.estimators import GradientSensitivity, probe_sensitivities, update_weights

_VERSION = importlib.metadata.version("lightning_act")
# What a compiled graph's plans depend on besides the settings: the code that makes them.
# Torch's AOT autograd cache reuses a graph across processes by this name, so an upgraded
# (or edited) library never runs a graph planned by another version.
_PLANNING_CODE = hashlib.sha256(
    b"".join(Path(module.__file__).read_bytes() for module in (backward_reads, decide_module, compiled_module))
).hexdigest()[:16]


# The kinds of save stored exactly, which a comparison's outcome may be stored against.
_EXACT_KINDS = frozenset(
    {
        Kind.KEEP,
        Kind.STATISTIC,
        Kind.INDEX,
        Kind.MASK,
        Kind.PARAMETER,
        Kind.EXTERNAL,
        Kind.CAST_PARAMETER,
        Kind.RECAST_WEIGHT,
    }
)


class Probe:
    """The handle :meth:`ActivationCapture.probing` yields: which slot is quantized now."""

    def __init__(self, seed: int):
        self.slots: list[str] = []
        self._held: dict[str, tuple[torch.Tensor, GroupQuantCodec, int | None]] = {}
        self.noisy_slot: str | None = None
        self.bits = 2
        #: The noisy slot's decoded tensor, given by :meth:`quantize_only`: every read of
        #: the slot then sees the same rounding, as the reads of one stored record do.
        self.decoded: torch.Tensor | None = None
        #: While set, the backward nodes that read each slot (slot -> nodes, in order).
        self.readers: dict[str, list] | None = None
        self._seed = seed
        self._draws = 0

    def quantize_only(self, slot: str | None, bits: int, decoded: torch.Tensor | None = None) -> None:
        """Quantize ``slot`` alone at ``bits`` in the following backward passes (with a
        fresh rounding per read, or as ``decoded``: see :meth:`decode`)."""
        self.noisy_slot = slot
        self.bits = bits
        self.decoded = decoded

    def decode(self, slot: str, bits: int, seed: int | None = None) -> torch.Tensor:
        """``slot``'s held tensor rounded once at ``bits`` (with ``seed``, else the next
        one), as its record would decode it."""
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
        """``||Q_b(x) - x||**2`` of every slot (rows) at every width (columns), from one
        rounding each, on the device: what the slot's noise is at each width, before
        backward scales it."""
        rows = []
        for slot in self.slots:
            dense, codec, group_axis = self._held[slot]
            errors = [
                (codec.pack(dense, b, self.next_seed(), group_axis).unpack() - dense).float().square().sum()
                for b in widths
            ]
            rows.append(torch.stack(errors))
        return torch.stack(rows).cpu() if rows else torch.zeros(0, len(widths))


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

    _sessions_in_process = 0

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
        # Quantizers with smaller groups, for normalisations' rows shorter than a group.
        self._row_codecs: dict[int, GroupQuantCodec] = {}
        #: Per slot, the axis its quantization groups run along (decided on its first step).
        self.group_orders = GroupOrders.of(model, self.config.group_size)
        self._mask_codec = MaskCodec()
        self._sign_codec = SignMaskCodec()
        self._index_codec = IndexCodec()
        self._tracker = OpTracker()
        # Decisions of earlier saves, which later steps' saves of the same calls find again.
        self._decided: dict[tuple, Decision] = {}
        # What each decision means in a module for an op, by (module, op, id(decision)).
        self._terms: dict[tuple[str, str | None, int], _Terms] = {}
        # Per slot, what its saves repeat from step to step.
        self._slot_plans: dict[str, _SlotPlan] = {}
        self.policy = policy or FixedBits(self.config.bits)
        self.model = model
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        # The model's modules, listed once, and their buffer tables (the dicts themselves, so
        # a buffer a module registers or replaces later is seen): buffers are marked alive at
        # every start without walking the tree, and with no call for a module that has none.
        self._modules: list[nn.Module] = [] if model is None else list(model.modules())
        self._buffer_tables = [module._buffers for module in self._modules]
        if model is not None:
            for name, module in model.named_modules():
                # A compiled module's modules are registered under its wrapper's ``_orig_mod``:
                # named as in the module the user compiled.
                name = ".".join(part for part in name.split(".") if part != "_orig_mod")
                self._names[module] = name or type(module).__name__
        # The model's modules of a class it has more of: one compiled graph may serve the
        # calls of all of them, so its saves cannot be named by one. Wrappers that
        # ``torch.compile`` made are left out: each bears the name of the module it wraps.
        modules = [m for m in self._modules if not isinstance(m, OptimizedModule)]
        classes = collections.Counter(type(module) for module in modules)
        self._shared_class_names = {self._names[m] for m in modules if classes[type(m)] > 1}
        self.chooses_group_axes = self.config.group_order == "auto"
        #: Every slot seen so far, with what the policy needs to allocate bits to it.
        self.slots: dict[str, SlotInfo] = {}
        #: Set by the caller for the sessions whose statistics feed a recalibration.
        self.estimator: GradientSensitivity | None = None
        self.report = CompressionReport()
        self.total_nonfinite_groups: torch.Tensor | int = 0
        self._rules_checked = False
        self._shared_graphs_checked = False
        self._warned_graphs_skipped = False
        self._active = False
        self._paused = False
        self._watched = False  # whether the op tracker watched when the session paused
        self._probe: Probe | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stack: list[str] = []
        # The recurrent modules running now with their fused kernels switched off, and the
        # switches to restore when each returns (``unfused_recurrent``).
        self._fused_switches: list[tuple[nn.Module, bool, bool]] = []
        self._qualnames: dict[str, str] = {}
        self._state: tuple[Any, str] = (None, "")
        self._layout_optimization: bool | None = None  # inductor's, while this session turned it off
        self._planned_graph = False  # a graph was planned in this session
        self._frames_at_start = 0  # frames dynamo had compiled when this session started
        self._filtering = "donated"  # torch's choice of the saves hooks see, outside sessions
        self._reset_session(seed=0)

    # ----------------------------------------------------------------- session control
    def _reset_session(self, seed: int) -> None:
        self.report = CompressionReport()
        self._seed = seed
        self._packs = 0
        self._slot_counts: dict[str, int] = {}
        self._dedup: dict[tuple, Shared] = {}
        self._saved_storages: dict[int, StorageWeakRef] = {}
        self._kept_storages: dict[int, StorageWeakRef] = {}
        self._external: dict[int, StorageWeakRef] = {}
        self._stats: list[torch.Tensor] = []
        # Saves kept exact because the op tracker was off (a compiled module's code run
        # eagerly), and whether any compiled graph packed a save: see _warn_if_graphs_skipped.
        self._unseen_saves = 0
        self._graph_packed = False

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
        ActivationCapture._sessions_in_process += 1
        self._planned_graph = False
        self._frames_at_start = _frames_compiled()
        if seed is None:
            # Counted per process, not per capture: a plain ``with compress_activations()``
            # block per step makes a new capture each step, and must not repeat its noise.
            seed = splitmix64(self.config.seed ^ splitmix64(ActivationCapture._sessions_in_process))
        self._reset_session(seed)
        self.mark_external(inputs)
        for table in self._buffer_tables:
            if table:
                for buffer in table.values():
                    if buffer is not None:
                        self.mark_external(buffer)
        _SharedModuleHooks.register()
        _switch_around_compiled_calls(self._modules)
        if not self._shared_graphs_checked:
            self._check_shared_graphs()
        _SharedModuleHooks.capturing.append(self)
        SeedStream.restart(seed)
        NativeSaves.follow(self)
        # Graph inputs are hooked too (an activation an earlier graph passed on at a graph
        # break), parameters and buffers not: see GraphPlan.
        self._filtering = functorch_config.saved_tensors_hooks_filtering_mode
        functorch_config.saved_tensors_hooks_filtering_mode = "no_static"
        CheaperSaves.install()
        hooks = GraphHooks.of(self._settings_state())
        self._hooks = torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
        self._hooks.__enter__()
        self._tracker.watch(True)  # last: the calls above are the library's own
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
            self._tracker.watch(False)
            self._hooks = None
            _SharedModuleHooks.capturing.remove(self)
            _SharedModuleHooks.forget_switches()
            self._stack.clear()
            NativeSaves.follow(capturing_now())
        functorch_config.saved_tensors_hooks_filtering_mode = self._filtering
        if self._layout_optimization is not None:
            sys.modules["torch._inductor.config"].layout_optimization = self._layout_optimization
            self._layout_optimization = None
        self._release_records()
        self._warn_if_graphs_skipped()
        self.group_orders.settle()
        if not self._rules_checked and self.report.modules:
            # After the first session that saved anything: a rule that matched nothing is a typo.
            self._rules_checked = True
            rules = self.policy.rules
            for module, memory in self.report.modules.items():
                for op in memory.ops or (None,):
                    # A graph torch loaded from its cache was planned, and its rules looked
                    # up, in the process that compiled it: a rule matching what it saved
                    # matched here too.
                    rules.lookup(module, op)
            ops = set().union(*(memory.ops for memory in self.report.modules.values()))
            rules.warn_unmatched(self._names.values(), ops)
        return self.report

    def shared_compiled_modules(self) -> dict[str, list[str]]:
        """The model's modules compiled one by one (``module.compile()``, ``torch.compile``
        of a submodule) whose class has several such modules, by class name: torch runs
        them all through the graphs compiled for the first one it met, whose plans name the
        saves relative to the compiled module (``mlp.0#0``) and fix each one's bits for every
        module of the class."""
        wrapped = {id(m._orig_mod) for m in self._modules if isinstance(m, OptimizedModule)}
        by_class: dict[type, list[str]] = {}
        for module in self._modules:
            if isinstance(module, OptimizedModule):
                continue
            if id(module) in wrapped or _compiled_in_place(module):
                by_class.setdefault(type(module), []).append(self._names.get(module) or type(module).__name__)
        return {kind.__name__: names for kind, names in by_class.items() if len(names) > 1}

    def _check_shared_graphs(self) -> None:
        """Refuse a memory target, and warn for per-tensor bits, where one compiled graph
        serves several modules (:meth:`shared_compiled_modules`): a plan chooses bits per
        saved tensor of each module, while the graph stores every module's saves at the bits
        planned for its own relative names, which no probe measures. On a ViT whose 6 blocks
        were compiled one by one, a 110 MiB target peaked at 142 MiB."""
        self._shared_graphs_checked = True
        if not isinstance(self.policy, AllocatedBits):
            return
        shared = self.shared_compiled_modules()
        if not shared:
            return
        listed = "; ".join(f"{len(names)} {kind} modules ({names[0]}, ...)" for kind, names in shared.items())
        remedy = (
            "compile the model whole (torch.compile(model), or trainer.fit of the compiled LightningModule) "
            "or leave these modules eager"
        )
        if isinstance(self.policy, TargetBits):
            raise ValueError(
                f"lightning_act: memory_target cannot be planned where modules compiled one by one share their "
                f"compiled graphs: {listed}. One graph stores the saves of every module of its class at one set of "
                f"bits, which the plan cannot price per module; {remedy}."
            )
        warnings.warn(
            f"lightning_act: modules compiled one by one share their compiled graphs: {listed}. Their saves are "
            f"stored at the policy's default bits, not chosen per tensor; {remedy} for per-tensor bits.",
            stacklevel=3,
        )

    def _warn_if_graphs_skipped(self) -> None:
        """Warn once where a compiled module's code ran eagerly in this session with the op
        tracker off, and no compiled graph packed any save: every tensor it saved went to
        the eager hooks unseen and was kept exact, the peak of no compression. Dynamo runs
        such code eagerly once it has recompiled a function ``recompile_limit`` times (a fit
        per fresh model in one process, shapes that change), where compiling failed, and for
        a call it breaks the graph at and cannot trace, made outside a submodule's call (a
        submodule called eagerly, such as ``nn.GRU``, turns the tracker back on)."""
        if not self._unseen_saves or self._graph_packed or self._warned_graphs_skipped:
            return
        self._warned_graphs_skipped = True
        limit = getattr(sys.modules.get("torch._dynamo.config"), "recompile_limit", None)
        warnings.warn(
            f"lightning_act: code of a compiled module ran eagerly in this step and no compiled graph stored "
            f"anything: {self._unseen_saves} saved tensors reached the eager hooks unseen and were kept exact, "
            "uncompressed. Dynamo runs code eagerly once it has recompiled a function "
            f"torch._dynamo.config.recompile_limit times ({limit}), where compiling failed, and for a call it "
            "breaks the graph at and cannot trace; its log names the function. Raise the limit, "
            "mark the changing sizes dynamic, call torch._dynamo.reset() between fits of fresh models, or compile "
            "the submodules Dynamo can trace rather than the whole model.",
            stacklevel=2,
        )

    def _settings_state(self) -> str:
        """Everything a compiled graph's plans depend on, as one name (see :class:`GraphHooks`)."""
        policy = self.policy
        # An allocation is replaced, never changed in place: the name is made again only then.
        key = (id(policy), id(getattr(policy, "assignment", None)))
        if self._state[0] != key:
            # Not the seed: the graphs draw their noise from a stream seeded at run time, so
            # a capture per step with a seed of its own must not compile new graphs.
            planned = dataclasses.replace(self.config, seed=0)
            described = repr(
                (_VERSION, _PLANNING_CODE, planned, type(policy).__name__, policy.rules.rules, policy.choices_state())
            )
            self._state = (key, f"lightning_act-{hashlib.sha256(described.encode()).hexdigest()[:24]}")
        return self._state[1]

    def module_name(self, qualname: str | None) -> str:
        """The report's name of a module a compiled graph names relative to the compiled
        module (``layer1.0.conv1``): the model's module whose name ends with it, where one does.
        A node outside the compiled module's modules (None, or ``""``: the compiled module
        itself) is named as eager names its saves, by the module whose call is compiling,
        unless the graph may serve other modules of its class too."""
        if not qualname:
            name = self._stack[-1] if self._stack else OUTSIDE_MODULES
            return COMPILED_REGION if name in self._shared_class_names else name
        known = self._qualnames.get(qualname)
        if known is None:
            names = {n for n in self._names.values() if n == qualname or n.endswith("." + qualname)}
            known = self._qualnames[qualname] = names.pop() if len(names) == 1 else qualname
        return known

    def compiling(self) -> None:
        """A graph is being compiled in this session: check that its settings hold inside
        graphs, and turn off inductor's layout optimization until the session stops.

        Compiled graphs store floating-point saves with the ``quant`` codec alone (their plans
        carry a quantizer's codes, not DIVISION's or the pool codec's tiles): a ``division`` or
        ``pool`` codec, set or named by a rule, is an error here, never silently replaced.

        Inductor lowers the graph after the hooks are inlined, and
        with it on, it stores a channels-last copy of every convolution's weight and input
        for backward, which no hook sees: ResNet-18's forward kept 184.6 MiB compiled against
        142.4 MiB eager, and 51.8 MiB at 2 bits instead of 9.5 MiB
        (``benchmarks/compiled.py``). ``TORCHINDUCTOR_LAYOUT_OPTIMIZATION=1`` keeps it on."""
        check_compiled_codecs(self.config, self.policy.rules)
        self._planned_graph = True
        config = sys.modules.get("torch._inductor.config")
        if config is None or self._layout_optimization is not None or "TORCHINDUCTOR_LAYOUT_OPTIMIZATION" in os.environ:
            return
        self._layout_optimization = config.layout_optimization
        config.layout_optimization = False

    @property
    def compiled_in_session(self) -> bool:
        """Whether a graph was compiled since the session started (its step's peak then holds
        the compiler's work): planned here, or taken from torch's caches (dynamo still traced
        a frame)."""
        return self._planned_graph or _frames_compiled() != self._frames_at_start

    def external_storages(self) -> list[int]:
        """The storages (data pointers) marked as alive for the whole step."""
        return list(self._external)

    def keeps_alive(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage stays alive for the whole step anyway (the batch, buffers)."""
        return self._live(self._external, t.untyped_storage().data_ptr())

    def account_compiled(self, plan: str, t: torch.Tensor, parts: list[torch.Tensor], kept_alive: bool = False) -> None:
        """Add a tensor a compiled graph packed (and the kept saves its plan carries) to the
        report; ``kept_alive``: one it kept as it is instead (see :meth:`keeps_alive`)."""
        save = PackedSave.of(plan, t, parts)
        if kept_alive:
            self.report.add(save.kept_alive)
            self._graph_packed = True
        elif save.slot_info is None:
            self.account_packed(save.delta, [], [])
        else:
            self.account_packed(save.delta, [parts[1]], [save])

    def account_packed(self, delta: ReportDelta, stats: list[torch.Tensor], quantized: Sequence[PackedSave]) -> None:
        """Add packed saves to the report. ``delta`` sums them (worked out once per plan, or
        once per set of plans for what the graph ops' C++ side packed: see
        :class:`PackedSave`); ``stats`` holds their groups' stats, one tensor per save of
        ``quantized`` or, where that is empty, concatenated (all the non-finite check needs,
        while no estimator observes them)."""
        self.report.add(delta)
        self._graph_packed = True
        self._stats.extend(stats)
        for save in quantized:
            if save.plan.slot not in self.slots:  # a graph from torch's cache: planned in another process
                self.slots[save.plan.slot] = save.slot_info
        if self.estimator is not None:
            for save, group_stats in zip(quantized, stats):
                plan = save.plan
                self.estimator.observe_stats(plan.slot, plan.module, group_stats, plan.bits, plan.group_size)

    def _release_records(self) -> None:
        """Count the non-finite groups stored so far and forget the records kept for sharing
        copies between saves: from now on autograd alone holds each record, so backward frees
        it right after the node that reads it, instead of all of them at the end of the step."""
        if self._stats:
            with torch._C.DisableTorchFunction():  # the library's own ops: no op tracker
                # Whole rows, twice the bytes of their first columns: slicing each record's
                # column first cost more than the concatenation (0.2 ms of a 50-layer step).
                stats = self._stats[0] if len(self._stats) == 1 else torch.cat(self._stats)
                found = count_nonfinite_groups(stats)
                self.report.nonfinite_groups = self.report.nonfinite_groups + found
                self.total_nonfinite_groups = self.total_nonfinite_groups + found
        self._stats = []
        self._dedup = {}

    def close(self) -> None:
        """Stop (the same as :meth:`stop`; kept for the context managers that close)."""
        self.stop()

    def pause(self) -> None:
        """Let saved tensors pass through untouched (for backward) until :meth:`resume`."""
        if not self._paused:
            self._watched = self._tracker.watching
        self._paused = True
        self._tracker.watch(False)
        NativeSaves.follow(capturing_now())
        self._release_records()

    def resume(self) -> None:
        if self._paused:
            self._tracker.watch(self._active and self._watched)
        self._paused = False
        if self._active:
            NativeSaves.follow(capturing_now())

    def watch_ops(self, on: bool) -> None:
        """Whether the op tracker sees the torch functions called from now on. The capture
        turns it off itself while a compiled module runs (``torch.compile(module)``,
        ``module.compile()``), and on again inside a module such a module calls eagerly
        (from a function compile is disabled for: Dynamo compiles the frames a graph break
        leaves, module calls and their hooks included); a caller whose whole step runs
        compiled code, with no module call
        around it (Lightning's compiled ``training_step``), turns it off after :meth:`start`.
        Off, a float tensor saved eagerly outside any module is kept exact: its op went
        unseen (:func:`~lightning_act.capture.decide.decide`'s ``unseen``)."""
        self._tracker.watch(on and self._active and not self._paused)

    @property
    def nominal_bits(self) -> int:
        """The bits most saves get: the fixed policy's, or an allocation's default."""
        return getattr(self.policy, "bits", None) or getattr(self.policy, "default_bits", None) or self.config.bits

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
        probe = Probe(seed)
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
        method: str = "linearized",
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
            method: ``"linearized"`` (a cost independent of depth) or ``"per_tensor"`` (one
                backward per saved tensor), see
                :func:`~lightning_act.policy.estimators.probe_sensitivities`.

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
                return probe_sensitivities(self, loss_fn, params, inputs=inputs, weights=weights, method=method)
        finally:
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    b.copy_(buffers[name])
            self.model.train(was_training)
            # The probes' graphs are held by reference cycles (hooks that close over their own
            # nodes): left to the collector, the step after would carry them (ResNet-18: twice
            # its activations).
            gc.collect()

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
        for t in tensors_in(obj):
            ptr, ref = storage_key(t)
            self._external[ptr] = ref
            NativeSaves.external(self, ptr)

    # ----------------------------------------------------------------- module attribution
    def _enter_module(self, module: nn.Module) -> None:
        self._stack.append(self._names.get(module) or self._unnamed_module(module))
        if self.config.unfused_recurrent and isinstance(module, nn.RNNBase) and not self._paused:
            # The fused kernels are chosen by these switches as the forward runs; backward
            # follows what the forward built.
            self._fused_switches.append((module, torch._C._get_mkldnn_enabled(), torch._C._get_cudnn_enabled()))
            torch._C._set_mkldnn_enabled(False)
            torch._C._set_cudnn_enabled(False)

    def _unnamed_module(self, module: nn.Module) -> str:
        """The name of a module outside the model: ``torch.compile(model)``'s wrapper is the
        model's (its graphs name their saves outside the model's modules by it, as eager
        does), any other module its class's."""
        if isinstance(module, OptimizedModule):
            name = self._names.get(module._orig_mod)
            if name is not None:
                return name
        return type(module).__name__

    def _leave_module(self, module: nn.Module, output: Any) -> None:
        if self._fused_switches and self._fused_switches[-1][0] is module:
            _, mkldnn, cudnn = self._fused_switches.pop()
            torch._C._set_mkldnn_enabled(mkldnn)
            torch._C._set_cudnn_enabled(cudnn)
        if not self._stack:
            return
        name = self._stack.pop()
        if self.estimator is not None and isinstance(output, torch.Tensor) and not self._paused:
            self.estimator.observe_output(name, output)

    # ----------------------------------------------------------------- the pack hook
    @staticmethod
    def _live(table: dict[int, StorageWeakRef], ptr: int) -> bool:
        ref = table.get(ptr)
        return ref is not None and not _storage_expired(ref.cdata)

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
    ) -> None:
        """Add one saved tensor, saved by ``op`` in ``module``, to the report, stored at ``bits``
        (None: exact) by ``codec``; its storage counts once however often saved. ``copied``: a
        tensor its outcome keeps, kept as a copy of ``stored`` bytes instead."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        saved = 0
        # A weak reference is made only for a storage not seen yet: most saves share one.
        seen = self._saved_storages.get(ptr)
        if seen is None or _storage_expired(seen.cdata):
            self._saved_storages[ptr] = seen = StorageWeakRef(storage)
            saved = storage.nbytes()
        if outcome.keeps_storage and not copied:
            if self._live(self._kept_storages, ptr):
                stored = 0
            else:
                self._kept_storages[ptr] = seen
                stored = storage.nbytes()
        self.report.count(module, op, outcome, saved, stored, bits, codec)

    def _count_uncounted(self, outcome: Outcome) -> None:
        """Count a tensor that stays alive anyway: it is in neither byte total."""
        counts, key = self.report.counts, outcome.key
        counts[key] = counts.get(key, 0) + 1

    def _next_slot(self, module: str) -> str:
        index = self._slot_counts.get(module, 0)
        self._slot_counts[module] = index + 1
        return f"{module}#{index}"

    def _pack(self, t: torch.Tensor) -> Any:
        if self._paused or torch._C._current_graph_task_id() != -1:
            return t.detach()  # a detached alias, never t itself: returning t can leak it
        if t.layout != torch.strided or t.is_nested:
            self._count_uncounted(Outcome.KEPT)  # sparse, nested: no storage to key or codec to take it
            return t.detach()
        module = self._stack[-1] if self._stack else OUTSIDE_MODULES
        ptr = t.untyped_storage().data_ptr()
        call = self._tracker.current_call()
        # The attribute, not its property: Dynamo traces this where it inlines the hook.
        unseen = call is None and not self._tracker._watching
        decision = decide(
            t,
            call,
            external=self._live(self._external, ptr),
            min_numel=self.config.min_numel,
            group_size=self.config.group_size,
            unseen=unseen,
            decided=self._decided,
        )
        if unseen and decision.kind is Kind.KEEP:
            self._unseen_saves += 1
        if call is None:
            return self._store_decided(t, None, decision, module, ptr)
        call.saves += 1
        if decision.match_partner:
            return self._store_match_partner(t, call, decision, module, ptr)
        saved = self._store_decided(t, call, decision, module, ptr)
        call.saved.append((saved, decision.kind))
        if call.waiting:
            call.waiting = [settle for settle in call.waiting if not settle(False)]
        return saved

    def _store_decided(
        self, t: torch.Tensor, call: TrackedCall | None, decision: Decision, module: str, ptr: int
    ) -> Any:
        """What autograd holds for ``t``, stored as ``decision`` says."""
        op = None if call is None else call.name
        kind = decision.kind
        if kind is Kind.MATCH:
            return self._store_match(t, call, decision, module)
        if kind is Kind.RECOMPUTE:
            return self._store_recomputed(t, call, decision, module, ptr)
        if kind is Kind.PARAMETER or kind is Kind.EXTERNAL:
            self._count_uncounted(Outcome.PARAMETER if kind is Kind.PARAMETER else Outcome.EXTERNAL)
            return t.detach()
        if kind is Kind.RECAST_WEIGHT:
            self._account(module, op, t, Outcome.RECAST, 0)
            return RecastWeight(decision.parameter, t)
        if kind is Kind.CAST_PARAMETER:
            self._account(module, op, t, Outcome.KEPT, 0)
            return t.detach()
        key, region = self._sharing_key(t, ptr, decision)
        shared = self._shared_copy(key, t, module, op, decision)
        if shared is not None:
            self._account(module, op, t, Outcome.DEDUPLICATED, 0)
            return shared
        if kind is Kind.KEEP or kind is Kind.STATISTIC:
            self._account(module, op, t, Outcome.KEPT if kind is Kind.KEEP else Outcome.STATISTIC, 0)
            kept = t.detach()
            self._share(key, region, t, t, kept, decision, None)  # later saves need no copy
            return kept
        dense = decision.layout.dense(t)
        _hold_until_read(t)
        if kind is Kind.QUANTIZE:
            terms = self._terms_of(module, op, decision)
            saved = self._store(t, dense, decision, module, op, terms.codec)
        else:
            terms = None
            saved = self._store_lossless(t, dense, decision, module, op)
        self._share(key, region, t, dense, saved, decision, terms)
        return saved

    # ----------------------------------------------------------------- one copy for many saves
    @staticmethod
    def _sharing_key(t: torch.Tensor, ptr: int, decision: Decision) -> tuple[tuple, tuple[int, int] | None]:
        """The key under which saves of the same tensor find one stored copy, and the run of
        storage ``t`` fills (None if it fills none).

        A view that fills a run of storage is keyed by that run, so that its other views (a
        transpose, a reshape) find its copy; any other view by its own layout. A sign mask,
        the cells between constants, or a substitute stored in the tensor's place, serves
        only saves stored in that same form: another op's save of the tensor is stored again.
        """
        region = storage_region(t)
        where = region if region is not None else (t.storage_offset(), t.shape, t.stride())
        form = None
        if decision.kind is Kind.SIGN_MASK or decision.kind is Kind.CELLS:
            form = (decision.kind, decision.divisor, decision.interval, decision.cells)
        elif decision.substitute is not None and decision.substitute.for_its_op_alone:
            form = decision.substitute
        return (ptr, where, t.dtype, t._version, form), region

    def _shared_copy(self, key: tuple, t: torch.Tensor, module: str, op: str | None, decision: Decision) -> Any:
        """What autograd may hold for ``t`` from an earlier save's copy, or None."""
        cached = self._dedup.get(key)
        if cached is None or _storage_expired(cached.storage.cdata):
            return None
        if decision.row_group is not None and cached.rows not in (None, (decision.row_group, decision.row_layout)):
            # A normalisation's input needs groups within the rows it normalises: a copy
            # whose groups span rows (ReLU's output, stored before a BatchNorm saves it as
            # its input) would put a loud row's rounding noise into a near-constant row,
            # whose 1 / std multiplies it. Stored again, in its own rows.
            return None
        needed = self._terms_of(module, op, decision).needed
        if cached.view == (t.shape, t.stride()):
            # A copy with fewer bits than this save needs (RMSNorm's input, which pow saved
            # at the quantizer's bits before mul saved it) is stored again at this save's
            # floor, and later saves share the new copy.
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
        # A copy guarantees its floor and rule, not the policy's bits, so which saves share a
        # copy is the same under any policy and in probes. Masks, indices and kept tensors
        # are exact. A pooled copy serves the saves of its own view, as pooling is the
        # method chosen for every save alike.
        if decision.kind is not Kind.QUANTIZE:
            view_guaranteed = run_guaranteed = math.inf
        elif terms.codec.unbiased:
            view_guaranteed = run_guaranteed = terms.needed
        else:  # a pooled copy has lost detail other ops may need: it guarantees them nothing
            view_guaranteed, run_guaranteed = math.inf, 0.0
        run_record = None
        in_memory_order = not isinstance(saved, Compressed) or saved.layout.memory_order
        if region is not None and in_memory_order:
            # Read in memory order, the stored dense tensor is the run itself: other views of
            # it may share it, unless they need more bits than it guarantees (attention's
            # query read through a 2-bit copy made for another op).
            run_record = saved.record if isinstance(saved, Compressed) else KeptRecord(dense)
        else:
            run_guaranteed = 0.0
        # The storage's weak reference, made when the save was accounted.
        storage = self._saved_storages[key[0]]
        rows = None if decision.kind is not Kind.QUANTIZE else (decision.row_group, decision.row_layout)
        earlier = self._dedup.get(key)
        self._dedup[key] = later = Shared(
            storage, (t.shape, t.stride()), saved, run_record, view_guaranteed, run_guaranteed, rows
        )
        if earlier is not None:
            self._supersede(earlier, later)

    def _supersede(self, earlier: Shared, later: Shared) -> None:
        """Let an earlier save of the same view read the copy a later save stored with more
        bits, and free the earlier copy: one copy, at the highest floor, and every read of
        the tensor sees the same values. RMSNorm written out (HF's Llama, Mistral, T5):
        ``pow`` saves ``x`` at the policy's bits before ``mul`` shows the normalisation and
        saves it at its floor, or exact over rows shorter than a group, where two reads of
        differently rounded copies gave one-value rows an 8-bit gradient error of 42 times
        the gradient's norm (6e-4 with one copy). Only where the later copy serves every use
        the earlier one did: exact, or the quantizer (zeros kept) at bits as high; not where
        another view decodes from the earlier record, nor a substitute stored for its op
        alone."""
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
        report = self.report
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
        """The codec and the fewest bits of ``decision`` for a save by ``op`` in ``module``:
        found once per decision (a step's saves repeat the last step's decisions), looked up
        at every save by the decision's identity (the entry holds it, so no other object
        takes its id while the entry lives)."""
        key = (module, op, id(decision))
        terms = self._terms.get(key)
        if terms is None or terms.policy is not self.policy:
            if len(self._terms) >= _TERMS_KEPT:  # new decisions at every step: start again
                self._terms.clear()
            terms = self._terms[key] = _Terms(
                decision, self.policy, self._codec_for(module, op, decision), self._bits_needed(module, op, decision)
            )
        return terms

    def _bits_needed(self, module: str, op: str | None, decision: Decision) -> float:
        """The fewest bits a copy stored for another save may have to serve this one: the
        op's floor, or more where a rule pins this module or op to more (or to exact). A save
        kept as it is needs it exactly (backward compares it for equality, indexes with it)."""
        if decision.kind is Kind.KEEP or decision.kind is Kind.STATISTIC:
            return math.inf
        needed = decision.min_bits
        rule = self.policy.rules.lookup(module, op)
        if rule is not None and rule.pins_bits:
            needed = math.inf if rule.bits is None else max(needed, rule.bits)  # None: exact
        return needed

    def _codec_for(self, module: str, op: str | None, decision: Decision):
        rule = self.policy.rules.lookup(module, op)
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
            if arrived and all(kind in _EXACT_KINDS for _, kind in partners):
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

    def _store_match_partner(
        self, t: torch.Tensor, call: TrackedCall, decision: Decision, module: str, ptr: int
    ) -> Any:
        """A tensor backward reads only as what matched saves of its call are compared with
        (``scatter_reduce`` amax's result). Those saves take their outcomes against ``t``
        itself, here; then ``t`` is stored at its bits and their stand-ins are rebuilt from the
        stored copy, so backward's comparisons come out as with exact tensors. Exact where
        one of them cannot store its outcome now, and while probing (a probed copy is drawn
        again at each decode)."""
        index = len(call.saved)
        call.saved.append((t.detach(), Kind.KEEP))
        if call.waiting:
            call.waiting = [settle for settle in call.waiting if not settle(False)]
        dependents = [saved for saved, kind in (call.saved[d] for d in decision.match_partner) if kind is Kind.MATCH]
        settled = (
            self._probe is None
            and len(dependents) == len(decision.match_partner)
            and all(saved.matched is not None for saved in dependents)
        )
        final = decision._replace(match_partner=()) if settled else Decision(Kind.KEEP)
        if settled and t.device.type == "cpu" and bool(torch.isfinite(t).all()):
            # Nothing for the finite stand-in to replace (on the CPU, looking costs no device
            # synchronisation): the copy decodes to the tensor, and the next layer's save of
            # it may share it.
            final = final._replace(substitute=None)
        stored = self._store_decided(t, call, final, module, ptr)
        call.saved[index] = (stored, final.kind)
        for saved in dependents:
            if saved.matched is not None:
                saved.partners[saved.match.partners.index(index)] = stored
        return stored

    def _store_recomputed(self, t: torch.Tensor, call: TrackedCall, decision: Decision, module: str, ptr: int) -> Any:
        """A fused attention's output: nothing stored; computed again in backward from what
        autograd holds for the call's query, key and value (one computation for the output
        and the logsumexp). Kept exact where those saves are not there to read."""
        recompute = decision.recompute
        if max(recompute.inputs) >= len(call.saved):
            return self._store_decided(t, call, Decision(Kind.KEEP), module, ptr)
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
        kind = decision.kind
        if kind is Kind.INDEX:
            record = self._index_codec.pack(dense, 0, 0, value_range=decision.value_range)
        elif kind is Kind.SIGN_MASK:
            record = self._sign_codec.pack(dense, 0, 0, divisor=decision.divisor, interval=decision.interval)
        elif kind is Kind.CELLS:
            cells = decision.cells
            record = self._index_codec.pack(cells.cell(dense), 0, 0, value_range=(0, cells.count - 1))
        else:
            record = self._mask_codec.pack(dense, 0, 0)
        name = kind.value if kind is Kind.CELLS else record.codec  # the cells' indices, by what they are
        self._account(module, op, t, Outcome.LOSSLESS, record.nbytes, codec=name)
        return Compressed(record, decision.layout, decision.cells)

    def _store(
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
            # A slot's sizes follow from its decision (made for one dtype, shape and strides),
            # its op and its codec: described once, not at every step.
            info = SlotInfo(
                module=module,
                shape=tuple(t.shape),
                numel=dense.numel(),
                groups=-(-dense.numel() // getattr(codec, "group_size", self.config.group_size)),
                element_bits=dense.element_size() * 8,
                op=op,
                min_bits=decision.min_bits,
            )
            plan = self._slot_plans[slot] = _SlotPlan(decision, op, codec, info)
        info = plan.info
        probing = self._probe is not None
        if not probing or slot not in self.slots:
            # A probe runs on a few rows of the batch: the sizes the policy plans with stay
            # the training step's (a memory target given the probes' sizes planned for a
            # batch a few times smaller, and the next step overshot its target by a third).
            self.slots[slot] = info
        bits = None if probing else self.policy.bits_for(slot, info)
        # Groups along another axis than the last where that was measured to round with less
        # noise, at the width the slot is stored at (while probing, the one most get).
        group_axis = None
        if codec is self._codecs["quant"] and self.chooses_group_axes and (probing or bits is not None):
            group_axis = self.group_orders.order(slot, dense, bits or self.nominal_bits)
        if probing:
            # Probed through the quantizer with the groups the tensor would be stored in.
            probe_codec = codec if isinstance(codec, GroupQuantCodec) else self._codecs["quant"]
            if not self.policy.pins_bits(info):  # a rule decides its bits: nothing to measure
                self._probe.add(slot, dense.detach(), probe_codec, group_axis)
            self._account(module, op, t, Outcome.EXACT, 0)
            return Compressed(ProbeRecord(self._probe, slot, dense.detach(), probe_codec, group_axis), layout, restorer)
        dense_bytes = layout.numel * dense.element_size()  # without the padding of rows
        if bits is None:
            return self._store_exact(t, kept_copy, laid_out, module, op, slot, dense_bytes)
        self._packs += 1
        seed = splitmix64(self._seed + self._packs) >> 1
        record = codec.pack(dense, bits, seed) if group_axis is None else codec.pack(dense, bits, seed, group_axis)
        if isinstance(record, StoredTensor):  # a shape the codec does not compress (pool on 2-D)
            self._account(module, op, t, Outcome.KEPT, 0)
            return t.detach()
        self._stats.append(record.stats)
        if self.estimator is not None and isinstance(codec, (GroupQuantCodec, DivisionCodec)):
            self.estimator.observe_stats(slot, module, record.stats, bits, codec.group_size)
        self._account(module, op, t, Outcome.COMPRESSED, record.nbytes, bits=bits, codec=record.codec)
        self.report.slots[slot] = plan.memory_of(bits, dense_bytes, record.nbytes, record.codec)
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
        """A slot the policy or a rule keeps exact: ``t`` itself, or, where ``t`` views part of
        a storage nothing else keeps for backward, a copy of its own values. Kept as a view, an
        attention's value, a third of the ``qkv`` projection's output, held all of it: two
        such slots stored 4 MiB where a plan counted 2, and the step after a memory target's
        recalibration peaked 4% over the target."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() <= dense_bytes or self._live(self._kept_storages, ptr):
            self._account(module, op, t, Outcome.EXACT, 0, bits=None)
            saved = t.detach()
        else:
            # ``dense`` is ``t``'s values in memory order: a view of the storage where they
            # are one run of it (a third of ``qkv`` split along its first axis), else a copy.
            copy = dense.clone() if dense.untyped_storage().data_ptr() == ptr else dense
            self._account(module, op, t, Outcome.EXACT, dense_bytes, copied=True, bits=None)
            saved = Compressed(KeptRecord(copy.detach()), layout)
        self.report.slots[slot] = SlotMemory(module, tuple(t.shape), None, dense_bytes, dense_bytes, "stored", op)
        return saved


class _SlotPlan:
    """What a slot's saves have in common from step to step: the decision, op and codec it
    was described under, its description, and the last report entry it made."""

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


#: ``StorageWeakRef.expired`` without the ``eval`` torch's method runs at every call: checked
#: several times per save.
_storage_expired = torch.UntypedStorage._expired

#: Entries :meth:`ActivationCapture._terms_of` keeps before it starts again.
_TERMS_KEPT = 4096


class _Terms(NamedTuple):
    """What a decision means for a save by one op in one module, under one policy's rules."""

    decision: Decision  # held: its id keys the entry
    policy: BitPolicy
    codec: GroupQuantCodec | DivisionCodec | PoolCodec
    needed: float


def _hold_until_read(t: torch.Tensor) -> None:
    """Keep ``t``'s memory from being reused before the kernels just queued on the current
    stream have read it: the caller drops ``t`` once they are queued, and a tensor made on
    another stream would otherwise go back to that stream's pool at once."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


class _SharedModuleHooks:
    """One pair of global module hooks that tells the capturing captures which module is
    running: registered on the first capture's start and kept for the process.

    Dynamo guards a compiled module on the global hooks, so hooks registered anew for each
    session (a ``with compress_activations(...)`` block per step) would recompile it every
    step, and run it eagerly past the recompile limit. Outside a session they return at once.
    Inside a graph being compiled they do nothing, so the graph has no trace of them: a
    compiled graph's saves are attributed by the modules recorded in the graph instead.

    They also turn the captures' op trackers off while a compiled module runs and on again
    inside any module it calls eagerly, each restored when the module returns (see
    :meth:`ActivationCapture.watch_ops`).
    """

    capturing: list[ActivationCapture] = CAPTURING
    _handles: list[torch.utils.hooks.RemovableHandle] = []
    #: The modules whose call switched the trackers, innermost last, each with the state
    #: to restore when it returns.
    _switched: list[tuple[nn.Module, bool]] = []

    @classmethod
    def register(cls) -> None:
        if cls._handles:
            return
        cls._handles = [
            nn.modules.module.register_module_forward_pre_hook(cls._enter),
            nn.modules.module.register_module_forward_hook(cls._leave, always_call=True),
        ]
        # torch warns on every call of a compiled module while global hooks exist that they
        # fire once more for the compiled wrapper; these hooks expect that.
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")

    # Where Dynamo leaves compiled code to run natively (at a graph break, or a whole frame
    # it could not compile), its frame hook still compiles each frame entered there, these
    # hooks' included: traced, they saw is_compiling() and did nothing, so the op tracker
    # stayed off through the modules Dynamo then runs natively (torch's own: nn.GRU, which
    # it will not trace, and those around it), and every tensor they saved was kept exact (a
    # two-layer GRU in a model compiled whole: 7.32x eager's bytes). So the hooks run
    # natively (set below): there the tracker watches a module whose forward Dynamo runs
    # natively and not one whose forward it compiles. Their bodies, and all they call, are
    # never compiled as frames.

    @classmethod
    def _enter(cls, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not cls.capturing:
            return
        cls._entered(module, get_eval_frame_callback() is not None)

    @classmethod
    def _entered(cls, module: nn.Module, under_frame_hook: bool) -> None:
        for capture in cls.capturing:
            capture._enter_module(module)
        watch = not runs_compiled(module) and (not under_frame_hook or _dynamo_runs_natively(module))
        if watch != cls.capturing[-1]._tracker.watching:
            cls._switched.append((module, not watch))
            cls._watch(watch)

    @classmethod
    def _leave(cls, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        for capture in cls.capturing:
            capture._leave_module(module, output)
        if cls._switched and cls._switched[-1][0] is module:
            cls._watch(cls._switched.pop()[1])

    @classmethod
    def _watch(cls, on: bool) -> None:
        for capture in cls.capturing:
            capture.watch_ops(on)

    @classmethod
    def forget_switches(cls) -> None:
        """After the last session stops: no module call left to restore a state for."""
        if not cls.capturing:
            cls._switched.clear()


# The hooks run natively, never compiled by Dynamo's frame hook: ``_enter`` reads whether it
# is on, so only its own frame is skipped; the rest, and the tracker's handler, with all they
# call. Where Dynamo traces a module call it still inlines the hooks.
_NATIVE_FRAME = FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT)
_NATIVE_CALLS = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
for _function, _strategy in (
    (_SharedModuleHooks._enter, _NATIVE_FRAME),
    (_SharedModuleHooks._entered, _NATIVE_CALLS),
    (_SharedModuleHooks._leave, _NATIVE_CALLS),
    (OpTracker.__torch_function__, _NATIVE_CALLS),
):
    set_code_exec_strategy(getattr(_function, "__func__", _function).__code__, _strategy)


def _dynamo_runs_natively(module: nn.Module) -> bool:
    """Whether Dynamo's frame hook leaves ``module``'s forward to run natively, as its trace
    rules do for torch's own modules (it inlines them only inside a frame it traces)."""
    code = getattr(getattr(module.forward, "__func__", module.forward), "__code__", None)
    return code is not None and _skipped_by_frame_hook(code)


@functools.cache
def _skipped_by_frame_hook(code: types.CodeType) -> bool:
    return bool(trace_rules.check(code))


def runs_compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code: ``torch.compile(module)``,
    ``module.compile()`` or Lightning's compiled module (whose ``forward`` Dynamo wraps),
    unless ``torch.compiler.set_stance("force_eager")`` runs it eagerly (the probes do)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or eval_frame._stance.stance == "force_eager":
        return False
    return _compiled_in_place(module)


def _compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module`` itself was compiled, whatever the stance: ``module.compile()`` or a
    forward Dynamo wraps (Lightning's compiled module)."""
    if module._compiled_call_impl is not None:
        return True
    forward = module.__dict__.get("forward")  # set on the instance by all but module.compile()
    return forward is not None and getattr(forward, "_torchdynamo_orig_callable", None) is not None


def _switch_around_compiled_calls(modules: list[nn.Module]) -> None:
    """Gives each of a model's ``modules`` compiled in place (``module.compile()``) the switch of
    the op tracker around its compiled call that ``torch.compile(module)``'s wrapper gets
    from the module hooks. In place, the hooks run inside the compiled code, where they do
    nothing (Dynamo traces them), so the tracker stayed on and Dynamo traced its handler in
    the compiled frames, which torch 2.14 gets wrong (HF Bloom's ``device`` read as a
    ``torch.Size``). Wrapped once, for good: outside a capture the switch does nothing."""
    for module in modules:
        compiled = module._compiled_call_impl
        if compiled is None or getattr(compiled, "_lightning_act_switch", False):
            continue

        def call(*args, _module=module, _compiled=compiled, **kwargs):
            _SharedModuleHooks._enter(_module, args)
            output = None
            try:
                output = _compiled(*args, **kwargs)
                return output
            finally:
                _SharedModuleHooks._leave(_module, args, output)

        call._lightning_act_switch = True
        module._compiled_call_impl = call


def _frames_compiled() -> int:
    """Frames dynamo has compiled in this process (0 before it is imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["frames"]["total"]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a batch: nested dicts, lists and tuples, and graph batches
    (``torch_geometric`` ``Data``, through ``to_dict``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
    elif callable(getattr(obj, "to_dict", None)):
        yield from tensors_in(obj.to_dict())


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


def check_compiled_codecs(config: CompressionConfig, rules: SaveRules) -> None:
    """Raise where ``config`` or a rule asks for a codec that compiled graphs do not store
    with (they store with ``quant`` alone)."""
    if config.codec != "quant":
        raise ValueError(
            f"codec={config.codec!r} is not available inside torch.compile graphs, which store saved "
            "tensors with codec='quant' only; use codec='quant' with a compiled model, or run it eagerly"
        )
    for key, rule in rules.by_key():
        if rule.codec not in (None, "quant"):
            raise ValueError(
                f"rules[{key!r}]={rules.rules[key]!r} names codec {rule.codec!r}, which is not available inside "
                "torch.compile graphs (they store saved tensors with 'quant' only); name bits or 'exact' for a "
                "compiled model"
            )


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
    if "memory_target" in settings:
        # The block holds a forward; a target bounds the whole step and follows it from step to step.
        raise ValueError(
            f"memory_target={settings['memory_target']!r}: a memory target bounds a whole training step, which this "
            "block does not hold; use lightning_act.MemoryTarget(model, target) and 'with target.step(inputs=x):' "
            "around the forward, backward and optimizer step"
        )
    capture = ActivationCapture(config or CompressionConfig(**settings), model)
    return _CaptureContext(capture, inputs, seed=None, close=True)
