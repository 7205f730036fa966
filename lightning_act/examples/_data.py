"""The loaders the example data modules share: shuffled training batches, ordered evaluation."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset


class SplitDataModule(pl.LightningDataModule):
    """A data module whose ``setup`` assigns ``train_set``, ``val_set`` and ``test_set``.

    Training batches are shuffled and complete (an incomplete last batch is dropped);
    validation and test batches come in order. Where one data set serves two splits, the
    subclass assigns it to both.

    Args:
        batch_size: samples per batch.
        num_workers: data loader worker processes, kept alive from one epoch to the next.
    """

    def __init__(self, batch_size: int, num_workers: int):
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, self.batch_size, num_workers=self.num_workers)
