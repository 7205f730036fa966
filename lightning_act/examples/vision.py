"""Image classification: a torchvision ResNet, CIFAR-10, and a generated data set (plain Lightning classes)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch import nn
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

from lightning_act.examples._checks import check_fraction
from lightning_act.examples._data import SplitDataModule
from lightning_act.examples._schedule import warmup_cosine

RESNET_ARCHS = tuple(name for name in torchvision.models.resnet.__all__ if name.islower())

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
PACKED_CIFAR10 = {"train": "cifar10_jpeg_train.npz", "test": "cifar10_jpeg_test.npz"}


class ImageClassifier(pl.LightningModule):
    """A torchvision ResNet trained with cross-entropy.

    Args:
        arch: torchvision ResNet constructor name: resnet18/34/50/101/152, resnext50_32x4d,
            resnext101_32x8d/64x4d or wide_resnet50_2/101_2. Weights start random.
        num_classes: size of the classification head.
        cifar_stem: for 32x32 inputs: a 3x3 stride-1 first convolution and no max-pool,
            so the first stage sees 32x32 maps instead of 8x8.
        optimizer: ``sgd`` (momentum, Nesterov) or ``adamw``.
        lr: peak learning rate, after ``warmup_steps``; cosine decay to zero over the run.
        momentum: SGD momentum (``adamw``: beta1).
        weight_decay: decoupled for ``adamw``, L2 for ``sgd``.
        warmup_steps: optimizer steps of linear warmup.
        label_smoothing: cross-entropy label smoothing in [0, 1).

    Raises:
        ValueError: ``arch`` is not a torchvision ResNet, or a number is out of range.
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        cifar_stem: bool = False,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        warmup_steps: int = 0,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        if arch not in RESNET_ARCHS:
            raise ValueError(f"arch={arch!r} is not a torchvision ResNet; allowed: {', '.join(RESNET_ARCHS)}")
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer={optimizer!r} is not supported; allowed: sgd, adamw")
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2")
        check_fraction("label_smoothing", label_smoothing)
        self.save_hyperparameters()
        self.net = getattr(torchvision.models, arch)(num_classes=num_classes)
        if cifar_stem:
            self.net.conv1 = nn.Conv2d(3, self.net.conv1.out_channels, 3, stride=1, padding=1, bias=False)
            self.net.maxpool = nn.Identity()
        # micro: the share of correct predictions, as papers report (torchmetrics defaults to the class mean).
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_acc(logits, labels)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.test_acc(logits, labels)
        self.log("test/loss", F.cross_entropy(logits, labels))
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(
                self.parameters(),
                lr=hp.lr,
                momentum=hp.momentum,
                nesterov=hp.momentum > 0,
                weight_decay=hp.weight_decay,
            )
        else:
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=hp.lr, betas=(hp.momentum, 0.999), weight_decay=hp.weight_decay
            )
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine(optimizer, self.trainer, hp.warmup_steps)}


class ImageArrayDataset(Dataset):
    """``uint8[n, height, width, 3]`` images in memory with class labels; ``transform`` is applied to
    each ``uint8[3, height, width]`` tensor."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: v2.Transform):
        self.images = images
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.from_numpy(self.images[index]).permute(2, 0, 1)
        return self.transform(image), self.labels[index]


class CIFAR10DataModule(SplitDataModule):
    """CIFAR-10: 50,000 training and 10,000 test images, 32x32, 10 classes.

    Reads the packed JPEG copy (``cifar10_jpeg_train.npz``, ``cifar10_jpeg_test.npz``) when
    ``data_dir`` holds it, else torchvision's ``cifar-10-batches-py/``, decoded once into memory.
    Training images are padded by 4, randomly cropped and flipped; the test set also validates.

    Args:
        data_dir: folder holding the packed files or torchvision's layout.
        batch_size: images per batch.
        num_workers: data loader worker processes; ``None``: one per available CPU core, less one.
        download: fetch torchvision's copy into ``data_dir`` when neither layout is there.
        limit: use only a fixed random subset of this many images of each split (the files are
            sorted by class, so a prefix would not do).

    Raises:
        FileNotFoundError: ``data_dir`` holds neither layout and ``download`` is off.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike = "data/cifar10",
        batch_size: int = 128,
        num_workers: int | None = None,
        download: bool = False,
        limit: int | None = None,
    ):
        super().__init__(batch_size, num_workers)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        if limit is not None and limit < batch_size:
            raise ValueError(
                f"limit={limit!r} must be >= batch_size={batch_size!r} (an incomplete last training batch is "
                "dropped) or null for the whole split"
            )
        self.data_dir = Path(data_dir)
        self.download = download
        self.limit = limit
        normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        self.train_transform = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *normalize])
        self.eval_transform = v2.Compose(normalize)
        # Checked here, not at prepare_data, so a wrong path fails before a model is built.
        if not download and not self._available():
            raise FileNotFoundError(
                f"data_dir={str(data_dir)!r} holds neither {' and '.join(PACKED_CIFAR10.values())} nor torchvision's "
                "cifar-10-batches-py/; set download=true to fetch CIFAR-10 there"
            )

    def _packed(self) -> bool:
        return all((self.data_dir / name).is_file() for name in PACKED_CIFAR10.values())

    def _available(self) -> bool:
        return self._packed() or (self.data_dir / "cifar-10-batches-py").is_dir()

    def prepare_data(self) -> None:
        if self.download and not self._available():
            for train in (True, False):
                torchvision.datasets.CIFAR10(self.data_dir, train=train, download=True)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        self.train_set = ImageArrayDataset(*self._load("train"), self.train_transform)
        self.val_set = self.test_set = ImageArrayDataset(*self._load("test"), self.eval_transform)

    def _load(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        if self._packed():
            with np.load(self.data_dir / PACKED_CIFAR10[split]) as packed:
                jpeg, offsets, labels = packed["jpeg"], packed["offsets"], packed["labels"]
            index = self._subset(len(labels))
            images = np.stack(
                [
                    np.asarray(Image.open(io.BytesIO(jpeg[offsets[i] : offsets[i + 1]].tobytes())).convert("RGB"))
                    for i in index
                ]
            )
            return images, labels[index]
        dataset = torchvision.datasets.CIFAR10(self.data_dir, train=split == "train")
        index = self._subset(len(dataset.targets))
        return dataset.data[index], np.asarray(dataset.targets)[index]

    def _subset(self, n: int) -> np.ndarray:
        if self.limit is None or self.limit >= n:
            return np.arange(n)
        return np.sort(np.random.default_rng(0).permutation(n)[: self.limit])


class SyntheticImages(Dataset):
    """Noisy, shifted copies of class patterns, each drawn from its own seed when read: no memory
    per sample, and sample ``i`` is the same in every epoch, worker and run.

    ``patterns`` is ``[num_classes, 3, height, width]`` of unit variance; ``noise`` a standard
    deviation relative to theirs; ``max_shift`` in pixels per axis; each ``seed`` its own stream.
    """

    def __init__(self, patterns: torch.Tensor, size: int, noise: float, max_shift: int, seed: int):
        self.patterns = patterns
        self.size = size
        self.noise = noise
        self.max_shift = max_shift
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed((self.seed << 32) + index)
        label = torch.randint(len(self.patterns), (), generator=generator)
        shift = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=generator).tolist()
        contrast = torch.empty(()).uniform_(0.5, 1.5, generator=generator)
        image = contrast * self.patterns[label].roll(tuple(shift), dims=(1, 2))
        image = image + self.noise * torch.randn(image.shape, generator=generator)
        # Unit variance whatever the noise level, so the learning rate need not follow it.
        return image / (1.0 + self.noise**2) ** 0.5, label


class SyntheticImageDataModule(SplitDataModule):
    """Generated images a small network learns within a few epochs: no files, no network.

    A sample is its class's smooth random pattern shifted by a few pixels, scaled in contrast and
    buried in Gaussian noise, so only shift-tolerant features separate the classes. Everything
    comes from ``seed``; samples are generated when read, so ImageNet shapes cost no memory.

    Args:
        num_classes: number of classes (and patterns).
        image_size: height and width of the square images.
        train_size: training images.
        val_size: validation images (also used for testing).
        noise: standard deviation of the added noise relative to the patterns' (1); the sum is
            rescaled to unit variance. Above 1, only features pooled over the image separate classes.
        max_shift: largest shift in pixels, each axis, wrapping around the border.
        batch_size: images per batch.
        num_workers: data loader worker processes; ``None``: one per available CPU core, less one.
        seed: seeds the patterns and the samples.
    """

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        train_size: int = 4096,
        val_size: int = 1024,
        noise: float = 1.0,
        max_shift: int = 4,
        batch_size: int = 64,
        num_workers: int | None = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size, num_workers)
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r} must be >= 2")
        if image_size < 8:
            raise ValueError(f"image_size={image_size!r} must be >= 8")
        if batch_size < 1 or train_size < batch_size or val_size < 1:
            raise ValueError(
                f"batch_size={batch_size!r} must be >= 1, train_size={train_size!r} >= batch_size and "
                f"val_size={val_size!r} >= 1"
            )
        if noise < 0 or max_shift < 0:
            raise ValueError(f"noise={noise!r} and max_shift={max_shift!r} must be >= 0")
        if not 0 <= seed < 2**31:
            raise ValueError(f"seed={seed!r} must be in [0, 2**31)")
        self.num_classes = num_classes
        self.image_size = image_size
        self.train_size = train_size
        self.val_size = val_size
        self.noise = noise
        self.max_shift = max_shift
        self.seed = seed

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        generator = torch.Generator().manual_seed(self.seed)
        coarse = torch.randn(self.num_classes, 3, 4, 4, generator=generator)
        patterns = F.interpolate(coarse, size=self.image_size, mode="bicubic", align_corners=False)
        patterns = (patterns - patterns.mean(dim=(1, 2, 3), keepdim=True)) / patterns.std(dim=(1, 2, 3), keepdim=True)
        # Seeds 2s and 2s + 1: the training and validation streams never share a sample.
        self.train_set = SyntheticImages(patterns, self.train_size, self.noise, self.max_shift, 2 * self.seed)
        self.val_set = self.test_set = SyntheticImages(
            patterns, self.val_size, self.noise, self.max_shift, 2 * self.seed + 1
        )
