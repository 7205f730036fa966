"""Validation loss of a character transformer trained with each compression setting.

A 2-layer pre-norm GPT (d=128, T=64, batch 32, AdamW lr 3e-3) trains from scratch on Tiny
Shakespeare for a fixed number of steps, with the same seed and data order for every
setting; the validation loss (first 40 validation batches) is compared with no compression.

    python benchmarks/transformer_accuracy.py --data ../shared/data --steps 400
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import lightning as L
import torch

from lightning_act import ActCompression
from lightning_act.examples.language import CharTextDataModule, CharTransformer

DEFAULT_INTERVAL = inspect.signature(ActCompression).parameters["recalibrate_every_n_steps"].default

SETTINGS = {
    "none": None,
    "fixed 8 bits": {"bits": 8},
    "fixed 4 bits": {"bits": 4},
    "fixed 2 bits": {"bits": 2},
    "fixed 4 bits, attention 8": {"bits": 4, "rules": {"op:scaled_dot_product_attention": 8}},
    "adaptive 4 bits": {"budget": 4.0},
    "adaptive 3 bits": {"budget": 3.0},
    "adaptive 2 bits": {"budget": 2.0},
}


def train(data: Path, steps: int, settings: dict | None, recalibrate: int) -> dict:
    L.seed_everything(0, workers=True)
    model = CharTransformer(d_model=128, n_layers=2, n_heads=4, block_size=64, dropout=0.0, lr=3e-3,
                            warmup_steps=20)
    datamodule = CharTextDataModule(str(data / "tinyshakespeare" / "input.txt"), block_size=64, batch_size=32)
    callbacks = []
    if settings is not None:
        callbacks.append(ActCompression(recalibrate_every_n_steps=recalibrate, **settings))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=40, val_check_interval=steps,
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    seconds = time.perf_counter() - started
    result = {"val_loss": float(trainer.callback_metrics["val/loss"]), "seconds": seconds}
    if callbacks:
        report = callbacks[0].last_report
        result.update(ratio=report.ratio, saved_mib=report.saved_bytes / 2**20,
                      stored_mib=report.stored_bytes / 2**20)
        if callbacks[0].adaptive and callbacks[0].recalibrations:
            # One recalibration's cost spread over the default interval, against this run's
            # own step time (which includes the one validation pass: a slight underestimate).
            each_ms = callbacks[0].recalibration_ms / callbacks[0].recalibrations
            step_ms = (seconds * 1e3 - callbacks[0].recalibration_ms) / steps
            result.update(
                recalibrations=callbacks[0].recalibrations,
                recalibration_ms_each=each_ms,
                step_ms=step_ms,
                recalibration_pct_at_default_interval=100 * each_ms / (DEFAULT_INTERVAL * step_ms),
            )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--recalibrate", type=int, default=100, help="steps between recalibrations")
    parser.add_argument("--only", nargs="*", help="names of settings to run (default: all)")
    args = parser.parse_args()
    results = {"steps": args.steps, "date": time.strftime("%Y-%m-%d"), "device": "cpu", "torch": torch.__version__}
    for name, settings in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        results[name] = train(args.data, args.steps, settings, args.recalibrate)
        base = results.get("none", {}).get("val_loss")
        change = f" ({100 * (results[name]['val_loss'] / base - 1):+.1f}% vs none)" if base else ""
        print(f"{name:16s} val loss {results[name]['val_loss']:.4f}{change}  "
              f"ratio {results[name].get('ratio', 1.0):.2f}x  {results[name]['seconds']:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transformer_accuracy_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
