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

With two norms (the raw gradient's and the optimizer update's, blended by the estimator
at a scale that makes uniform 2 bits score the same in both), one set of directions
serves both: ``z ~ N(0, a I + b W)`` estimates the blend ``a ||J d||**2 + b ||J d||_W**2``
at once. The scale comes first, from the totals over every tensor, which one backward
gives: the errors of all tensors summed with random signs and back-propagated to the
parameters have, over the signs, the summed energies as their expected energy.

Cost: one forward and one backward on the slice, one call of each reading node per
tensor (about one more backward in all), one more backward for the scale with two norms,
and ``directions`` forwards. An error
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

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

#: The step of the finite difference, relative to the parameters' norm: small enough that
#: the curvature's share of the difference is negligible, large enough for float32.
RELATIVE_STEP = 1e-3
#: How many nodes a tensor's errors are followed through, at most, to reach the activations
#: that torch functions returned.
MAX_CALLS = 64
#: The dtype the errors routed to activations are held in until the directional forwards.
ERROR_DTYPE = torch.bfloat16


class Mismatch(RuntimeError):
    """A perturbed forward did not repeat the recorded one call for call."""


class ForwardRecorder(TorchFunctionMode):
    """Indexes the floating-point outputs of every torch function in call order (calls
    that return none do not count).

    ``record`` mode notes each output that has a gradient function, keyed by its autograd
    edge ``(grad_fn, output_nr)``, with its shape (no copy of its values: a probe holds
    none); ``replay`` mode hands each wanted output of a later forward to
    ``on_output(call, position, output)``."""

    def __init__(self):
        super().__init__()
        self.replaying = False
        #: (grad_fn, output_nr) -> (call, position) of the output of that edge.
        self.index: dict[tuple, tuple[int, int]] = {}
        #: (call, position) -> the shape of that output.
        self.shapes: dict[tuple[int, int], torch.Size] = {}
        self.wanted: set[tuple[int, int]] | None = None
        self.signature: list[int] = []  # floating-point outputs per call
        self.on_output: Callable[[int, int, torch.Tensor], None] | None = None
        self._calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [(i, t) for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not tensors:  # attribute reads and the like: a lazy first-call setup may add some
            return out
        call = self._calls
        self._calls += 1
        if not self.replaying:
            self.signature.append(len(tensors))
            for i, t in tensors:
                if t.grad_fn is not None:
                    self.index[(t.grad_fn, t.output_nr)] = (call, i)
                    self.shapes[(call, i)] = t.shape
            return out
        if call >= len(self.signature) or self.signature[call] != len(tensors):
            raise Mismatch(f"call {call} of the perturbed forward differs from the recorded one")
        for i, t in tensors:
            if (call, i) in self.wanted:
                if self.shapes[(call, i)] != t.shape:
                    raise Mismatch(
                        f"output {i} of call {call} has shape {tuple(t.shape)}, "
                        f"recorded {tuple(self.shapes[(call, i)])}"
                    )
                self.on_output(call, i, t.detach())
        return out

    def replay(self, wanted: set[tuple[int, int]], on_output: Callable[[int, int, torch.Tensor], None]):
        """Hand the ``wanted`` outputs of the next forward run under this mode to ``on_output``."""
        self.replaying, self.wanted, self.on_output, self._calls = True, wanted, on_output, 0
        return self

    def finish(self) -> None:
        if self.replaying and self._calls != len(self.signature):
            raise Mismatch(f"the perturbed forward made {self._calls} calls, the recorded one {len(self.signature)}")


def norm_energies(errors: Iterable[tuple[int, torch.Tensor]], norms: list, device: torch.device) -> torch.Tensor:
    """Per norm, the summed squared error of parameters' gradients, given as ``(parameter
    index, error)``: plain (a norm of None), or each element weighted by the norm's weight
    for that parameter (None: plain). A float64 tensor on ``device``, one entry per norm."""
    totals: list[torch.Tensor | float] = [0.0] * len(norms)
    for index, error in errors:
        squared = error.double().square()
        for j, norm in enumerate(norms):
            weight = None if norm is None else norm[index]
            totals[j] = totals[j] + (squared if weight is None else squared * weight).sum()
    return torch.stack([torch.as_tensor(total, dtype=torch.float64, device=device) for total in totals])


def _sum_to(error: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return error if error.shape == shape else error.sum_to_size(shape)


def _drop_gradient(gradient: torch.Tensor) -> torch.Tensor:
    return gradient.new_zeros(()).expand(gradient.shape)


def energies_of_gradients(
    params: Sequence[torch.Tensor],
    norms: list,
    backward: Callable[[], object],
    reference: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Per norm, the summed squared gradient (less ``reference``'s, per parameter) that
    ``backward`` computes for ``params``, each parameter's taken as it arrives and then
    dropped: the energies cost one parameter's gradient at a time, not a copy of all."""
    device = params[0].device
    totals = torch.zeros(len(norms), dtype=torch.float64, device=device)

    def hook_of(index: int):
        def hook(gradient: torch.Tensor) -> torch.Tensor:
            if reference is None:
                totals.add_(norm_energies([(index, gradient.float())], norms, device))
            elif reference[index] is not None:
                totals.add_(norm_energies([(index, (gradient - reference[index]).float())], norms, device))
            return _drop_gradient(gradient)

        return hook

    handles = [p.register_hook(hook_of(i)) for i, p in enumerate(params)]
    try:
        backward()
    finally:
        for handle in handles:
            handle.remove()
    return totals


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
    """Steps 1 to 3 for one probed forward: build it, :meth:`measure` the slots, then
    :meth:`upstream`.

    No backward's gradients are held: a first backward records the order its nodes run in,
    the metadata of what reaches each and which nodes read each slot; a second one calls
    each reader, from its pre-hook, on what reaches it as it runs (step 2)."""

    def __init__(
        self, probe, recorder: ForwardRecorder, loss: torch.Tensor, params: Sequence[torch.Tensor], norms: list
    ):
        self.probe = probe
        self.recorder = recorder
        self.loss = loss
        self.params = list(params)
        self.norms = norms  # per norm: None (plain) or a weight per parameter
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        # node -> the (shape, dtype, device) of each gradient reaching it, in the order backward ran them
        self._arriving: dict = {}
        probe.readers = {}
        try:
            self._backward({node: self._note_arrivals(node) for node in graph_nodes(loss.grad_fn)})
        finally:
            self.readers, probe.readers = probe.readers, None
        self._order = {node: i for i, node in enumerate(self._arriving)}
        #: per slot: the squared error of the parameters its readers write, per norm (a
        #: device tensor).
        self.local: dict[str, torch.Tensor] = {}
        #: (call, position) -> [(slot, error of that activation's gradient)].
        self.errors: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        #: Slots whose errors could not all be followed to a recorded activation.
        self.unrouted: set[str] = set()

    def _backward(self, prehooks: dict) -> None:
        """The exact backward on the slice with ``prehooks`` (node -> hook). The parameters'
        gradients are not needed, only what reaches each node: each is dropped as it arrives
        (a one-element view is returned instead)."""
        handles = [node.register_prehook(hook) for node, hook in prehooks.items()]
        handles += [p.register_hook(_drop_gradient) for p in self.params]
        try:
            torch.autograd.grad(self.loss, self.params, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()

    def _note_arrivals(self, node):
        def hook(grad_outputs):
            self._arriving[node] = [None if g is None else (g.shape, g.dtype, g.device) for g in grad_outputs]

        return hook

    def _call(self, node, grad_outputs) -> tuple:
        with torch.no_grad():  # a node called outside backward would otherwise record a graph
            result = node(*grad_outputs)
        return result if isinstance(result, tuple) else (result,)

    def measure(self, widths: dict[str, int]) -> None:
        """Step 2 for every slot, rounded at its width: its readers' errors, routed."""
        by_reader: dict = {}
        waiting: dict[str, int] = {}  # slot -> readers still to run
        seeds: dict[str, int] = {}
        for slot in widths:
            readers = self.readers.get(slot, [])
            if not readers or any(node not in self._order for node in readers):
                self.unrouted.add(slot)
                continue
            waiting[slot] = len(readers)
            seeds[slot] = self.probe.next_seed()  # drawn in the slots' order, whatever order backward reads them in
            for node in readers:
                by_reader.setdefault(node, []).append(slot)
        decoded: dict[str, torch.Tensor] = {}
        errors: dict[str, list] = {}

        def reads(node):
            def hook(grad_outputs):
                for slot in by_reader[node]:
                    if slot not in decoded:
                        decoded[slot] = self.probe.decode(slot, widths[slot], seeds[slot])
                    exact = self._call(node, grad_outputs)
                    self.probe.quantize_only(slot, widths[slot], decoded[slot])
                    try:
                        noisy = self._call(node, grad_outputs)
                    finally:
                        self.probe.quantize_only(None, 0)
                    errors.setdefault(slot, []).extend(
                        (edge, n - e)
                        for edge, n, e in zip(node.next_functions, noisy, exact)
                        if n is not None and e is not None
                    )
                    del exact, noisy
                    waiting[slot] -= 1
                    if not waiting[slot]:  # its last reader: routed now, its copies dropped
                        del decoded[slot]
                        self._route(slot, errors.pop(slot))

            return hook

        self._backward({node: reads(node) for node in by_reader})

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
                # Kept in bfloat16, float32's range at half its bytes: every error is only ever
                # read in sums of products with other vectors, which its rounding (a 2**-9
                # relative error per element, unbiased across elements) does not move.
                self.errors.setdefault(key, []).append(
                    (slot, _sum_to(error, self.recorder.shapes[key]).to(ERROR_DTYPE))
                )
                return True
            arriving = self._arriving.get(node)
            if arriving is None or arriving[output_nr] is None:
                return False
            # Called directly, a node returns the gradient of a broadcast input unreduced; the
            # engine would sum it to the input's shape.
            error = _sum_to(error, arriving[output_nr][0])
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
            alone = [None if g is None else torch.zeros(g[0], dtype=g[1], device=g[2]) for g in self._arriving[node]]
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
        self.local[slot] = norm_energies(param_errors.items(), self.norms, self.params[0].device)

    def upstream_totals(self, factors: dict[str, float]) -> torch.Tensor:
        """Per norm, the upstream error energy summed over the routed slots, each slot's
        errors scaled by ``sqrt(factors[slot])`` (its noise energy at another width
        relative to the probed one): one backward of the errors summed with random signs,
        from the recorded activations to the parameters. Over the signs, the cross terms
        between slots vanish, so the result's expectation is the sum of the slots' own."""
        generator = torch.Generator().manual_seed(1)
        slots = sorted({slot for entries in self.errors.values() for slot, _ in entries})
        signs = dict(zip(slots, (torch.randint(0, 2, (len(slots),), generator=generator) * 2 - 1).tolist()))
        edges = {key: edge for edge, key in self.recorder.index.items() if key in self.errors}
        if not edges:
            return torch.zeros(len(self.norms), dtype=torch.float64)
        # The backward starts from every activation with a zero gradient that costs nothing (a
        # stride-0 view); each activation's signed errors are added only as its node runs.
        by_node: dict = {}
        for key, (node, output_nr) in edges.items():
            by_node.setdefault(node, []).append((output_nr, key))

        def injects(node):
            def hook(grad_outputs):
                grad_outputs = list(grad_outputs)
                for output_nr, key in by_node[node]:
                    signed = sum(
                        signs[slot] * math.sqrt(factors[slot]) * error.float() for slot, error in self.errors[key]
                    )
                    arriving = grad_outputs[output_nr]
                    grad_outputs[output_nr] = signed.to(arriving.dtype) + arriving
                return tuple(grad_outputs)

            return hook

        outputs = [GradientEdge(*edge) for edge in edges.values()]
        zeros = [
            torch.zeros((), device=self.errors[key][0][1].device).expand(self.recorder.shapes[key]) for key in edges
        ]
        handles = [node.register_prehook(injects(node)) for node in by_node]
        try:
            return energies_of_gradients(
                self.params,
                self.norms,
                lambda: torch.autograd.grad(outputs, self.params, zeros, retain_graph=True, allow_unused=True),
            ).cpu()
        finally:
            for handle in handles:
                handle.remove()

    def upstream(self, forward: Callable[[], object], directions: int, weights: Sequence) -> dict[str, float]:
        """Step 3: per slot, the mean over directions ``z ~ N(0, W)`` of ``<J^T z, d>**2``,
        ``W`` given per parameter by ``weights`` (a tensor of its shape, a float, or None
        for 1).

        ``<J^T z, d>`` is the finite difference of ``<f(theta), d>`` along ``z``, with ``f`` the
        recorded activations. The products are taken as each forward returns its
        activations, in float64, the one at the parameters as they are by one more forward:
        no forward's activations are kept, and every forward runs without a graph. The
        directions are fixed, like the probes' rounding seeds, so that the same model and
        batch measure the same."""
        slots = sorted({slot for entries in self.errors.values() for slot, _ in entries})
        if not slots:  # every error is local
            return {}
        position = {slot: k for k, slot in enumerate(slots)}
        # Per activation: its slots' errors as the rows of one matrix, so that one product
        # gives every slot's <f, d> there.
        stacked = {}
        for key in list(self.errors):
            entries = self.errors.pop(key)
            stacked[key] = (
                torch.tensor([position[slot] for slot, _ in entries], device=entries[0][1].device),
                torch.stack([error.reshape(-1) for _, error in entries]),
            )
            del entries
        device = self.params[0].device
        products = torch.zeros(len(slots), dtype=torch.float64, device=device)

        def on_output(call: int, position: int, output: torch.Tensor) -> None:
            rows, errors = stacked[(call, position)]
            products.index_add_(0, rows, _float64_products(errors, output.reshape(-1)))

        def products_at_parameters() -> torch.Tensor:
            products.zero_()
            with torch.no_grad(), self.recorder.replay(set(stacked), on_output):
                forward()
            self.recorder.finish()
            return products.clone()

        base = products_at_parameters()
        means = torch.zeros(len(slots), dtype=torch.float64, device=device)  # read once, at the end
        scale = sum(p.detach().double().square().sum() for p in self.params).sqrt()  # the parameters' norm
        generator = torch.Generator().manual_seed(0)
        originals = [p.data for p in self.params]
        try:
            for _ in range(directions):
                eps = self._perturb(weights, generator, scale, originals)
                if eps is None:  # every weight is zero: no error counts
                    continue
                means += ((products_at_parameters() - base) / eps).square()
                for p, value in zip(self.params, originals):
                    p.data = value
        finally:
            for p, value in zip(self.params, originals):
                p.data = value
        return dict(zip(slots, (means / directions).tolist()))

    def _perturb(
        self, weights: Sequence, generator: torch.Generator, scale: torch.Tensor, originals: list[torch.Tensor]
    ) -> float | None:
        """Moves the parameters to ``originals + eps * z`` for a new direction ``z ~ N(0, W)``,
        one parameter at a time, and returns ``eps``. The originals stay as they are (the
        parameters get new tensors): restoring them is exact, and the probe holds one
        perturbed copy of the parameters, not the draws, the steps and a saved copy too."""

        def steps():
            for i, (p, value) in enumerate(zip(self.params, originals)):
                z = torch.randn(p.shape, generator=generator).to(p.device)
                weight = weights[i]
                yield value, (z if weight is None else z.mul_(torch.as_tensor(weight, device=p.device).sqrt()))

        state = generator.get_state()
        length = sum(step.double().square().sum() for _, step in steps()).sqrt()
        if length == 0:
            return None
        eps = float(RELATIVE_STEP * scale / length)
        generator.set_state(state)  # the same draws again, now applied
        for p, (value, step) in zip(self.params, steps()):
            p.data = value + step.to(value.dtype) * eps
        return eps


def _float64_products(rows: torch.Tensor, vector: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """``rows @ vector`` in float64, a chunk of columns at a time (the float64 copies stay
    small): a finite difference of two such products cancels all but a thousandth of them."""
    total = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    for start in range(0, vector.numel(), chunk):
        total += rows[:, start : start + chunk].double() @ vector[start : start + chunk].double()
    return total
