"""Node classification on citation graphs: GCN and GAT, and the Planetoid data sets."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from lightning_act.examples._checks import check_fraction, check_positive

with warnings.catch_warnings():
    # PyG calls the deprecated torch.jit.script at import: a warning users cannot act on.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
    from torch_geometric.data import Data
    from torch_geometric.datasets import Planetoid
    from torch_geometric.nn import GATConv, GCNConv

PLANETOID_NAMES = ("Cora", "CiteSeer", "PubMed")


class NodeClassifier(pl.LightningModule):
    """A two-layer graph network classifying every node of one graph, trained full-batch.

    ``gcn`` is Kipf and Welling's GCN (dropout, GCNConv, ReLU, dropout, GCNConv); ``gat``
    is Velickovic et al.'s GAT (``heads`` attention heads of ``hidden_channels`` each, ELU,
    one averaged output head, dropout on inputs and attention weights). Adam with a
    constant learning rate, as in both papers.

    Args:
        conv: ``gcn`` or ``gat``.
        in_channels: node feature size (Cora 1433, CiteSeer 3703, PubMed 500).
        num_classes: classes (Cora 7, CiteSeer 6, PubMed 3).
        hidden_channels: hidden width (per head for ``gat``).
        heads: attention heads of the hidden ``gat`` layer.
        dropout: dropout on features (and, for ``gat``, attention weights).
        lr: Adam learning rate.
        weight_decay: Adam L2 penalty.

    Raises:
        ValueError: ``conv`` is unknown, a size is not positive, or (at setup) the data
            module's feature or class count differs from the model's.
    """

    def __init__(
        self,
        conv: Literal["gcn", "gat"] = "gcn",
        in_channels: int = 1433,
        num_classes: int = 7,
        hidden_channels: int = 16,
        heads: int = 8,
        dropout: float = 0.5,
        lr: float = 0.01,
        weight_decay: float = 5e-4,
    ):
        super().__init__()
        if conv not in ("gcn", "gat"):
            raise ValueError(f"conv={conv!r} is not supported; allowed: gcn, gat")
        check_positive(in_channels=in_channels, num_classes=num_classes, hidden_channels=hidden_channels, heads=heads)
        check_fraction("dropout", dropout)
        self.save_hyperparameters()
        if conv == "gcn":
            self.conv1 = GCNConv(in_channels, hidden_channels)
            self.conv2 = GCNConv(hidden_channels, num_classes)
            self.activation = nn.ReLU()
        else:
            self.conv1 = GATConv(in_channels, hidden_channels, heads=heads, dropout=dropout)
            self.conv2 = GATConv(hidden_channels * heads, num_classes, heads=1, concat=False, dropout=dropout)
            self.activation = nn.ELU()
        self.dropout = nn.Dropout(dropout)
        # micro: the share of correct predictions, as papers report (torchmetrics defaults to the class mean).
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        for name, expected in (("num_features", "in_channels"), ("num_classes", "num_classes")):
            found = getattr(datamodule, name, None)
            if found is not None and found != self.hparams[expected]:
                raise ValueError(
                    f"{expected}={self.hparams[expected]} does not match the data, which has {name}={found}; "
                    f"set model {expected}: {found}"
                )

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """Class logits ``[nodes, num_classes]``."""
        x = self.activation(self.conv1(self.dropout(x), edge_index))
        return self.conv2(self.dropout(x), edge_index)

    def _step(self, data: Data, mask: torch.Tensor, accuracy: MulticlassAccuracy, stage: str) -> torch.Tensor:
        logits = self(data.x, data.edge_index)[mask]
        labels = data.y[mask]
        loss = F.cross_entropy(logits, labels)
        accuracy(logits, labels)
        nodes = int(mask.sum())
        self.log(f"{stage}/loss", loss, prog_bar=stage != "test", batch_size=nodes)
        self.log(f"{stage}/acc", accuracy, prog_bar=stage != "test", batch_size=nodes)
        return loss

    def training_step(self, data: Data, batch_idx: int) -> torch.Tensor:
        return self._step(data, data.train_mask, self.train_acc, "train")

    def validation_step(self, data: Data, batch_idx: int) -> None:
        self._step(data, data.val_mask, self.val_acc, "val")

    def test_step(self, data: Data, batch_idx: int) -> None:
        self._step(data, data.test_mask, self.test_acc, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class PlanetoidDataModule(pl.LightningDataModule):
    """A Planetoid citation graph (Cora, CiteSeer, PubMed) with its train/val/test masks.

    Every loader yields the whole graph once per epoch; the steps pick their mask. PyG's
    ``processed/`` copy is built in a temporary folder, so a shared data folder is never written.

    Args:
        root: folder holding ``<name>/raw/`` (``ind.cora.x`` ...).
        name: Cora, CiteSeer or PubMed.
        split: Planetoid split: ``public`` (20 labelled nodes per class), ``full``,
            ``geom-gcn`` or ``random``.
        download: fetch the raw files into ``root`` when they are missing.

    Raises:
        ValueError: ``name`` is not a Planetoid data set.
        FileNotFoundError: the raw files are not under ``root`` and ``download`` is off.
    """

    def __init__(
        self,
        root: str | os.PathLike = "data/planetoid",
        name: str = "Cora",
        split: Literal["public", "full", "geom-gcn", "random"] = "public",
        download: bool = False,
    ):
        super().__init__()
        if name not in PLANETOID_NAMES:
            raise ValueError(f"name={name!r} is not a Planetoid data set; allowed: {', '.join(PLANETOID_NAMES)}")
        self.root = Path(root)
        self.name = name
        self.split = split
        self.download = download
        self.data: Data | None = None
        self.num_features: int | None = None
        self.num_classes: int | None = None
        # Checked here, not at prepare_data, so a wrong path fails before a model or folder is made.
        if not download:
            expected = _ReadOnlyPlanetoid.expected_raw_files(self.root, name, split)
            missing = [path for path in expected if not path.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"root={str(root)!r} does not hold the {name} files ({missing[0]} is missing); "
                    f"set root to the folder holding {name}/, or download=true to fetch them there"
                )

    def prepare_data(self) -> None:
        if self.download:
            self._load()

    def setup(self, stage: str) -> None:
        if self.data is not None:
            return
        dataset = self._load()
        self.data = dataset[0]
        self.num_features = dataset.num_features
        self.num_classes = dataset.num_classes

    def _load(self) -> Planetoid:
        with tempfile.TemporaryDirectory(prefix="planetoid-") as processed:
            return _ReadOnlyPlanetoid(self.root, Path(processed), self.name, self.split)

    def _whole_graph(self) -> DataLoader:
        # batch_size=None: the loader yields the graph itself, not a one-element batch of it.
        return DataLoader([self.data], batch_size=None, collate_fn=_identity)

    def train_dataloader(self) -> DataLoader:
        return self._whole_graph()

    def val_dataloader(self) -> DataLoader:
        return self._whole_graph()

    def test_dataloader(self) -> DataLoader:
        return self._whole_graph()


class _ReadOnlyPlanetoid(Planetoid):
    """PyG's Planetoid reading ``raw/`` under ``root`` but writing ``processed/`` elsewhere."""

    def __init__(self, root: Path, processed_root: Path, name: str, split: str):
        self.processed_root = processed_root
        super().__init__(str(root), name, split=split)

    @property
    def processed_dir(self) -> str:
        return str(self.processed_root / Path(super().processed_dir).relative_to(self.root))

    # The processed copy is rebuilt on every run: PyG's "Processing... Done!" would be noise.
    @property
    def log(self) -> bool:
        return False

    @log.setter
    def log(self, value: bool) -> None:
        pass

    @classmethod
    def expected_raw_files(cls, root: Path, name: str, split: str) -> list[Path]:
        """The raw files PyG reads for this data set and split (its own layout, nothing loaded)."""
        layout = cls.__new__(cls)
        layout.root, layout.name, layout.split = str(root), name, split.lower()
        return [Path(path) for path in layout.raw_paths]


def _identity(data: Data) -> Data:
    return data
