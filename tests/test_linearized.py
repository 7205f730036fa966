"""The linearized probes: GACT's per-tensor sensitivities with passes that do not grow with depth."""

import pytest
import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.policy import linearized
from lightning_act.policy.estimators import probe_sensitivities
from torch import nn


class Deep(nn.Module):
    """Linear layers with GELU, LayerNorm and a softmax between: tensors whose rounding
    reaches only their own layer's weight (the linear inputs) and tensors whose rounding
    flows upstream through every layer before (GELU's, LayerNorm's, softmax's)."""

    def __init__(self, depth: int, width: int = 128):
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        h = self.inp(x)
        for layer, norm in zip(self.layers, self.norms):
            h = h + layer(F.gelu(norm(h)))
        return self.out(torch.softmax(h, dim=-1) * h)


def sensitivities(model, x, method, **kwargs):
    params = list(model.parameters())
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=4096, group_order="memory"), model)
    return probe_sensitivities(capture, lambda: model(x).square().mean(), params, inputs=x, method=method, **kwargs)


@pytest.mark.slow  # a backward per tensor: 4.5 s
def test_linearized_probes_measure_what_a_backward_per_tensor_measures():
    torch.manual_seed(0)
    model, x = Deep(depth=3), torch.randn(256, 32)
    whole = sensitivities(model, x, "per_tensor")
    linear = sensitivities(model, x, "linearized", directions=256)
    assert set(linear) == set(whole)
    total = sum(table[2] for table in whole.values())
    compared = 0
    for slot, table in whole.items():
        if table[2] > 0.005 * total:  # each rounding draw's own spread dominates below
            assert linear[slot][2] == pytest.approx(table[2], rel=0.5), slot
            compared += 1
        assert linear[slot][1] > linear[slot][2] > linear[slot][4] > linear[slot][8] >= 0.0
    assert compared >= 6
    assert sum(table[2] for table in linear.values()) == pytest.approx(total, rel=0.15)


def test_the_number_of_backward_passes_does_not_grow_with_depth(monkeypatch):
    # How each op's backward reads its saves is traced once per call signature, with backward
    # passes of its own, and cached: traced before counting.
    torch.manual_seed(0)
    sensitivities(Deep(1), torch.randn(64, 32), "linearized", directions=2)
    grads = []
    original = torch.autograd.grad

    def counting(*args, **kwargs):
        grads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    counts = {}
    for depth in (1, 6):
        torch.manual_seed(0)
        model, x = Deep(depth), torch.randn(64, 32)
        for method in ("linearized", "per_tensor"):
            grads.clear()
            tables = sensitivities(model, x, method, directions=2)
            counts[depth, method] = len(grads)
        probed = sum(1 for table in tables.values() if table[1] > 0)
        assert counts[depth, "per_tensor"] == 1 + probed
    # One backward records the nodes, one measures every slot from the readers' pre-hooks.
    assert counts[1, "linearized"] == counts[6, "linearized"] == 2


def test_a_forward_that_does_not_repeat_falls_back_to_a_backward_per_tensor(monkeypatch):
    class Wandering(Deep):
        calls = 0

        def forward(self, x):
            Wandering.calls += 1
            if Wandering.calls % 2 == 0:  # an extra call every other forward
                x = x * 1.0
            return super().forward(x)

    torch.manual_seed(0)
    model, x = Wandering(depth=2), torch.randn(64, 32)
    upstream = []
    original = linearized.LinearizedProbe.upstream

    def spy(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except linearized.Mismatch as mismatch:
            upstream.append(mismatch)
            raise

    monkeypatch.setattr(linearized.LinearizedProbe, "upstream", spy)
    tables = sensitivities(model, x, "linearized", directions=2)
    assert upstream, "the perturbed forward should have been found to differ"
    assert tables and all(table[1] > table[2] > 0 for table in tables.values() if table[1] > 0)


def test_probe_arguments_are_validated():
    model, x = Deep(1), torch.randn(8, 32)
    with pytest.raises(ValueError, match="method='both' is not supported; allowed: linearized, per_tensor"):
        sensitivities(model, x, "both")
    with pytest.raises(ValueError, match="directions=0 must be an int >= 1"):
        sensitivities(model, x, "linearized", directions=0)
