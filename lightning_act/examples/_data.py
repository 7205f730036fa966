"""The loaders the example data modules share: shuffled training batches, ordered evaluation."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import suggested_max_num_workers
from torch.utils.data import DataLoader, Dataset


class SplitDataModule(pl.LightningDataModule):
    """A data module whose ``setup`` assigns ``train_set``, ``val_set`` and ``test_set``.

    Training batches are shuffled and complete (a short last batch is dropped); validation and
    test batches come in order.

    Args:
        batch_size: samples per batch.
        num_workers: data loader worker processes, kept alive between epochs; ``None``: one per
            available CPU core, less one (Lightning's suggestion, so neither it nor PyTorch warns).
    """

    def __init__(self, batch_size: int, num_workers: int | None):
        super().__init__()
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0 or null for one per available core")
        self.batch_size = batch_size
        self._num_workers = num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    @property
    def num_workers(self) -> int:
        if self._num_workers is not None:
            return self._num_workers
        devices = self.trainer.num_devices if self.trainer is not None else 1
        return suggested_max_num_workers(devices)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, self.batch_size, num_workers=self.num_workers)
