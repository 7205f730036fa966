"""Which op is saving a tensor right now: the torch function running when a pack hook fires.

Autograd calls the pack hook of ``torch.autograd.graph.saved_tensors_hooks`` from inside
the op that saves the tensor, so the op that is running is the op that saves. The
:class:`OpTracker` is a :class:`torch.overrides.TorchFunctionMode` that notes the name of
every torch function while it runs: ``"relu"``, ``"conv2d"``, ``"max_pool2d"``,
``"dropout"``, ``"linear"``, ``"softmax"``, ``"layer_norm"``,
``"scaled_dot_product_attention"``, and so on. A pack hook asks :meth:`OpTracker.current`
and can then pick a codec by op: a 1-bit sign mask for ReLU's saved output, a narrow
integer codec for max-pool indices (whose bound :func:`saved_index_range` reads off the
call, with no device synchronisation), the plain quantizer elsewhere.

What it sees:

* the *outermost* torch function of a call. While a mode's handler runs the mode is
  switched off, so ``F.relu`` is reported as ``"relu"`` and the ``torch.relu`` it calls is
  not seen; ``F.max_pool2d`` is ``"max_pool2d"`` although ATen saves the indices of
  ``max_pool2d_with_indices``. Tensor methods and operators count too (``x.relu()`` is
  ``"relu"``, ``x * y`` is ``"mul"``);
* functions, not modules: ``nn.Conv2d``'s forward is reported as ``"conv2d"``. A custom
  ``torch.autograd.Function``'s ``apply`` is not a torch function: what it saves is
  reported as None (or as the enclosing function, if a torch function called it);
* under ``torch.compile`` it steps aside: while Dynamo traces, the handler only calls the
  function, so the traced graph is the one without the tracker and ``fullgraph=True``
  still holds. A graph compiled with the default inductor backend (or any AOTAutograd
  backend) saves from inside one fused autograd function when it runs, reported as None:
  the capture engine compresses those tensors by the default rules. Dynamo guards on the
  active modes, so a compiled module called both with and without the tracker is
  compiled once for each.

Cost: one extra Python call per torch function, attribute accesses such as ``x.shape``
included: 2.7 us per call on the CPU measured, and a ResNet-18 forward makes 109 calls, so
0.3 ms per step: under 0.01% of a 3.6 s CPU step (``benchmarks/optrack_overhead.py``); on
a GPU, where the same step takes milliseconds, it would be a few percent (not measured).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OpTracker", "TrackedCall", "saved_index_range"]


class TrackedCall(NamedTuple):
    """One torch function call in progress."""

    name: str
    args: tuple
    kwargs: dict


def _function_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


class OpTracker(TorchFunctionMode):
    """Knows which torch function is running, for pack hooks that choose a codec by op.

    Example::

        tracker = OpTracker()

        def pack(t):
            if tracker.current() == "relu":
                ...

        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(x).sum()

    Enter it in the thread that runs the forward (torch function modes are per thread), and
    enter it once at a time.
    """

    def __init__(self):
        super().__init__()
        self._calls: list[TrackedCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        self._calls.append(TrackedCall(_function_name(func), args, kwargs))
        try:
            return func(*args, **kwargs)
        finally:
            self._calls.pop()

    def current(self) -> str | None:
        """Name of the torch function running now, or None outside any."""
        return self._calls[-1].name if self._calls else None

    def current_call(self) -> TrackedCall | None:
        """The torch function running now with its arguments, or None outside any."""
        return self._calls[-1] if self._calls else None


# Max-pool functions whose saved indices address the input's last `n` dimensions, flattened.
_MAX_POOL_DIMS = {
    "max_pool1d": 1,
    "max_pool2d": 2,
    "max_pool3d": 3,
    "max_pool1d_with_indices": 1,
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "adaptive_max_pool1d": 1,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
    "adaptive_max_pool1d_with_indices": 1,
    "adaptive_max_pool2d_with_indices": 2,
    "adaptive_max_pool3d_with_indices": 3,
}


def saved_index_range(call: TrackedCall | None) -> tuple[int, int] | None:
    """``(low, high)`` bounding the integer tensor a call saves, when the call alone tells.

    Max-pool indices address the flattened spatial plane of the input: ``[0, H * W)`` for a
    2-D pool. The bound comes from the input's shape, so it costs no synchronisation;
    :class:`~lightning_act.codecs.exact.IndexCodec` takes it as ``value_range``. None for
    other calls.
    """
    if call is None or call.name not in _MAX_POOL_DIMS:
        return None
    source = call.args[0] if call.args else call.kwargs.get("input")
    if not isinstance(source, torch.Tensor):
        return None
    plane = 1
    for size in source.shape[-_MAX_POOL_DIMS[call.name] :]:
        plane *= size
    return 0, max(plane - 1, 0)
