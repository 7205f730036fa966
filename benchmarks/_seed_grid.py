"""The seed grid the accuracy benchmarks share: every setting trained with the same seeds,
mean and spread of the validation loss, written after each setting so a long run keeps
what it finished."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch


def run_settings(
    args: argparse.Namespace, settings: Mapping[str, dict], train: Callable[..., dict], result_name: str
) -> None:
    """Trains each setting (all, or ``args.only``) for ``args.seeds`` seeds and records
    ``{setting: {val_loss, val_loss_std, runs}}`` in ``args.out / result_name``.

    ``train(data, steps, settings, recalibrate, seed)`` returns one run's dict with at least
    ``val_loss`` and ``seconds`` (and ``ratio`` where compression is on).
    """
    torch.set_num_threads(args.threads)
    path = Path(args.out) / result_name
    # Settings not run now keep their earlier results, if those came from the same schedule.
    earlier = json.loads(path.read_text()) if path.exists() else {}
    run = {
        "steps": args.steps,
        "recalibrate": args.recalibrate,
        "seeds": args.seeds,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    same_schedule = all(earlier.get(key) == value for key, value in run.items())
    results = {**(earlier if same_schedule else {}), **run, "date": time.strftime("%Y-%m-%d"), "device": "cpu"}
    width = max(len(name) for name in settings) + 2
    for name, setting in settings.items():
        if args.only and name not in args.only:
            continue
        runs = [train(args.data, args.steps, setting, args.recalibrate, seed) for seed in range(args.seeds)]
        losses = [r["val_loss"] for r in runs]
        results[name] = {
            "val_loss": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "runs": runs,
        }
        base = results.get("none", {}).get("val_loss")
        change = f" ({100 * (results[name]['val_loss'] / base - 1):+.1f}% vs none)" if base else ""
        print(
            f"{name:{width}s} val loss {results[name]['val_loss']:.4f} +- {results[name]['val_loss_std']:.4f}"
            f"{change}  per seed {[round(v, 4) for v in losses]}  ratio {runs[0].get('ratio', 1.0):.2f}x  "
            f"{sum(r['seconds'] for r in runs):.0f} s",
            flush=True,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
