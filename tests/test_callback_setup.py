"""Setups the callback cannot train say what is wrong before the first step."""

import lightning as L
import pytest
import torch
from lightning_act import ActCompression
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class FrozenRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        self.net.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_without_trainable_parameters_is_named(tmp_path):
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[ActCompression(bits=2)],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"no parameter of FrozenRegressor requires grad") as error:
        trainer.fit(FrozenRegressor(), DataLoader(data, batch_size=8))
    assert "requires_grad_(True)" in str(error.value)
