"""The storage rules of :func:`lightning_act.capture.call_sites.decide`, on small tensors: calls
built by hand, and the saves of real calls decided as the capture decides them."""

import os

import pytest
import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig, compress_activations
from lightning_act.capture.call_sites import decide, read_of, source_parameter
from lightning_act.capture.decide import Decision, Form
from lightning_act.capture.records import Layout
from lightning_act.codecs import GroupQuantCodec
from lightning_act.optrack import OpTracker, TrackedCall
from torch import nn


def call(name, *args, **kwargs):
    """A call of the torch function ``name`` (``torch.nn.functional``'s, else ``torch``'s) in a
    training forward: its float tensor arguments require grad, as activations do."""
    func = getattr(F, name, None) or getattr(torch, name)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.is_leaf:
            a.requires_grad_()
    return TrackedCall(name, args, kwargs, func=func)


def saves_of(func, *args, min_numel=1, **kwargs):
    """The decision for each tensor ``func(*args, **kwargs)`` saves, in order, as the capture
    makes them (the call tracked, its saves counted)."""
    tracker, decisions = OpTracker(), []

    def pack(t):
        current = tracker.current_call()
        decisions.append(decide(t, current, external=False, min_numel=min_numel))
        if current is not None:
            current.saves += 1
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        func(*args, **kwargs)
    return decisions


def grad_input(*shape, scale=1.0):
    """An intermediate that requires grad, as a model's activations are."""
    return torch.randn(*shape, requires_grad=True) * scale


def decided(t, c=None, external=False, min_numel=1):
    return decide(t, c, external=external, min_numel=min_numel)


def test_parameters_and_their_views_pass_through():
    p = nn.Parameter(torch.randn(6, 4))
    assert decided(p, call("linear", torch.randn(3, 4), p)).form is Form.PARAMETER
    assert decided(p.t()).form is Form.PARAMETER
    assert source_parameter(p.t()) == (p, False)


def test_autocast_copy_of_a_parameter_is_recast_and_other_casts_are_kept():
    p = nn.Parameter(torch.randn(6, 4))
    copy = p.to(torch.bfloat16)
    decision = decided(copy)
    assert decision.form is Form.RECAST_WEIGHT and decision.parameter is p
    twice = copy.to(torch.float16)  # two casts: casting the parameter once does not re-create it
    assert decided(twice).form is Form.CAST_PARAMETER
    # A parameter is never compressed, not even when it is also marked alive for the step.
    assert decided(p, external=True).form is Form.PARAMETER


def test_tensors_alive_anyway_pass_through():
    x = torch.randn(8, 16)
    assert decided(x, call("linear", x), external=True) == Decision(Form.EXTERNAL)
    assert decided(x > 0, external=True).form is Form.EXTERNAL


def test_masks_and_indices_are_lossless_with_the_bound_their_op_implies():
    x = torch.randn(2, 3, 4, 6)
    mask = decided(x > 0, call("where", x > 0, x, 0.0))
    assert mask.form is Form.MASK and mask.layout.numel == x.numel()
    indices = torch.randint(0, 24, (2, 3, 2, 3))
    pooled = decided(indices, call("max_pool2d", x, 2))
    assert pooled.form is Form.INDEX and pooled.value_range == (0, 23)
    gathered = torch.randint(0, 3, (2, 3, 4, 6))
    bounded = decided(gathered, call("gather", x, 1, gathered))
    assert bounded.form is Form.INDEX and bounded.value_range == (0, 2)
    # The same tensor saved by an op that bounds another argument: its range is measured.
    unbounded = decided(gathered, call("gather", x, 1, gathered.clone()))
    assert unbounded.form is Form.INDEX and unbounded.value_range is None


def test_unbounded_indices_off_the_cpu_are_kept_rather_than_measured_with_a_host_sync():
    # A meta tensor stands in for a GPU one: no data, a device other than the CPU.
    indices = torch.empty(2, 3, 4, 6, dtype=torch.long, device="meta")
    assert decided(indices, call("mul", indices, 2)).form is Form.KEEP
    source = torch.empty(4096, 8, device="meta")
    bounded = decided(indices, call("embedding", indices, source))
    assert bounded.form is Form.INDEX and bounded.value_range == (0, 4095)


def test_attention_query_and_key_get_the_nonlinear_floor_from_the_traced_backward():
    """Backward recomputes the probabilities exp(q k^T - logsumexp) from query and key, and
    reads the value linearly; the output and the logsumexp are computed again from those."""
    q, k, v = (grad_input(2, 4, 16, 12) for _ in range(3))
    decisions = saves_of(F.scaled_dot_product_attention, q, k, v)
    floors = sorted(d.min_bits for d in decisions if d.form is Form.QUANTIZE)
    assert floors == [1, 8, 8]
    assert [d.form for d in decisions].count(Form.RECOMPUTE) == 2


def row_groups(t, c):
    """(group, row, padded row) of a decision, after checking its groups stay within rows
    and its layout gives ``t`` back exactly."""
    decision = decided(t, c)
    layout = decision.row_layout or decision.layout  # the quantizer's; other codecs take decision.layout
    dense = layout.dense(t)
    assert torch.equal(layout.restore(dense), t)
    row = layout.row or dense.shape[-1]
    padded = layout.padded_row or row
    if decision.row_group is not None:
        assert padded % decision.row_group == 0 and dense.numel() % padded == 0
    return decision.row_group, layout.row, layout.padded_row


def test_normalisation_inputs_are_grouped_within_the_rows_they_normalise():
    tokens = torch.randn(8, 65, 192)
    assert row_groups(tokens, call("layer_norm", tokens, (192,))) == (64, None, None)  # 3 groups a token
    frames = torch.randn(2, 64, 192)
    assert row_groups(frames, call("rms_norm", frames, [64, 192])) == (None, None, None)  # 48 whole groups
    maps = torch.randn(4, 32, 6, 6)
    assert row_groups(maps, call("group_norm", maps, 8)) == (32, 144, 160)  # 4 channels of 36, padded
    # One 6x6 plane: shorter than SHORT_ROW, so at 8 bits, where smaller groups pay.
    assert row_groups(maps, call("instance_norm", maps)) == (16, 36, 48)
    # BatchNorm's rows are its channels, laid out channel-major (4 samples of a 6x6 map),
    # unless each channel's map is whole groups already.
    channels = decided(maps, call("batch_norm", maps, None, None, training=True))
    assert channels.row_layout.perm == (1, 0, 2, 3) and not channels.row_layout.memory_order
    assert channels.layout.memory_order  # for DIVISION's and pool's spatial tiles
    # Channels shorter than LONG_CHANNEL are stored at the normalisations' 4-bit floor, in the
    # groups that store them in the fewest bits at 4 bits.
    assert row_groups(maps, call("batch_norm", maps, None, None, training=True)) == (32, 144, 160)
    late = torch.randn(8, 16, 7, 7)  # ResNet-50's last stage at batch 8: 392 values a channel
    assert row_groups(late, call("batch_norm", late, None, None, training=True)) == (64, 392, 448)
    large = torch.randn(4, 4, 16, 16)  # channels of LONG_CHANNEL values, each map whole groups
    assert decided(large, call("batch_norm", large, None, None, training=True)) == decided(
        large, call("mul", large, large.clone())
    )
    # A strided input's rows are not runs, and other ops normalise nothing.
    strided = tokens.transpose(1, 2)
    assert decided(strided, call("layer_norm", strided, (65,))).row_group is None
    assert decided(tokens, call("linear", tokens, torch.randn(8, 192))).row_group is None


def test_normalisation_inputs_get_four_bits_eight_over_short_rows_and_batch_norm_over_long_channels_none():
    tokens = torch.randn(8, 65, 192)
    assert decided(tokens, call("layer_norm", tokens, (192,))).min_bits == 4
    maps = torch.randn(4, 32, 6, 6)
    assert decided(maps, call("group_norm", maps, 8)).min_bits == 4
    # BatchNorm's backward is as quadratic, but over rows of the whole batch and map: a hand
    # rule, where a channel holds LONG_CHANNEL values or more. Shorter ones get the floor.
    batch_norm = call("batch_norm", maps, None, None, training=True)
    assert read_of(maps, batch_norm).use.name == "QUADRATIC" and decided(maps, batch_norm).min_bits == 4
    long = torch.randn(16, 8, 8, 8)  # 1,024 values a channel
    assert decided(long, call("batch_norm", long, None, None, training=True)).min_bits == 1
    shorter = torch.randn(16, 8, 8, 7)  # 896
    assert decided(shorter, call("batch_norm", shorter, None, None, training=True)).min_bits == 4
    # Rows shorter than SHORT_ROW: the bias grows as they shorten, 8 bits.
    narrow = torch.randn(8, 256, 16)  # a Segformer's first stage: 16 channels
    assert decided(narrow, call("layer_norm", narrow, (16,))).min_bits == 8
    small_maps = torch.randn(8, 16, 2, 2)  # 32 values a channel
    assert decided(small_maps, call("batch_norm", small_maps, None, None, training=True)).min_bits == 8
    # What else a normalisation saves is not its input: its statistics, kept exact.
    saved = saves_of(F.layer_norm, grad_input(8, 65, 192), (192,))
    assert [d.form for d in saved] == [Form.QUANTIZE, Form.STATISTIC, Form.STATISTIC]


def test_a_normalisation_written_out_is_found_by_its_factor_s_history():
    """x * rsqrt(mean(x**2) + eps): mul's factor per row is computed from x itself, so x is
    a normalisation's input (four bits, groups within its rows). A per-row factor from
    elsewhere (a padding mask) scales x linearly: no floor."""
    x = torch.randn(8, 65, 192, requires_grad=True) * 1.0
    factor = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert decided(x, call("mul", x, factor)).min_bits == 4
    assert decided(x, call("mul", factor, x)).min_bits == 4
    assert row_groups(x.detach(), call("mul", x, factor)) == (64, None, None)
    mask = torch.rand(8, 65, 1, requires_grad=True) * 1.0
    assert decided(x, call("mul", x, mask)).min_bits == 1
    assert decided(x, call("mul", x, mask)).row_group is None
    # The factor itself, and a factor that is not per row, are not the input.
    assert decided(x, call("mul", x, factor.squeeze(-1).unsqueeze(0))).min_bits == 1


def test_a_token_with_a_small_std_keeps_its_gradient_when_groups_stay_within_tokens():
    """One token of a LayerNorm input at 1/1000 the scale of the others: a 256-value group
    across tokens rounds it to noise that backward multiplies by its 1 / std."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(192)
    x = torch.randn(4, 10, 192)
    x[:, 3] *= 1e-3
    x.requires_grad_(True)
    grad_out = torch.randn(4, 10, 192)
    (exact,) = torch.autograd.grad(norm(x), x, grad_out)
    capture = ActivationCapture(CompressionConfig(bits=4, min_numel=1), norm)
    with capture.capturing():
        y = norm(x * 1.0)  # a product, so that the capture stores the input
    (noisy,) = torch.autograd.grad(y, x, grad_out)
    assert ((noisy - exact).norm() / exact.norm()).item() < 0.05


def test_batch_norm_on_one_by_one_maps_keeps_each_channel_apart():
    """Channels of very different scales (depthwise convolutions on 1x1 maps): groups across
    channels would round a small channel to noise that backward multiplies by its 1 / std."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(64)
    x = torch.randn(16, 64, 1, 1) * torch.logspace(-3, 1, 64).view(1, 64, 1, 1)
    x.requires_grad_(True)
    grad_out = torch.randn(16, 64, 1, 1)
    (exact,) = torch.autograd.grad(norm(x), x, grad_out)
    capture = ActivationCapture(CompressionConfig(bits=4, min_numel=1), norm)
    with capture.capturing():
        y = norm(x * 1.0)
    (noisy,) = torch.autograd.grad(y, x, grad_out)
    assert ((noisy - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("codec", ["quant", "division", "pool"])
def test_every_codec_still_stores_batch_norm_inputs_of_small_maps(codec):
    """The channel-major, padded layout is the quantizer's: DIVISION and pool keep their
    spatial tiles on the same input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16))
    x = torch.randn(2, 8, 14, 14)  # 196 values a channel and sample: channel-major for the quantizer
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1, codec=codec), model)
    with capture.capturing(inputs=x):
        y = model(x)
    assert capture.report.slots["1#0"].codec == ("quant" if codec == "quant" else codec)
    y.square().sum().backward()  # and it decodes


def test_ops_reading_only_a_sign_get_a_sign_mask():
    x = torch.randn(4, 8)
    leaky = decided(x, call("leaky_relu", x, 0.1))  # backward compares x with 0 alone
    assert leaky.form is Form.SIGN_MASK and leaky.divisor is None
    noise = torch.randn(4, 8)
    assert decided(noise, call("dropout", x, 0.25)).divisor == pytest.approx(0.75)
    assert decided(noise, call("dropout", x, p=0.1)).divisor == pytest.approx(0.9)
    assert decided(noise, call("dropout", x)).divisor == pytest.approx(0.5)


def test_ops_reading_only_whether_inside_an_interval_get_an_interval_mask():
    x = torch.randn(4, 8)
    assert decided(x, call("hardtanh", x, -2.0, 0.5)).interval == (-2.0, 0.5)
    assert decided(x, call("hardtanh", x)).interval == (-1.0, 1.0)
    assert decided(x, call("hardtanh_", x, min_val=0.0, max_val=6.0)).interval == (0.0, 6.0)
    assert decided(x, call("relu6", x)).interval == (0.0, 6.0)
    assert decided(x, call("hardsigmoid", x)).interval == (-3.0, 3.0)
    assert decided(x, call("hardsigmoid", x)).form is Form.SIGN_MASK
    # Compared with constants where no 1-bit mask keeps the comparisons (an empty interval,
    # clamp's inclusive ends): the cells between the constants, never rounded across them.
    assert decided(x, call("hardtanh", x, 1.0, 1.0)).form is Form.CELLS
    assert decided(x, call("clamp", x, -0.5, 0.5)).cells.thresholds == (-0.5, 0.5)


@pytest.mark.parametrize("activation", [F.silu, F.gelu, F.mish, F.hardswish, F.elu, F.softplus, torch.erfc])
def test_pointwise_activations_store_their_derivative_and_hand_back_an_input_with_it(activation):
    """Backward reads the input only through grad * h(x): h(x) is stored, so backward is linear
    in what is stored; at unpack an input on h's monotone branch with the decoded derivative
    is handed back, whose derivative backward then reads."""
    torch.manual_seed(0)
    x = torch.randn(4096) * 6
    decision = decided(x, call(activation.__name__, x))
    assert decision.form is Form.QUANTIZE and decision.min_bits == 1
    derivative, restorer = decision.substitute.store(x)
    grad = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    (exact,) = torch.autograd.grad(activation(leaf), leaf, grad)
    assert torch.allclose(grad * derivative, exact, atol=1e-5)
    # Any value of h's range, rounded anywhere inside it, comes back as an input with it.
    rounded = derivative.min() + torch.rand_like(derivative) * (derivative.max() - derivative.min())
    back = restorer.restore(rounded.clone()).requires_grad_()
    (read,) = torch.autograd.grad(activation(back), back, grad)
    assert torch.allclose(read, grad * rounded, atol=1e-4 * grad.abs().max().item())


def test_a_derivative_stored_at_two_bits_gives_an_unbiased_gradient():
    """SiLU's input at 2 bits, 64 rounding seeds: the mean gradient converges to the exact one
    (a stored input, put through SiLU's curvature, would not)."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * 3
    grad = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    (exact,) = torch.autograd.grad(F.silu(leaf), leaf, grad)
    substitute = decided(x, call("silu", x)).substitute
    codec = GroupQuantCodec(256)
    derivative, restorer = substitute.store(x)
    gradients = []
    for seed in range(64):
        back = restorer.restore(codec.pack(derivative, 2, seed).unpack()).requires_grad_()
        gradients.append(torch.autograd.grad(F.silu(back), back, grad)[0])
    one = ((gradients[0] - exact).norm() / exact.norm()).item()
    mean = ((torch.stack(gradients).mean(0) - exact).norm() / exact.norm()).item()
    assert one / mean > 6  # sqrt(64) = 8 when unbiased


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_derivative_is_restored_a_level_at_a_time_as_from_its_decoded_values(bits, dtype):
    """Unpacking a stored derivative inverts each group's few levels and reads them back by
    code: the same input, bit for bit, as inverting every decoded value (a partial last
    group, a group holding NaN and one of exact zeros included)."""
    torch.manual_seed(0)
    x = torch.randn(40_000) * 3
    substitute = decided(x, call("gelu", x)).substitute
    derivative, restorer = substitute.store(x)
    derivative = derivative.to(dtype)
    derivative[:300] = 0.0
    derivative[1000] = float("nan")
    record = GroupQuantCodec(256).pack(derivative.contiguous(), bits, seed=3)
    expected = restorer.restore(record.unpack())
    restored = restorer.unpack(record)
    assert restored.dtype == dtype and restored.shape == x.shape
    assert torch.equal(restored.isnan(), expected.isnan()) and restored[1000].isnan()
    assert torch.equal(restored.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graph_ops_c_side_restores_a_derivative_as_python_does_in_under_twice_its_bytes(bits, dtype):
    """The graph ops' C++ side decodes a derivative save as Python does, bit for bit, with the
    inverse taken a chunk at a time (inverted whole, the temporaries were six times the
    tensor's bytes at once), and at 8 bits of the values themselves: a group then has as many
    levels as values, and a table of them beside the values doubled the decode's memory."""
    from lightning_act import ops
    from lightning_act.capture.graph_ops import Plan, encode_plan

    ops.ensure_kernels("cpu")
    if not (ops.loaded_kernels()["cpu"] and torch.ops.lightning_act.live_memory_install()):
        pytest.skip("the CPU kernels did not build")
    torch.manual_seed(0)
    x = torch.randn(300_000) * 3
    substitute = decided(x, call("gelu", x)).substitute
    derivative, _ = substitute.store(x)
    plan = encode_plan(Plan(Form.QUANTIZE, bits, 256, "m", "m#0", "gelu", bits, derivative=substitute.source))
    parts = torch.ops.lightning_act.pack_saved_python(derivative.to(dtype), plan)
    expected = torch.ops.lightning_act.unpack_saved_python(parts, [x.numel()], [1], dtype, plan)
    inverse = substitute.inverse_grid(x.device)
    codes, width = ops.every_code(bits, x.device)
    torch.ops.lightning_act.graph_native_derivative_decoder(
        plan, bits, 256, codes, width, inverse.low, inverse.step, inverse.starts, inverse.slopes
    )
    before = torch.ops.lightning_act.live_memory_read()[0]
    torch.ops.lightning_act.live_memory_reset_peak()
    restored = torch.ops.lightning_act.unpack_saved(parts, [x.numel()], [1], dtype, plan)
    transient = torch.ops.lightning_act.live_memory_read()[1] - before
    assert torch.equal(restored, expected)
    assert transient <= 1.75 * restored.numel() * restored.element_size()  # the float temporaries of a chunk


def test_a_derivatives_grids_are_made_with_temporaries_no_larger_than_a_grid():
    """A derivative's grids are made at a step's first store and first decode, where that
    step's peak counts what making them holds. Made whole, their temporaries (the points,
    the pieces they fall in, the lines read there) came to five times the grid, and a
    compiled Whisper's first step peaked 1.25x over the same step without compression."""
    from lightning_act import ops

    ops.ensure_kernels("cpu")
    if not (ops.loaded_kernels()["cpu"] and torch.ops.lightning_act.live_memory_install()):
        pytest.skip("the CPU kernels did not build")
    x = torch.randn(4096) * 3
    substitute = decided(x, call("gelu", x)).substitute
    for make in (substitute._inverse_grid, substitute._smooth_grid):
        before = torch.ops.lightning_act.live_memory_read()[0]
        torch.ops.lightning_act.live_memory_reset_peak()
        grid = make(torch.device("cpu"))
        transient = torch.ops.lightning_act.live_memory_read()[1] - before
        assert transient <= 1.25 * (grid.starts.nbytes + grid.slopes.nbytes), make.__name__


def test_derivatives_of_one_function_share_their_tables():
    """Each layer's GELU finds its own derivative (here: two call signatures); their tables
    and grids are held once, by their values, not once per layer. SiLU's are its own."""
    x, y = torch.randn(4096) * 3, torch.randn(64, 96) * 3
    first = decided(x, call("gelu", x)).substitute
    second = decided(y, call("gelu", y)).substitute
    other = decided(x, call("silu", x)).substitute
    assert first is not second
    cpu = torch.device("cpu")
    assert first.inverse_grid(cpu) is second.inverse_grid(cpu)
    assert first.inverse_grid(cpu) is not other.inverse_grid(cpu)
    first.store(x), second.store(y), other.store(x)
    assert first._grids["store", cpu] is second._grids["store", cpu] is not None
    assert other._grids["store", cpu] is not first._grids["store", cpu]
    # What each restores is still its own function's inverse.
    for substitute, activation in ((second, F.gelu), (other, F.silu)):
        derivative, restorer = substitute.store(y)
        back = restorer.restore(derivative.clone()).requires_grad_()
        (read,) = torch.autograd.grad(activation(back), back, torch.ones_like(y))
        assert torch.allclose(read, derivative, atol=1e-4)


def test_integers_saved_outside_any_call_are_measured_on_the_cpu():
    """A custom autograd function's index: no op bounds it, so the CPU measures its range (a
    byte buffer, whose bytes span their whole range, is kept)."""
    assert decided(torch.randint(-3, 40, (64,))).form is Form.INDEX
    assert decided(torch.randint(0, 255, (64,), dtype=torch.uint8)).form is Form.KEEP


def test_what_no_codec_can_store_smaller_is_kept():
    x = torch.randn(4, 8)
    assert decided(x, min_numel=33).form is Form.KEEP  # too small
    assert decided(x, min_numel=32).form is Form.QUANTIZE
    assert decided(torch.randn(0, 8), min_numel=0).form is Form.KEEP  # empty: nothing to store
    assert decided(torch.randn(16).unfold(0, 4, 1)).form is Form.KEEP  # overlapping windows
    assert decided(torch.randn(4, 8, dtype=torch.complex64)).form is Form.KEEP  # no codec
    assert decided(torch.randn(4, 8, dtype=torch.float64)).form is Form.KEEP
    assert decided(torch.randn(4, 8).to_sparse_csr()).form is Form.KEEP  # not strided
    assert decided(torch.randn(4, 8).to_sparse()).form is Form.KEEP
    assert decided(torch.randn(4, 8) > 0, min_numel=64).form is Form.KEEP


def test_reduction_statistics_are_kept_exact():
    x = torch.randn(64, 32)
    mean = x.mean(1, keepdim=True)  # computed by the op, 32 times smaller than its input
    assert decided(mean, call("layer_norm", x, (32,))).form is Form.STATISTIC
    # The op's own (small) input is an activation, not a statistic.
    small = torch.randn(64, 8)
    assert decided(small, call("layer_norm", small, (8,))).form is Form.QUANTIZE
    # Rows shorter than the smallest group cannot have groups of their own: kept exact.
    tiny = torch.randn(64, 2)
    assert decided(tiny, call("layer_norm", tiny, (2,))).form is Form.KEEP
    # Next to a large weight only, a small tensor is an activation too.
    weight = nn.Parameter(torch.randn(256, 2))
    out = torch.randn(64, 2)
    assert decided(out, call("linear", torch.randn(64, 256)[:, :2], weight)).form is Form.QUANTIZE
    # Without the call nothing tells it is a statistic.
    assert decided(mean).form is Form.QUANTIZE
    # GroupNorm's mean and rstd, saved by the op itself, are statistics too.
    saved = saves_of(F.group_norm, grad_input(8, 4, 6, 6), 2)
    assert [d.form for d in saved] == [Form.QUANTIZE, Form.STATISTIC, Form.STATISTIC]


def test_a_step_that_repeats_its_calls_repeats_no_decision_work(monkeypatch):
    from lightning_act.capture import call_sites

    decided_afresh = []
    original = call_sites._decide_from_call
    monkeypatch.setattr(
        call_sites,
        "_decide_from_call",
        lambda t, c, *rest: decided_afresh.append(c and c.name) or original(t, c, *rest),
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1), model)
    reports = []
    for batch in (8, 8, 5):
        with capture.capturing(inputs=None):
            model(torch.randn(batch, 16)).sum().backward()
        reports.append((len(decided_afresh), dict(capture.report.counts), capture.report.stored_bytes))
        decided_afresh.clear()
    (first, counts, stored), (second, counts_again, stored_again), (new_shape, _, _) = reports
    assert first > 0 and second == 0 and new_shape == first  # a new batch size is decided afresh
    assert counts_again == counts and stored_again == stored


def test_decisions_found_again_tell_apart_what_the_signature_does_not_show():
    """A ``mul`` by a factor computed from ``x`` itself (RMSNorm written out) and by another
    tensor of the same shape have one signature; only the first takes the quadratic floor.
    A parameter and a leaf that needs a gradient look alike too."""
    table = {}

    def one_save(x, factor):
        with OpTracker() as tracker:
            saved = []

            def pack(t):
                current = tracker.current_call()
                saved.append(decide(t, current, external=False, min_numel=1, decided=table))
                current.saves += 1
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x * factor
        return saved

    x = grad_input(4, 64) * 1.0
    own = torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    other = grad_input(4, 1) * 1.0
    assert max(d.min_bits for d in one_save(x, own)) >= 4
    assert max(d.min_bits for d in one_save(x, other)) < 4
    weight = nn.Parameter(torch.randn(4, 64))
    leaf = torch.randn(4, 64, requires_grad=True)
    data = grad_input(4, 64) * 1.0
    assert Form.PARAMETER in [d.form for d in one_save(data, weight)]
    assert Form.PARAMETER not in [d.form for d in one_save(data, leaf)]


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm", "group_norm", "batch_norm"])
@pytest.mark.parametrize("row", [1, 2, 7])
def test_a_normalisation_over_rows_shorter_than_a_group_stores_everything_it_saves_exact(norm, row):
    """On a row of one value ``x - mean`` is exactly 0: LayerNorm's rounded mean (as large as
    its input there) made the input gradient 1e8 times the exact one at 8 bits."""
    if norm == "batch_norm" and row == 1:
        pytest.skip("BatchNorm needs more than one value per channel to train")
    torch.manual_seed(0)
    shapes = {"layer_norm": (3, row), "rms_norm": (3, row), "group_norm": (2, 4, row), "batch_norm": (row, 4)}
    x = torch.randn(shapes[norm], requires_grad=True)
    weight = torch.randn(x.shape[-1], requires_grad=True)  # not a parameter: a save it decides
    forward = {
        "layer_norm": lambda: F.layer_norm(x, (row,), weight),
        "rms_norm": lambda: F.rms_norm(x, (row,), weight),
        "group_norm": lambda: F.group_norm(x, 4),
        "batch_norm": lambda: F.batch_norm(x, None, None, training=True),
    }[norm]
    grad = torch.randn_like(forward())
    exact = torch.autograd.grad(forward(), x, grad)[0]
    capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1))
    with capture.capturing():
        y = forward()
    assert torch.equal(torch.autograd.grad(y, x, grad)[0], exact)
    assert set(capture.report.counts) <= {"kept", "deduplicated"}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_softmax_over_rows_shorter_than_a_group_keeps_its_output_exact(compiled):
    """A group then spans rows, its step is set by the largest probabilities, and a saturated
    row's gradient ``y (g - <g, y>)`` shrinks with what it leaves beside its largest:
    multi-head attention over 3 tokens lost 0.39 of its gradient at 8 bits. Found inside the
    composite call (eager names the attention, not the softmax) and in a compiled graph."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(64, 3, 16) * 10  # logits of up to about 30: saturated rows
    grad = torch.randn(64, 3, 16)

    def run(module):  # with its weights: the softmax written out, not a fused kernel
        leaf = x.clone().requires_grad_(True)
        return leaf, module(leaf * 1.0, leaf * 1.0, leaf * 1.0, need_weights=True)[0]

    leaf, y = run(attention)
    exact = torch.autograd.grad(y, leaf, grad)[0]
    module = torch.compile(attention, backend="aot_eager") if compiled else attention
    capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1), attention)
    with capture.capturing():
        leaf, y = run(module)
    noisy = torch.autograd.grad(y, leaf, grad)[0]
    assert ((noisy - exact).norm() / exact.norm()).item() < 0.03
    assert capture.report.counts.get("kept") == 1  # the probabilities; before, all 8 float saves rounded


def test_the_attention_probabilities_of_the_math_kernel_are_a_softmaxs_output_as_in_a_graph():
    """``scaled_dot_product_attention`` with dropout runs its math kernel on the CPU, whose
    softmax is ``_safe_softmax``: the probabilities it saves inside the call get a softmax
    output's floor (8 bits, the hand rule over the analysis's 4) in eager as in a compiled
    graph. Eager missed it (compiled HF Wav2Vec2 stored 1.20x eager's bytes, at 8 bits
    where eager stored 4)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1))
    with capture.capturing():
        F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, dropout_p=0.1)
    bits = sorted(slot.bits for slot in capture.report.slots.values() if slot.shape == (2, 4, 64, 64))
    assert bits == [2, 8], bits  # the probabilities at 8, after dropout read linearly at 2


@pytest.mark.parametrize("cell", [pytest.param(nn.GRU, marks=pytest.mark.slow), nn.LSTM, nn.RNN])  # GRU: 1.5 s
def test_recurrent_calls_are_read_as_the_trace_of_a_short_sequence_reads_them(cell):
    """Recurrent calls are not traced (the trace grows with the sequence): their float saves
    get the quadratic floor. The trace of a short sequence shows nothing stricter: each
    step's gates are read through y (1 - y) and 1 - y**2, the rest linearly."""
    from lightning_act.backward_reads import Use, call_reads

    torch.manual_seed(0)
    rnn = cell(16, 8, num_layers=2)
    sequence = grad_input(3, 4, 16)
    hidden = torch.zeros(2, 4, 8)
    state = (hidden, hidden.clone()) if cell is nn.LSTM else hidden
    vf = {nn.GRU: torch._VF.gru, nn.LSTM: torch._VF.lstm, nn.RNN: torch._VF.rnn_tanh}[cell]
    traced = call_reads(vf, (sequence, state, rnn._flat_weights, True, 2, 0.0, True, False, False), {})
    assert traced is not None
    reads, saves = traced
    floats = [r.use for r, (dtype, _) in zip(reads, saves) if dtype.is_floating_point]
    assert floats and max(floats) <= Use.QUADRATIC
    decided_floors = {d.min_bits for d in saves_of(rnn, grad_input(12, 4, 16)) if d.form is Form.QUANTIZE}
    assert decided_floors == {4}


def test_one_byte_buffers_without_a_bound_are_kept_as_they_are():
    """An opaque workspace (oneDNN's, cuDNN's) spans all 256 byte values: nothing to save."""
    workspace = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    assert decided(workspace, call("lstm", torch.randn(16, 64, 32))).form is Form.KEEP
    assert decided(workspace.to(torch.int8), call("gru", torch.randn(16, 64, 32))).form is Form.KEEP
    # Wider integers are measured; a bound from the op makes a one-byte tensor storable too.
    assert decided(workspace.long(), call("mul", workspace.long(), 2)).form is Form.INDEX
    pooled = decided(workspace[:36].view(1, 1, 6, 6), call("max_pool2d", torch.randn(1, 1, 12, 12), 2))
    assert pooled.form is Form.INDEX and pooled.value_range == (0, 143)


@pytest.mark.parametrize(
    ("func", "kinds"),
    [
        # The denominator, then the numerator: linear, but its rounding is divided by b
        (lambda a, b: a / b, ["keep", "keep"]),
        (lambda a, b: a / b.sum(1, keepdim=True), ["keep", 1]),  # divided by a row's scale
        (lambda a, b: torch.cumprod(b, 1), ["keep", "keep"]),  # backward: result / input
        # The same, by a branch the trace misses (measured on the call's values)
        (lambda a, b: torch.prod(b[:4], 0), ["keep", "keep"]),
        (lambda a, b: torch.log(b), ["keep"]),
        (lambda a, b: torch.log1p(b), ["keep"]),
        (lambda a, b: torch.asin(b / 2), ["keep"]),  # near the edge of its domain
        (lambda a, b: b.pow(2), [1]),  # RMSNorm's square: backward 2x, linear
        (lambda a, b: b.pow(-0.5), ["keep"]),
        (lambda a, b: b.sqrt(), ["keep"]),  # its output: backward grad / (2 out)
        (lambda a, b: 2.0**b, [1, 1]),  # its output: backward log(2) out, linear
        # exp(x - result), both rounded: their difference far smaller than either
        (lambda a, b: torch.logcumsumexp(b, 1), ["keep", "keep"]),
        (lambda a, b: a * b, [1, 1]),
    ],
)
def test_saves_backward_divides_by_or_takes_roots_of_are_kept_exact(func, kinds):
    a, b = grad_input(64, 64), torch.rand(64, 64, requires_grad=True) + 0.5
    decisions = saves_of(func, a, b)
    assert [d.form.value if d.form in (Form.KEEP, Form.STATISTIC) else d.min_bits for d in decisions] == kinds


def test_an_input_read_through_its_exponent_less_a_statistic_is_rounded_as_a_softmaxs_output():
    """logsumexp's backward reads ``exp(x - result)``: the result, a row's statistic, is kept
    exact, so only ``x`` is rounded, once, as a softmax's output is: the nonlinear floor."""
    x = torch.randn(64, 64, requires_grad=True)
    decisions = saves_of(lambda a, b: torch.logsumexp(b, 1), grad_input(64, 64), x)
    assert [d.form.value if d.form is Form.STATISTIC else d.min_bits for d in decisions] == [8, "statistic"]


def test_minus_infinity_read_through_an_exponential_is_put_back():
    """A masked log-softmax saves -inf where the mask is: the codec would decode its groups
    as NaN; stored as a stand-in and a mask, the gradient stays finite and exact there."""
    torch.manual_seed(0)
    logits = torch.randn(16, 64).masked_fill(torch.rand(16, 64) < 0.3, -torch.inf).requires_grad_()
    grad = torch.randn(16, 64)
    (exact,) = torch.autograd.grad(F.log_softmax(logits, -1), logits, grad)
    capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1))
    with capture.capturing():
        out = F.log_softmax(logits * 1.0, -1)
    (noisy,) = torch.autograd.grad(out, logits, grad)
    assert torch.isfinite(noisy).all() and ((noisy - exact).norm() / exact.norm()).item() < 0.05


class MaskedAttention(nn.Module):
    """Attention whose float mask, built in the forward, is saved by the fused attention op
    (as HF Falcon's causal mask is)."""

    def __init__(self, mask_value: float):
        super().__init__()
        self.proj = nn.Linear(32, 96)
        self.mask_value = mask_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        mask = torch.zeros(x.shape[0], 1, length, length).masked_fill(causal, self.mask_value)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("mask_value", [-torch.inf, torch.finfo(torch.float32).min], ids=["-inf", "finfo.min"])
def test_an_attention_mask_is_put_back_exactly(mask_value):
    """A fused attention's float mask is read through its softmax's exponential: its masked
    positions (-inf, or the dtype's most negative value) would make the codec's groups NaN;
    they are stored as a stand-in and a mask, and the gradient keeps 8-bit accuracy."""
    torch.manual_seed(0)
    model, x = MaskedAttention(mask_value), torch.randn(8, 64, 32)
    exact = torch.autograd.grad(model(x), list(model.parameters()))
    capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1), model)
    with capture.capturing(inputs=x):
        out = model(x)
    noisy = torch.autograd.grad(out, list(model.parameters()))
    exact, noisy = torch.cat([g.flatten() for g in exact]), torch.cat([g.flatten() for g in noisy])
    assert torch.isfinite(noisy).all() and ((noisy - exact).norm() / exact.norm()).item() < 0.02
    slots = {s.op for s in capture.report.slots.values()}
    assert "scaled_dot_product_attention" in slots  # the mask and the attention's inputs were stored


def test_a_batchnorm_input_shared_with_a_relus_output_gets_groups_within_its_channels():
    """RepVGG's identity branch: a BatchNorm reads a ReLU's output, stored first (groups in
    memory order, across channels). A near-constant channel's 1 / std would multiply the
    rounding noise of the louder channels it shares groups with (8-bit error 0.17 here; timm's
    RepVGG-A0 0.074), so the BatchNorm's save is stored again, channel by channel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 1), nn.ReLU(), nn.BatchNorm2d(64), nn.Flatten(), nn.Linear(64 * 4, 10))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(64).view(64, 64, 1, 1))
        model[0].bias.zero_()
    x, y = torch.randn(8, 64, 2, 2), torch.randint(0, 10, (8,))
    x[:, ::2] = -1.0
    x[0, ::2, 0, 0] = 0.01 * torch.rand(32)  # every other channel: one small positive value
    params = list(model.parameters())
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(F.cross_entropy(model(x), y), params)])
    capture = ActivationCapture(CompressionConfig(bits=8, min_numel=1), model)
    with capture.capturing(inputs=x, seed=0):
        loss = F.cross_entropy(model(x), y)
    noisy = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    assert ((noisy - exact).norm() / exact.norm()).item() < 0.01


@pytest.mark.parametrize(
    ("func", "why"),
    [
        (lambda x: torch.amax(x, 1), "backward tests x == amax(x)"),
        (lambda x: x.max(), "backward tests x == max(x)"),
        (lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1), "x == max |x|"),
        (lambda x: (x - x.amax(-1, keepdim=True)).exp(), "a softmax written out"),
        (lambda x: torch.zeros(4, 64).scatter_reduce(0, torch.randint(0, 4, (64, 64)), x, "amax"), "scatter amax"),
    ],
)
def test_tensors_backward_compares_with_another_value_are_kept_exact_or_as_the_outcome(func, why):
    x = grad_input(64, 64)
    decisions = saves_of(func, x)
    float_saves = [d for d in decisions if d.form not in (Form.INDEX, Form.MASK)]
    assert float_saves and any(d.form in (Form.KEEP, Form.MATCH) for d in float_saves), why


def test_floats_an_op_outside_aten_reads_are_kept_exact():
    """torchvision's roi_align reads its boxes' first column as an image index, unchecked."""
    torchvision = pytest.importorskip("torchvision")
    images = grad_input(2, 3, 16, 16)
    boxes = torch.tensor([[0, 0, 0, 8, 8.0], [1, 2, 2, 12, 12]])
    decisions = saves_of(torchvision.ops.roi_align, images, boxes, (2, 2))
    assert decisions and all(d.form is Form.KEEP for d in decisions)


def test_floors_follow_how_backward_reads_the_tensor():
    x = torch.randn(2, 4, 16, 8)
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    relu = decided(x, call("relu", x))
    assert relu.form is Form.QUANTIZE and relu.min_bits == 2 and relu.keeps_zeros
    assert decided(x, call("softmax", x, -1)).min_bits == 8  # a hand rule over the analysis's 4
    logits, target = grad_input(32, 10), torch.randint(0, 10, (32,))
    assert saves_of(F.cross_entropy, logits, target)[0].min_bits == 8  # exp(log-probabilities)
    plain = decided(x, call("conv2d", x, torch.randn(4, 4, 3, 3)))
    assert plain.min_bits == 1 and not plain.keeps_zeros
    # Saved outside any op (a custom autograd function, a checkpoint's block input): its
    # backward is unknown, so it gets the floor of a nonlinear use.
    assert decided(x).min_bits == 8
    # Too small to store: kept as it is, which serves any save of it exactly.
    assert decided(x, call("relu", x), min_numel=10**6) == Decision(Form.KEEP)


def test_a_decision_is_a_value_that_repeats_with_its_inputs():
    """Same op, shapes and strides: equal, hashable decisions (so they can be cached per slot)."""
    first = torch.randn(8, 16).t()
    second = torch.randn(8, 16).t()
    a = decided(first, call("relu", first))
    b = decided(second, call("relu", second))
    assert a == b and hash(a) == hash(b)
    assert a != decided(second, call("gelu", second))


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x,
        lambda x: x.transpose(1, 2),
        lambda x: x.contiguous(memory_format=torch.channels_last),
        lambda x: x[:, :, :3],  # a slice with gaps: copied dense
        lambda x: x[:, :1].expand(2, 5, 4, 3),  # broadcast: stored once
        lambda x: x[:, :, :3].transpose(0, 3),
    ],
)
def test_layout_lays_out_densely_and_restores(make):
    t = make(torch.randn(2, 5, 4, 3))
    layout = Layout.of(t)
    dense = layout.dense(t)
    assert dense.is_contiguous() and dense.numel() == layout.numel
    assert layout.numel == len({p for p in _addresses(t)})  # each distinct element once
    restored = layout.restore(dense.clone())
    assert restored.shape == t.shape and torch.equal(restored, t)
    if not layout.copy:  # read in place: given back with the saved tensor's strides
        assert restored.stride() == t.stride()


def _addresses(t):
    index = torch.cartesian_prod(*[torch.arange(s) for s in t.shape]).reshape(-1, t.dim())
    return (t.storage_offset() + (index * torch.tensor(t.stride())).sum(1)).tolist()


def test_a_view_saved_outside_any_call_comes_back_with_its_own_strides():
    """A compiled graph's saves reach the capture outside any call, and its backward asserts
    their strides: a slice with gaps (a ViT's class token) comes back strided, not dense."""
    tokens = torch.randn(4, 65, 192)
    cls = tokens[:, 0]
    decision = decided(cls)  # no call
    restored = decision.layout.restore(decision.layout.dense(cls))
    assert restored.stride() == cls.stride() and torch.equal(restored, cls)
    # Inside a call, whose backward is known to read values only, it comes back dense.
    inside = decided(cls, call("mul", cls, cls.clone()))
    assert inside.layout.restore(inside.layout.dense(cls)).is_contiguous()


def test_layout_refuses_overlapping_elements():
    windows = torch.randn(16).unfold(0, 4, 1)
    assert Layout.of(windows) is None


def test_a_call_under_autocast_is_traced_with_its_casts():
    """Autocast casts a convolution's input and weight to bfloat16 before autograd saves them,
    and reads as off inside the call, where the pack hook runs: the trace must run under the
    autocast the call began with, or its saves (float32) do not match the real ones and the
    input would be kept exact."""
    x = grad_input(8, 16, 16, 16)
    weight = nn.Parameter(torch.randn(16, 16, 3, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decisions = saves_of(F.conv2d, x, weight)
    assert [d.form for d in decisions] == [Form.QUANTIZE, Form.RECAST_WEIGHT]


def test_a_call_given_one_tensor_twice_is_traced_with_it_once():
    """``multi_head_attention_forward`` projects ``query is key is value`` with one matmul and
    saves other tensors than for three: traced with three copies, the saves did not match
    and every attention tensor was kept exact (a torchvision ViT at 3.1x instead of 10x)."""
    attention = nn.MultiheadAttention(64, 4)
    x = grad_input(16, 8, 64)
    decisions = saves_of(attention, x, x, x, need_weights=False)
    kinds = [d.form for d in decisions]
    assert Form.KEEP not in kinds, kinds
    assert kinds.count(Form.QUANTIZE) >= 4  # the projection's input, q, k, v, the output


def test_a_complex_parameters_view_is_a_parameter_not_stored_memory():
    """A spectral layer's ``einsum`` saves a permuted view of its complex weight: alive
    anyway, so passed through and not counted as stored (it was reported as kept bytes)."""
    from lightning_act import compress_activations

    class Spectral(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32, 32, 16, dtype=torch.cfloat) / 32)

        def forward(self, x):
            modes = torch.fft.rfft(x, dim=-1)[..., :16]
            return torch.fft.irfft(torch.einsum("bin,oin->bon", modes, self.weight), n=64, dim=-1)

    model = Spectral()
    x = torch.randn(64, 32, 64, requires_grad=True)
    with compress_activations(model, inputs=x, bits=2) as capture:
        loss = model(x).square().mean()
    loss.backward()
    assert capture.report.counts["parameter"] == 1
    # What the einsum keeps is the spectrum alone (a view of rfft's whole output).
    assert capture.report.modules["Spectral"].stored_bytes == 64 * 32 * 33 * 8


def test_a_parameters_view_in_another_dtype_is_the_parameter_and_a_cast_copy_is_kept():
    """Memory decides, not the dtype: a spectral layer's ``view_as_complex`` of its real
    weight shares the weight's storage and costs nothing; a cast is a copy of its own."""
    weight = torch.nn.Parameter(torch.randn(32, 32, 16, 2))
    spectrum = torch.randn(8, 32, 16, dtype=torch.cfloat, requires_grad=True)
    kinds = [d.form for d in saves_of(lambda: torch.einsum("bin,oin->bon", spectrum, torch.view_as_complex(weight)))]
    assert Form.PARAMETER in kinds and Form.CAST_PARAMETER not in kinds, kinds
    x = grad_input(8, 64)
    linear = torch.nn.Parameter(torch.randn(64, 64))
    kinds = [d.form for d in saves_of(lambda: x.double() @ linear.double())]
    assert Form.CAST_PARAMETER in kinds or Form.RECAST_WEIGHT in kinds, kinds


def _gradient_with_and_without(forward, x: torch.Tensor):
    """``x``'s gradient through ``forward`` exactly and with every save captured at 2 bits,
    and the capture's report."""
    x = x.detach().requires_grad_(True)
    out = forward(x * 1.0)
    grad = torch.randn_like(out)
    exact = torch.autograd.grad(out, x, grad)[0]
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1))
    with capture.capturing():
        out = forward(x * 1.0)
    return torch.autograd.grad(out, x, grad)[0], exact, capture.report


_INDEX = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0))[:, None].expand(400, 16)


@pytest.mark.parametrize(
    "reduce",
    [
        lambda v: torch.zeros(50, 16).scatter_reduce(0, _INDEX, v, "amax", include_self=False),
        lambda v: torch.zeros(50, 16).scatter_reduce_(0, _INDEX, v, "amin", include_self=False),
        lambda v: torch.zeros(50, 16).scatter_reduce(0, _INDEX, v, "amax"),
        lambda v: torch.amax(v, 1),
        lambda v: torch.amax(v, -1, keepdim=True),
        lambda v: torch.amin(v.view(20, 20, 16), (0, 2)),
        lambda v: torch.max(v),
        lambda v: torch.min(v[4:]),  # rows past the NaN
    ],
    ids=[
        "scatter_amax",
        "scatter_amin_in_place",
        "scatter_amax_with_self",
        "amax",
        "amax_keepdim",
        "amin_dims",
        "max_of_all_nan",
        "min_of_all",
    ],
)
def test_a_tensor_backward_only_compares_with_a_reduction_is_stored_as_the_outcome(reduce):
    """Backward tests ``x == result`` (gathered by the index, or with the reduced dimensions
    put back), and for ``max()`` also ``isnan(x) & isnan(result)`` (on a CPU ``isnan(x)``
    alone where the result is NaN): one bit per element, and the result stored at 2 bits with
    the stand-ins rebuilt from that copy, give the same gradient, ties and NaN included."""
    torch.manual_seed(0)
    x = torch.randn(400, 16).round()  # ties: several elements equal to their maximum
    x[3, 5] = float("nan")
    x[7, 2] = float("inf")  # a result the stored copy holds as a finite stand-in
    got, exact, report = _gradient_with_and_without(reduce, x)
    assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got.nan_to_num(), exact.nan_to_num())
    # The result too is stored at the session's bits (a full reduction's one value is kept as a
    # statistic): backward reads it only as what the outcomes were taken against.
    assert report.counts.get("lossless", 0) >= 1 and "kept" not in report.counts
    assert report.stored_bytes < x.numel() * 4 / 4


def test_a_comparison_traced_at_other_sizes_views_the_result_at_the_calls_own():
    """``amax``'s backward views its result with the reduced dimension put back, at the sizes
    the call was traced with; a later call of the same signature at other sizes (the same
    number of results, so a view at the traced sizes would not fail) puts it back at its own."""
    torch.manual_seed(0)
    for shape in ((2, 16, 3), (3, 16, 2)):
        got, exact, report = _gradient_with_and_without(lambda v: torch.amax(v, 1), torch.randn(shape).round())
        assert torch.equal(got, exact) and report.counts.get("lossless") == 1


def test_a_grouped_matmul_reads_its_operands_linearly():
    """A mixture of experts' ``torch._grouped_mm`` (one matmul per group of rows): its backward
    is two more grouped matmuls, linear in each operand, so both are stored at any bits."""
    tokens = grad_input(32, 16).to(torch.bfloat16)
    experts = grad_input(4, 8, 16).to(torch.bfloat16).transpose(-2, -1)
    offsets = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
    decisions = saves_of(torch._grouped_mm, tokens, experts, offs=offsets)
    floats = [d for d in decisions if d.form is not Form.INDEX]
    assert floats and all(d.form is Form.QUANTIZE and d.min_bits == 1 for d in floats)


def test_a_deformable_convolution_is_stored_where_its_backward_is_measured_linear():
    """``torchvision::_deform_conv2d_backward`` is outside aten: measured on random values, it
    is linear in the input, the weight and the modulation mask, which are stored at any bits;
    bilinear sampling at the offsets jumps from cell to cell, so they are kept exact."""
    torchvision = pytest.importorskip("torchvision")
    x, offsets, mask = grad_input(2, 8, 10, 10), grad_input(2, 18, 8, 8), grad_input(2, 9, 8, 8)
    weight = nn.Parameter(torch.randn(16, 8, 3, 3))
    kinds = [d.form for d in saves_of(torchvision.ops.deform_conv2d, x, offsets, weight, mask=mask)]
    assert kinds[:4] == [Form.QUANTIZE, Form.PARAMETER, Form.KEEP, Form.QUANTIZE]


_probed_library = torch.library.Library("lightning_act_test", "DEF")
_probed_library.define("scale(Tensor x, Tensor s, bool crash) -> Tensor")
_probed_library.define("scale_backward(Tensor grad, Tensor x, Tensor s, bool crash) -> (Tensor, Tensor)")


@torch.library.impl(_probed_library, "scale", "CompositeExplicitAutograd")
def _scale(x, s, crash):
    return x * s


@torch.library.impl(_probed_library, "scale_backward", "CompositeExplicitAutograd")
def _scale_backward(grad, x, s, crash):
    if crash:
        os.abort()  # an op that writes through an index it does not check, on values it was not meant for
    return grad * s, (grad * x).sum_to_size(s.shape)


@torch.library.register_fake("lightning_act_test::scale_backward", lib=_probed_library)
def _scale_backward_fake(grad, x, s, crash):
    return torch.empty_like(x), torch.empty_like(s)


def _scale_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.crash = inputs[2]


def _scale_derivative(ctx, grad):
    return (*torch.ops.lightning_act_test.scale_backward(grad, *ctx.saved_tensors, ctx.crash), None)


torch.library.register_autograd(
    "lightning_act_test::scale", _scale_derivative, setup_context=_scale_setup, lib=_probed_library
)


@pytest.mark.parametrize("crash", [False, True])
def test_an_op_outside_aten_is_measured_in_a_forked_process(crash):
    """Measured linear, an unknown op's saves are stored at any bits. Where the measurement
    kills its process, they are kept exact, and this process runs on."""
    from lightning_act.backward_reads import probe_cost

    measured = probe_cost()["ops"]
    x, s = grad_input(64, 64), grad_input(64, 1)
    decisions = saves_of(torch.ops.lightning_act_test.scale, x, s, crash)
    assert [d.form for d in decisions] == [Form.KEEP] * 2 if crash else [Form.QUANTIZE] * 2
    assert probe_cost()["ops"] == measured + 1  # once per signature, counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "compare",
    [
        lambda v: v.clamp(min=1e-5),
        lambda v: v.clamp(-1, 1),
        lambda v: F.threshold(v, 0.5, 0.0),
    ],
    ids=["clamp_min", "clamp_interval", "threshold"],
)
def test_a_tensor_backward_only_compares_with_constants_is_stored_as_its_cells(compare, dtype):
    """The cell between the constants each value falls in, equality and NaN included, gives
    backward the same comparisons: the gradient bit for bit, in 2 or 4 bits per value."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    x[0, :5] = torch.tensor([1e-5, 0.5, 1.0, -1.0, float("nan")])
    got, exact, report = _gradient_with_and_without(compare, x.to(dtype))
    assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got.nan_to_num(), exact.nan_to_num())
    assert report.counts == {"lossless": 1}
    assert report.stored_bytes <= x.numel() // 2


def test_cells_between_constants_one_rounding_apart_are_not_made():
    from lightning_act.codecs.substitutes import ThresholdCells

    assert ThresholdCells.of((1.0, 1.0 + 1e-9), torch.float32) is None  # one float32 value
    assert ThresholdCells.of((float("inf"),), torch.float32) is None
    cells = ThresholdCells.of((0.0, 1.0), torch.float32)
    assert cells.count == 6 and cells.values[1] == 0.0 and cells.values[3] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", [F.silu, F.gelu])
def test_a_half_precision_activation_stores_its_derivative(activation, dtype):
    """A bfloat16 SiLU's backward casts to float32, computes, and casts back: the casts are
    element by element, so its input is stored as its derivative, as in float32, and the
    2-bit gradient is unbiased (it was kept exact, read as a cube through the casts)."""
    x = (grad_input(64, 64) * 3).to(dtype)
    (decision,) = saves_of(activation, x)
    assert decision.form is Form.QUANTIZE and decision.substitute is not None and decision.min_bits == 1


def test_rms_norm_written_out_over_one_value_rows_is_exact():
    """``x * rsqrt(mean(x**2) + eps)`` over rows of one value: ``pow`` saves ``x`` before
    ``mul`` shows the normalisation; ``mul``'s exact copy then serves ``pow`` too, so the
    two reads that cancel in backward see the same values (8 bits each, rounded apart: a
    relative error of 42, against 6e-4)."""
    torch.manual_seed(0)
    linear, weight, project = nn.Linear(4, 1), torch.randn(1), torch.randn(1)

    def loss(x):
        h = linear(x)
        return ((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight) @ project).sin().sum()

    x = torch.randn(512, 4)
    loss(x).backward()
    exact = linear.weight.grad.clone()
    linear.zero_grad()
    with compress_activations(linear, inputs=x, bits=8, min_numel=1):
        compressed = loss(x)
    compressed.backward()
    assert (linear.weight.grad - exact).norm() / exact.norm() < 1e-2


def _attention_gradients(bits: int | str, scale: float = 1.0, dropout_p: float = 0.0, backwards: int = 1):
    """``scaled_dot_product_attention`` (the CPU flash kernel) on queries and keys scaled by
    ``scale``: the exact gradients, the captured ones (each backward of a retained graph) and
    the report. ``bits="exact"`` keeps the query, key and value exact by a rule."""
    from lightning_act.policy import FixedBits

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 64, 16, generator=generator) for _ in range(3))
    leaves = [t.requires_grad_(True) for t in (q * scale, k * scale, v)]
    grad = torch.randn(4, 4, 64, 16, generator=generator)

    def attention():
        torch.manual_seed(0)  # the same dropout mask, with and without the capture
        return F.scaled_dot_product_attention(*(t * 1.0 for t in leaves), dropout_p=dropout_p)

    exact = torch.autograd.grad(attention(), leaves, grad)
    policy = FixedBits(8, {"op:scaled_dot_product_attention": "exact"}) if bits == "exact" else FixedBits(bits)
    capture = ActivationCapture(CompressionConfig(min_numel=1), policy=policy)
    with capture.capturing():
        out = attention()
    got = [torch.autograd.grad(out, leaves, grad, retain_graph=True) for _ in range(backwards)]
    return exact, got, capture.report


def test_a_fused_attention_computes_its_output_again_from_the_stored_query_key_and_value():
    """Nothing stored for the output and logsumexp; recomputed from exact inputs, they are
    the forward's own, and the gradients bit for bit (a retained graph's second backward
    too)."""
    exact, got, report = _attention_gradients("exact", backwards=2)
    assert report.counts.get("recomputed") == 2 and "statistic" not in report.counts
    for gradients in got:
        assert all(torch.equal(g, e) for g, e in zip(gradients, exact))


def test_a_fused_attention_recomputed_from_rounded_inputs_keeps_a_saturated_gradient():
    """Logits up to about 50: stored apart, the output's and the value's rounding no longer
    cancel in ``rowsum(dO * O) - dO V^T``, and the probabilities recomputed from rounded
    queries and keys against the exact logsumexp do not sum to one: the 2-bit gradient's error
    was 4.6 of its norm. Recomputed from what is stored, as backward reads it, 0.8."""
    exact, (got,), report = _attention_gradients(2, scale=3.0)
    error = max(((g - e).norm() / e.norm()).item() for g, e in zip(got, exact))
    assert report.counts.get("recomputed") == 2 and error < 1.0


def test_a_fused_attention_with_dropout_stores_its_output():
    """Its random mask would be drawn again: the output is stored, as any other save."""
    exact, (got,), report = _attention_gradients(8, dropout_p=0.3)
    assert "recomputed" not in report.counts
    assert max(((g - e).norm() / e.norm()).item() for g, e in zip(got, exact)) < 0.05


_segments_library = torch.library.Library("lightning_act_segments", "DEF")
_segments_library.define("scale(Tensor x, Tensor w, Tensor ends) -> Tensor")
_segments_library.define("scale_backward(Tensor grad, Tensor x, Tensor w, Tensor ends) -> (Tensor, Tensor)")


def _segments(ends):
    start = 0
    for i, end in enumerate(ends.tolist()):
        yield i, slice(start, max(start, end))
        start = max(start, end)


@torch.library.impl(_segments_library, "scale", "CompositeExplicitAutograd")
def _segments_scale(x, w, ends):
    out = torch.zeros_like(x)
    for i, rows in _segments(ends):
        out[rows] = x[rows] * w[i]
    return out


@torch.library.impl(_segments_library, "scale_backward", "CompositeExplicitAutograd")
def _segments_scale_backward(grad, x, w, ends):
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    for i, rows in _segments(ends):
        grad_x[rows] = grad[rows] * w[i]
        grad_w[i] = (grad[rows] * x[rows]).sum(0)
    return grad_x, grad_w


@torch.library.register_fake("lightning_act_segments::scale_backward", lib=_segments_library)
def _segments_scale_backward_fake(grad, x, w, ends):
    return torch.empty_like(x), torch.empty_like(w)


def _segments_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.ends = inputs[2]


torch.library.register_autograd(
    "lightning_act_segments::scale",
    lambda ctx, grad: (*torch.ops.lightning_act_segments.scale_backward(grad, *ctx.saved_tensors, ctx.ends), None),
    setup_context=_segments_setup,
    lib=_segments_library,
)


def test_an_op_outside_aten_with_integer_arguments_is_measured_around_valid_indices():
    """A grouped op's backward (rows ``ends[i-1]:ends[i]`` times the group's weights), outside
    aten and taking integer offsets: measured with the offsets held at small sorted values, it
    is linear in the rows and the weights, which are stored at any bits."""
    x, w = grad_input(96, 32), grad_input(4, 32)
    ends = torch.tensor([10, 40, 70, 96])
    decisions = saves_of(torch.ops.lightning_act_segments.scale, x, w, ends)
    assert [d.form for d in decisions] == [Form.QUANTIZE] * 2


def _grouped_matmul():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    torch.manual_seed(0)
    x, w = grad_input(96, 32), grad_input(4, 32, 16)
    offsets = torch.tensor([10, 40, 70, 96], dtype=torch.int32)
    try:
        torch._grouped_mm(x, w, offs=offsets)
    except RuntimeError as error:
        pytest.skip(f"no float32 _grouped_mm on the CPU: {error}")
    return x, w, offsets


def test_a_call_its_fake_kernel_refuses_is_read_on_its_own_values():
    """torch's fake ``_grouped_mm`` refuses float32, which its CPU kernel runs: the call is
    traced on copies of its own values instead, and its saves are stored as any matmul's."""
    x, w, offsets = _grouped_matmul()
    decisions = saves_of(torch._grouped_mm, x, w, offs=offsets)
    assert [d.form for d in decisions] == [Form.QUANTIZE, Form.INDEX, Form.QUANTIZE]


def test_the_saves_no_trace_can_read_are_kept_whole_and_named_in_the_report(monkeypatch):
    """Where neither trace can read a call (here: its values over the size traced for real),
    its saves are kept as they are, and the report names the op, the bytes and why."""
    from lightning_act.backward_reads import trace

    x, w, offsets = _grouped_matmul()
    monkeypatch.setattr(trace, "PROBE_NUMEL", 0)
    monkeypatch.setattr(trace, "_cache", {})
    monkeypatch.setattr(trace, "_UNTRACED", {})
    with compress_activations(inputs=offsets, bits=2, min_numel=1) as capture:
        out = torch._grouped_mm(x * 1, w * 1, offs=offsets)
        (out * torch.randn_like(out)).sum().backward()
    report = capture.report
    tensors, stored, why = report.untraced["_grouped_mm"]
    assert tensors == report.counts["untraced"] == 2
    assert stored == (x.numel() + w.numel()) * 4
    assert why == "RuntimeError: too large to trace on its own values"
    assert "_grouped_mm: 2 tensors" in report.summary()
