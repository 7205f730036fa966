"""OpTracker: the op that saves a tensor, as a pack hook sees it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning_act.codecs.exact import IndexCodec
from lightning_act.optrack import OpTracker, TrackedCall, saved_index_range
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


def saves_by_op(forward, tracker: OpTracker) -> list[tuple[str | None, torch.dtype, tuple]]:
    """(op, dtype, shape) of every tensor saved while ``forward`` runs under the tracker."""
    saved = []

    def pack(t):
        saved.append((tracker.current(), t.dtype, tuple(t.shape)))
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return saved


def test_names_the_op_that_saves():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    steps = {
        "relu": lambda: F.relu(x),
        "conv2d": lambda: conv(x),
        "max_pool2d": lambda: nn.MaxPool2d(2)(x),
        "dropout": lambda: F.dropout(x, 0.5, training=True),
        "linear": lambda: nn.Linear(8, 5)(x),
        "softmax": lambda: F.softmax(x, -1),
        "layer_norm": lambda: nn.LayerNorm(8)(x),
        "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, q, q),
    }
    for name, step in steps.items():
        saved = saves_by_op(step, OpTracker())
        assert saved, name
        assert {op for op, _, _ in saved} == {name}, saved


def test_reports_the_outermost_function_and_pops_on_errors():
    tracker = OpTracker()
    x = torch.randn(4, requires_grad=True)
    # F.relu calls torch.relu: the mode is off inside its own handler, so only "relu" is seen
    assert saves_by_op(lambda: F.relu(x), tracker) == [("relu", torch.float32, (4,))]
    assert saves_by_op(lambda: x.relu(), tracker)[0][0] == "relu"
    assert saves_by_op(lambda: x * x, tracker)[0][0] == "mul"
    assert tracker.current() is None and tracker.current_call() is None
    with tracker, pytest.raises(RuntimeError):
        torch.mm(x, x)  # 1-D inputs: raises inside the function
    assert tracker.current() is None


def test_watching_off_takes_the_tracker_out_from_under_other_modes():
    class Counting(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    tracker, above = OpTracker(), Counting()
    tracker.watch(True)
    above.__enter__()  # entered after the tracker, still active when the tracker stops
    tracker.watch(False)
    assert not tracker.watching
    assert _get_current_function_mode_stack() == [above]
    torch.ones(2).relu()
    assert above.calls == 2  # ones and relu: the mode above still sees every call
    above.__exit__(None, None, None)
    assert _get_current_function_mode_stack() == []


def test_max_pool_indices_come_with_a_bound():
    tracker = OpTracker()
    x = torch.randn(2, 3, 15, 13, requires_grad=True)
    records = []

    def pack(t):
        if not t.is_floating_point():
            value_range = saved_index_range(tracker.current_call())
            records.append((t, value_range, IndexCodec().pack(t.contiguous(), 2, 0, value_range=value_range)))
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.max_pool2d(x, 3, 2)
    (indices, value_range, record) = records[0]
    assert value_range == (0, 15 * 13 - 1)
    assert int(indices.max()) <= value_range[1]
    assert record.width == 8 and torch.equal(record.unpack(), indices)
    assert saved_index_range(None) is None


def saved_integer_ranges(fn):
    """(saved integer tensor, its bound from the call) for every integer save of ``fn()``."""
    tracker = OpTracker()
    saved = []

    def pack(t):
        if not t.is_floating_point() and t.dtype != torch.bool:
            saved.append((t, saved_index_range(tracker.current_call(), t)))
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize(
    ("name", "fn", "expected"),
    [
        ("embedding", lambda w, i: F.embedding(i, w), (0, 39)),
        ("index_select", lambda w, i: w.index_select(0, i), (0, 39)),
        ("gather", lambda w, i: torch.gather(w, 0, i.view(-1, 1).expand(-1, 5)), (0, 39)),  # a broadcast view
        ("scatter_add", lambda w, i: torch.zeros(40, 5).scatter_add(0, i.view(-1, 1).repeat(1, 5), w[:12]), (0, 39)),
        ("index_add", lambda w, i: torch.zeros(40, 5).index_add(0, i, w[:12]), (0, 39)),
        ("getitem", lambda w, i: w[i - 20], (-40, 39)),
        ("cross_entropy", lambda w, i: F.cross_entropy(w[:12].T.contiguous().T @ torch.randn(5, 40), i), (-100, 39)),
        ("nll_loss", lambda w, i: F.nll_loss(w[:12] @ torch.randn(5, 40), i, ignore_index=255), (0, 255)),
    ],
)
def test_indexing_ops_bound_their_index_by_the_indexed_dimension(name, fn, expected):
    torch.manual_seed(0)
    weight = torch.randn(40, 5, requires_grad=True)
    index = torch.randint(0, 40, (12,))
    saved = saved_integer_ranges(lambda: fn(weight, index))
    assert saved, f"{name} saved no integer tensor"
    for t, value_range in saved:
        assert value_range == expected
        low, high = value_range
        assert low <= int(t.min()) and int(t.max()) <= high
        assert torch.equal(IndexCodec().pack(t.contiguous(), 0, 0, value_range=value_range).unpack(), t)


def test_an_integer_tensor_that_is_not_the_index_argument_gets_no_bound():
    source = torch.randn(40, 5)
    index = torch.randint(0, 40, (12,))
    other = torch.randint(0, 1000, (12,))
    call = TrackedCall("index_select", (source, 0, index), {})
    assert saved_index_range(call, index) == (0, 39)
    assert saved_index_range(call, other) is None
    assert saved_index_range(TrackedCall("index_select", (source, 5, index), {}), index) is None  # bad dim


def test_leaves_no_trace_in_a_compiled_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    expected = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break would raise
    tracker = OpTracker()
    saved = saves_by_op(lambda: compiled(x), tracker)
    assert saved and all(op is None for op, _, _ in saved)  # saved inside the compiled graph
    with tracker:
        assert torch.allclose(compiled(x), expected)
