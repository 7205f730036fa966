"""GACT's sensitivities at a cost that does not grow with depth.

GACT's probes (:func:`~lightning_act.policy.estimators.probe_sensitivities` with
``method="per_tensor"``) measure ``v_i``, the error that saved tensor ``i``'s rounding noise
puts into the gradient, with one backward through the whole model per tensor: the cost of a
recalibration grows with the number of saved tensors, so with depth. Here the same
quantity, per tensor, comes from passes whose number does not depend on the model:

1. one exact backward on the probe slice that records which backward nodes read each saved
   tensor and the gradient each node receives;
2. per tensor, its reading nodes called once more on that gradient, with the tensor
   rounded: the errors they pass on, ``d``, to parameters' gradients (the local part,
   measured as is) and to activations' gradients;
3. the error that an activation's gradient error ``d`` puts into every parameter upstream,
   ``||J d||**2`` with ``J`` the backward from that activation to the parameters, estimated
   without back-propagating ``d``: for a random direction ``z`` in parameter space,
   ``<z, J d> = <J^T z, d>``, and ``J^T z`` is how the activation moves when the parameters
   move along ``z``: a directional derivative, taken by a finite difference, one forward
   per direction for every activation at once. The mean of ``<J^T z, d>**2`` over
   directions ``z ~ N(0, W)`` is ``d^T J^T W J d`` (Hutchinson's estimator): the squared
   error in the norm that ``W`` weighs (the identity for the raw gradient, the optimizer's
   ``(lr / denominator)**2`` for its update).

Cost: one forward and one backward on the slice, one call of each reading node per
tensor (about one more backward in all) and ``directions`` forwards per norm. An error
whose activation no forward call returned (a value inside a fused C++ op) is followed
through the nodes between, which are linear in it; a tensor whose error cannot be followed
to a recorded activation within :data:`MAX_CALLS` node calls is probed by a whole backward
instead (the hidden states inside ``nn.GRU``'s one fused op: every timestep is a node),
and if the perturbed forwards do not repeat the first one call for call (data-dependent
control flow), every tensor is.

The directional estimate has a relative spread of ``sqrt(2 / directions)`` per tensor; the
allocation compares tensors whose sensitivities span orders of magnitude, and
``benchmarks/adaptive_allocation.py`` measures what the spread costs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

#: The step of the finite difference, relative to the parameters' norm: small enough that
#: the curvature's share of the difference is negligible, large enough for float32.
RELATIVE_STEP = 1e-3
#: How many nodes a tensor's errors are followed through, at most, to reach the activations
#: that torch functions returned.
MAX_CALLS = 64


class Mismatch(RuntimeError):
    """A perturbed forward did not repeat the recorded one call for call."""


class ForwardRecorder(TorchFunctionMode):
    """Records the floating-point outputs of every torch function in call order (calls
    that return none do not count).

    ``record`` mode keeps each output that has a gradient function, keyed by its autograd
    edge ``(grad_fn, output_nr)``; ``compare`` mode hands each wanted output's difference
    from the recorded one to ``on_difference(call, position, difference)``."""

    def __init__(self):
        super().__init__()
        self.comparing = False
        #: (grad_fn, output_nr) -> (call, position) of the output of that edge.
        self.index: dict[tuple, tuple[int, int]] = {}
        self.recorded: dict[tuple[int, int], torch.Tensor] = {}
        self.signature: list[int] = []  # floating-point outputs per call
        self.on_difference: Callable[[int, int, torch.Tensor], None] | None = None
        self._calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [(i, t) for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not tensors:  # attribute reads and the like: a lazy first-call setup may add some
            return out
        call = self._calls
        self._calls += 1
        if not self.comparing:
            self.signature.append(len(tensors))
            for i, t in tensors:
                if t.grad_fn is not None:
                    self.index[(t.grad_fn, t.output_nr)] = (call, i)
                    # A copy, in float32: the output may be written in place later in the forward.
                    self.recorded[(call, i)] = t.detach().float().clone()
            return out
        if call >= len(self.signature) or self.signature[call] != len(tensors):
            raise Mismatch(f"call {call} of the perturbed forward differs from the recorded one")
        for i, t in tensors:
            base = self.recorded.get((call, i))
            if base is not None:
                if base.shape != t.shape:
                    raise Mismatch(f"output {i} of call {call} has shape {tuple(t.shape)}, recorded {tuple(base.shape)}")
                self.on_difference(call, i, t.detach().float() - base)
        return out

    def compare(self, on_difference: Callable[[int, int, torch.Tensor], None]) -> ForwardRecorder:
        self.comparing, self.on_difference, self._calls = True, on_difference, 0
        return self

    def finish(self) -> None:
        if self.comparing and self._calls != len(self.signature):
            raise Mismatch(f"the perturbed forward made {self._calls} calls, the recorded one {len(self.signature)}")

    def keep_only(self, wanted: set[tuple[int, int]]) -> None:
        self.recorded = {key: value for key, value in self.recorded.items() if key in wanted}


def _sum_to(error: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return error if error.shape == shape else error.sum_to_size(shape)


def graph_nodes(root) -> list:
    """Every node of the backward graph reachable from ``root``."""
    seen, stack, nodes = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


class LinearizedProbe:
    """Steps 1 to 3 for one probed forward: build it, then call :meth:`sensitivities`."""

    def __init__(self, probe, recorder: ForwardRecorder, loss: torch.Tensor, params: Sequence[torch.Tensor],
                 norms: list):
        self.probe = probe
        self.recorder = recorder
        self.params = list(params)
        self.norms = norms  # per norm: None (plain) or a weight per parameter
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        self._received: dict = {}  # node -> its incoming gradients, in the order backward ran them
        handles = [node.register_prehook(self._receive(node)) for node in graph_nodes(loss.grad_fn)]
        probe.readers = {}
        try:
            self.exact = torch.autograd.grad(loss, self.params, retain_graph=True, allow_unused=True)
        finally:
            self.readers, probe.readers = probe.readers, None
            for handle in handles:
                handle.remove()
        self._order = {node: i for i, node in enumerate(self._received)}
        self._exact_calls: dict = {}
        #: per slot: the squared error of the parameters its readers write, per norm (a
        #: device tensor).
        self.local: dict[str, torch.Tensor] = {}
        #: (call, position) -> [(slot, error of that activation's gradient)].
        self.errors: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        #: Slots whose errors could not all be followed to a recorded activation.
        self.unrouted: set[str] = set()

    def _receive(self, node):
        def hook(grad_outputs):
            self._received[node] = grad_outputs
        return hook

    def _call(self, node, grad_outputs) -> tuple:
        with torch.no_grad():  # a node called outside backward would otherwise record a graph
            result = node(*grad_outputs)
        return result if isinstance(result, tuple) else (result,)

    def add(self, slot: str, bits: int) -> None:
        """Step 2 for ``slot`` rounded at ``bits``: its readers' errors, routed."""
        readers = self.readers.get(slot, [])
        if not readers or any(node not in self._received for node in readers):
            self.unrouted.add(slot)
            return
        decoded = self.probe.decode(slot, bits)
        errors = []
        for node in readers:
            grad_outputs = self._received[node]
            if node not in self._exact_calls:
                self._exact_calls[node] = self._call(node, grad_outputs)
            self.probe.quantize_only(slot, bits, decoded)
            try:
                noisy = self._call(node, grad_outputs)
            finally:
                self.probe.quantize_only(None, 0)
            errors += [(edge, n - e) for edge, n, e in zip(node.next_functions, noisy, self._exact_calls[node])
                       if n is not None and e is not None]
        self._route(slot, errors)

    def _route(self, slot: str, errors: list) -> None:
        """Follows ``[((node, output_nr), error)]`` to parameters and recorded activations.

        Nodes in between are called, each once with everything that reaches it, in the
        order the exact backward ran them, which is when every error bound for a node has
        arrived; a node returns an error that ``alone`` would cause, being linear in it."""
        param_errors: dict[int, torch.Tensor] = {}
        pending: dict = {}  # node -> {output_nr: error}

        def reach(node, output_nr: int, error: torch.Tensor) -> bool:
            if node is None:
                return True
            variable = getattr(node, "variable", None)
            if variable is not None:  # a parameter's (or an input's) gradient accumulator
                index = self._param_index.get(id(variable))
                if index is not None:
                    error = _sum_to(error, variable.shape)
                    param_errors[index] = param_errors[index] + error if index in param_errors else error
                return True
            key = self.recorder.index.get((node, output_nr))
            if key is not None:
                self.errors.setdefault(key, []).append((slot, _sum_to(error, self.recorder.recorded[key].shape).float()))
                return True
            received = self._received.get(node)
            if received is None or received[output_nr] is None:
                return False
            # Called directly, a node returns the gradient of a broadcast input unreduced; the
            # engine would sum it to the input's shape.
            error = _sum_to(error, received[output_nr].shape)
            waiting = pending.setdefault(node, {})
            waiting[output_nr] = waiting[output_nr] + error if output_nr in waiting else error
            return True

        routed = all(reach(node, output_nr, error) for (node, output_nr), error in errors)
        calls = 0
        while routed and pending:
            node = min(pending, key=self._order.__getitem__)
            if calls == MAX_CALLS:
                routed = False
                break
            calls += 1
            alone = [None if g is None else torch.zeros_like(g) for g in self._received[node]]
            for output_nr, error in pending.pop(node).items():
                alone[output_nr] = error
            for (next_node, next_nr), passed in zip(node.next_functions, self._call(node, alone)):
                if passed is not None and not reach(next_node, next_nr, passed):
                    routed = False
        if not routed:
            self.unrouted.add(slot)
            for entries in self.errors.values():
                entries[:] = [entry for entry in entries if entry[0] != slot]
            return
        # On the device: the caller reads every slot's in one transfer.
        local = [0.0] * len(self.norms)
        for index, error in param_errors.items():
            squared = error.double().square()
            for j, norm in enumerate(self.norms):
                weight = None if norm is None else norm[index]
                local[j] = local[j] + (squared if weight is None else squared * weight).sum()
        self.local[slot] = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.params[0].device)
                                        for v in local])

    def upstream(self, forward: Callable[[], object], directions: int) -> dict:
        """Step 3: per slot and norm, the mean over directions of ``<J^T z, d>**2``.

        The directions are fixed, like the probes' rounding seeds, so that the same model
        and batch measure the same, and each norm scales the same draws by its weights."""
        self.recorder.keep_only(set(self.errors))
        slots = sorted({slot for entries in self.errors.values() for slot, _ in entries})
        position = {slot: k for k, slot in enumerate(slots)}
        # Per activation: its slots' errors as the rows of one matrix, so that one product
        # gives every slot's <J^T z, d> there.
        self._stacked = {key: (torch.tensor([position[slot] for slot, _ in entries], device=entries[0][1].device),
                               torch.stack([error.reshape(-1) for _, error in entries]))
                         for key, entries in self.errors.items()}
        self.errors = {}
        means = torch.zeros(len(slots), len(self.norms), dtype=torch.float64)
        scale = sum(p.detach().double().square().sum() for p in self.params).sqrt()  # the parameters' norm
        for j, norm in enumerate(self.norms):
            generator = torch.Generator().manual_seed(0)
            for _ in range(directions):
                means[:, j] += self._direction(forward, norm, generator, len(slots), scale).square().cpu() / directions
        return dict(zip(slots, means.tolist()))

    def _direction(self, forward, norm, generator: torch.Generator, slots: int, scale: torch.Tensor) -> torch.Tensor:
        steps = []
        for i, p in enumerate(self.params):
            z = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device)
            weight = None if norm is None else norm[i]
            steps.append(z if weight is None else z * torch.as_tensor(weight, dtype=torch.float32).sqrt())
        length = sum(s.double().square().sum() for s in steps).sqrt()
        eps = float(RELATIVE_STEP * scale / length) if length > 0 else 0.0
        dots = torch.zeros(slots, dtype=torch.float64, device=self.params[0].device)

        def on_difference(call: int, position: int, difference: torch.Tensor) -> None:
            rows, errors = self._stacked[(call, position)]
            dots.index_add_(0, rows, (errors @ difference.reshape(-1)).double() / eps)

        saved = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, step in zip(self.params, steps):
                    p.add_(step.to(p.dtype), alpha=eps)
            with self.recorder.compare(on_difference):
                forward()
            self.recorder.finish()
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, saved):
                    p.copy_(value)
        return dots
