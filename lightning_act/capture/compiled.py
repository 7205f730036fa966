"""Compression inside ``torch.compile`` graphs.

AOTAutograd (so ``inductor``, ``aot_eager``) inlines saved-tensor hooks given as
``fx.GraphModule`` s into compiled graphs: the pack hook per saved tensor at the end of the
forward, the unpack hook at the start of the backward, told which forward node they pack.
:class:`GraphHooks` is such a pair, made once per settings (Dynamo guards a graph on the hooks'
identity). At compile time each saved node's decision becomes a *plan*, a string constant baked
into the graph for the ops of :mod:`~lightning_act.capture.graph_ops`: a string, not a table
index, so a graph loaded from torch's AOT autograd cache in a new process still runs. Called
eagerly (outside a compiled region), the hooks hand the tensor to the eager path.
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._dynamo.eval_frame import skip_code

from lightning_act import ops
from lightning_act.backward_reads import (
    Read,
    Use,
    graph_reads,
    in_fresh_thread,
    is_tangent,
    size_hint,
)
from lightning_act.capture.active import Capture, capturing_now
from lightning_act.capture.decide import Decision, Form, exact_form
from lightning_act.capture.graph_nodes import (
    VIEW_OPS,
    backward_readers,
    consumers,
    decide_saved_node,
    function_name,
    hinted,
    index_bound,
    is_statistic,
    module_qualname,
    op_name,
    producer,
    softmax_row,
    target_name,
)
from lightning_act.capture.graph_ops import Plan, encode_plan, parse_plan, unpacked_stride
from lightning_act.capture.group_order import candidate_axes
from lightning_act.capture.records import unpack as unpack_eager
from lightning_act.capture.report import Outcome
from lightning_act.codecs.exact import INDEX_DTYPES, index_layout
from lightning_act.policy import SlotInfo

__all__ = ["CheaperSaves", "GraphHooks", "GraphPlan", "UnpackWhereRead"]


_EAGER, _KEPT, _PACKED = "eager", "kept", "packed"


_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def _hook_context() -> dict | None:
    """What torch tells a hook while it is inlined into a compiled graph; None when called
    eagerly. Looked up, not imported: importing torch's AOT graph compiler is slow."""
    module = sys.modules.get(_GRAPH_COMPILE)
    return None if module is None else module._get_saved_tensor_hook_context()


@torch.fx.wrap
def _pack(x: torch.Tensor, state: str) -> Any:
    capture = capturing_now()
    context = _hook_context()
    if context is None:  # called eagerly: an op outside any compiled region
        return (_KEPT, x.detach()) if capture is None else (_EAGER, capture.pack(x))
    plan = None if capture is None else GraphHooks.of(state).plan(context, capture)
    if plan is None:
        return (_KEPT, x)
    stored, parsed = x, parse_plan(plan)
    if parsed.form is Form.KEEP:  # kept as it is; the op counts what the graph keeps
        # ``x`` last: where it is also the graph's output or input, torch moves the backward's
        # input for the op's part before it, and the forward's outputs must match that order.
        return (_KEPT, torch.ops.lightning_act.pack_saved(x, plan), x)
    if parsed.derivative is not None:
        # Traced here into the graph's own ops; stored in the memory order unpack restores.
        stored = parsed.substitute().of_input(x)
        stride = unpacked_stride(x.shape, x.stride())
        if stored.stride() != tuple(stride):
            stored = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(stored)
    elif parsed.channels_last:
        # A (values per channel, channels) view of its memory: groups run down each channel.
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
    """A hook graph, run directly (not through ``nn.Module.__call__``, which the capture's global
    module hooks see). Never compiled by Dynamo: eager code after a graph break calls it at every
    save, and Dynamo would recompile it per storage address. With no frame hook set (the common
    case) it skips the costly ``torch.compiler.disable`` wrapper."""

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
    # In a thread of its own: FX keeps the frames it traced from in reference cycles, and the
    # caller's frames hold the step's batch, which would stay alive until the collector ran.
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
    """The hook pair for one ``state``, shared by every capture with it so that a new
    ``compress_activations`` block per step does not recompile. ``state`` names all the plans
    depend on (library version, config, rules, allocation), as torch's AOT autograd cache keys.
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

    def plan(self, context: dict, capture: Capture) -> str | None:
        """The plan of the node torch is inlining the pack hook for (planned per graph)."""
        capture.compiling()
        UnpackWhereRead.install()
        ops.ensure_kernels("cpu")  # the graph ops' C++ side comes with the CPU kernels
        forward = context["_fw_graph"]
        plans = self._plans.get(forward)
        if plans is None:
            plans = self._plans[forward] = GraphPlan(forward, context["_bw_graph"], capture)
        return plans.get(context["_node"])


class UnpackWhereRead:
    """An inductor post-grad pass moving each ``unpack_saved`` to just before its first reader:
    torch inlines every unpack hook at the start of the backward, which would decode everything
    at once, at the uncompressed peak. Chained after any pass already set; installed once per
    process, as backward graphs compile at the first backward, after the session."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        unpack = torch.ops.lightning_act.unpack_saved.default
        # Unpacks read only graph inputs, so moving one leaves every other position as it was.
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


class CheaperSaves:
    """Inductor's min-cut partitioner, then the saves chosen again where backward would read
    one it can store only at many bits through a recomputation.

    Min-cut saves what is cheapest *uncompressed*: attention's scores, recomputing the softmax.
    Compressed, that turns around: scores read through ``exp(s - max)`` stay exact, while the
    softmax is read at 8 bits. So in a session, where a save costs more bits than the session's,
    the recomputed results backward reads and the equality outcomes computed from it
    (:func:`_outcomes`) are marked ``MUST_SAVE`` and the graph partitioned again, kept if its
    saves cost fewer bits. Outside a session, or under the user's checkpointing: plain min-cut.
    """

    ROUNDS = 3

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch.utils.checkpoint import CheckpointPolicy

        # The user's activation checkpointing tags what to recompute: left as they chose.
        checkpointed = any("recompute" in node.meta for node in joint.graph.nodes)
        capture = capturing_now()
        if capture is None or checkpointed:
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def partition() -> tuple[fx.GraphModule, fx.GraphModule]:
            with _choosing_saves():
                return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        try:
            forward, backward = partition()
        except Exception:  # a partition min-cut cannot make without the constants: its own
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        bits = capture.nominal_bits
        cost, candidates = _saves_cost(forward, backward, capture, bits)
        marked: set[str] = set()
        for _ in range(self.ROUNDS):
            # Recomputed results, then outcomes, each tried alone: one that does not pay cannot
            # cost the other its round.
            for names in candidates:
                nodes = [n for n in joint.graph.nodes if n.name in names - marked]
                if not nodes:
                    continue
                for node in nodes:
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked |= names
                try:
                    forward_again, backward_again = partition()
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
        """Inductor's partitioner from now on in this process, unless the user set their own."""
        config = sys.modules.get("torch._inductor.config")
        if config is None or config.custom_partitioner_fn is not None:
            return
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        CustomPartitionerFn.register(CheaperSaves)  # what inductor's config accepts, with a uuid
        config.custom_partitioner_fn = CheaperSaves()


@contextlib.contextmanager
def _choosing_saves() -> Iterator[None]:
    """Min-cut, with its saved set chosen again: a node computed from no tensor (a fill, an
    ``arange``) is not saved, as backward computes it again for nothing (AOT autograd merges
    backward's zeros with forward's: a complex FFT's gradient buffer was kept whole). The nodes
    marked ``MUST_SAVE`` that min-cut does not save are: it honours the mark only on forward
    nodes other than ``getitem``, and never saves a node computed from saves alone (an equality
    outcome), whose inputs it keeps anyway; saved, the outcome frees those inputs' exact copy.
    """
    from torch._functorch import partitioners
    from torch.utils.checkpoint import CheckpointPolicy

    choose = partitioners.choose_saved_values_set

    def choose_again(joint_graph: fx.Graph, node_info: Any, *args: Any, **kwargs: Any) -> list[fx.Node]:
        marked = {n for n in joint_graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE}
        saved: list[fx.Node] = []
        for node in choose(joint_graph, node_info, *args, **kwargs):
            # A save read only through marked parts (the tensors a ``split`` hands out, which
            # min-cut never bans from recomputing): the parts instead, each stored as read.
            parts = _marked_parts(node, marked) or [node]
            saved.extend(p for p in dict.fromkeys(parts) if p not in saved and not _constant(p))
        return saved + [n for n in joint_graph.nodes if n in marked and node_info.is_unclaimed(n) and n not in saved]

    partitioners.choose_saved_values_set = choose_again
    try:
        yield
    finally:
        partitioners.choose_saved_values_set = choose


def _constant(node: fx.Node) -> bool:
    """Whether a node's values come from no tensor and no random stream (``empty`` gives none)."""
    target = node.target
    return (
        node.op == "call_function"
        and not node.all_input_nodes
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and not target_name(target).startswith("empty")
    )


# Ops handing out a list of views of their input, each taken by a ``getitem``.
_SPLITS = frozenset("split split_with_sizes unbind chunk tensor_split".split())


def _marked_parts(node: fx.Node, marked: set[fx.Node]) -> list[fx.Node] | None:
    """The marked views every reader of ``node`` reaches through views (a ``split``'s parts
    included), or None where a reader reaches none."""
    parts: list[fx.Node] = []
    for user in node.users:
        if user in marked:
            parts.append(user)
            continue
        name = target_name(user.target)
        part = user.target is operator.getitem and target_name(node.target) in _SPLITS
        viewing = part or name in VIEW_OPS or name in _SPLITS
        below = _marked_parts(user, marked) if viewing else None
        if not below:
            return None
        parts.extend(below)
    return parts


def _saves_cost(
    forward: fx.GraphModule, backward: fx.GraphModule, capture: Capture, bits: int
) -> tuple[float, tuple[set[str], set[str]]]:
    """The bits a partition's saves cost as :class:`GraphPlan` would store them at ``bits``,
    and the candidates to save instead of those that cost more (see :class:`CheaperSaves`)."""
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
            hinted(val),
            reads[placeholder.name],
            producer(node),
            consumers(node),
            min_numel=capture.config.min_numel,
            group_size=capture.config.group_size,
            statistic=is_statistic(node),
            softmax_row=softmax_row(node),
        )
        if decision.form is Form.MASK:
            cost = 1
        elif decision.form is Form.CELLS:
            cost = (decision.cells.count - 1).bit_length()
        elif decision.form is Form.QUANTIZE:
            cost = max(bits, decision.min_bits)
        else:
            cost = val.element_size() * 8
        total += size_hint(val.numel()) * cost
        if cost > bits:
            results |= _recomputed_results(placeholder, computed)
            outcomes |= _outcomes(placeholder, gradient_free)
    return total, (results, outcomes)


def _free_of_tangents(backward: fx.Graph) -> set[fx.Node]:
    """The nodes of a backward graph computed from saved tensors alone (a forward can too)."""
    free: set[fx.Node] = set()
    for node in backward.nodes:
        if node.op == "placeholder":
            if not is_tangent(node):
                free.add(node)
        elif node.op == "call_function" and all(n in free for n in node.all_input_nodes):
            free.add(node)
    return free


def _outcomes(saved: fx.Node, gradient_free: set[fx.Node]) -> set[str]:
    """The widest gradient-free comparisons backward makes of a saved tensor: boolean nodes from
    saves alone that no boolean node takes further. Saved instead of the tensor, 1 bit a value."""

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
            if node in gradient_free and target_name(node.target) in VIEW_OPS:
                stack.extend(node.users)
            continue
        wider = [u for u in node.users if boolean(u)]
        if wider:
            stack.extend(wider)
        else:
            outcomes.add(node.name)
    return outcomes


def _recomputed_results(saved: fx.Node, computed: dict[str, fx.Node]) -> set[str]:
    """The forward ops' results a backward graph recomputes from a saved tensor and reads:
    whole ops' results (a softmax, not the ``exp`` inside it), and for a view read, the result
    it views (a ReLU after a normalisation, compared with 0 through reshapes)."""
    results, stack, seen = set(), list(saved.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node.name not in computed:
            continue
        seen.add(node)
        recomputed = [u for u in node.users if u.name in computed]
        stack.extend(recomputed)
        if len(recomputed) == len(node.users):
            continue  # not read by backward
        while target_name(node.target) in VIEW_OPS and isinstance(node.args[0], fx.Node):
            node = node.args[0]  # a view read: the result it views is what to save
        if node.op == "call_function" and node.name in computed and _whole_op_result(computed[node.name]):
            results.add(node.name)
    return results


def _whole_op_result(node: fx.Node) -> bool:
    """Whether a forward node is the result of the op it was decomposed from: none of the
    nodes reading it comes from the same call of that op."""
    op = (node.meta.get("original_aten"), node.meta.get("seq_nr"))
    return op[0] is not None and all((u.meta.get("original_aten"), u.meta.get("seq_nr")) != op for u in node.users)


class GraphPlan:
    """The encoded plan of every tensor one compiled forward saves (None: kept as it is).

    The graph's results are planned at once, so the first packed one can carry the kept ones'
    bytes into the report. Its inputs (planned when asked) may be activations passed on at a
    graph break, or the batch, told apart only at run time: the pack op hands back as it is any
    input the session knows stays alive.
    """

    def __init__(self, forward: fx.Graph, backward: fx.Graph, capture: Capture):
        self._reads = graph_reads(backward, forward)
        self._capture = capture
        # As in eager, a save belongs to the module of the first forward op whose backward reads
        # it; the ops that save it are those whose backward reads it, by aten and torch name.
        forward_ops = {
            int(n.meta["seq_nr"]): {op_name(n), function_name(n)} - {None}
            for n in reversed(forward.nodes)
            if n.meta.get("seq_nr") is not None
        }
        self._modules, self._savers = {}, {}
        for node in backward.nodes:
            if node.op == "placeholder":
                readers = backward_readers(node)
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
            # Nothing packed: a kept save carries the others, or the report would miss them all.
            carrier = next(node for node in saved if isinstance(node.meta.get("val"), torch.Tensor))
            plans[carrier.name] = Plan(Form.KEEP, 0, 0, self._module(carrier), "", None, 1, kept=tuple(kept))
        self._encoded = {name: encode_plan(plan) for name, plan in plans.items()}

    def get(self, node: fx.Node) -> str | None:
        if node.name not in self._encoded:
            self._encoded[node.name] = encode_plan(self._plan(node)[0])
        return self._encoded[node.name]

    def _plan(self, node: fx.Node) -> tuple[Plan | None, Outcome]:
        capture = self._capture
        val = hinted(node.meta.get("val"))
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
        if decision.form is Form.MASK:
            return Plan(Form.MASK, 1, 0, module, "", op, 1), Outcome.LOSSLESS
        if decision.form is Form.INDEX and index_layout(*decision.value_range, val.dtype) is not None:
            return Plan(Form.INDEX, 0, 0, module, "", op, 1, index_range=decision.value_range), Outcome.LOSSLESS
        if decision.form is Form.CELLS:
            return Plan(Form.CELLS, 0, 0, module, "", op, 1, cells=decision.cells.thresholds), Outcome.LOSSLESS
        shape = node.meta["val"].shape
        if decision.group_axis is not None and not all(
            isinstance(size, int) for size in (shape if decision.channels_last else (shape[decision.group_axis],))
        ):
            # Its groups depend on these sizes: under ``dynamic=True`` another batch size would
            # move them across channels.
            decision = Decision(Form.KEEP)
        if decision.form is not Form.QUANTIZE:
            return None, Outcome.STATISTIC if decision.form is Form.STATISTIC else Outcome.KEPT
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
            storage_bytes = size_hint(node.meta["val"].untyped_storage().nbytes())
            if exact_form(storage_bytes, numel * val.element_size()) is Form.COPY:
                return Plan(Form.COPY, 0, 0, module, slot, op, decision.min_bits), Outcome.EXACT
            self._exact_slots[node.name] = (slot, info.shape, op)
            return None, Outcome.EXACT
        quantized = Plan(Form.QUANTIZE, bits, group_size, module, slot, op, decision.min_bits)
        if decision.substitute is not None:
            return quantized._replace(derivative=decision.substitute.source), Outcome.COMPRESSED
        # Its group axis surveyed where eager would: plain groups, in a tensor in logical order.
        surveyed = (
            capture.chooses_group_axes
            and decision.row_group is None
            and val.is_contiguous()
            and bool(candidate_axes(val, group_size))
        )
        return quantized._replace(
            survey=f"{slot} {tuple(val.shape)}" if surveyed else None,
            group_axis=decision.group_axis,
            channels_last=decision.channels_last,
        ), Outcome.COMPRESSED

    def _rule_op(self, module: str, op: str | None, savers: set[str]) -> str | None:
        """The op a saved node is named by, for rules and the report: of the ops whose backward
        reads it, the one whose rule pins the most bits (a shared copy serves the most demanding
        save); else the op that computed it, unless a rule names that op and it does not read
        the node (GELU's output is not ``op:gelu``'s)."""
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
