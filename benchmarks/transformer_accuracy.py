"""Validation loss of a character transformer trained with each compression setting.

A 2-layer pre-norm GPT (d=128, T=64, batch 32, AdamW lr 3e-3) trains from scratch on Tiny
Shakespeare for a fixed number of steps; every setting runs the same seeds (model, data
order and rounding noise), and the mean validation loss (first 40 validation batches) is
compared with no compression's. Several seeds, because a model this small sits on a
plateau (the loss of character frequencies) until attention starts to work, and when that
happens varies from run to run: one seed's loss after a short schedule says more about
that moment than about the compression.

    python benchmarks/transformer_accuracy.py --data ../shared/data --steps 800 --seeds 3
"""

from __future__ import annotations

import argparse
import gc
import inspect
import time
from pathlib import Path

import lightning as L
from lightning_act import ActCompression
from lightning_act.examples.language import CharTextDataModule, CharTransformer

from _seed_grid import run_settings

DEFAULT_INTERVAL = inspect.signature(ActCompression).parameters["recalibrate_every_n_steps"].default

SETTINGS = {
    "none": None,
    "adaptive 4 bits": {"budget": 4.0},
    "adaptive 3 bits": {"budget": 3.0},
    "adaptive 2 bits": {"budget": 2.0},
    "fixed 8 bits": {"bits": 8},
    "fixed 4 bits": {"bits": 4},
    "fixed 2 bits": {"bits": 2},
    "fixed 4 bits, attention 8": {"bits": 4, "rules": {"op:scaled_dot_product_attention": 8}},
}


def train(data: Path, steps: int, settings: dict | None, recalibrate: int, seed: int) -> dict:
    # The earlier runs' trainers, models and optimizer states sit in reference cycles until
    # the collector runs: left, they count in this run's live-tensor peak (5 MiB here).
    gc.collect()
    L.seed_everything(seed, workers=True)
    model = CharTransformer(d_model=128, n_layers=2, n_heads=4, block_size=64, dropout=0.0, lr=3e-3, warmup_steps=20)
    datamodule = CharTextDataModule(str(data / "tinyshakespeare" / "input.txt"), block_size=64, batch_size=32)
    callbacks = []
    if settings is not None:
        callbacks.append(ActCompression(recalibrate_every_n_steps=recalibrate, seed=seed, **settings))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=40,
        val_check_interval=steps,
        check_val_every_n_epoch=None,  # a schedule may be longer than one epoch
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    seconds = time.perf_counter() - started
    result = {"val_loss": float(trainer.callback_metrics["val/loss"]), "seconds": seconds}
    if callbacks:
        report = callbacks[0].last_report
        result.update(ratio=report.ratio, saved_mib=report.saved_bytes / 2**20, stored_mib=report.stored_bytes / 2**20)
        if callbacks[0].max_peak_bytes is not None:
            result.update(max_peak_mib=callbacks[0].max_peak_bytes / 2**20)
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
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--recalibrate", type=int, default=100, help="steps between recalibrations")
    parser.add_argument("--only", nargs="*", help="names of settings to run (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (model, data order, rounding) per setting")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op CPU threads (one: a shared machine's busy cores slow OpenMP barriers)",
    )
    run_settings(parser.parse_args(), SETTINGS, train, "transformer_accuracy_cpu.json")


if __name__ == "__main__":
    main()
