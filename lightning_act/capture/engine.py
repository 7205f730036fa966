"""The capture engine: every tensor autograd saves is decided
(:func:`~lightning_act.capture.call_sites.decide`), stored, attributed to its module and accounted.
Framework-free; the Lightning callback is a thin scheduler around it. Tensors are compressed at pack
time: a deferred copy would miss in-place changes, which autograd no longer detects once hooks are
installed. The hooks (:class:`~lightning_act.capture.compiled.GraphHooks`) are inlined into compiled
graphs; called eagerly they hand each tensor to :meth:`ActivationCapture.pack`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.metadata
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

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
from lightning_act.capture import graph_nodes, graph_ops
from lightning_act.capture.active import CAPTURING, capturing_now, splitmix64
from lightning_act.capture.call_sites import decide
from lightning_act.capture.compiled import CheaperSaves, GraphHooks
from lightning_act.capture.decide import Decision, Form
from lightning_act.capture.graph_ops import COMPILED_REGION, NativeSaves, PackedSave, SeedStream
from lightning_act.capture.group_order import GroupOrders
from lightning_act.capture.records import (
    storage_key,
)
from lightning_act.capture.report import (
    OUTSIDE_MODULES,
    CompressionReport,
    Outcome,
    ReportDelta,
)
from lightning_act.capture.store import Probe, SaveStore, live
from lightning_act.config import CompressionConfig
from lightning_act.ops import count_nonfinite_groups
from lightning_act.optrack import OpTracker
from lightning_act.policy import AllocatedBits, BitPolicy, FixedBits, SlotInfo, TargetBits
from lightning_act.policy.bits import SaveRules
from lightning_act.policy.estimators import GradientSensitivity, probe_sensitivities, update_weights

_VERSION = importlib.metadata.version("lightning_act")
# The code that makes a compiled graph's plans, hashed into the name torch's AOT autograd cache
# reuses a graph by: an upgraded or edited library never runs a graph planned by another version.
_PLANNING_FILES = [Path(m.__file__) for m in (decide_module, compiled_module, graph_nodes, graph_ops)]
_PLANNING_FILES += sorted(Path(backward_reads.__file__).parent.glob("*.py"))
_PLANNING_CODE = hashlib.sha256(b"".join(path.read_bytes() for path in _PLANNING_FILES)).hexdigest()[:16]


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
        #: Per slot, the axis its quantization groups run along (decided on its first step).
        self.group_orders = GroupOrders.of(model, self.config.group_size)
        self._tracker = OpTracker()
        # Decisions of earlier saves, which later steps' saves of the same calls find again.
        self._decided: dict[tuple, Decision] = {}
        self.policy = policy or FixedBits(self.config.bits)
        self.model = model
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        # The buffer dicts themselves, so a buffer registered or replaced later is seen.
        self._modules: list[nn.Module] = [] if model is None else list(model.modules())
        self._buffer_tables = [module._buffers for module in self._modules]
        if model is not None:
            for name, module in model.named_modules():
                # Named as in the module the user compiled, without its wrapper's ``_orig_mod``.
                name = ".".join(part for part in name.split(".") if part != "_orig_mod")
                self._names[module] = name or type(module).__name__
        # Classes with several modules (wrappers aside): one compiled graph may serve them all.
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
        self.paused = False
        self._watched = False  # whether the op tracker watched when the session paused
        #: The probe running now (:meth:`probing`), if any.
        self.probe: Probe | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stack: list[str] = []
        # Recurrent modules running with fused kernels off, and the switches to restore.
        self._fused_switches: list[tuple[nn.Module, bool, bool]] = []
        self._qualnames: dict[str, str] = {}
        self._state: tuple[Any, str] = (None, "")
        self._layout_optimization: bool | None = None  # inductor's, while this session turned it off
        self._planned_graph = False  # a graph was planned in this session
        self._frames_at_start = 0  # frames dynamo had compiled when this session started
        self._filtering = "donated"  # torch's choice of the saves hooks see, outside sessions
        self.store = SaveStore(self)
        self._reset_session(seed=0)

    # ----------------------------------------------------------------- session control
    def _reset_session(self, seed: int) -> None:
        self.report = CompressionReport()
        self.store.start(seed)
        self._external: dict[int, StorageWeakRef] = {}
        # Saves kept exact because the op tracker was off, and whether a graph packed any save.
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
            # Per process: a ``compress_activations()`` block per step must not repeat its noise.
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
        # Hook graph inputs too (an activation passed on at a graph break), not parameters/buffers.
        self._filtering = functorch_config.saved_tensors_hooks_filtering_mode
        functorch_config.saved_tensors_hooks_filtering_mode = "no_static"
        CheaperSaves.install()
        hooks = GraphHooks.of(self._settings_state())
        self._hooks = torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
        self._hooks.__enter__()
        self._tracker.watch(True)  # last: the calls above are the library's own
        self._active = True
        self.paused = False

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
                    # Marks rules matched by saves of graphs planned in another process (torch's cache).
                    rules.lookup(module, op)
            ops = set().union(*(memory.ops for memory in self.report.modules.values()))
            rules.warn_unmatched(self._names.values(), ops)
        return self.report

    def shared_compiled_modules(self) -> dict[str, list[str]]:
        """Modules compiled one by one, by class name, where a class has several: torch runs them
        all through the first one's graphs, whose plans fix each save's bits for the whole class."""
        wrapped = {id(m._orig_mod) for m in self._modules if isinstance(m, OptimizedModule)}
        by_class: dict[type, list[str]] = {}
        for module in self._modules:
            if isinstance(module, OptimizedModule):
                continue
            if id(module) in wrapped or _compiled_in_place(module):
                by_class.setdefault(type(module), []).append(self._names.get(module) or type(module).__name__)
        return {kind.__name__: names for kind, names in by_class.items() if len(names) > 1}

    def _check_shared_graphs(self) -> None:
        """Refuse a memory target, and warn for per-tensor bits, where one compiled graph serves
        several modules (:meth:`shared_compiled_modules`) at one module's planned bits."""
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
        """Warn once where compiled code ran eagerly with the op tracker off and no graph packed
        any save (past ``recompile_limit``, a failed compile): every save was kept exact."""
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
            # Not the seed: graphs seed their noise at run time, so no recompiling per seed.
            planned = dataclasses.replace(self.config, seed=0)
            described = repr(
                (_VERSION, _PLANNING_CODE, planned, type(policy).__name__, policy.rules.rules, policy.choices_state())
            )
            self._state = (key, f"lightning_act-{hashlib.sha256(described.encode()).hexdigest()[:24]}")
        return self._state[1]

    def module_name(self, qualname: str | None) -> str:
        """The report's name of a module a compiled graph names relative to the compiled module
        (``layer1.0.conv1``): the model's one module whose name ends with it, if any. None or
        ``""`` (the compiled module itself): the module whose call is compiling, unless the graph
        may serve other modules of its class."""
        if not qualname:
            name = self._stack[-1] if self._stack else OUTSIDE_MODULES
            return COMPILED_REGION if name in self._shared_class_names else name
        known = self._qualnames.get(qualname)
        if known is None:
            names = {n for n in self._names.values() if n == qualname or n.endswith("." + qualname)}
            known = self._qualnames[qualname] = names.pop() if len(names) == 1 else qualname
        return known

    def compiling(self) -> None:
        """A graph is being compiled: refuse codecs other than ``quant`` (never silently replaced)
        and turn off inductor's layout optimization until the session stops: it runs after the
        hooks are inlined and saves channels-last copies of convolutions' weights and inputs that
        no hook sees. ``TORCHINDUCTOR_LAYOUT_OPTIMIZATION=1`` keeps it on."""
        check_compiled_codecs(self.config, self.policy.rules)
        self._planned_graph = True
        config = sys.modules.get("torch._inductor.config")
        if config is None or self._layout_optimization is not None or "TORCHINDUCTOR_LAYOUT_OPTIMIZATION" in os.environ:
            return
        self._layout_optimization = config.layout_optimization
        config.layout_optimization = False

    @property
    def compiled_in_session(self) -> bool:
        """Whether a graph was compiled (planned here, or taken from torch's caches) since the
        session started: its step's peak then holds the compiler's work."""
        return self._planned_graph or _frames_compiled() != self._frames_at_start

    def external_storages(self) -> list[int]:
        """The storages (data pointers) marked as alive for the whole step."""
        return list(self._external)

    def keeps_alive(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage stays alive for the whole step anyway (the batch, buffers)."""
        return live(self._external, t.untyped_storage().data_ptr())

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
        """Add packed saves (summed in ``delta``) to the report; ``stats``: their group stats, one
        tensor per save of ``quantized``, or concatenated where that is empty."""
        self.report.add(delta)
        self._graph_packed = True
        self.store.stats.extend(stats)
        for save in quantized:
            if save.plan.slot not in self.slots:  # a graph from torch's cache: planned in another process
                self.slots[save.plan.slot] = save.slot_info
        if self.estimator is not None:
            for save, group_stats in zip(quantized, stats):
                plan = save.plan
                self.estimator.observe_stats(plan.slot, plan.module, group_stats, plan.bits, plan.group_size)

    def _release_records(self) -> None:
        """Count the non-finite groups stored so far and forget the records kept for sharing:
        autograd alone then holds each, so backward frees it right after the node that reads it."""
        stats = self.store.release()
        if stats:
            with torch._C.DisableTorchFunction():  # the library's own ops: no op tracker
                # Whole rows: cheaper than slicing out each one's first columns.
                found = count_nonfinite_groups(stats[0] if len(stats) == 1 else torch.cat(stats))
                self.report.nonfinite_groups = self.report.nonfinite_groups + found
                self.total_nonfinite_groups = self.total_nonfinite_groups + found

    def close(self) -> None:
        """Stop (the same as :meth:`stop`; kept for the context managers that close)."""
        self.stop()

    def pause(self) -> None:
        """Let saved tensors pass through untouched (for backward) until :meth:`resume`."""
        if not self.paused:
            self._watched = self._tracker.watching
        self.paused = True
        self._tracker.watch(False)
        NativeSaves.follow(capturing_now())
        self._release_records()

    def resume(self) -> None:
        if self.paused:
            self._tracker.watch(self._active and self._watched)
        self.paused = False
        if self._active:
            NativeSaves.follow(capturing_now())

    def watch_ops(self, on: bool) -> None:
        """Whether the op tracker sees torch calls from now on. Off while compiled modules run (and
        after :meth:`start` for a wholly compiled step, e.g. Lightning's compiled
        ``training_step``): eager saves outside any module are then kept exact, their op unseen."""
        self._tracker.watch(on and self._active and not self.paused)

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
        self.probe = probe
        try:
            with self.capturing(inputs, seed):
                yield probe
        finally:
            self.probe = None

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
            # The probes' graphs are held by reference cycles (hooks closing over their own
            # nodes): collected now, or the next step would carry them.
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
        if self.config.unfused_recurrent and isinstance(module, nn.RNNBase) and not self.paused:
            # Read as the forward runs; backward follows what the forward built.
            self._fused_switches.append((module, torch._C._get_mkldnn_enabled(), torch._C._get_cudnn_enabled()))
            torch._C._set_mkldnn_enabled(False)
            torch._C._set_cudnn_enabled(False)

    def _unnamed_module(self, module: nn.Module) -> str:
        """The name of a module outside the model: ``torch.compile(model)``'s wrapper gets the
        model's (as eager names those saves), any other module its class's."""
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
        if self.estimator is not None and isinstance(output, torch.Tensor) and not self.paused:
            self.estimator.observe_output(name, output)

    # ----------------------------------------------------------------- the pack hook
    def pack(self, t: torch.Tensor) -> Any:
        if self.paused or torch._C._current_graph_task_id() != -1:
            return t.detach()  # a detached alias, never t itself: returning t can leak it
        if t.layout != torch.strided or t.is_nested:
            self.store.count_uncounted(Outcome.KEPT)  # sparse, nested: no storage to key or codec to take it
            return t.detach()
        module = self._stack[-1] if self._stack else OUTSIDE_MODULES
        ptr = t.untyped_storage().data_ptr()
        call = self._tracker.current_call()
        unseen = call is None and not self._tracker.watching
        decision = decide(
            t,
            call,
            external=live(self._external, ptr),
            min_numel=self.config.min_numel,
            group_size=self.config.group_size,
            unseen=unseen,
            decided=self._decided,
        )
        if unseen and decision.form is Form.KEEP:
            self._unseen_saves += 1
        if call is None:
            return self.store.store(t, None, decision, module, ptr)
        call.saves += 1
        if decision.match_partner:
            return self.store.store_match_partner(t, call, decision, module, ptr)
        saved = self.store.store(t, call, decision, module, ptr)
        call.saved.append((saved, decision.form))
        if call.waiting:
            call.waiting = [settle for settle in call.waiting if not settle(False)]
        return saved


class _SharedModuleHooks:
    """Global module hooks telling the capturing captures which module runs, and switching
    their op trackers (:meth:`ActivationCapture.watch_ops`). Registered once per process: Dynamo
    guards compiled modules on global hooks, so per-session hooks would recompile every step.
    Inside a graph being compiled they do nothing (graphs record their modules).
    """

    capturing: list[ActivationCapture] = CAPTURING
    _handles: list[torch.utils.hooks.RemovableHandle] = []
    #: The modules whose call switched the trackers, innermost last, with the state to restore.
    _switched: list[tuple[nn.Module, bool]] = []

    @classmethod
    def register(cls) -> None:
        if cls._handles:
            return
        cls._handles = [
            nn.modules.module.register_module_forward_pre_hook(cls._enter),
            nn.modules.module.register_module_forward_hook(cls._leave, always_call=True),
        ]
        # torch warns that global hooks fire again for a compiled wrapper; these hooks expect it.
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")

    # Where Dynamo runs code natively (graph breaks), its frame hook still compiles each frame
    # entered; traced, these hooks would see is_compiling() and leave the tracker off through
    # modules run natively (nn.GRU). So they run natively themselves (set below).

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


# ``_enter`` reads whether the frame hook is on, so only its own frame skips it; the rest skip
# all they call. Traced module calls still inline the hooks.
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
    """Wrap each ``module.compile()``'d call in the tracker switch the module hooks give a
    ``torch.compile(module)`` wrapper: in place the hooks run traced, as nothing, and Dynamo
    would trace the tracker's handler, which torch gets wrong. Wrapped once, for good."""
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
