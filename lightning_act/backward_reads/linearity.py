"""Ops the algebra does not know, measured: is an op linear in each argument?"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

# Measured once per op and argument signature: each float tensor argument is moved by a
# random step as large as its values (so that a function linear only within cells, such as
# bilinear sampling at learned offsets, shows it); linear, the change doubles with the step.
# Random values may be out of range for an argument read as an index (``roi_align``'s boxes,
# written through unchecked), so this runs in a forked process: a crash there reads as
# "cannot be measured" and the training process is untouched.
PROBE_NUMEL = 1 << 24  # all arguments together: beyond, unmeasured (exact)
_PROBE_SECONDS = 30.0  # then given up (exact): a child stuck on a lock
_PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_probed: dict[Any, frozenset[int] | None] = {}
_probe_cost = {"ops": 0, "seconds": 0.0}
_log = logging.getLogger(__name__)


def linear_arguments(node: fx.Node) -> frozenset[int] | None:
    """The positions, among ``node``'s flattened arguments, of the tensors it is linear in,
    each with the others held. None where it cannot be measured: arguments too large, or an
    error. Cached per op and signature."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
    key = (node.target, tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for v in vals))
    try:
        hash(key)
    except TypeError:
        return None
    if key not in _probed:
        started = time.perf_counter()
        _probed[key] = _in_forked_child(lambda: _measure_linearity(node.target, vals, spec))
        elapsed = time.perf_counter() - started
        _probe_cost["ops"] += 1
        _probe_cost["seconds"] += elapsed
        _log.info(
            "lightning_act: measured how %s reads its arguments in %.1f ms: linear in %s",
            node.target,
            elapsed * 1e3,
            "nothing measurable" if _probed[key] is None else sorted(_probed[key]),
        )
    return _probed[key]


def probe_cost() -> dict[str, float]:
    """How many op signatures :func:`linear_arguments` measured in this process, and the time."""
    return dict(_probe_cost)


def _measure_linearity(op: Callable, vals: list, spec) -> frozenset[int] | None:
    every = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    tensors = [i for i in every if vals[i].is_floating_point()]
    held = [i for i in every if i not in tensors]
    if any(vals[i].is_complex() or vals[i].dtype == torch.bool for i in held) or not tensors:
        return None
    if sum(vals[i].numel() for i in every) > PROBE_NUMEL:
        return None
    # Integer arguments (indices, offsets) are held at small sorted values, valid as an index
    # into every dimension of the float arguments: the float arguments are measured around them.
    bound = min((size for i in tensors for size in vals[i].shape), default=1)
    for dtype in (torch.float64, torch.float32):
        generator = torch.Generator().manual_seed(0)
        values = list(vals)
        for i in tensors:
            values[i] = torch.randn(vals[i].shape, dtype=dtype, generator=generator)
        for i in held:
            drawn = torch.randint(0, max(bound, 1), (vals[i].numel(),), generator=generator).sort().values
            values[i] = drawn.to(vals[i].dtype).view(vals[i].shape)

        def run(moved: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            args, kwargs = pytree.tree_unflatten([moved.get(i, v) for i, v in enumerate(values)], spec)
            out = op(*args, **kwargs)
            return [
                o.double() for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()
            ]

        try:
            with torch.no_grad():
                base = run({})
                linear = set()
                for i in tensors:
                    step = torch.randn(vals[i].shape, dtype=dtype, generator=generator)
                    once = run({i: values[i] + step})
                    twice = run({i: values[i] + 2 * step})
                    if all(_doubles(b, o, t, _PROBE_TOLERANCE[dtype]) for b, o, t in zip(base, once, twice)):
                        linear.add(i)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue  # no float64 kernel: the dtype it runs in
        return frozenset(linear)
    return None


def _in_forked_child(work: Callable[[], frozenset[int] | None]) -> frozenset[int] | None:
    """``work()`` in a forked copy of this process (one CPU thread, never a GPU), its result
    sent back through a pipe; None where it crashed, hung or cannot fork."""
    if not hasattr(os, "fork"):
        return None
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking a threaded process: the child runs one
        pid = os.fork()
    if pid == 0:  # the child: what it does never returns here
        status = 1
        try:
            os.close(read_end)
            faulthandler.disable()  # a crash here is an answer, not an error to print
            silent = os.open(os.devnull, os.O_WRONLY)
            os.dup2(silent, 1)
            os.dup2(silent, 2)
            torch.set_num_threads(1)  # the parent's OpenMP pool does not exist in a forked child
            result = work()
            os.write(write_end, b"-" if result is None else ",".join(map(str, sorted(result))).encode() + b".")
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    answer, deadline = b"", time.monotonic() + _PROBE_SECONDS
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], max(deadline - time.monotonic(), 0.0))
            chunk = os.read(read_end, 1 << 16) if ready else b""
            if not chunk:
                break
            answer += chunk
    finally:
        os.close(read_end)
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if status != 0 or not answer.endswith(b".") or answer == b"-":
        return None
    text = answer[:-1].decode()
    return frozenset(int(i) for i in text.split(",")) if text else frozenset()


def _doubles(base: torch.Tensor, once: torch.Tensor, twice: torch.Tensor, tolerance: float) -> bool:
    """Whether ``twice - base`` is twice ``once - base``, to ``tolerance`` of its size."""
    change = once - base
    scale = max(change.abs().max().item(), base.abs().max().item(), 1e-30)
    return bool(((twice - base) - 2 * change).abs().max().item() <= tolerance * scale)
