"""Every step's peak, recalibrations included, measured two ways side by side.

A user sizes the batch to the peak a compressed step reaches; that peak has to hold on every
step, the steps whose probes re-measure the tensors' sensitivity (``budget=``) or whose plan
moves (``memory_target=``) as well as the steady ones. For each model this runs short
Lightning fits (Adam, the model's own fixed batch every step), each in a process of its own,
and reads each step's peak:

* ``library``: what :class:`~lightning_act.ActCompression` logs as ``act/peak_mib``;
* ``profiler``: independently of the library, the profiler's allocation events replayed in
  time order from the step's first callback to its last (a callback placed before
  ``ActCompression`` starts the profiler, one placed after it stops it), added to the live
  tensors at that moment. On a GPU, ``torch.cuda.max_memory_allocated`` over the same span.

Runs: ``none`` (no callback), ``bits2``, ``budget2`` (recalibrating every
``--every`` steps from step 0) and ``memory_target`` (halfway between the ``bits2`` and
``none`` steady peaks, and at least 5% over every ``bits2`` step), eager or compiled
(``--compile``). It prints, per run, every step's
two figures and the verdicts of the targets:

* a recalibration step peaks at most 1.05x the steady step at the same plan (the step after
  it), and no step above the uncompressed step;
* every step of a memory target stays at or under it;
* the library's figure is within 2% of the profiler's.

    python benchmarks/recalibration_memory.py                       # every model, eager
    python benchmarks/recalibration_memory.py --compile --models transformer
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import multiprocessing
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_act import ActCompression

from harness import _git, environment
from memory_target import _Task as _SgdTask
from peak_memory import MODELS, build, replay

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
#: A recalibration step may peak this much above the steady step at the same plan.
RECALIBRATION_SLACK = 1.05
#: The library's figure and the profiler's may differ by this share.
AGREEMENT = 0.02


class _Task(_SgdTask):
    """One workload as a LightningModule, with Adam: its two moments are what a step holds
    beyond SGD's momentum."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-4)


class _StepBegins(L.Callback):
    """Placed first: the step's span opens before any other callback's work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.profiler: profile | None = None
        self.live_at_start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.live_at_start = _live_bytes(pl_module)
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()


class _StepEnds(L.Callback):
    """Placed last: closes the span after every other callback's work of the step."""

    def __init__(self, begins: _StepBegins, act: ActCompression | None):
        self.begins = begins
        self.act = act
        self.profiler_mib: list[float] = []
        self.library_mib: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        begins = self.begins
        if begins.device.type == "cuda":
            torch.cuda.synchronize(begins.device)
            peak = torch.cuda.max_memory_allocated(begins.device)
        else:
            begins.profiler.__exit__(None, None, None)
            peak = (
                begins.live_at_start
                + replay(begins.profiler.profiler.kineto_results.experimental_event_tree()).peak_bytes
            )
            begins.profiler = None
        self.profiler_mib.append(round(peak / MIB, 2))
        library = None if self.act is None or self.act.last_peak_bytes is None else self.act.last_peak_bytes / MIB
        self.library_mib.append(None if library is None else round(library, 2))


def _live_bytes(model: torch.nn.Module) -> int:
    """Live tensors now: the CPU allocator counter installed with the library's kernels, plus
    what was allocated before it was installed (the parameters and buffers)."""
    from lightning_act.monitor import StepPeakMemory

    return StepPeakMemory(torch.device("cpu"), model).live_bytes()


def fit(name: str, steps: int, device: torch.device, data_dir: Path, settings: dict | None, compiled: bool) -> dict:
    """One fit, in a process of its own: what an earlier fit leaves behind (compiled code,
    objects in reference cycles, the allocator's state) is not in its peaks."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_fit, name, steps, str(device), data_dir, settings, compiled).result()


def _fit(name: str, steps: int, device: str, data_dir: Path, settings: dict | None, compiled: bool) -> dict:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    device = torch.device(device)
    act = None if settings is None else ActCompression(**settings)
    workload = build(name, MODELS[name].batch, device, data_dir)
    task = _Task(workload, steps)
    if compiled:
        torch._dynamo.reset()
        task.model = workload.model = torch.compile(workload.model)
    if device.type == "cpu":  # the profiler's first session misses some of its allocation events
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            torch.ones(1)
    begins = _StepBegins(device)
    ends = _StepEnds(begins, act)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[begins, *([act] if act else []), ends],
    )
    trainer.fit(task)
    return {
        "profiler_mib": ends.profiler_mib,
        "library_mib": ends.library_mib,
        "recalibrated_at": [] if act is None else act.recalibration_steps,
    }


def measure(name: str, steps: int, every: int, device: torch.device, data_dir: Path, compiled: bool) -> dict:
    none = fit(name, steps, device, data_dir, None, compiled)
    bits2 = fit(name, steps, device, data_dir, {"bits": 2}, compiled)
    budget = fit(
        name, steps, device, data_dir, {"budget": 2, "warmup_steps": 0, "recalibrate_every_n_steps": every}, compiled
    )
    # Halfway between the 2-bit and the uncompressed steady peaks, and 5% over every 2-bit step
    # (where compression barely lowers the peak, as a GCN's peak in its forward).
    target_mib = round(
        max((bits2["profiler_mib"][-1] + none["profiler_mib"][-1]) / 2, 1.05 * max(bits2["profiler_mib"])), 2
    )
    target = fit(name, steps, device, data_dir, {"memory_target": int(target_mib * MIB)}, compiled)
    target["target_mib"] = target_mib
    uncompressed = max(none["profiler_mib"])
    # Each recalibration step against the next, which runs at the plan it chose.
    peaks = budget["profiler_mib"]
    judged = [s for s in budget["recalibrated_at"] if s + 1 < len(peaks)]
    budget["over_steady"] = [round(peaks[s] / peaks[s + 1], 3) for s in judged]
    budget["recalibration_fits"] = (
        all(r <= RECALIBRATION_SLACK for r in budget["over_steady"]) and max(peaks) <= uncompressed
    )
    target["every_step_fits"] = max(target["profiler_mib"]) <= target_mib
    for run in (bits2, budget, target):
        pairs = [(a, b) for a, b in zip(run["library_mib"], run["profiler_mib"]) if a is not None]
        run["library_vs_profiler"] = round(max(abs(a / b - 1) for a, b in pairs), 4) if pairs else None
        run["agrees"] = run["library_vs_profiler"] is not None and run["library_vs_profiler"] <= AGREEMENT
    return {
        "title": MODELS[name].title,
        "batch": MODELS[name].batch,
        "none": none,
        "bits2": bits2,
        "budget2": budget,
        "memory_target": target,
    }


def table(results: dict) -> str:
    lines = []
    for row in results["models"].values():
        lines += [
            f"\n### {row['title']}, batch {row['batch']} ({results['mode']})\n",
            "| run | step peaks, profiler (MiB) | library (MiB) | max library/profiler - 1 | verdict |",
            "|---|---|---|---:|---|",
        ]
        for run_name in ("none", "bits2", "budget2", "memory_target"):
            run = row[run_name]
            verdict = ""
            if run_name == "budget2":
                verdict = (
                    f"recalibrated at steps {run['recalibrated_at']}, each over the next step "
                    f"{run['over_steady']}: {'fits' if run['recalibration_fits'] else 'OVER'}"
                )
            elif run_name == "memory_target":
                verdict = f"target {run['target_mib']}: {'every step fits' if run['every_step_fits'] else 'OVER'}"
            agreement = run.get("library_vs_profiler")
            lines.append(
                f"| {run_name} | {', '.join(map(str, run['profiler_mib']))} | "
                f"{', '.join(str(x) for x in run['library_mib'] if x is not None) or '-'} | "
                f"{'-' if agreement is None else f'{100 * agreement:.2f}%'} | {verdict} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["resnet18_cifar", "transformer", "gcn_cora"]
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="recalibrate_every_n_steps of the budget run")
    parser.add_argument("--compile", action="store_true", help="every run's model compiled (inductor)")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    mode = "compiled" if args.compile else "eager"
    results = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "environment": environment(device),
        "mode": mode,
        "models": {},
    }
    for name in args.models:
        results["models"][name] = row = measure(name, args.steps, args.every, device, args.data, args.compile)
        print(table({"mode": mode, "models": {name: row}}), flush=True)
    output = args.output or REPO / "benchmarks" / "results" / f"recalibration_memory_{mode}_{device.type}.json"
    output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwritten: {output}")


if __name__ == "__main__":
    main()
