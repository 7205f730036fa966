"""What the adaptive policy's recalibration costs, next to the training steps it serves,
and how that grows with depth.

Models trained by a plain Lightning Trainer with ``ActCompression`` at the callback's
defaults (8 probe samples, 20 warm-up steps, a recalibration every 1,000 steps) on Tiny
Shakespeare, each with the linearized probes (``estimator="probe"``, the default) and with
GACT's one backward per saved tensor (``"probe_per_tensor"``):

* the Shakespeare config's character transformer (d256, 4 layers, T128, batch 64, budget 4,
  attention pinned at 8 bits), as ``configs/shakespeare_transformer.yaml`` trains it;
* a small HF ``LlamaForCausalLM`` (``benchmarks/llama_accuracy.py``'s: d128, 2 layers,
  T64, batch 32, budget 2);
* the same Llama at T128, batch 8, budget 2, with 2, 8 and 32 layers: the probes' 8
  samples are the whole batch, so a probe pass costs what a training pass does.

Each runs the warm-up, the first recalibration and a few steps after it; with
``--compiled`` also as ``trainer.fit(torch.compile(model))`` (the probes run the model
eagerly, and the new allocation recompiles its graphs once, on the step after). It reports the
recalibration's wall time (``ActCompression.recalibration_ms``), the median step time
after it (the recalibration's own step excluded), the recalibration in steps' time, and
its share of training time at the defaults: one recalibration per 1,000 steps, the first
one included (``recalibration / (recalibration + 1,000 steps)``). Compiled, the
recalibration includes the recompile (the step after it, less a median step).

    python benchmarks/recalibration_cost.py --data ../shared/data --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning_act import ActCompression
from lightning_act.examples.language import CharTextDataModule, CharTransformer


class StepTimes(L.Callback):
    """Wall time of each training step, from batch start to batch end."""

    def __init__(self):
        self.seconds: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._started)


def shakespeare_case(data: Path):
    model = CharTransformer(d_model=256, n_layers=4, n_heads=4, block_size=128)
    path = data / "tinyshakespeare" / "input.txt"
    datamodule = CharTextDataModule(path, block_size=128, batch_size=64, num_workers=0)
    return model, datamodule, {"budget": 4.0, "rules": {"blocks.*.attn*": 8}}


def llama_case(data: Path, n_layers: int = 2, d_model: int = 128, block_size: int = 64, batch_size: int = 32):
    from llama_accuracy import LlamaBytes

    model = LlamaBytes(d_model=d_model, n_layers=n_layers, block_size=block_size)
    datamodule = CharTextDataModule(
        data / "tinyshakespeare" / "input.txt", block_size=block_size, batch_size=batch_size, num_workers=0
    )
    return model, datamodule, {"budget": 2.0}


def llama_depth_case(n_layers: int):
    """The Llama at hidden 128, T128, batch 8 (the probes' 8 samples are the whole batch)."""
    return lambda data: llama_case(data, n_layers=n_layers, block_size=128, batch_size=8)


CASES = {
    "shakespeare_transformer": shakespeare_case,
    "hf_llama": llama_case,
    **{f"hf_llama_{depth}_layers": llama_depth_case(depth) for depth in (2, 8, 32)},
}


def measure(case, data: Path, steps_after: int, estimator: str, compiled: bool = False) -> dict:
    L.seed_everything(0)
    model, datamodule, settings = case(data)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model)
    callback = ActCompression(**settings, estimator=estimator)
    timer = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=callback.warmup_steps + 1 + steps_after,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, timer],
    )
    trainer.fit(model, datamodule)
    if callback.recalibrations != 1:
        raise RuntimeError(f"expected one recalibration, got {callback.recalibrations}")
    recalibration_s = callback.recalibration_ms / 1e3
    step_s = statistics.median(timer.seconds[callback.warmup_steps + 1 :])
    # Compiled: the step after the recalibration recompiles for the new allocation.
    recompile_s = max(timer.seconds[callback.warmup_steps + 1] - step_s, 0.0) if compiled else 0.0
    interval = callback.recalibrate_every_n_steps
    return {
        "settings": {**settings, "estimator": estimator, "compiled": compiled},
        "tensors_probed": len(callback.sensitivity),
        "probe_samples": callback.probe_samples,
        "recalibration_s": recalibration_s,
        "step_s": step_s,
        "recompile_s": recompile_s,
        "recalibration_in_steps": (recalibration_s + recompile_s) / step_s,
        "share_at_defaults_pct": 100.0
        * (recalibration_s + recompile_s)
        / (recalibration_s + recompile_s + interval * step_s),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps-after", type=int, default=5, help="steps timed after the recalibration")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="models to run (default: all)")
    parser.add_argument(
        "--estimators",
        nargs="*",
        default=["probe", "probe_per_tensor"],
        choices=["probe", "probe_per_tensor"],
        help="probe estimators to time",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also each model under torch.compile (inductor): its probes run eagerly, "
        "the new allocation recompiles once",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "recalibration_cost_cpu.json"
    # Models not run now keep their earlier results.
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(
        {
            "device": "cpu",
            "machine": platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
        }
    )
    for name, case in CASES.items():
        if args.only and name not in args.only:
            continue
        for estimator, compiled in [
            (e, c) for e in args.estimators for c in ((False, True) if args.compiled else (False,))
        ]:
            key = f"{estimator}_compiled" if compiled else estimator
            results.setdefault(name, {})[key] = r = measure(case, args.data, args.steps_after, estimator, compiled)
            print(
                f"{name} ({key}): {r['tensors_probed']} tensors probed, recalibration "
                f"{r['recalibration_s']:.2f} s = {r['recalibration_in_steps']:.1f} steps of {r['step_s']:.3f} s; "
                f"{r['share_at_defaults_pct']:.2f}% of training at the defaults",
                flush=True,
            )
            path.write_text(json.dumps(results, indent=2) + "\n")  # a long run keeps what it finished
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
