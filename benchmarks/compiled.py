"""Compression inside ``torch.compile`` graphs, beside eager and beside torch's own fp8 pass.

For each model (the harness's ResNet-18 with the CIFAR stem at batch 32, its ViT and char
transformer, GCN on Cora), the same weights and batch in every row:

* ``kept`` and ``peak`` of one training step (as ``benchmarks/peak_memory.py`` measures them:
  the profiler's allocation events on the CPU, the allocator's counters on a GPU) for eager
  and compiled runs without compression, with this library at 2 bits, and compiled with
  torch's activation-quantization pass (fp8 e5m2 per row, ``use_scaling`` on, every float
  size; it has no per-tensor rules);
* gradient error against the uncompressed run of the same mode, at 8 and at 2 bits, and
  how much closer the mean of 16 steps at 2 bits (the same weights and batch, fresh noise)
  is than one step: 4 for unbiased noise, 1 for a bias;
* graphs compiled after the first compressed step, over 20 steps (Dynamo's counter);
* step time at 2 bits against compiled-none, in alternating rounds of one step each (the
  fastest round of each counts, so drifting load on a shared machine hits both alike).

    python benchmarks/compiled.py                       # every model, inductor
    python benchmarks/compiled.py --models resnet18_cifar --backend aot_eager
    python benchmarks/compiled.py --group-order memory --out benchmarks/results/compiled_memory_order_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Graphs compiled here, not loaded from an earlier run's cache: every row compiles as a new
# user's first run does (set before torch reads it).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="lightning_act_compiled_"))

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CPU_SUITE, GPU_SUITE, Workload, build_workload, environment
from peak_memory import Compression, Method, measure_step, train_step

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
MODELS = {"resnet18_cifar": 32, "vit": 16, "char_transformer": 32, "gcn_cora": 1}
FP8_PASS = {
    "activation_quantization_aten_pass": {
        "allowed_dtypes": "torch.float32;torch.bfloat16;torch.float16",
        "size_in_mb": 0,
        "use_scaling": True,
        "quant_type": "torch.float8_e5m2",
        "exclude_primals": True,
    }
}


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


def compiled(workload: Workload, backend: str) -> Workload:
    return dataclasses.replace(workload, model=torch.compile(workload.model, backend=backend))


def gradients(workload: Workload, method: Method) -> torch.Tensor:
    """One step's parameter gradients. Torch's generator is reseeded first, so that every
    step draws the same dropout masks (the library's rounding noise has its own stream)."""
    torch.manual_seed(0)
    train_step(workload, method)
    return torch.cat([p.grad.flatten() for p in workload.model.parameters() if p.grad is not None])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def memory(workload: Workload, method: Method, device: torch.device) -> dict:
    gradients(workload, method)  # compiled and warm: the measured step allocates as every later one
    step = measure_step(workload, method, device)
    return {"kept_mib": step.kept_bytes / MIB, "peak_mib": step.peak_bytes / MIB}


def step_seconds(workload: Workload, methods: dict[str, Method], rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            start = time.process_time()
            gradients(workload, method)
            best[name] = min(best[name], time.process_time() - start)
    return best


def measure_model(
    name: str, batch: int, backend: str, device: torch.device, data_dir: Path, rounds: int, group_order: str
) -> dict:
    suite = CPU_SUITE if device.type == "cpu" else GPU_SUITE
    sizes = suite.models[name].sizes
    eager = build_workload(name, batch, sizes, device, data_dir)
    none, two, eight = Method(), Compression(2, group_order=group_order), Compression(8, group_order=group_order)
    row: dict = {"batch": batch, "backend": backend, "group_order": group_order}

    torch._dynamo.reset()
    log(f"{name}: eager")
    for method in (two, eight):
        method.prepare(eager)
    row["eager_none"] = memory(eager, none, device)
    row["eager_2bit"] = memory(eager, two, device)
    exact = gradients(eager, none)
    row["eager_2bit"]["grad_err"] = rel_err(gradients(eager, two), exact)
    row["eager_8bit_grad_err"] = rel_err(gradients(eager, eight), exact)

    log(f"{name}: compiled ({backend})")
    graph = compiled(eager, backend)
    for method in (two, eight):
        method.prepare(graph)
    row["compiled_none"] = memory(graph, none, device)
    row["compiled_2bit"] = memory(graph, two, device)
    exact = gradients(graph, none)
    row["compiled_8bit_grad_err"] = rel_err(gradients(graph, eight), exact)
    gradients(graph, two)
    graphs = counters["stats"]["unique_graphs"]
    steps = [gradients(graph, two) for _ in range(20)]
    row["new_graphs_over_20_steps"] = counters["stats"]["unique_graphs"] - graphs
    one = sum(rel_err(g, exact) for g in steps[:16]) / 16
    row["compiled_2bit"]["grad_err"] = one
    row["compiled_2bit"]["mean_of_16_closer"] = one / rel_err(torch.stack(steps[:16]).mean(0), exact)
    report = two.capture.report
    row["compiled_2bit"]["report_ratio"] = report.ratio
    row["compiled_2bit"]["compressed_tensors"] = report.counts.get("compressed", 0)
    log(f"{name}: step time, {rounds} rounds")
    seconds = step_seconds(graph, {"compiled_none": none, "compiled_2bit": two}, rounds)
    row["compiled_none"]["step_s"] = seconds["compiled_none"]
    row["compiled_2bit"]["step_s"] = seconds["compiled_2bit"]

    log(f"{name}: compiled with torch's fp8 pass")
    torch._dynamo.reset()
    fp8 = compiled(eager, backend)
    with torch._inductor.config.patch(post_grad_fusion_options=FP8_PASS):
        row["compiled_fp8"] = memory(fp8, none, device)
        row["compiled_fp8"]["grad_err"] = rel_err(gradients(fp8, none), exact)
    torch._dynamo.reset()

    base = row["compiled_none"]["kept_mib"]
    for key in ("compiled_2bit", "compiled_fp8"):
        row[key]["kept_ratio"] = base / max(row[key]["kept_mib"], 1e-9)
    row["eager_2bit"]["kept_ratio"] = row["eager_none"]["kept_mib"] / max(row["eager_2bit"]["kept_mib"], 1e-9)
    row["compiled_2bit"]["step_vs_none"] = seconds["compiled_2bit"] / seconds["compiled_none"]
    log(
        f"{name}: compiled 2-bit kept {row['compiled_2bit']['kept_ratio']:.2f}x (eager "
        f"{row['eager_2bit']['kept_ratio']:.2f}x, fp8 pass {row['compiled_fp8']['kept_ratio']:.2f}x), 8-bit error "
        f"{row['compiled_8bit_grad_err']:.4f}, 16-step mean {row['compiled_2bit']['mean_of_16_closer']:.2f}x "
        f"closer, {row['new_graphs_over_20_steps']} new graphs, step {row['compiled_2bit']['step_vs_none']:.2f}x"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--group-order",
        default="auto",
        choices=("auto", "memory"),
        help="the library's group_order (memory: every group in memory order)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the harness: one thread measures the methods, not the neighbours
    logging.getLogger("torch._inductor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    results = {"environment": environment(device), "models": {}}
    for name in args.models:
        torch.manual_seed(0)
        results["models"][name] = measure_model(
            name, MODELS[name], args.backend, device, args.data_dir, args.rounds, args.group_order
        )
    out = args.out or REPO / "benchmarks" / "results" / f"compiled_{device.type}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
