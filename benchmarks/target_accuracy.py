"""Validation loss at equal peak: a memory target that aims at fixed 2 bits' measured peak,
against fixed 2 bits itself.

The character transformer of ``transformer_accuracy.py``, trained with the same seeds (model,
data order, rounding noise). For each seed fixed 2 bits trains first; its largest step peak
(live tensors: parameters, gradients, optimizer state, batch, saved tensors) is where the
second run's plan aims (its ``memory_target`` is that peak over ``AIM``, the share of the
target a plan aims at), starting at every tensor's lowest bits and spending the room up to
that peak where the measured sensitivity says, recalibrated every ``--recalibrate`` steps. Both runs' validation loss,
largest peak, stored bytes and time are printed and written side by side, with the time the
plan's moves took (the knapsack solves, timed around ``TargetBits.update``).

    python benchmarks/target_accuracy.py --data ../shared/data --steps 800 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from lightning_act.policy.memory_target import AIM, TargetBits

from transformer_accuracy import train

MIB = 2**20


class _PlanTimer:
    """Total seconds spent in ``TargetBits.update`` (each move of the plan) while installed."""

    def __init__(self):
        self.seconds, self.moves = 0.0, 0
        self._update = TargetBits.update

    def __enter__(self):
        timer, update = self, self._update

        def timed(policy, *args, **kwargs):
            started = time.perf_counter()
            try:
                return update(policy, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - started
                timer.moves += 1

        TargetBits.update = timed
        return self

    def __exit__(self, *exc):
        TargetBits.update = self._update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--recalibrate", type=int, default=100, help="steps between recalibrations")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    print(
        f"{'seed':>4} {'fixed 2 bits: loss':>19} {'peak MiB':>9} {'s':>5} | {'target: loss':>13} {'peak MiB':>9}"
        f" {'s':>5} {'moves':>5} {'plan s':>7}",
        flush=True,
    )
    for seed in range(args.seeds):
        fixed = train(args.data, args.steps, {"bits": 2}, args.recalibrate, seed)
        target_bytes = int(fixed["max_peak_mib"] * MIB / AIM)
        with _PlanTimer() as timer:
            target = train(args.data, args.steps, {"memory_target": target_bytes}, args.recalibrate, seed)
        target.update(plan_seconds=timer.seconds, plan_moves=timer.moves, target_mib=target_bytes / MIB)
        runs.append({"seed": seed, "fixed_2_bits": fixed, "memory_target": target})
        print(
            f"{seed:>4} {fixed['val_loss']:>19.4f} {fixed['max_peak_mib']:>9.2f} {fixed['seconds']:>5.0f} |"
            f" {target['val_loss']:>13.4f} {target['max_peak_mib']:>9.2f} {target['seconds']:>5.0f}"
            f" {timer.moves:>5} {timer.seconds:>7.3f}",
            flush=True,
        )
    summary = {name: statistics.fmean(r[name]["val_loss"] for r in runs) for name in ("fixed_2_bits", "memory_target")}
    print(
        f"mean validation loss: fixed 2 bits {summary['fixed_2_bits']:.4f}, "
        f"a target aiming at its peak {summary['memory_target']:.4f}"
    )
    results = {
        "steps": args.steps,
        "seeds": args.seeds,
        "threads": args.threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu",
        "mean_val_loss": summary,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "target_accuracy_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
