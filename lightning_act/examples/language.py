"""Character-level language modelling: a small GPT and a text-file data module.

Characters are the text's UTF-8 bytes: a fixed 256-entry vocabulary fits any text file.
"""

from __future__ import annotations

import math
import os
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_act.examples._checks import check_fraction, check_positive
from lightning_act.examples._data import SplitDataModule
from lightning_act.examples._schedule import warmup_cosine

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
VOCAB_SIZE = 256


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (``n_heads`` divides ``d_model``), ``dropout`` on the
    attention weights and the output projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; arguments as :class:`CausalSelfAttention`'s."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(pl.LightningModule):
    """A GPT-style decoder predicting the next byte: pre-norm, causal, tied embeddings.

    Args:
        d_model: width of the residual stream.
        n_layers: transformer blocks.
        n_heads: attention heads per block; must divide ``d_model``.
        block_size: longest context, in bytes (positions have learned embeddings up to it).
        dropout: dropout probability in every block.
        lr: peak AdamW learning rate, after ``warmup_steps``; cosine decay to zero over the run.
        weight_decay: AdamW decay on matrices and embeddings (not biases and LayerNorm gains).
        warmup_steps: optimizer steps of linear warmup.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``, or a size is not positive.
    """

    def __init__(
        self,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        block_size: int = 128,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
    ):
        super().__init__()
        check_positive(d_model=d_model, n_layers=n_layers, n_heads=n_heads, block_size=block_size)
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads!r} must divide d_model={d_model!r}")
        check_fraction("dropout", dropout)
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down with depth keep the stream's variance flat.
        for block in self.blocks:
            for projection in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits ``[batch, length, 256]`` for byte ids ``[batch, length]``."""
        length = tokens.shape[1]
        if length > self.hparams.block_size:
            raise ValueError(
                f"sequence length {length} exceeds block_size={self.hparams.block_size}; give the data module "
                "the same block_size as the model"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True)
        # Bits per character: the figure character-level results are usually quoted in.
        self.log("val/bpc", loss / math.log(2))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("test/loss", loss)
        self.log("test/bpc", loss / math.log(2))

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=(0.9, 0.95),
        )
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine(optimizer, self.trainer, hp.warmup_steps)}


class ByteWindows(Dataset):
    """Non-overlapping ``block_size`` windows of a ``uint8`` byte tensor: ``(x, y)``, ``y`` shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int):
        if len(data) <= block_size:
            raise ValueError(f"the text split has {len(data)} bytes, not more than block_size={block_size}")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class CharTextDataModule(SplitDataModule):
    """One text file as next-byte prediction: the first 90% trains, the last 10% validates.

    Args:
        path: the text file (UTF-8). Tiny Shakespeare is the customary corpus.
        download: fetch ``url`` to ``path`` when ``path`` does not exist.
        url: where to fetch the text from.
        block_size: bytes per training window, at most the model's ``block_size``.
        batch_size: windows per batch.
        num_workers: data loader worker processes; ``None``: one per available CPU core, less one.
        train_fraction: leading share of the text used for training; the rest validates and tests.

    Raises:
        FileNotFoundError: ``path`` does not exist and ``download`` is off.
    """

    def __init__(
        self,
        path: str | os.PathLike = "data/tinyshakespeare/input.txt",
        download: bool = False,
        url: str = TINY_SHAKESPEARE_URL,
        block_size: int = 128,
        batch_size: int = 64,
        num_workers: int | None = 0,
        train_fraction: float = 0.9,
    ):
        super().__init__(batch_size, num_workers)
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size={block_size!r} and batch_size={batch_size!r} must be >= 1")
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction={train_fraction!r} must be in (0, 1)")
        self.path = Path(path)
        self.download = download
        self.url = url
        self.block_size = block_size
        self.train_fraction = train_fraction
        # Checked here, not at prepare_data, so a wrong path fails before a model is built.
        if not download and not self.path.is_file():
            raise FileNotFoundError(f"path={str(path)!r} does not exist; set download=true to fetch {url} there")

    def prepare_data(self) -> None:
        if self.path.is_file():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".part")
        urllib.request.urlretrieve(self.url, partial)
        partial.replace(self.path)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8)
        split = int(len(data) * self.train_fraction)
        self.train_set = ByteWindows(data[:split], self.block_size)
        self.val_set = self.test_set = ByteWindows(data[split:], self.block_size)
