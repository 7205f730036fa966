"""What the capture engine costs the host per saved tensor, apart from the codec's kernels.

A GPU runs a training step asynchronously while the host queues its kernels; the host's
own work per saved tensor (choosing the codec and bits, accounting, dedup) stays hidden
only while it is shorter than the kernels it queues. On small batches it is not, so this
measures it where the kernels cost almost nothing: a deep, narrow MLP (``--layers``
Linear+ReLU pairs of width 64, batch 4) on one CPU thread, every activation compressed
(``min_numel=1``), each layer saving three tensors (the Linear's input and weight, the
ReLU's output, which is also the next Linear's input and is stored once). Steps with and
without the capture alternate in rounds, so drifting load hits both alike; the fastest
round of each is compared.

    python benchmarks/capture_overhead.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

from lightning_act import ActivationCapture, CompressionConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(args.layers) for m in (nn.Linear(64, 64), nn.ReLU())))
    x = torch.randn(4, 64)
    capture = ActivationCapture(CompressionConfig(bits=2, min_numel=1), model)

    def step(compressed: bool) -> None:
        if compressed:
            with capture.capturing(inputs=x):
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        loss.backward()

    def round_ms(compressed: bool) -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            step(compressed)
        return (time.perf_counter() - started) / args.steps * 1e3

    for compressed in (False, True):  # warm-up: kernels loaded, allocator primed
        round_ms(compressed)
    rounds = {False: [], True: []}
    for _ in range(args.rounds):
        for compressed in (False, True):
            rounds[compressed].append(round_ms(compressed))
    plain, captured = min(rounds[False]), min(rounds[True])
    step(True)
    counts = dict(sorted(capture.report.counts.items()))
    per_layer_us = (captured - plain) / args.layers * 1e3
    print(f"{args.layers} Linear+ReLU layers, batch 4, width 64: step {plain:.2f} ms plain, {captured:.2f} ms "
          f"with the capture; {per_layer_us:.0f} us more per layer; saved tensors per step: {counts}")
    result = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "layers": args.layers,
        "plain_step_ms": plain,
        "capture_step_ms": captured,
        "extra_us_per_layer": per_layer_us,
        "decisions_per_step": counts,
        "rounds_ms": {"plain": rounds[False], "capture": rounds[True]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "capture_overhead_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
