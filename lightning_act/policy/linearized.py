"""GACT's sensitivities at a cost that does not grow with depth.

GACT's probes (``method="per_tensor"``) run a whole backward per saved tensor. Here ``v_i``, the gradient error
tensor ``i``'s rounding causes, comes from a number of passes independent of the model:

1. an exact backward on the probe slice records which nodes read each saved tensor and what reaches each node;
2. per tensor, its readers are called again with it rounded: the errors ``d`` they pass to parameters'
   gradients (the local part) and to activations' gradients;
3. ``d`` reaches the parameters upstream as ``||J d||**2``. For a direction ``z``, ``<z, J d> = <J^T z, d>``,
   and ``J^T z`` is the activations' directional derivative: one finite-difference forward per direction
   serves them all. Over ``z ~ N(0, W)``, ``E <J^T z, d>**2 = d^T J^T W J d`` (Hutchinson).

Two norms (gradient and update) share the directions: ``z ~ N(0, a I + b W)`` estimates the blend
``a ||J d||**2 + b ||J d||_W**2``; its scale comes first, from one backward of all errors summed with random
signs. Errors inside fused ops are followed through the (linear) nodes between; a tensor not routed within
:data:`MAX_CALLS` calls is probed by a whole backward, and every tensor is if a perturbed forward does not
repeat the recorded one. The estimate's relative spread is ``sqrt(2 / directions)`` per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

#: The finite difference's step relative to the parameters' norm: small enough that curvature is negligible,
#: large enough for float32.
RELATIVE_STEP = 1e-3
#: The most nodes a tensor's errors are followed through to reach activations torch functions returned.
MAX_CALLS = 64
#: The dtype the errors routed to activations are held in until the directional forwards.
ERROR_DTYPE = torch.bfloat16


class Mismatch(RuntimeError):
    """A perturbed forward did not repeat the recorded one call for call."""


class ForwardRecorder(TorchFunctionMode):
    """Indexes the floating-point outputs of torch functions in call order: recording keys each output that has
    a ``grad_fn`` by its autograd edge (shape only); :meth:`replay` hands wanted outputs of a later forward to
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
    """Per norm, the summed squared ``(parameter index, error)`` pairs, each element weighted by the norm's
    weight for that parameter (None: unweighted). A float64 tensor on ``device``."""
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
    """Per norm, the summed squared gradient (less ``reference``'s) ``backward`` computes for ``params``, each
    taken as it arrives and dropped, so only one parameter's gradient is held at a time."""
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
    """Steps 1 to 3 for one probed forward: build it, :meth:`measure` the slots, then :meth:`upstream`.

    No gradients are held: the first backward records the nodes' order, the metadata of what reaches each
    and each slot's readers; a second calls each reader from its pre-hook as it runs (step 2)."""

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
        #: Per slot: the squared error of the parameters its readers write, per norm (a device tensor).
        self.local: dict[str, torch.Tensor] = {}
        #: (call, position) -> [(slot, error of that activation's gradient)].
        self.errors: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        #: Slots whose errors could not all be followed to a recorded activation.
        self.unrouted: set[str] = set()

    def _backward(self, prehooks: dict) -> None:
        """The exact backward on the slice with ``prehooks`` (node -> hook); parameters' gradients are dropped."""
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

        Nodes in between are called once each, in the exact backward's order (when all their errors have
        arrived), on the errors alone: they are linear in them."""
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
                # bfloat16: float32's range at half the bytes; errors are only read in sums of products,
                # which per-element rounding does not move.
                self.errors.setdefault(key, []).append(
                    (slot, _sum_to(error, self.recorder.shapes[key]).to(ERROR_DTYPE))
                )
                return True
            arriving = self._arriving.get(node)
            if arriving is None or arriving[output_nr] is None:
                return False
            # A node called directly returns a broadcast input's gradient unreduced.
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
        """Per norm, the upstream error energy summed over the routed slots, each scaled by
        ``sqrt(factors[slot])``: one backward of the errors summed with random signs, whose cross terms
        vanish in expectation."""
        generator = torch.Generator().manual_seed(1)
        slots = sorted({slot for entries in self.errors.values() for slot, _ in entries})
        signs = dict(zip(slots, (torch.randint(0, 2, (len(slots),), generator=generator) * 2 - 1).tolist()))
        edges = {key: edge for edge, key in self.recorder.index.items() if key in self.errors}
        if not edges:
            return torch.zeros(len(self.norms), dtype=torch.float64)
        # Start from stride-0 zero gradients; each activation's signed errors are added as its node runs.
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
        """Step 3: per slot, the mean over directions ``z ~ N(0, W)`` of ``<J^T z, d>**2``, ``W`` given per
        parameter by ``weights`` (a tensor, a float, or None for 1).

        ``<J^T z, d>`` is the finite difference of ``<f(theta), d>`` along ``z``, ``f`` the recorded
        activations, taken in float64 as each graph-free forward returns them. Directions are seeded, so the
        same model and batch measure the same."""
        slots = sorted({slot for entries in self.errors.values() for slot, _ in entries})
        if not slots:  # every error is local
            return {}
        position = {slot: k for k, slot in enumerate(slots)}
        # Per activation: its slots' errors as rows of one matrix, so one product gives every slot's <f, d>.
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
        """Moves the parameters to ``originals + eps * z`` for a new direction ``z ~ N(0, W)`` and returns
        ``eps``. The parameters get new tensors, so restoring the originals is exact; the draws are
        regenerated rather than held."""

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
    """``rows @ vector`` in float64 (a finite difference of two cancels most of their digits), a chunk of
    columns at a time so the float64 copies stay small."""
    total = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    for start in range(0, vector.numel(), chunk):
        total += rows[:, start : start + chunk].double() @ vector[start : start + chunk].double()
    return total
