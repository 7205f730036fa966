"""The storage rules of :func:`lightning_act.capture.decide.decide`, on small tensors and calls
built by hand (no capture, no hooks)."""

import pytest
import torch
from torch import nn

from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.capture.decide import Decision, Kind, decide, floor_bits, source_parameter
from lightning_act.capture.records import Layout
from lightning_act.codecs import GroupQuantCodec
from lightning_act.optrack import TrackedCall


def call(name, *args, **kwargs):
    return TrackedCall(name, args, kwargs)


def decided(t, c=None, external=False, min_numel=1):
    return decide(t, c, external=external, min_numel=min_numel)


def test_parameters_and_their_views_pass_through():
    p = nn.Parameter(torch.randn(6, 4))
    assert decided(p, call("linear", torch.randn(3, 4), p)).kind is Kind.PARAMETER
    assert decided(p.t()).kind is Kind.PARAMETER
    assert source_parameter(p.t()) == (p, False)


def test_autocast_copy_of_a_parameter_is_recast_and_other_casts_are_kept():
    p = nn.Parameter(torch.randn(6, 4))
    copy = p.to(torch.bfloat16)
    decision = decided(copy)
    assert decision.kind is Kind.RECAST_WEIGHT and decision.parameter is p
    twice = copy.to(torch.float16)  # two casts: casting the parameter once does not re-create it
    assert decided(twice).kind is Kind.CAST_PARAMETER
    # A parameter is never compressed, not even when it is also marked alive for the step.
    assert decided(p, external=True).kind is Kind.PARAMETER


def test_tensors_alive_anyway_pass_through():
    x = torch.randn(8, 16)
    assert decided(x, call("linear", x), external=True) == Decision(Kind.EXTERNAL)
    assert decided(x > 0, external=True).kind is Kind.EXTERNAL


def test_masks_and_indices_are_lossless_with_the_bound_their_op_implies():
    x = torch.randn(2, 3, 4, 6)
    mask = decided(x > 0, call("threshold_backward_like"))
    assert mask.kind is Kind.MASK and mask.layout.numel == x.numel()
    indices = torch.randint(0, 24, (2, 3, 2, 3))
    pooled = decided(indices, call("max_pool2d", x, 2))
    assert pooled.kind is Kind.INDEX and pooled.value_range == (0, 23)
    gathered = torch.randint(0, 3, (2, 3, 4, 6))
    bounded = decided(gathered, call("gather", x, 1, gathered))
    assert bounded.kind is Kind.INDEX and bounded.value_range == (0, 2)
    # The same tensor saved by an op that bounds another argument: its range is measured.
    unbounded = decided(gathered, call("gather", x, 1, gathered.clone()))
    assert unbounded.kind is Kind.INDEX and unbounded.value_range is None


def test_unbounded_indices_off_the_cpu_are_kept_rather_than_measured_with_a_host_sync():
    # A meta tensor stands in for a GPU one: no data, a device other than the CPU.
    indices = torch.empty(2, 3, 4, 6, dtype=torch.long, device="meta")
    assert decided(indices, call("mul", indices, 2)).kind is Kind.KEEP
    source = torch.empty(4096, 8, device="meta")
    bounded = decided(indices, call("embedding", indices, source))
    assert bounded.kind is Kind.INDEX and bounded.value_range == (0, 4095)


@pytest.mark.parametrize("head_dim", [12, 20])
def test_padded_copies_of_query_and_key_get_the_softmax_floor_by_position(head_dim):
    """A GPU's flash attention saves query, key and value padded to a head dim that is a
    multiple of 8, in that order: new tensors that match no argument by identity."""
    query, key, value = (torch.randn(2, 4, 16, head_dim) for _ in range(3))
    padded = head_dim + (-head_dim) % 8
    attention = call("scaled_dot_product_attention", query, key, value)
    floors = []
    for _ in ("query", "key", "value", "output"):
        floors.append(floor_bits(torch.randn(2, 4, 16, padded), attention))
        attention.saves += 1  # as the capture engine counts the call's saves
    assert floors == [8, 8, 1, 1]
    # Unpadded saves are matched by identity, whatever their position.
    assert floor_bits(key, call("scaled_dot_product_attention", query, key, value)) == 8
    assert floor_bits(value, call("scaled_dot_product_attention", query, key, value)) == 1
    # A head dim that needs no padding: a same-shaped copy is not the query.
    aligned = call("scaled_dot_product_attention", *(torch.randn(2, 4, 16, 16) for _ in range(3)))
    assert floor_bits(torch.randn(2, 4, 16, 16), aligned) == 1


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
    assert row_groups(maps, call("instance_norm", maps)) == (64, 36, 64)  # one 6x6 plane
    # BatchNorm's rows are its channels, laid out channel-major (4 samples of a 6x6 map),
    # unless each channel's map is whole groups already.
    channels = decided(maps, call("batch_norm", maps))
    assert channels.row_layout.perm == (1, 0, 2, 3) and not channels.row_layout.memory_order
    assert channels.layout.memory_order  # for DIVISION's and pool's spatial tiles
    assert row_groups(maps, call("batch_norm", maps)) == (64, 144, 192)
    late = torch.randn(8, 16, 7, 7)  # ResNet-50's last stage at batch 8: 392 values a channel
    assert row_groups(late, call("batch_norm", late)) == (256, 392, 512)
    large = torch.randn(2, 4, 16, 16)
    assert decided(large, call("batch_norm", large)) == decided(large, call("linear", large))
    # A strided input's rows are not runs, and other ops normalise nothing.
    strided = tokens.transpose(1, 2)
    assert decided(strided, call("layer_norm", strided, (65,))).row_group is None
    assert decided(tokens, call("linear", tokens)).row_group is None


def test_inputs_of_a_normalisation_over_rows_get_four_bits_and_batch_norm_none():
    tokens = torch.randn(8, 65, 192)
    assert floor_bits(tokens, call("layer_norm", tokens, (192,))) == 4
    maps = torch.randn(4, 32, 6, 6)
    assert floor_bits(maps, call("group_norm", maps, 8)) == 4
    assert floor_bits(maps, call("batch_norm", maps)) == 1
    # What else a normalisation saves is not its input (its weight, its statistics).
    assert floor_bits(torch.randn(192), call("layer_norm", tokens, (192,))) == 1


def test_a_normalisation_written_out_is_found_by_its_factor_s_history():
    """x * rsqrt(mean(x**2) + eps): mul's factor per row is computed from x itself, so x is
    a normalisation's input (four bits, groups within its rows). A per-row factor from
    elsewhere (a padding mask) scales x linearly: no floor."""
    x = torch.randn(8, 65, 192, requires_grad=True) * 1.0
    factor = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert floor_bits(x, call("mul", x, factor)) == 4
    assert floor_bits(x, call("mul", factor, x)) == 4
    assert row_groups(x.detach(), call("mul", x, factor)) == (64, None, None)
    mask = torch.rand(8, 65, 1, requires_grad=True) * 1.0
    assert floor_bits(x, call("mul", x, mask)) == 1
    assert decided(x, call("mul", x, mask)).row_group is None
    # The factor itself, and a factor that is not per row, are not the input.
    assert floor_bits(factor, call("mul", x, factor)) == 1
    assert floor_bits(x, call("mul", x, factor.squeeze(-1).unsqueeze(0))) == 1


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
    leaky = decided(x, call("leaky_relu", x, 0.1))
    assert leaky.kind is Kind.SIGN_MASK and leaky.divisor is None
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
    assert decided(x, call("hardsigmoid", x)).kind is Kind.SIGN_MASK
    # An empty interval is not one backward reads: quantized like any activation.
    assert decided(x, call("hardtanh", x, 1.0, 1.0)).kind is Kind.QUANTIZE


def test_hardswish_input_is_stored_as_the_point_of_the_affine_piece_with_its_derivative():
    x = torch.tensor([-7.0, -3.5, -3.0, -1.0, 0.0, 2.5, 3.0, 3.01, 40.0])
    decision = decided(x, call("hardswish", x))
    assert decision.kind is Kind.QUANTIZE and decision.substitute is not None
    substitute = decision.substitute.store(x)
    assert substitute.tolist() == [-1.5, -1.5, -1.5, -1.0, 0.0, 2.5, 1.5, 1.5, 1.5]
    grad = torch.randn(9)
    assert torch.equal(torch.ops.aten.hardswish_backward(grad, substitute), torch.ops.aten.hardswish_backward(grad, x))
    # The codec's grid ends, rounded outward, land on the switches: decoding moves them back inside.
    for dtype in (torch.float32, torch.bfloat16):
        back = decision.substitute.restore(torch.tensor([-3.0, -3.5, 3.0, 0.5], dtype=dtype))
        assert -3 < back.min().item() < -2.98 and 2.98 < back.max().item() < 3 and back[3].item() == 0.5
    assert decided(x, call("relu", x)).substitute is None


def test_inputs_of_saturating_activations_are_clamped_where_the_derivative_has_levelled_off():
    """SiLU's input of standard deviation 20: values far out stretch each group's range,
    and the noise backward puts through SiLU's curvature grows with it. Clamped at 10, the
    gradient moves by under 1e-3 and its 8-bit rounding error falls about 5 times."""
    torch.manual_seed(0)
    x = torch.randn(64 * 256) * 20
    substitute = decided(x, call("silu", x)).substitute
    assert substitute.limit == 10.0 and decided(x, call("gelu", x)).substitute.limit == 5.0
    grad = torch.randn_like(x)
    exact = torch.ops.aten.silu_backward(grad, x)
    stored = substitute.store(x)
    assert stored.abs().max() == 10.0
    assert (torch.ops.aten.silu_backward(grad, stored) - exact).norm() < 1e-3 * exact.norm()
    codec = GroupQuantCodec(256)

    def error(source):
        decoded = substitute.restore(codec.pack(source, 8, 0).unpack())
        return ((torch.ops.aten.silu_backward(grad, decoded) - exact).norm() / exact.norm()).item()

    assert error(stored) < error(x) / 3


def test_what_no_codec_can_store_smaller_is_kept():
    x = torch.randn(4, 8)
    assert decided(x, min_numel=33).kind is Kind.KEEP  # too small
    assert decided(x, min_numel=32).kind is Kind.QUANTIZE
    assert decided(torch.randn(0, 8), min_numel=0).kind is Kind.KEEP  # empty: nothing to store
    assert decided(torch.randn(16).unfold(0, 4, 1)).kind is Kind.KEEP  # overlapping windows
    assert decided(torch.randn(4, 8, dtype=torch.complex64)).kind is Kind.KEEP  # no codec
    assert decided(torch.randn(4, 8) > 0, min_numel=64).kind is Kind.KEEP


def test_reduction_statistics_are_kept_exact():
    x = torch.randn(64, 32)
    mean = x.mean(1, keepdim=True)  # computed by the op, 32 times smaller than its input
    assert decided(mean, call("layer_norm", x, (32,))).kind is Kind.STATISTIC
    # The op's own (small) input is an activation, not a statistic.
    small = torch.randn(64, 2)
    assert decided(small, call("layer_norm", small, (2,))).kind is Kind.QUANTIZE
    # Next to a large weight only, a small tensor is an activation too.
    weight = nn.Parameter(torch.randn(256, 2))
    out = torch.randn(64, 2)
    assert decided(out, call("linear", torch.randn(64, 256)[:, :2], weight)).kind is Kind.QUANTIZE
    # Without the call nothing tells it is a statistic.
    assert decided(mean).kind is Kind.QUANTIZE
    # An output of the op itself with autograd history (GroupNorm's mean) is still one ...
    images = torch.randn(8, 4, 6, 6, requires_grad=True)
    with torch.enable_grad():
        _, group_mean, _ = torch.native_group_norm(images, None, None, 8, 4, 36, 2, 1e-5)
    assert group_mean.grad_fn is not None
    assert decided(group_mean, call("group_norm", images, 2)).kind is Kind.STATISTIC
    # ... but not a value computed step by step inside a composite op (a recurrent step's gate).
    sequence = torch.randn(16, 64, 32, requires_grad=True)
    with torch.enable_grad():
        gate = torch.sigmoid(sequence[:, 3] * 2)
    inside = decided(gate, call("gru", sequence))
    # Which step's backward reads it, and how, is unknown: a gate's own backward is quadratic in it.
    assert inside.kind is Kind.QUANTIZE and inside.min_bits == 4
    with torch.enable_grad():
        direct = torch.sigmoid(sequence)
    assert decided(direct, call("sigmoid", sequence)).min_bits == 1  # an op's own output
    # A copy of an input the op makes first (a linear layer's reshape of a strided input) is
    # the input, not a value computed inside.
    strided = sequence.transpose(0, 1)
    with torch.enable_grad():
        flat = strided.reshape(-1, 32)
    assert flat.untyped_storage().data_ptr() != sequence.untyped_storage().data_ptr()
    assert decided(flat, call("linear", strided, nn.Parameter(torch.randn(8, 32)))).min_bits == 1


def test_one_byte_buffers_without_a_bound_are_kept_as_they_are():
    """An opaque workspace (oneDNN's, cuDNN's) spans all 256 byte values: nothing to save."""
    workspace = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    assert decided(workspace, call("lstm", torch.randn(16, 64, 32))).kind is Kind.KEEP
    assert decided(workspace.to(torch.int8), call("gru", torch.randn(16, 64, 32))).kind is Kind.KEEP
    # Wider integers are measured; a bound from the op makes a one-byte tensor storable too.
    assert decided(workspace.long(), call("mul", workspace.long(), 2)).kind is Kind.INDEX
    pooled = decided(workspace[:36].view(1, 1, 6, 6), call("max_pool2d", torch.randn(1, 1, 12, 12), 2))
    assert pooled.kind is Kind.INDEX and pooled.value_range == (0, 143)


@pytest.mark.parametrize(
    ("make_call", "saved", "divisor"),
    [
        (lambda a, b: call("div", a, b), "b", True),
        (lambda a, b: call("div", a, b), "a", False),  # the numerator: backward is linear in it
        (lambda a, b: call("div", a, other=b), "b", True),
        (lambda a, b: call("log", b), "b", True),
        (lambda a, b: call("rsqrt", b), "b", True),
        (lambda a, b: call("pow", b, 2), "b", False),  # RMSNorm's square: backward 2x, linear
        (lambda a, b: call("pow", b, -0.5), "b", True),
        (lambda a, b: call("pow", b, 0.5), "b", True),
        (lambda a, b: call("pow", b, a), "b", True),  # a tensor exponent
        (lambda a, b: call("pow", a, b), "b", True),
        (lambda a, b: call("__rpow__", b, 2.0), "b", True),  # 2 ** b
        (lambda a, b: call("mul", a, b), "b", False),
    ],
)
def test_tensors_backward_divides_by_get_the_nonlinear_floor(make_call, saved, divisor):
    a, b = torch.randn(64, 64), torch.rand(64, 64) + 0.5
    decision = decided({"a": a, "b": b}[saved], make_call(a, b))
    assert decision.kind is Kind.QUANTIZE
    assert decision.min_bits == (8 if divisor else 1)


def test_floors_follow_how_backward_reads_the_tensor():
    x = torch.randn(2, 4, 16, 8)
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    relu = decided(x, call("relu", x))
    assert relu.kind is Kind.QUANTIZE and relu.min_bits == 2 and relu.keeps_zeros
    assert decided(x, call("softmax", x, -1)).min_bits == 8
    assert decided(x, call("cross_entropy", x, None)).min_bits == 8
    sdpa = call("scaled_dot_product_attention", q, k, v)
    assert [decided(t, sdpa).min_bits for t in (q, k, v)] == [8, 8, 1]
    assert decided(k, call("scaled_dot_product_attention", query=q, key=k, value=v)).min_bits == 8
    plain = decided(x, call("conv2d", x))
    assert plain.min_bits == 1 and not plain.keeps_zeros
    # Saved outside any op (a custom autograd function, a checkpoint's block input): its
    # backward is unknown, so it gets the floor of a nonlinear use.
    assert floor_bits(x, None) == 8
    # The floor holds whatever kind results: a copy shared between saves must satisfy it.
    assert decided(x, call("relu", x), min_numel=10**6) == Decision(Kind.KEEP, 2)


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


def test_layout_refuses_overlapping_elements():
    windows = torch.randn(16).unfold(0, 4, 1)
    assert Layout.of(windows) is None
