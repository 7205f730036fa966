"""How good is each bit allocation? Gradient variance at the same stored bytes.

For ResNet-18 on a CIFAR-10 batch and a character transformer on Tiny Shakespeare, each
first trained for the callback's default warm-up (20 steps, with its example's optimizer:
SGD with momentum, AdamW), it compares uniform 2-bit quantization with the adaptive policy
at the same stored bytes (a budget of 2 stores what uniform 2 bits stores, 8-bit floors
included), its sensitivities estimated from the normal training step
("gradient"), by the probes on the raw gradient ("probe_gradient"), by the probes on the
optimizer's update ("probe_update"), or by the probes on both, each relative to uniform 2
bits ("probe", what ActCompression does), the probes linearized (a cost independent of
depth) or GACT's own, one backward per tensor ("probe_per_tensor"). Variance is measured,
not estimated, over rounding seeds, in two norms: the gradient's, the mean of
``||g_seed - g_exact||**2``, and the update's, the same with every element weighted by
``(lr / d)**2`` as the optimizer scales it (``update_weights``); next to the bytes really
stored, the time each estimator took, and the least variance any allocation of bits per
tensor, or per group, could reach under the estimator's sensitivities, with the tensors'
floors and without (``allocation_bound``).

    python benchmarks/adaptive_allocation.py --data ../shared/data --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.policy import AdaptiveBits, FixedBits
from lightning_act.policy.estimators import GradientSensitivity, probe_sensitivities, update_weights
from torch import nn

WARMUP_STEPS = 20


def resnet18_case(data: Path, batch: int):
    from lightning_act.examples.vision import CIFAR10DataModule, ImageClassifier

    torch.manual_seed(0)
    model = ImageClassifier(arch="resnet18", cifar_stem=True).net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cifar = CIFAR10DataModule(data / "cifar10", batch_size=batch, limit=batch)
    cifar.setup("fit")
    x, y = (torch.stack(column) for column in zip(*(cifar.test_set[i] for i in range(batch))))

    def loss_on(rows: int):
        return lambda: nn.functional.cross_entropy(model(x[:rows]), y[:rows])

    return model, x, loss_on, optimizer


def transformer_case(data: Path, batch: int):
    from lightning_act.examples.language import CharTransformer

    torch.manual_seed(0)
    ids = torch.frombuffer(bytearray((data / "tinyshakespeare" / "input.txt").read_bytes()), dtype=torch.uint8).long()
    model = CharTransformer(d_model=128, n_layers=2, n_heads=4, block_size=64, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    starts = torch.randint(0, len(ids) - 65, (batch,))
    x = torch.stack([ids[s : s + 64] for s in starts])
    y = torch.stack([ids[s + 1 : s + 65] for s in starts])

    def loss_on(rows: int):
        return lambda: nn.functional.cross_entropy(model(x[:rows]).flatten(0, 1), y[:rows].flatten())

    return model, x, loss_on, optimizer


def weight_grad(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def measured_variance(model, x, loss_fn, policy, config, exact, weights, seeds):
    """Mean over rounding seeds of the gradient's and the update's squared error, and bytes."""
    capture = ActivationCapture(config, model, policy)
    gradient, update, stored = 0.0, 0.0, 0
    for seed in range(seeds):
        with capture.capturing(inputs=x, seed=1000 + seed):
            loss = loss_fn()
        error = (weight_grad(model, loss) - exact).square()
        gradient += error.sum().item()
        update += (error * weights).sum().item()
        stored = capture.report.stored_bytes
    return gradient / seeds, update / seeds, stored, capture.report.saved_bytes


def allocation_bound(units: list[tuple[int, float, int]], budget: float, floors: bool = True) -> float:
    """The least variance, relative to uniform ``budget`` bits, of any allocation that gives
    each unit (``(numel, sensitivity, floor)``: a tensor, or a group of one) its own bits,
    chosen freely as real numbers (no fixed widths, statistics ignored), with
    ``S(b) = 4**-b``, at the bytes uniform bits store (a unit below its floor at its floor).
    With ``floors=False`` a unit may also go below its floor (then every unit's variance
    comes out proportional to its size, the ratio the size-weighted geometric mean of the
    sensitivity per element over its arithmetic mean; insensitive units take no bits)."""
    allowed = sum(n * max(budget, f) for n, _, f in units)
    uniform = sum(c * 4.0 ** -max(budget, f) for _, c, f in units)
    lows = [(n, c, f if floors else 0) for n, c, f in units]

    def bits(level: float) -> list[float]:
        # Where the budget binds, d(variance)/d(bits) is the same for every unit above its floor.
        return [max(f, 0.5 * (math.log2(c * math.log(4.0) / n) - level)) if c > 0.0 else f for n, c, f in lows]

    low, high = -4000.0, 4000.0  # bracket for log2 of the budget's price
    for _ in range(200):
        level = (low + high) / 2
        used = sum(n * b for (n, _, _), b in zip(lows, bits(level)))
        low, high = (level, high) if used > allowed else (low, level)
    return sum(c * 4.0**-b for (_, c, _), b in zip(lows, bits(high))) / uniform


class GroupSteps:
    """Collects every slot's per-group quantization steps, fed by ActivationCapture like an
    estimator: how a tensor's rounding noise is spread over its groups."""

    def __init__(self):
        self.steps: dict[str, torch.Tensor] = {}

    def observe_stats(self, slot, module, stats, bits, group_size) -> None:
        self.steps[slot] = stats[:, 1].float().abs()  # (low, step) per group; a sign marks zero-preserving

    def observe_output(self, module, output) -> None:
        pass


def allocation_bounds(sens: dict, slots: dict, steps: dict, group_size: int, budget: float) -> dict:
    """:func:`allocation_bound` with bits per tensor and with bits per group (a tensor's
    sensitivity split over its groups by their squared step, as its variance is), each with
    and without the tensors' floors."""
    per_tensor = [(info.numel, sens.get(k, {}).get(2, 0.0), info.min_bits) for k, info in slots.items()]
    per_group = []
    for k, info in slots.items():
        c, step = sens.get(k, {}).get(2, 0.0), steps.get(k)
        if step is None or float(step.square().sum()) == 0.0:
            per_group.append((info.numel, c, info.min_bits))
            continue
        share = step.square() / step.square().sum()
        per_group += [(group_size, c * w, info.min_bits) for w in share.tolist()]
    return {
        "per_tensor": allocation_bound(per_tensor, budget),
        "per_group": allocation_bound(per_group, budget),
        "per_tensor_no_floors": allocation_bound(per_tensor, budget, floors=False),
        "per_group_no_floors": allocation_bound(per_group, budget, floors=False),
    }


def run_case(name, model, x, loss_on, optimizer, seeds, probe_rows):
    config = CompressionConfig(bits=2)
    full = loss_on(x.shape[0])
    for _ in range(WARMUP_STEPS):
        optimizer.zero_grad()
        full().backward()
        optimizer.step()
    with ActivationCapture(config, model).capturing(inputs=x):  # settles each tensor's group order
        loss = full()
    loss.backward()
    optimizer.zero_grad()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = update_weights([optimizer], params)
    flat_weights = torch.cat(
        [torch.as_tensor(w, dtype=torch.float32).expand_as(p).flatten() for w, p in zip(weights, params)]
    )
    exact = weight_grad(model, full())
    uniform_var, uniform_update, uniform_bytes, saved = measured_variance(
        model, x, full, FixedBits(2), config, exact, flat_weights, seeds
    )
    result = {
        "saved_bytes": saved,
        "warmup_steps": WARMUP_STEPS,
        "optimizer": type(optimizer).__name__,
        "uniform_2bit": {"variance": uniform_var, "update_variance": uniform_update, "stored_bytes": uniform_bytes},
    }

    capture = ActivationCapture(config, model)
    started = time.perf_counter()
    estimate = GradientSensitivity()
    capture.estimator = estimate
    for step in range(4):  # the callback's default calibration_steps
        with capture.capturing(inputs=x, seed=step):
            loss = full()
        weight_grad(model, loss)
    gradient_sens = estimate.sensitivities()
    gradient_s = time.perf_counter() - started
    steps = GroupSteps()
    capture.estimator = steps
    with capture.capturing(inputs=x, seed=0):
        loss = full()
    weight_grad(model, loss)
    slots = dict(capture.slots)
    budget = 2.0  # stores what uniform 2 bits stores, floors included

    probes = {}
    variants = {  # estimator -> probe_sensitivities' arguments
        "probe": {"weights": weights},  # ActCompression's: both norms, linearized probes
        "probe_per_tensor": {"weights": weights, "method": "per_tensor"},  # the same, one backward per tensor
        "probe_gradient": {},  # the raw gradient's norm (GACT's)
        "probe_update": {"weights": weights, "update_share": 1.0},  # the optimizer update's alone
    }
    for estimator, kwargs in variants.items():
        started = time.perf_counter()
        sens = probe_sensitivities(
            ActivationCapture(config, model), loss_on(probe_rows), params, inputs=x[:probe_rows], **kwargs
        )
        probes[estimator] = (sens, time.perf_counter() - started)

    started = time.perf_counter()
    for _ in range(3):
        weight_grad(model, full())
    step_s = (time.perf_counter() - started) / 3
    result["uncompressed_step_s"] = step_s

    estimators = {"gradient": (gradient_sens, gradient_s), **probes}
    for estimator, (sens, seconds) in estimators.items():
        policy = AdaptiveBits(budget)
        policy.update(sens, slots)
        var, update, stored, _ = measured_variance(model, x, full, policy, config, exact, flat_weights, seeds)
        # What the estimator itself expects the allocation to gain, to compare with what it gains.
        predicted = sum(sens[k].get(b, 0.0) if b is not None else 0.0 for k, b in policy.assignment.items())
        predicted_uniform = sum(sens[k][max(2, slots[k].min_bits)] for k in policy.assignment)
        result[f"adaptive_{estimator}"] = {
            "variance": var,
            "update_variance": update,
            "stored_bytes": stored,
            "variance_vs_uniform": var / uniform_var,
            "update_variance_vs_uniform": update / uniform_update,
            "predicted_vs_uniform": predicted / predicted_uniform,
            "bound_vs_uniform": allocation_bounds(sens, slots, steps.steps, config.group_size, budget),
            "estimator_seconds": seconds,
            "estimator_cost_in_steps": seconds / step_s,
            "bits": {k: (b if b is not None else "exact") for k, b in policy.assignment.items()},
        }
    print(
        f"\n{name}: saved {saved / 2**20:.1f} MiB, uniform 2-bit stores {uniform_bytes / 2**20:.2f} MiB, "
        f"gradient variance {uniform_var:.4e}, update variance {uniform_update:.4e}; adaptive budget {budget:.3f} bits"
    )
    for estimator in estimators:
        r = result[f"adaptive_{estimator}"]
        print(
            f"  adaptive ({estimator:14s}): stores {r['stored_bytes'] / 2**20:.2f} MiB, gradient variance "
            f"{r['variance_vs_uniform']:.3f}x uniform, update variance {r['update_variance_vs_uniform']:.3f}x "
            f"(estimator expected {r['predicted_vs_uniform']:.3f}x in its own norm; no allocation below "
            f"{r['bound_vs_uniform']['per_tensor']:.3f}x per tensor, {r['bound_vs_uniform']['per_group']:.3f}x "
            f"per group, {r['bound_vs_uniform']['per_tensor_no_floors']:.3f}x and "
            f"{r['bound_vs_uniform']['per_group_no_floors']:.3f}x without floors); estimate took "
            f"{r['estimator_seconds']:.2f} s ({r['estimator_cost_in_steps']:.1f} uncompressed steps)"
        )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--probe-rows", type=int, default=8)
    args = parser.parse_args()
    results = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "seeds": args.seeds,
        "resnet18_cifar10_batch64": run_case(
            "ResNet-18, CIFAR-10, batch 64", *resnet18_case(args.data, 64), args.seeds, args.probe_rows
        ),
        "char_transformer_shakespeare_batch32": run_case(
            "char transformer d128 L2 T64, batch 32", *transformer_case(args.data, 32), args.seeds, args.probe_rows
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "adaptive_allocation_cpu.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
