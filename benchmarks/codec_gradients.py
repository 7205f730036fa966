"""Weight-gradient error of each way to store activations, at the bytes each really stores.

ResNet-18 (torchvision, CIFAR stem: 3x3 stride-1 first convolution, no max-pool) on a
batch of real CIFAR-10 images, fp32, training mode. Every saved activation goes through the
capture engine with the codec under test; the weight gradient is compared with the one of
uncompressed training (relative L2 error), for single rounding seeds and for the mean over
seeds, whose error falls as 1/sqrt(seeds) only for an unbiased codec. Stored bytes and the
ratio are the capture engine's report; the bytes the forward really keeps are measured
with the profiler.

ReLU's backward reads only the sign of its saved output, and ResNet's in-place ReLU saves
the tensor the next convolution saves too, so one record serves both. The capture engine
stores that record with the zero-preserving quantizer whatever the codec, so ReLU's
gradient stays exact: DIVISION and pool apply to the other activations (the inputs of
batch norm). Their rows therefore store a mix, and the quantizer at group 128 is the
row with about DIVISION's bytes.

    python benchmarks/codec_gradients.py --data ../shared/data --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from lightning_act import ActivationCapture, CompressionConfig
from torch import nn
from torch.profiler import ProfilerActivity, profile


def resnet18_batch(data: Path, batch: int):
    from lightning_act.examples.vision import CIFAR10DataModule, ImageClassifier

    torch.manual_seed(0)
    model = ImageClassifier(arch="resnet18", cifar_stem=True).net
    cifar = CIFAR10DataModule(data / "cifar10", batch_size=batch, limit=batch)
    cifar.setup("fit")
    x, y = (torch.stack(column) for column in zip(*(cifar.test_set[i] for i in range(batch))))
    return model, x, y


def weight_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def kept_by_forward(forward) -> tuple[int, torch.Tensor]:
    """Bytes the forward allocated and did not free (what it keeps for backward), and the loss."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()
    return sum(e.self_cpu_memory_usage for e in prof.events()), loss


def run_config(name, model, x, y, config, exact, seeds):
    capture = ActivationCapture(config, model)

    def forward(seed):
        with capture.capturing(inputs=x, seed=seed):
            return nn.functional.cross_entropy(model(x), y)

    total = torch.zeros_like(exact)
    single_errors = []
    started = time.perf_counter()
    for seed in range(seeds):
        g = weight_grad(model, forward(1000 + seed))
        single_errors.append(((g - exact).norm() / exact.norm()).item())
        total += g
    seconds = (time.perf_counter() - started) / seeds
    report = capture.report
    kept, loss = kept_by_forward(lambda: forward(0))
    weight_grad(model, loss)
    result = {
        "single_seed_error": sum(single_errors) / seeds,
        "mean_of_seeds_error": ((total / seeds - exact).norm() / exact.norm()).item(),
        "saved_bytes": report.saved_bytes,
        "stored_bytes": report.stored_bytes,
        "ratio": report.ratio,
        "kept_bytes_measured": kept,
        "step_seconds": seconds,
        "slots": list(report.slots.values()),
    }
    print(
        f"{name:<44} {result['single_seed_error']:>8.4f} {result['mean_of_seeds_error']:>9.4f}"
        f" {report.stored_bytes / 2**20:>9.2f} {kept / 2**20:>9.2f} {report.ratio:>7.2f}x {seconds:>6.1f}",
        flush=True,
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()

    model, x, y = resnet18_batch(args.data, args.batch)
    model.train()
    exact = weight_grad(model, nn.functional.cross_entropy(model(x), y))
    baseline, loss = kept_by_forward(lambda: nn.functional.cross_entropy(model(x), y))
    weight_grad(model, loss)
    print(
        f"ResNet-18 (CIFAR stem), CIFAR-10 batch {args.batch}, fp32: the uncompressed forward keeps "
        f"{baseline / 2**20:.1f} MiB; {args.seeds} rounding seeds per row\n"
    )
    print(f"{'codec':<44} {'1 seed':>8} {'mean':>9} {'stored':>9} {'kept':>9} {'ratio':>8} {'s/step':>6}")
    print(f"{'':<44} {'error':>8} {'error':>9} {'MiB':>9} {'MiB':>9}")

    configs = {
        "quant 2-bit, group 256": CompressionConfig(bits=2, group_size=256),
        "quant 2-bit, group 128": CompressionConfig(bits=2, group_size=128),
        "quant 2-bit, group 64": CompressionConfig(bits=2, group_size=64),
        "DIVISION block 8, residual 2-bit": CompressionConfig(bits=2, codec="division", block=8),
        "pool 2x2 (biased)": CompressionConfig(bits=2, codec="pool", block=2),
    }
    results = {}
    for name, config in configs.items():
        results[name] = run_config(name, model, x, y, config, exact, args.seeds)
        results[name]["codecs"] = sorted({slot.codec for slot in results[name].pop("slots")})
        results[name]["kept_bytes_uncompressed"] = baseline
        results[name]["kept_ratio_measured"] = baseline / results[name]["kept_bytes_measured"]

    summary = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "batch": args.batch,
        "seeds": args.seeds,
        "configs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "codec_gradients_cpu.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
