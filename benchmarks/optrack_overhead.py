"""What OpTracker costs: a ResNet-18 training step on the CPU with and without it.

ResNet-18 (torchvision, CIFAR stem), batch 64 of 32x32 inputs, fp32, forward and backward.
Runs with and without the tracker alternate, so drifting machine load hits both alike; the
medians are compared. On a loaded machine the step-to-step noise can exceed the tracker's
cost, so the cost is also derived bottom-up: the torch function calls one forward makes,
times the extra time one call takes under the tracker (measured on a one-element tensor,
where the call costs nothing else).

    python benchmarks/optrack_overhead.py --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torchvision
from lightning_act.optrack import OpTracker
from torch import nn


class _CallCounter(OpTracker):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    def step(context) -> float:
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        with context:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return time.perf_counter() - started

    counter = _CallCounter()
    step(counter)
    step(contextlib.nullcontext())  # warm-up of both paths
    plain, tracked = [], []
    for _ in range(args.rounds):
        plain.append(step(contextlib.nullcontext()))
        tracked.append(step(OpTracker()))
    plain_ms, tracked_ms = statistics.median(plain) * 1e3, statistics.median(tracked) * 1e3
    per_call_us = _per_call_overhead_us()
    estimate_ms = counter.calls * per_call_us / 1e3
    print(
        f"ResNet-18 CIFAR stem, batch {args.batch}, CPU ({torch.get_num_threads()} threads), "
        f"median of {args.rounds} forward+backward steps"
    )
    print(f"  without tracker {plain_ms:8.1f} ms   (min {min(plain) * 1e3:.1f})")
    print(f"  with tracker    {tracked_ms:8.1f} ms   (min {min(tracked) * 1e3:.1f})")
    print(
        f"  overhead        {tracked_ms - plain_ms:8.1f} ms = {100 * (tracked_ms / plain_ms - 1):+.2f}% "
        f"(step-to-step noise included)"
    )
    print(
        f"  bottom-up       {counter.calls} torch function calls per forward x {per_call_us:.2f} us per call = "
        f"{estimate_ms:.2f} ms = {100 * estimate_ms / plain_ms:.3f}% of the step"
    )


def _per_call_overhead_us(calls: int = 20000, rounds: int = 7) -> float:
    """Extra microseconds one torch function call takes under the tracker (best of rounds)."""
    tiny = torch.ones(1)

    def loop() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            torch.neg(tiny)
        return time.perf_counter() - started

    plain, tracked = [], []
    for _ in range(rounds):
        plain.append(loop())
        with OpTracker():
            tracked.append(loop())
    return (min(tracked) - min(plain)) / calls * 1e6


if __name__ == "__main__":
    main()
