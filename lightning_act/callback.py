"""The Lightning callback: compresses the activations of every training forward."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_act.capture import ActivationCapture, CompressionReport, splitmix64
from lightning_act.config import CompressionConfig
from lightning_act.ops import ensure_kernels

LOG_PREFIX = "act"


class ActCompression(Callback):
    """Store the tensors autograd saves for backward at a few bits per value.

    Capture is armed from ``on_train_batch_start`` to ``on_train_batch_end`` and paused
    between ``on_before_backward`` and ``on_after_backward``, so it covers automatic and
    manual optimization, gradient accumulation and optimizer closures; validation and
    test are never touched. Every ``log_every_n_steps`` the memory figures of the last
    training step go to the trainer's loggers under ``act/``.

    Args:
        bits: bits per stored value, one of 1, 2, 4, 8.
        group_size: consecutive values sharing one (low, step) pair, a power of two in
            [8, 65536].
        min_numel: saved tensors with fewer elements are kept as they are.
        seed: seeds the rounding noise, which has its own stream: turning compression on
            never changes the user's random numbers (dropout masks, data order).

    Raises:
        ValueError: a setting is out of range; the message names it and what is allowed.

    Example::

        trainer = Trainer(callbacks=[ActCompression(bits=2)])
    """

    def __init__(self, bits: int = 2, group_size: int = 256, min_numel: int = 2048, seed: int = 0):
        super().__init__()
        self.config = CompressionConfig(bits=bits, group_size=group_size, min_numel=min_numel, seed=seed)
        self.capture: ActivationCapture | None = None
        self.last_report = CompressionReport()
        self._warned_nonfinite = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.capture = ActivationCapture(self.config, pl_module)
        ensure_kernels(trainer.strategy.root_device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self.capture is None:
            return
        # Reproducible per step and distinct per rank and micro-batch: resuming a run
        # replays the same rounding noise, and ranks do not share (correlated) noise.
        stream = splitmix64((trainer.global_step << 24) ^ (batch_idx << 8) ^ trainer.global_rank)
        self.capture.start(inputs=batch, seed=splitmix64(self.config.seed ^ stream))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        if self.capture is not None:
            self.capture.pause()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.capture is not None:
            self.capture.resume()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx):
        if self.capture is None or not self.capture.active:
            return
        report = self.capture.stop()
        self.last_report = report
        pl_module.log_dict(
            {
                f"{LOG_PREFIX}/saved_mib": report.saved_bytes / 2**20,
                f"{LOG_PREFIX}/stored_mib": report.stored_bytes / 2**20,
                f"{LOG_PREFIX}/compression_ratio": report.ratio,
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        if (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0:
            self._report_nonfinite(pl_module)

    def _report_nonfinite(self, pl_module: pl.LightningModule) -> None:
        # Reading the device counter synchronizes, so it happens at logging steps only.
        total = int(self.capture.total_nonfinite_groups)
        pl_module.log(f"{LOG_PREFIX}/nonfinite_groups", float(total), on_step=True, on_epoch=False, batch_size=1)
        if total and not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank_zero_warn(
                f"lightning_act: {total} groups of saved activations held NaN or Inf so far; they are stored "
                "as NaN (never as finite values), so the affected gradients are NaN as they would be without "
                "compression. Check the model for overflow (e.g. fp16 without loss scaling)."
            )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.capture is not None:
            self.capture.stop()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.last_report.saved_bytes:
            rank_zero_info(f"lightning_act: activation memory of the last training step\n{self.last_report.summary()}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.capture is not None:
            self.capture.stop()
