"""Bit policies, the allocation solver and the sensitivity estimators."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.capture import OUTSIDE_MODULES
from lightning_act.policy import AdaptiveBits, FixedBits, Rule, SaveRules, SlotInfo, allocate_bits
from lightning_act.policy.allocation import storage_bits
from lightning_act.policy.estimators import GradientSensitivity, probe_sensitivities, update_weights
from torch import nn

CANDIDATES = (1, 2, 4, 8, None)


def plain_table(c: float) -> dict[int, float]:
    return {b: c / ((1 << b) - 1) ** 2 for b in (1, 2, 4, 8)}


def brute_force(variance, sizes, budget):
    allowed = sum(n * budget + g * 32 for n, g, _ in sizes.values())
    best = None
    for choice in itertools.product(CANDIDATES, repeat=len(sizes)):
        cost = sum(storage_bits(b, *sizes[k]) for k, b in zip(sizes, choice))
        if cost > allowed:
            continue
        total = sum(0.0 if b is None else variance[k][b] for k, b in zip(sizes, choice))
        if best is None or total < best[0]:
            best = (total, dict(zip(sizes, choice)))
    return best


@pytest.mark.parametrize("budget", [1.0, 1.5, 2.0, 3.0, 4.0, 8.0])
def test_allocation_matches_brute_force(budget):
    g = torch.Generator().manual_seed(int(budget * 10))
    sizes = {
        f"t{i}": (int(n), int(n) // 256 + 1, 32) for i, n in enumerate(torch.randint(500, 60000, (5,), generator=g))
    }
    variance = {
        k: plain_table(float(c))
        for k, c in zip(sizes, torch.rand(5, generator=g) * 10 ** torch.randint(-2, 3, (5,), generator=g))
    }
    chosen = allocate_bits(variance, sizes, budget, CANDIDATES)
    allowed = sum(n * budget + gr * 32 for n, gr, _ in sizes.values())
    assert sum(storage_bits(b, *sizes[k]) for k, b in chosen.items()) <= allowed
    got = sum(0.0 if b is None else variance[k][b] for k, b in chosen.items())
    optimum, _ = brute_force(variance, sizes, budget)
    assert got <= optimum * 1.02 + 1e-12


def test_identical_tensors_get_the_uniform_answer():
    sizes = {k: (65536, 256, 32) for k in "abc"}
    variance = {k: plain_table(1.0) for k in sizes}
    assert allocate_bits(variance, sizes, 2.0, CANDIDATES) == {k: 2 for k in sizes}


def test_sensitive_small_tensor_is_kept_precise():
    sizes = {"small": (2048, 8, 32), "big1": (65536, 256, 32), "big2": (65536, 256, 32)}
    variance = {"small": {1: 370.0, 2: 1.0, 4: 0.025, 8: 1e-4}, "big1": plain_table(9.0), "big2": plain_table(9.0)}
    chosen = allocate_bits(variance, sizes, 3.0, CANDIDATES)
    assert chosen["small"] is None and chosen["big1"] == chosen["big2"] == 2


def test_rules_pin_bits_and_codecs_by_module_and_op_first_match_wins():
    rules = SaveRules({"conv1": 8, "layer*.fc": "exact", "op:layer_norm": "division:4", "layer4.*": "pool", "*": 4})
    assert rules.lookup("conv1") == Rule(bits=8)
    assert rules.lookup("layer3.fc").bits is None
    assert rules.lookup("layer4.0", "conv2d") == Rule(codec="pool")
    assert not rules.lookup("layer4.0", "conv2d").pins_bits
    assert rules.lookup("blocks.0.norm", "layer_norm") == Rule(codec="division", bits=4)
    assert rules.lookup("anything", None) == Rule(bits=4)
    assert SaveRules({"op:relu": 8}).lookup("relu", None) is None  # unknown op: op rules never match
    assert SaveRules({"x": "8"}).lookup("x") == Rule(bits=8)  # YAML may hand numbers over as strings
    with pytest.raises(ValueError, match=r"rules\['x'\]=3 is not supported; allowed: 1, 2, 4, 8 or 'exact'"):
        SaveRules({"x": 3})
    with pytest.raises(ValueError, match=r"rules\['x'\]='zip' is not supported; allowed: 1, 2, 4, 8, 'exact', a codec"):
        SaveRules({"x": "zip"})
    with pytest.raises(ValueError, match=r"rules\['x'\]='quant:3' is not supported"):
        SaveRules({"x": "quant:3"})


def test_fixed_policy_with_rules_and_floors():
    policy = FixedBits(1, rules={"head": "exact", "stem": 8, "op:conv2d": "division"})
    assert policy.bits_for("head#0", SlotInfo("head", (8,), 8, 1, 32)) is None
    assert policy.bits_for("stem#1", SlotInfo("stem", (8,), 8, 1, 32)) == 8
    assert policy.bits_for("body#0", SlotInfo("body", (8,), 8, 1, 32, op="conv2d")) == 1
    # A ReLU output keeps its zeros exact only at 2 bits or more.
    assert policy.bits_for("body#1", SlotInfo("body", (8,), 8, 1, 32, op="relu", min_bits=2)) == 2


def test_adaptive_policy_validation_and_state_round_trip():
    with pytest.raises(ValueError, match="budget=0.5 must be a number of bits in"):
        AdaptiveBits(0.5)
    with pytest.raises(ValueError, match="need a bit width <= budget"):
        AdaptiveBits(2.0, candidates=(4, 8))
    policy = AdaptiveBits(2.5)
    assert policy.default_bits == 2
    slots = {f"m#{i}": SlotInfo("m", (4096,), 4096, 16, 32) for i in range(3)}
    policy.update({"m#0": plain_table(100.0), "m#1": plain_table(1.0), "m#2": plain_table(0.01)}, slots)
    state = policy.state_dict()
    assert all(isinstance(v, str) for v in state["bits"])
    restored = AdaptiveBits(2.5)
    restored.load_state_dict(state)
    assert restored.assignment == policy.assignment
    assert restored.choose("unseen#0") == 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 8)

    def forward(self, x):
        return self.c(F.gelu(self.b(torch.relu(self.a(x)))))


def test_estimators_give_decreasing_variance_tables():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(64, 64)
    config = CompressionConfig(bits=2, min_numel=256)

    def loss_fn(rows=64):
        return model(x[:rows]).square().mean()

    capture = ActivationCapture(config, model)
    probe = probe_sensitivities(capture, loss_fn, list(model.parameters()), inputs=x)
    assert set(probe) == set(capture.slots)
    for table in probe.values():
        assert table[1] > table[2] > table[4] > table[8] > 0
    estimate = GradientSensitivity()
    capture.estimator = estimate
    with capture.capturing(inputs=x):
        loss = loss_fn()
    loss.backward()
    gradient = estimate.sensitivities()
    # the loss's input is saved outside every module: no output gradient, no estimate
    assert set(gradient) == {s for s, info in capture.slots.items() if info.module != OUTSIDE_MODULES}
    for table in gradient.values():
        assert table[1] > table[2] > table[4] > table[8] > 0


def test_probes_scale_their_one_width_by_the_noise_each_width_puts_into_the_tensor():
    """A tensor with four evenly spaced levels per group is exact at 2 bits: the probe sees
    that from the rounding noise itself, which a model of uniform noise would not."""
    torch.manual_seed(0)

    class Levels(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 8)

        def forward(self, x):
            levels = torch.round(torch.sigmoid(self.a(x)) * 3)  # 0, 1, 2, 3 in every group
            return self.b(levels)

    model = Levels()
    x = torch.randn(64, 64) * 4
    capture = ActivationCapture(CompressionConfig(min_numel=256), model)
    tables = probe_sensitivities(capture, lambda: model(x).square().mean(), list(model.parameters()), inputs=x)
    levels = tables["b#0"]  # b's input
    # 2 bits hit the levels exactly; 4 and 8 bits nearly (their steps, 3/15 and 3/255, are
    # not exact in floating point); 1 bit does not.
    assert levels[2] == 0.0 and levels[1] > 100 * max(levels[4], levels[8])
    plain = tables["<outside modules>#0"]  # the loss's input: no structure
    assert plain[1] > plain[2] > plain[4] > plain[8] > 0.0


def test_probes_leave_grads_untouched():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(32, 64)
    model(x).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    probe_sensitivities(
        ActivationCapture(CompressionConfig(min_numel=256), model),
        lambda: model(x).sum(),
        list(model.parameters()),
        inputs=x,
    )
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


def test_adaptive_allocation_beats_uniform_on_measured_variance():
    """The point of the policy: less gradient variance than uniform 2 bits, same bytes."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.b.weight.mul_(0.05)  # makes gelu's input small and b's neighbours matter little
    x = torch.randn(128, 64)
    config = CompressionConfig(bits=2, min_numel=256)
    params = list(model.parameters())
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(model(x).square().mean(), params)])

    def variance(policy):
        capture = ActivationCapture(config, model, policy)
        total = 0.0
        for seed in range(16):
            with capture.capturing(inputs=x, seed=seed):
                loss = model(x).square().mean()
            g = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
            total += (g - exact).square().sum().item()
        return total / 16, capture.report.stored_bytes

    probe_capture = ActivationCapture(config, model)
    tables = probe_sensitivities(probe_capture, lambda: model(x).square().mean(), params, inputs=x)
    adaptive = AdaptiveBits(2.0)
    adaptive.update(tables, probe_capture.slots)
    uniform_variance, uniform_bytes = variance(FixedBits(2))
    adaptive_variance, adaptive_bytes = variance(adaptive)
    assert adaptive_bytes <= uniform_bytes
    assert adaptive_variance < 0.8 * uniform_variance


def test_calibrate_leaves_no_trace_and_sets_the_allocation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Dropout(0.2), nn.Linear(256, 8))
    x = torch.randn(64, 64)
    model(x).sum().backward()  # gradients, BatchNorm statistics and a train() state to keep
    model.eval()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    capture = ActivationCapture(CompressionConfig(min_numel=256), model, AdaptiveBits(2.0))

    def probe_loss():
        model.train()  # as a training_step would; calibrate puts eval() back
        return model(x[:8]).square().mean()

    assignment = capture.calibrate(probe_loss, inputs=x[:8])
    assert assignment and set(assignment) <= set(capture.slots)
    assert capture.policy.assignment == assignment
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    assert not model.training
    with pytest.raises(TypeError, match="calibrate needs an adaptive policy"):
        ActivationCapture(model=model).calibrate(probe_loss)
    with pytest.raises(ValueError, match="needs the model"):
        ActivationCapture(policy=AdaptiveBits(2.0)).calibrate(probe_loss)


def test_update_weights_follow_each_optimizer_step():
    torch.manual_seed(0)
    a, b, c, unused = (nn.Parameter(torch.randn(32, 16)) for _ in range(4))
    adam = torch.optim.AdamW([a], lr=3e-3, betas=(0.9, 0.95), eps=1e-6)
    sgd = torch.optim.SGD([{"params": [b], "lr": 0.1}, {"params": [c], "lr": 0.01}])
    for _ in range(3):
        for opt in (adam, sgd):
            opt.zero_grad()
        ((a * 2).sin().sum() + (b * c).sum()).backward()
        adam.step()
        sgd.step()
    weights = update_weights([adam, sgd], [a, b, c, unused])
    v_hat = adam.state[a]["exp_avg_sq"] / (1 - 0.95**3)
    torch.testing.assert_close(weights[0], (3e-3 / (v_hat.sqrt() + 1e-6)) ** 2)
    assert weights[1:] == [pytest.approx(0.1**2), pytest.approx(0.01**2), None]

    # The probe's variance is the update's: an Adam weight of w on every element multiplies it by w.
    model = Net()
    x = torch.randn(32, 64)
    params = list(model.parameters())
    plain = probe_sensitivities(
        ActivationCapture(CompressionConfig(min_numel=256), model), lambda: model(x).square().mean(), params, inputs=x
    )
    scaled = probe_sensitivities(
        ActivationCapture(CompressionConfig(min_numel=256), model),
        lambda: model(x).square().mean(),
        params,
        inputs=x,
        weights=[4.0] * len(params),
        update_share=1.0,
    )
    for slot, table in plain.items():
        assert scaled[slot][2] == pytest.approx(4 * table[2], rel=1e-5)


def net_probe(method: str, **options):
    """The probes of a seeded :class:`Net` on one batch, by ``method``, and its parameters."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(32, 64)
    params = list(model.parameters())

    def probe(**kwargs):
        capture = ActivationCapture(CompressionConfig(min_numel=256), model)
        return probe_sensitivities(
            capture, lambda: model(x).square().mean(), params, inputs=x, method=method, **options, **kwargs
        )

    return probe, params


@pytest.mark.parametrize("method", ["per_tensor", "linearized"])
def test_a_learning_rate_of_zero_ranks_the_tensors_by_the_gradient(method):
    # Update weights of 0 (a schedule at lr 0): no update to disturb, so the raw gradient's
    # norm alone ranks the tensors, not a table of zeros that would send each to its floor.
    probe, params = net_probe(method)
    gradient, frozen = probe(), probe(weights=[0.0] * len(params))
    assert sum(table[2] for table in frozen.values()) > 0.0
    for slot in gradient:
        assert frozen[slot][2] == pytest.approx(gradient[slot][2], rel=1e-5)


@pytest.mark.parametrize("method", ["per_tensor", pytest.param("linearized", marks=pytest.mark.slow)])  # 4 s
def test_probe_blends_the_gradient_and_update_norms_at_equal_footing(method):
    # Weights that favour the first layer's parameters 1000-fold: the update norm then ranks
    # the slots differently from the gradient norm, and the blend is their mix, the
    # gradient's term rescaled so that uniform 2 bits scores the same in both. A backward
    # per tensor measures each norm exactly; the linearized probes estimate the blend
    # (its scale from one backward of sign-mixed errors, one set of directions for both
    # norms), so they match within their directional spread.
    probe, params = net_probe(method, directions=512)
    weights = [1000.0 if i < 2 else 1.0 for i in range(len(params))]

    gradient, update = probe(), probe(weights=weights, update_share=1.0)
    blend = probe(weights=weights, update_share=0.25)
    assert len(gradient) >= 2
    scale = sum(t[2] for t in update.values()) / sum(t[2] for t in gradient.values())
    assert scale > 1.0
    tolerance = 1e-5 if method == "per_tensor" else 0.25
    for slot in gradient:
        for bits in (1, 2, 4, 8):
            expected = 0.75 * scale * gradient[slot][bits] + 0.25 * update[slot][bits]
            assert blend[slot][bits] == pytest.approx(expected, rel=tolerance)
    with pytest.raises(ValueError, match="update_share=1.5"):
        probe(weights=weights, update_share=1.5)
