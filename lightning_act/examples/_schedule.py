"""The learning-rate schedule the examples share: linear warmup, then cosine decay to zero."""

from __future__ import annotations

import math

import lightning.pytorch as pl
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: Optimizer, trainer: pl.Trainer, warmup_steps: int = 0) -> dict:
    """A per-step schedule spanning the whole run, in Lightning's ``lr_scheduler`` form.

    Args:
        optimizer: the optimizer whose learning rates are scaled.
        trainer: gives the run length (``estimated_stepping_batches``): the decay ends at the
            last optimizer step.
        warmup_steps: steps of linear warmup from 0 before the cosine decay starts.

    Raises:
        ValueError: the run has no end (``max_epochs=-1`` and no ``max_steps``).
    """
    total = trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ValueError("the cosine schedule needs a finite run: set trainer.max_epochs (>= 0) or trainer.max_steps")
    total = max(int(total), 1)
    warmup = min(warmup_steps, total - 1)

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return {"scheduler": LambdaLR(optimizer, scale), "interval": "step"}
