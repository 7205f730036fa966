"""Validation loss of an HF ``transformers`` Llama trained with each compression setting.

A ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary positions, grouped-query ``sdpa``
attention, 4 heads, 2 key/value heads, random weights from its config) learns next-byte
prediction on Tiny Shakespeare from scratch for a fixed number of steps (AdamW with warmup
and cosine decay) in a plain Lightning Trainer, in one of two configurations:

* ``small``: d=128, 2 layers, T=64, batch 32, lr 3e-3, a recalibration every 100 steps;
* ``heldout``: d=256, 4 layers, T=128, batch 8, lr 1e-3, the callback's default
  recalibration interval (one recalibration in 300 steps). A smaller batch averages less
  rounding noise away: the harder case.

Every setting runs the same seeds (weights, data order and rounding noise); the mean
validation loss over the first 40 validation batches is compared with no compression's,
whose spread over the seeds is the yardstick: compression should stay within it.

    python benchmarks/llama_accuracy.py --data ../shared/data --steps 300 --seeds 3
    python benchmarks/llama_accuracy.py --config heldout --data ../shared/data --steps 300 --seeds 3

``--bound`` instead trains the configuration uncompressed for 50 steps and reports, from the
probes' sensitivities there (both norms, as the callback measures them), the least gradient
variance any allocation of real-valued bits per tensor could reach at budgets of 2 and 3
(``adaptive_allocation.allocation_bound``), next to uniform 4 bits', all relative to
uniform 2 bits': whether a budget could reach the noise of a width that keeps the loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
from lightning_act import ActCompression, ActivationCapture, CompressionConfig
from lightning_act.examples._schedule import warmup_cosine
from lightning_act.examples.language import CharTextDataModule

from _seed_grid import run_settings

SETTINGS = {
    "none": None,
    "fixed 2 bits": {"bits": 2},
    "adaptive 2 bits": {"budget": 2.0},
    "adaptive 3 bits": {"budget": 3.0},
    "fixed 4 bits": {"bits": 4},
    # Rounding noise about 7,000 times below 2 bits': what is left is not variance.
    "fixed 8 bits": {"bits": 8},
    # Quantization groups in memory order only (along the features), for comparison.
    "fixed 2 bits, memory order": {"bits": 2, "group_order": "memory"},
    "adaptive 2 bits, memory order": {"budget": 2.0, "group_order": "memory"},
}
BLOCK_SIZE = 64


class Config(NamedTuple):
    d_model: int
    n_layers: int
    block_size: int
    batch_size: int
    lr: float
    recalibrate: int  # steps between recalibrations


CONFIGS = {
    "small": Config(d_model=128, n_layers=2, block_size=BLOCK_SIZE, batch_size=32, lr=3e-3, recalibrate=100),
    "heldout": Config(d_model=256, n_layers=4, block_size=128, batch_size=8, lr=1e-3, recalibrate=1000),
}


class LlamaBytes(L.LightningModule):
    """``LlamaForCausalLM`` over bytes (vocabulary 256), built from its config."""

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        lr: float = 3e-3,
        warmup_steps: int = 20,
        block_size: int = BLOCK_SIZE,
    ):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=d_model,
            intermediate_size=int(8 * d_model / 3),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            max_position_embeddings=block_size,
            attn_implementation="sdpa",
        )
        self.llama = LlamaForCausalLM(config)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self.llama(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": warmup_cosine(optimizer, self.trainer, self.hparams.warmup_steps),
        }


def train(data: Path, steps: int, settings: dict | None, recalibrate: int, seed: int, config: Config) -> dict:
    L.seed_everything(seed, workers=True)
    model = LlamaBytes(d_model=config.d_model, n_layers=config.n_layers, lr=config.lr, block_size=config.block_size)
    datamodule = CharTextDataModule(
        str(data / "tinyshakespeare" / "input.txt"), block_size=config.block_size, batch_size=config.batch_size
    )
    callbacks = []
    if settings is not None:
        callbacks.append(ActCompression(recalibrate_every_n_steps=recalibrate, seed=seed, **settings))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=40,
        val_check_interval=steps,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    result = {"val_loss": float(trainer.callback_metrics["val/loss"]), "seconds": time.perf_counter() - started}
    if callbacks:
        report = callbacks[0].last_report
        result.update(ratio=report.ratio, saved_mib=report.saved_bytes / 2**20, stored_mib=report.stored_bytes / 2**20)
    return result


def variance_bound(data: Path, config: Config, steps: int = 50) -> dict:
    """See ``--bound`` in the module's docstring."""
    from adaptive_allocation import allocation_bound

    L.seed_everything(0)
    model = LlamaBytes(d_model=config.d_model, n_layers=config.n_layers, lr=config.lr, block_size=config.block_size)
    datamodule = CharTextDataModule(
        str(data / "tinyshakespeare" / "input.txt"), block_size=config.block_size, batch_size=config.batch_size
    )

    class StopAt(L.Callback):  # the schedule of a 300-step run, stopped where its learning rate is high
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step >= steps

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=300,
        limit_val_batches=0,
        logger=False,
        callbacks=[StopAt()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule)
    batch = next(iter(datamodule.train_dataloader()))
    capture = ActivationCapture(CompressionConfig(bits=2), model)
    sensitivity = capture.measure_sensitivity(lambda: model._loss(batch), inputs=batch, optimizers=trainer.optimizers)
    # (numel, sensitivity, floor) per tensor; the bound's model of the noise is S(b) = 4**-b.
    units = [(info.numel, sensitivity.get(slot, {}).get(2, 0.0), info.min_bits) for slot, info in capture.slots.items()]

    def uniform(bits: float) -> float:
        return sum(c * 4.0 ** -max(bits, floor) for _, c, floor in units)

    return {
        "after_steps": steps,
        "tensors": len(units),
        "budget_2_bound": allocation_bound(units, 2.0),
        "budget_3_bound": allocation_bound(units, 3.0) * uniform(3.0) / uniform(2.0),
        "uniform_3_bits": uniform(3.0) / uniform(2.0),
        "uniform_4_bits": uniform(4.0) / uniform(2.0),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--recalibrate", type=int, help="steps between recalibrations (default: the config's)")
    parser.add_argument("--only", nargs="*", choices=sorted(SETTINGS), help="settings to run (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (weights, data order, rounding) per setting")
    parser.add_argument(
        "--bound",
        action="store_true",
        help="the least variance a budget could reach, against uniform 4 bits (see above)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op CPU threads (one: a shared machine's busy cores slow OpenMP barriers)",
    )
    args = parser.parse_args()
    config = CONFIGS[args.config]
    if args.recalibrate is None:
        args.recalibrate = config.recalibrate
    if args.bound:
        torch.set_num_threads(args.threads)
        bound = variance_bound(args.data, config)
        print(
            "gradient variance relative to uniform 2 bits: "
            + ", ".join(f"{key} {value:.3f}" for key, value in bound.items() if isinstance(value, float)),
            flush=True,
        )
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"llama_variance_bound_{args.config}_cpu.json"
        path.write_text(json.dumps({**bound, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}, indent=1))
        return
    name = "llama_accuracy_cpu.json" if args.config == "small" else f"llama_accuracy_{args.config}_cpu.json"
    run_settings(args, SETTINGS, functools.partial(train, config=config), name)


if __name__ == "__main__":
    main()
