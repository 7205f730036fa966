"""A peak-memory target, measured: every step's peak against the target, from the
uncompressed peak down to the least reachable, and the step's time against activation
checkpointing at the same peak.

For each model this runs short Lightning fits (SGD with momentum, the model's own fixed
batch every step) and measures each step's peak as the callback does (live tensors: CUDA's
allocator, or on the CPU the counter around the CPU allocator), from a fresh model each run:

* ``none``: no callback; ``floor``: ``ActCompression(bits=1)``, every tensor at its lowest
  bits (about the least reachable peak); ``bits2``: ``ActCompression(bits=2)``;
  ``checkpoint``: no compression, every block recomputed (``torch.utils.checkpoint``,
  non-reentrant); ``floor_checkpoint``: both (whether recomputation could take a target
  below the floor's peak);
* compiled only: no compression, with torch's ``activation_memory_budget`` (the partitioner
  recomputes until the saved activations are at most that share of its default's) at each
  of ``BUDGETS``: the step time against the compiled floor's at the same peak;
* ``ActCompression(memory_target=...)`` at targets spread from 2% above the floor's peak to
  above none's, at the checkpointing run's and the 2-bit run's peaks, and below the floor
  (which must fail at the first steps, naming the least reachable peak).

It reports per target: the peak of each step, whether every step stayed at or under the
target, whether the steps from the fourth on reached 0.9 of it, and the median step time
(the first four steps, which plan, left out); across targets, whether a lower target ever
gave a higher final peak.

    python benchmarks/memory_target.py                     # every model, about 30 minutes on 2 cores
    python benchmarks/memory_target.py --models resnet18_cifar --steps 10
    python benchmarks/memory_target.py --compile --models vit  # every run compiled (inductor)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_act import ActCompression, MemoryTargetError
from lightning_act.monitor import StepPeakMemory

from harness import Checkpointing, Workload, _git, build_vit, environment
from peak_memory import MODELS, ModelSpec, build

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def build_llama(batch: int, device: torch.device, data_dir: Path, **sizes) -> Workload:
    """An HF Llama (``transformers``, SDPA attention) on random tokens; its decoder layers
    are the blocks checkpointing recomputes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **sizes)).to(device)
    tokens = torch.randint(
        0,
        sizes["vocab_size"],
        (batch, sizes["max_position_embeddings"] + 1),
        generator=torch.Generator().manual_seed(1),
    ).to(device)
    return Workload(
        model, (tokens,), lambda m, t: m(input_ids=t[:, :-1], labels=t[:, 1:]).loss, list(model.model.layers), batch
    )


# Two more for this benchmark, built by peak_memory's build as its own.
MODELS.update(
    {
        "vit": ModelSpec(
            "ViT 32x32, patch 4, d192 L6",
            build_vit,
            32,
            {
                "image_size": 32,
                "patch_size": 4,
                "num_layers": 6,
                "num_heads": 3,
                "hidden_dim": 192,
                "mlp_dim": 768,
                "num_classes": 10,
            },
        ),
        "llama": ModelSpec(
            "HF Llama d256 L4, 256 tokens",
            build_llama,
            8,
            {
                "vocab_size": 512,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
            },
        ),
    }
)
DEFAULT_MODELS = ("resnet18_cifar", "vit", "llama", "gcn_cora")
#: The lowest target tried, over the floor's peak (a step at the floor varies by about 0.1%).
FLOOR_MARGIN = 1.02
#: Targets as shares of the way from the floor's peak to none's (above 1: over none's).
SHARES = (0.1, 0.35, 0.6, 0.85, 1.2)
#: Steps that plan (two at the floor, then moves) before the steady ones.
PLANNING_STEPS = 4
#: torch's ``activation_memory_budget`` settings tried under compile (1.0, its default, is
#: the compiled run without compression).
BUDGETS = (0.5, 0.2, 0.05, 0.0)


class _Task(L.LightningModule):
    """One workload as a LightningModule: its batch every step, SGD with momentum."""

    def __init__(self, workload: Workload, steps: int):
        super().__init__()
        self.model = workload.model
        self.workload = workload
        self.steps = steps

    def training_step(self, batch, batch_idx):
        return self.workload.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.workload.batch] * self.steps, batch_size=None)


class _Steps(L.Callback):
    """Each step's peak (live tensors, as the callback measures it) and time. Placed last,
    it starts after a recalibration's probes, as the callback's own figure does."""

    def __init__(self, device: torch.device, model: torch.nn.Module):
        self.meter = StepPeakMemory(device, model)
        self.peaks: list[int] = []
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter.start()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self.started)
        self.peaks.append(self.meter.peak_bytes())


def fit(
    name: str,
    steps: int,
    device: torch.device,
    data_dir: Path,
    callback: L.Callback | None = None,
    checkpointed: bool = False,
    compiled: bool = False,
) -> dict:
    gc.collect()  # the last run's cycles would be live tensors in this one's peaks
    workload = build(name, MODELS[name].batch, device, data_dir)
    task = _Task(workload, steps)
    if compiled:  # as a user compiles a submodule: the LightningModule holds the compiled one
        # Each run compiles a fresh model of the same code: past dynamo's recompile limit (8 per
        # code object) it would run the later ones eagerly. Every run starts from empty caches.
        torch._dynamo.reset()
        task.model = workload.model = torch.compile(workload.model)
    measured = _Steps(device, task)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([callback] if callback else []), measured],
    )
    error = None
    with Checkpointing().active(workload) if checkpointed else _nothing():
        try:
            trainer.fit(task)
        except MemoryTargetError as failure:
            error = str(failure)
    peaks = [p / MIB for p in measured.peaks]
    steady = measured.seconds[PLANNING_STEPS:] or measured.seconds
    return {
        "peaks_mib": [round(p, 2) for p in peaks],
        "step_s": statistics.median(steady) if steady else None,
        "error": error,
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_model(name: str, steps: int, device: torch.device, data_dir: Path, compiled: bool) -> dict:
    def run_with(callback: L.Callback | None = None, checkpointed: bool = False) -> dict:
        return fit(name, steps, device, data_dir, callback, checkpointed, compiled)

    none = run_with()
    floor = run_with(ActCompression(bits=1))
    bits2 = run_with(ActCompression(bits=2))
    checkpoint = run_with(checkpointed=True)
    floor_checkpoint = run_with(ActCompression(bits=1), checkpointed=True)
    none_peak, floor_peak = none["peaks_mib"][-1], floor["peaks_mib"][-1]
    lowest = FLOOR_MARGIN * floor_peak
    spread = {round(max(floor_peak + share * (none_peak - floor_peak), lowest), 2) for share in SHARES}
    targets = sorted(spread | {round(max(run["peaks_mib"][-1], lowest), 2) for run in (checkpoint, bits2)})
    row = {
        "title": MODELS[name].title,
        "batch": MODELS[name].batch,
        "none": none,
        "floor": floor,
        "bits2": bits2,
        "checkpoint": checkpoint,
        "floor_checkpoint": floor_checkpoint,
        "targets": {},
    }
    if compiled:
        row["memory_budget"] = {}
        for budget in BUDGETS:
            with torch._functorch.config.patch(activation_memory_budget=budget):
                row["memory_budget"][f"{budget:g}"] = run = run_with()
            logging.info(
                "%s activation_memory_budget %g: %s, %.3f s/step", name, budget, run["peaks_mib"], run["step_s"]
            )
    for target in [round(0.9 * floor_peak, 2), *targets]:
        run = run_with(ActCompression(memory_target=int(target * MIB)))
        peaks = run["peaks_mib"]
        run["every_step_fits"] = run["error"] is None and max(peaks) <= target
        run["steady_reaches_0.9"] = run["error"] is None and min(peaks[PLANNING_STEPS - 1 :]) >= 0.9 * target
        row["targets"][f"{target:.2f}"] = run
        failed = f" ({run['error'][:90]}...)" if run["error"] else ""
        logging.info("%s target %.1f MiB: %s%s", name, target, peaks, failed)
    finals = [run["peaks_mib"][-1] for run in row["targets"].values() if run["error"] is None]
    row["monotone"] = all(a <= b + 0.01 for a, b in zip(finals, finals[1:]))
    return row


def table(results: dict) -> str:
    lines = []
    for row in results["models"].values():
        lines += [
            f"\n### {row['title']}, batch {row['batch']}\n",
            f"none {row['none']['peaks_mib'][-1]:.1f} MiB ({row['none']['step_s']:.3f} s/step), every tensor at its "
            f"floor {row['floor']['peaks_mib'][-1]:.1f} MiB, 2 bits {row['bits2']['peaks_mib'][-1]:.1f} MiB "
            f"({row['bits2']['step_s']:.3f} s/step), checkpointing {row['checkpoint']['peaks_mib'][-1]:.1f} MiB "
            f"({row['checkpoint']['step_s']:.3f} s/step), every tensor at its floor with checkpointing "
            f"{row['floor_checkpoint']['peaks_mib'][-1]:.1f} MiB; a lower target never a higher final peak: "
            f"{'yes' if row['monotone'] else 'no'}\n",
        ]
        if "memory_budget" in row:
            lines.append(_against_budget(row))
        lines += [
            "| target MiB | peak of each step, MiB | every step <= target | steps 4+ >= 0.9 target | s/step |",
            "|---:|---|---|---|---:|",
        ]
        for target, run in row["targets"].items():
            if run["error"]:
                lines.append(
                    f"| {target} | {', '.join(map(str, run['peaks_mib'])) or 'none finished'} | error: "
                    f"{run['error'].split(': ', 1)[1].split('. It holds')[0]} | | |"
                )
                continue
            lines.append(
                f"| {target} | {', '.join(f'{p:.1f}' for p in run['peaks_mib'])} | "
                f"{'yes' if run['every_step_fits'] else 'no'} | {'yes' if run['steady_reaches_0.9'] else 'no'} "
                f"| {run['step_s']:.3f} |"
            )
    return "\n".join(lines)


def _against_budget(row: dict) -> str:
    """torch's ``activation_memory_budget`` runs beside the memory target's lowest reachable
    run (a compiled plan stays at every tensor's floor): the fastest budget whose peak is no
    higher, if any."""
    reached = [
        (run["peaks_mib"][-1], float(target), run["step_s"])
        for target, run in row["targets"].items()
        if run["error"] is None
    ]
    peak, target, seconds = min(reached)
    runs = ", ".join(
        f"{budget}: {run['peaks_mib'][-1]:.1f} MiB, {run['step_s']:.3f} s/step"
        for budget, run in row["memory_budget"].items()
    )
    fitting = [
        (run["step_s"], budget, run["peaks_mib"][-1])
        for budget, run in row["memory_budget"].items()
        if run["peaks_mib"][-1] <= peak
    ]
    if fitting:
        fastest, budget, its_peak = min(fitting)
        verdict = (
            f"at or under that peak, the fastest is budget {budget}: {its_peak:.1f} MiB, {fastest:.3f} s/step, "
            f"{seconds / fastest:.2f}x its time"
        )
    else:
        lowest = min(run["peaks_mib"][-1] for run in row["memory_budget"].values())
        verdict = f"no budget reaches that peak (the lowest: {lowest:.1f} MiB)"
    return (
        f"torch's activation_memory_budget, no compression ({runs}); the target {target:.2f} MiB peaked at "
        f"{peak:.1f} MiB, {seconds:.3f} s/step: {verdict}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="every run under torch.compile (inductor)")
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("lightning", "lightning.pytorch", "lightning_act"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = {
        "command": "python benchmarks/memory_target.py " + " ".join(argv or sys.argv[1:]),
        "environment": environment(device),
        "commit": _git("rev-parse", "HEAD")[:12],
        "started": started,
        "models": {},
    }
    mode = "_compiled" if args.compile else ""
    out = args.out or REPO / "benchmarks" / "results" / f"memory_target{mode}_{device.type}.json"
    for name in args.models:
        results["models"][name] = measure_model(name, args.steps, device, args.data_dir, args.compile)
        out.write_text(json.dumps(results, indent=1) + "\n")
    title = f"# Memory target, {device.type}{', compiled' if args.compile else ''}"
    report = (
        f"{title}\n\n`{results['command']}` on {results['environment']['device']}, {started}; "
        f"commit `{results['commit']}`. Every number below was measured in this run.\n" + table(results) + "\n"
    )
    out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
