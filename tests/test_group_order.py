"""Along which axis quantization groups run: surveyed per slot on its first step, then kept."""

import pytest
import torch
from lightning_act import ActivationCapture, CompressionConfig, compress_activations, ops
from lightning_act.capture.group_order import GroupOrders, grouped_pieces, range_energy
from lightning_act.codecs import quant
from lightning_act.ops.reference import rounding_variance
from lightning_act.policy import FixedBits
from torch import nn
from torch._dynamo.utils import counters


class Projection(nn.Module):
    """A linear layer over tokens, and a loss: the layer's input (the batch times a gain) is
    the one activation saved, for the weight's gradient."""

    def __init__(self, features: int = 64):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(features))
        self.proj = nn.Linear(features, 32)
        self.register_buffer("target", torch.randn(32))

    def forward(self, x):
        return (self.proj(x * self.gain) * self.target).sum()


def outlier_features(generator, tokens=512, features=64):
    """Tokens x features where three features are 100x the others, as in a transformer."""
    x = torch.randn(tokens, features, generator=generator)
    x[:, [3, 17, 40]] *= 100.0
    return x


def scaled_rows(generator, tokens=512, features=64):
    """Rows of very different scale (normalised bag-of-words of different lengths)."""
    return torch.randn(tokens, features, generator=generator) * torch.logspace(-3, 1, tokens)[:, None]


def weight_grad(model, x, capture=None, seed=None, run=None):
    run = model if run is None else run
    model.zero_grad()
    if capture is None:
        run(x).backward()
    else:
        with capture.capturing(inputs=x, seed=seed):
            loss = run(x)
        loss.backward()
    return model.proj.weight.grad.clone()


def error_energy(model, x, order, seeds=16, run=None):
    """Mean squared gradient error at 2 bits over rounding seeds, and the mean gradient's
    (``run``: the model as called, e.g. compiled)."""
    exact = weight_grad(model, x, run=run)
    capture = ActivationCapture(CompressionConfig(bits=2, group_order=order, min_numel=0), model, FixedBits(2))
    weight_grad(model, x, capture, seed=0, run=run)  # the survey step
    total, mean = 0.0, torch.zeros_like(exact)
    for seed in range(1, seeds + 1):
        g = weight_grad(model, x, capture, seed=seed, run=run)
        total += (g - exact).square().sum().item()
        mean += g / seeds
    return total / seeds, (mean - exact).square().sum().item(), capture


def fixed_input():
    """One input, the same every run, for the checks of unbiasedness: the error lies in a few
    directions (the outlier features'), so how much closer 16 seeds' mean is than one seed
    spreads widely over inputs (5x to 400x over eleven of them, 16x expected)."""
    return outlier_features(torch.Generator().manual_seed(0))


def test_outlier_features_get_groups_down_the_columns_and_less_noise():
    torch.manual_seed(0)
    model, x = Projection(), fixed_input()
    memory, _, _ = error_energy(model, x, "memory")
    columns, mean_error, capture = error_energy(model, x, "auto")
    assert capture.group_orders.axis == {"proj#0": 0}
    assert columns < 0.2 * memory  # the outliers widen only their own groups
    # Still unbiased: the mean of 16 seeds' gradients is about 16x closer than one seed's.
    assert mean_error < columns / 6


def test_a_compiled_graph_surveys_and_chooses_the_axis_as_eager_does_without_recompiling():
    """The compiled pack op surveys the slot on the first step and groups later steps along
    the axis that won, at run time: the graph is not compiled again."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = Projection(), fixed_input()
    compiled = torch.compile(model, backend="inductor")
    memory, _, _ = error_energy(model, x, "memory", run=compiled)
    graphs = counters["stats"]["unique_graphs"]
    columns, mean_error, capture = error_energy(model, x, "auto", run=compiled)
    assert capture.group_orders.axis["proj#0 (512, 64)"] == 0  # (the graph also stores its input, the batch)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the "auto" settings' graph, once
    assert columns < 0.2 * memory
    assert mean_error < columns / 6
    torch._dynamo.reset()


def test_rows_of_different_scale_keep_memory_order(generator):
    torch.manual_seed(0)
    model, x = Projection(), scaled_rows(generator)
    memory, _, _ = error_energy(model, x, "memory")
    auto, _, capture = error_energy(model, x, "auto")
    assert capture.group_orders.axis == {"proj#0": None}
    assert auto == pytest.approx(memory, rel=0.5)


def test_the_survey_step_stores_in_memory_order_and_later_steps_in_the_chosen_one(generator, monkeypatch):
    torch.manual_seed(0)
    model, x = Projection(), outlier_features(generator)
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), model, FixedBits(2))
    packed_column_major = []
    quantize_pack = quant._QUANTIZE_PACK

    def spy(dense, bits, group_size, seed, column_major):
        packed_column_major.append(column_major)
        return quantize_pack(dense, bits, group_size, seed, column_major)

    monkeypatch.setattr(quant, "_QUANTIZE_PACK", spy)
    for seed in range(3):
        with capture.capturing(inputs=x, seed=seed):
            loss = model(x)
        loss.backward()
    assert packed_column_major == [False, True, True]


def test_decisions_are_shared_by_the_plain_api_blocks_of_one_model(generator):
    torch.manual_seed(0)
    model, x = Projection(), outlier_features(generator)
    for _ in range(2):
        with compress_activations(model, inputs=x, bits=2, min_numel=0) as capture:
            loss = model(x)
        loss.backward()
    assert capture.group_orders is GroupOrders.of(model, 256)
    assert capture.group_orders.axis == {"proj#0": 0}


def test_a_nonfinite_activation_keeps_memory_order(generator):
    torch.manual_seed(0)
    model, x = Projection(), outlier_features(generator)
    x[5, 7] = float("nan")
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=0), model, FixedBits(2))
    with capture.capturing(inputs=x):
        model(x)
    assert capture.group_orders.axis == {"proj#0": None}


def test_attention_heads_group_along_the_tokens_two_axes_before_the_last(generator):
    """(batch, tokens, heads, head features) with outlier features: the tokens axis wins."""
    x = torch.randn(4, 64, 4, 16, generator=generator)
    x[..., 3] *= 50.0
    orders = GroupOrders(256)
    assert orders.order("attn#0", x, 2) is None  # memory order while undecided
    orders.settle()
    assert orders.axis == {"attn#0": 1}
    record = quant.GroupQuantCodec(256).pack(x, 2, 7, group_axis=1)
    assert record.matrix == (64, 64)
    decoded = record.unpack()
    assert decoded.shape == x.shape
    # About half memory order's noise (0.49 on average over 1000 random inputs, sd 0.044,
    # at most 0.65): 0.75 is six deviations off.
    assert (decoded - x).square().sum() < 0.75 * (quant.GroupQuantCodec(256).pack(x, 2, 7).unpack() - x).square().sum()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_survey_expects_the_noise_the_quantizer_puts_in(generator, bits):
    """Mixed signs, ReLU-like groups (zero-preserving) and a constant group: the expected
    squared error against the kernels' mean over 64 seeds."""
    x = torch.randn(16, 256, generator=generator) * torch.logspace(-2, 2, 16)[:, None]
    x[4:9] = x[4:9].clamp_min(0.0)
    x[12] = 3.0
    x = x.view(-1)
    errors = []
    for seed in range(64):
        codes, stats = ops.quantize_pack(x, bits, 256, seed)
        errors.append((ops.unpack_dequantize(codes, stats, bits, 256, x.numel(), x.dtype) - x).square().sum())
    measured = torch.stack(errors)
    # The mean of 64 draws is within a few of its standard errors of the expectation.
    assert abs(measured.mean() - rounding_variance(x, bits, 256)) < 4 * measured.std() / 8


def test_range_energy_sums_squared_group_ranges():
    values = torch.tensor([0.0, 1.0, 3.0, 4.0, 10.0, 10.0, -2.0, 0.0, 99.0])  # the ragged tail is left out
    assert range_energy(values, 2).item() == 1.0 + 1.0 + 0.0 + 4.0


@pytest.mark.parametrize("shape", [(4, 6, 40), (3, 50, 7), (2, 9, 5, 31), (1, 300, 9)])
@pytest.mark.parametrize("piece", [8, 64, 1 << 20])
def test_a_survey_read_in_pieces_reads_the_groups_the_whole_reorder_holds(generator, shape, piece):
    """Pieces of whole groups, carried across pieces and matrices that do not hold whole
    groups, hold the groups of the tensor reordered at once, in order."""
    x = torch.randn(shape, generator=generator)
    for axis in [None, *range(x.dim() - 1)]:
        if axis is None:
            whole_reorder = x.reshape(-1)
        else:
            whole_reorder = x.view(-1, x.shape[axis], x.shape[axis + 1 :].numel()).transpose(1, 2).reshape(-1)
        expected = whole_reorder[: whole_reorder.numel() // 8 * 8].view(-1, 8)
        assert torch.equal(torch.cat(list(grouped_pieces(x, axis, 8, piece))), expected)


def test_values_on_the_grid_cost_nothing_so_binary_features_keep_memory_order(generator):
    """Bag-of-words features after dropout take two values: memory order stores them exactly,
    though their ranges would favour the words' axis (rare words' groups are all zeros)."""
    words = torch.rand(1433, generator=generator) ** 4 * 0.05  # a few common words, many rare
    x = (torch.rand(2048, 1433, generator=generator) < words).float() * 2.0
    # What the ranges alone would choose: the words' axis.
    assert range_energy(x.t().reshape(-1), 256) < 0.9 * range_energy(x.view(-1), 256)
    assert rounding_variance(x.view(-1), 2, 256) == 0.0
    orders = GroupOrders(256)
    orders.order("features#0", x, 2)
    orders.settle()
    assert orders.axis == {"features#0": None}
    codes, stats = ops.quantize_pack(x, 2, 256, 3)
    assert torch.equal(ops.unpack_dequantize(codes, stats, 2, 256, x.numel(), x.dtype).view_as(x), x)


def test_group_order_is_validated():
    with pytest.raises(ValueError, match="group_order='rows' is not supported; allowed: auto, memory"):
        CompressionConfig(group_order="rows")
