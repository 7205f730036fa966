"""Which op is saving a tensor right now: the torch function running when a pack hook fires.

A pack hook runs inside the op that saves, so :class:`OpTracker`, a ``TorchFunctionMode`` noting each
running torch function (``"relu"``, ``"conv2d"``, ...), lets it pick a codec by op: a sign mask for
ReLU's output, a narrow integer codec for indices (bounded by :func:`saved_index_range` from the
call, with no device synchronisation), the quantizer elsewhere.

It sees the *outermost* torch function of a call (``F.relu`` is ``"relu"``; ``F.max_pool2d`` is
``"max_pool2d"`` although ATen saves ``max_pool2d_with_indices``' indices), tensor methods and
operators (``x * y`` is ``"mul"``), and functions, not modules (``nn.Conv2d`` is ``"conv2d"``). What
a custom ``autograd.Function`` saves reads as None, or as the enclosing torch function. Under
``torch.compile`` Dynamo traces the handler as user code, so ``fullgraph=True`` holds (an
``is_compiling()`` branch in it gave ``nn.GRU``'s eager fallback an ``int`` for ``input.dtype``).
A compiled graph's saves read as None: the capture decides them from the compiled backward graph
(:mod:`lightning_act.capture.compiled`).

Cost: one Python call per torch function, ``x.shape`` included (``benchmarks/optrack_overhead.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

__all__ = [
    "LOOK_UP",
    "PLAIN_TYPES",
    "OpTracker",
    "TrackedCall",
    "arguments_key",
    "autocast_state",
    "call_argument",
    "is_same_tensor",
    "saved_index_range",
]

#: :attr:`TrackedCall.reads` and ``key`` before the call's first save looks them up.
LOOK_UP = object()


class TrackedCall:
    """One torch function call in progress.

    ``saves`` counts the tensors the call saved so far (the capture engine counts them), so that
    :func:`~lightning_act.backward_reads.call_reads`, which lists saves in order, can tell which one
    is being saved.
    """

    __slots__ = ("name", "func", "args", "kwargs", "saves", "autocast", "reads", "key", "saved", "waiting")

    def __init__(self, name: str, args: tuple, kwargs: dict, saves: int = 0, func: Any = None, autocast: tuple = ()):
        self.name = name
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.saves = saves
        #: The autocast in force when the call began (:func:`autocast_state`); inside it, it reads off.
        self.autocast = autocast
        #: The analysis of the call's saves, looked up once at its first save; ``LOOK_UP`` until then.
        self.reads: Any = LOOK_UP
        #: What the decisions about the call's saves depend on besides each tensor
        #: (:func:`~lightning_act.capture.call_sites.call_key`); ``LOOK_UP`` until its first save.
        self.key: Any = LOOK_UP
        #: What autograd holds for each save so far, in order, for later saves stored from earlier ones.
        self.saved: list = []
        #: Saves waiting for later saves of the call, or None: each a function of ``final`` that
        #: stores its save if it can (``final``: as it is, at return) and says whether it did.
        self.waiting: list | None = None


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """``(device, dtype, cache_enabled)`` of each device's autocast in force: what a call casts to."""
    if not torch._C._is_any_autocast_enabled():  # the common case, asked once: every tracked call asks
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


_PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
#: The plain argument types, checked first: a set lookup, where isinstance walks the tuple.
PLAIN_TYPES = frozenset(_PLAIN_VALUES)


def arguments_key(value: Any, tensor_key: Callable[[torch.Tensor], Any], other_key: Callable[[Any], Any]) -> Any:
    """A call's arguments as a hashable key: tensors by ``tensor_key``, plain values as they are,
    containers element by element, anything else by ``other_key`` (which may raise)."""
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    kind = type(value)
    if kind is tuple:  # a call's positional arguments: most of them tensors and plain values
        return tuple(
            [
                tensor_key(v)
                if isinstance(v, torch.Tensor)
                else v
                if type(v) in PLAIN_TYPES
                else arguments_key(v, tensor_key, other_key)
                for v in value
            ]
        )
    if kind in PLAIN_TYPES or isinstance(value, _PLAIN_VALUES):
        return value
    if isinstance(value, (list, tuple)):
        return tuple([arguments_key(v, tensor_key, other_key) for v in value])
    if isinstance(value, dict):
        return tuple([(k, arguments_key(v, tensor_key, other_key)) for k, v in value.items()])
    return other_key(value)


def _function_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


# Where Dynamo gives up on a frame (an RNN) it tries the check once more and warns that it
# cannot trace it; the frame then runs eagerly, where the check works.
warnings.filterwarnings("ignore", message=r"Dynamo does not know how to trace the builtin `torch\._C\._autograd\.")


@torch.compiler.assume_constant_result
def _pack_hooks_run() -> bool:
    """Whether a pack hook can see what is saved now: a compiled graph turns saved-tensor hooks off
    while it runs, so tracking its calls would be wasted. (Dynamo reads it once, as a constant.)"""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


class OpTracker(TorchFunctionMode):
    """Knows which torch function is running, for pack hooks that choose a codec by op.

    Example::

        tracker = OpTracker()

        def pack(t):
            if tracker.current() == "relu":
                ...

        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(x).sum()

    Enter it once at a time, in the thread that runs the forward (modes are per thread).
    """

    def __init__(self):
        super().__init__()
        self._calls: list[TrackedCall] = []
        #: Whether the tracker is on the torch function mode stack (sees calls). An attribute,
        #: not a property: Dynamo reads it where it inlines the pack hook.
        self.watching = False

    def __enter__(self) -> OpTracker:
        self.watch(True)
        return self

    def __exit__(self, *exc) -> None:
        self.watch(False)

    def watch(self, on: bool) -> None:
        """Put the tracker on the torch function mode stack, or take it off wherever it is (modes
        above it stay, in order). Off where no pack hook could use it: while the capture is paused
        for backward, and in compiled code, which runs with the modes it inlined still active, so
        each call of the graph's Python wrapper would pass through the handler for nothing. Dynamo
        guards on the active modes: a compiled module sees the same stack in and out of sessions."""
        if on == self.watching:
            return
        self.watching = on
        if on:
            _push_mode(self)
            return
        above = []
        while _len_torch_function_stack():
            mode = _pop_mode()
            if mode is self:
                break
            above.append(mode)
        for mode in reversed(above):
            _push_mode(mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _pack_hooks_run():
            return func(*args, **kwargs)
        call = TrackedCall(_function_name(func), args, kwargs, func=func, autocast=autocast_state())
        self._calls.append(call)
        try:
            return func(*args, **kwargs)
        finally:
            if call.waiting:
                for settle in call.waiting:
                    settle(True)
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


# Indexing functions whose forward checks every index against one dimension of a source
# tensor: name -> (index argument, source argument, dimension argument or the fixed
# dimension, whether negative indices count from the end). Arguments are (position, keywords).
_INDEXED_BY = {
    "embedding": ((0, "input"), (1, "weight"), 0, False),
    "index_select": ((2, "index"), (0, "input"), (1, "dim"), False),
    "gather": ((2, "index"), (0, "input"), (1, "dim"), False),
    "index_add": ((2, "index"), (0, "input"), (1, "dim"), False),
    "index_add_": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter_": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter_add": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter_add_": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter_reduce": ((2, "index"), (0, "input"), (1, "dim"), False),
    "scatter_reduce_": ((2, "index"), (0, "input"), (1, "dim"), False),
    "__getitem__": ((1,), (0,), 0, True),
}
# Losses whose integer target is a class index of the input's class dimension, or ignore_index.
_CLASS_TARGETS = {"cross_entropy", "nll_loss"}
_IGNORE_INDEX_POSITION = 4  # F.cross_entropy and F.nll_loss alike
_DEFAULT_IGNORE_INDEX = -100


def call_argument(call: TrackedCall, position: int, *keywords: str) -> Any:
    """The call's argument at ``position``, or passed by one of ``keywords``; None if absent."""
    if position < len(call.args):
        return call.args[position]
    return next((call.kwargs[k] for k in keywords if k in call.kwargs), None)


def is_same_tensor(candidate: Any, t: torch.Tensor) -> bool:
    """``candidate`` is the tensor ``t`` autograd saved (the same object, or the same view)."""
    return isinstance(candidate, torch.Tensor) and (
        candidate is t
        or (candidate.data_ptr() == t.data_ptr() and candidate.shape == t.shape and candidate.dtype == t.dtype)
    )


def saved_index_range(call: TrackedCall | None, t: torch.Tensor | None = None) -> tuple[int, int] | None:
    """``(low, high)`` bounding the integer tensor ``t`` a call saves, from shapes alone (no device
    synchronisation), for :class:`~lightning_act.codecs.exact.IndexCodec`'s ``value_range``:

    * max-pool indices address the input's flattened spatial plane (``[0, H * W)`` in 2-D);
    * an indexing function's index (``embedding``, ``index_select``, ``gather``, ``scatter*``,
      ``index_add``, ``x[index]``) lies within its source's indexed dimension, as the forward checked;
    * a ``cross_entropy`` or ``nll_loss`` target is a class of the input or the ``ignore_index``.

    None for other calls, and where ``t`` is not the call's index argument.
    """
    if call is None:
        return None
    if call.name in _MAX_POOL_DIMS:
        source = call.args[0] if call.args else call.kwargs.get("input")
        if not isinstance(source, torch.Tensor):
            return None
        plane = 1
        for size in source.shape[-_MAX_POOL_DIMS[call.name] :]:
            plane *= size
        return 0, max(plane - 1, 0)
    if t is None:
        return None
    if call.name in _INDEXED_BY:
        index_at, source_at, dim_at, negative = _INDEXED_BY[call.name]
        source = call_argument(call, *source_at)
        dim = dim_at if isinstance(dim_at, int) else call_argument(call, *dim_at)
        if not is_same_tensor(call_argument(call, *index_at), t) or not isinstance(source, torch.Tensor):
            return None
        if not isinstance(dim, int) or source.dim() == 0 or not -source.dim() <= dim < source.dim():
            return None
        size = source.shape[dim]
        return (-size if negative else 0), max(size - 1, 0)
    if call.name in _CLASS_TARGETS:
        scores, target = call_argument(call, 0, "input"), call_argument(call, 1, "target")
        ignore_index = call_argument(call, _IGNORE_INDEX_POSITION, "ignore_index")
        ignore_index = _DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
        if not is_same_tensor(target, t) or not isinstance(scores, torch.Tensor) or scores.dim() == 0:
            return None
        classes = scores.shape[1] if scores.dim() >= 2 else scores.shape[0]
        return min(0, ignore_index), max(classes - 1, ignore_index, 0)
    return None
