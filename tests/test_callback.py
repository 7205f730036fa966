"""ActCompression inside real Lightning training loops."""

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_act import ActCompression
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_images(n=256, seed=0):
    """Four classes, each a fixed random pattern plus noise: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(4, 3, 16, 16, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = patterns[labels] + 0.5 * torch.randn(n, 3, 16, 16, generator=g)
    return TensorDataset(images, labels)


class SmallCNN(L.LightningModule):
    def __init__(self, manual=False, fail_at_step=None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 4),
        )
        self.automatic_optimization = not manual
        self.fail_at_step = fail_at_step
        self.losses = []
        self.capture_active_in_validation = []

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("failure inside training_step")
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        callback = next(c for c in self.trainer.callbacks if isinstance(c, ActCompression))
        self.capture_active_in_validation.append(callback.capture.active)
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(model, callbacks, tmp_path, **trainer_kwargs):
    torch.manual_seed(0)
    data = make_images()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=trainer_kwargs.pop("max_steps", 6),
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))
    return trainer


def logged(tmp_path, key):
    path = next(tmp_path.rglob("metrics.csv"))
    with open(path) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_logs_memory_figures_under_each_precision(tmp_path, precision):
    callback = ActCompression(bits=2)
    fit(SmallCNN(), [callback], tmp_path, precision=precision, limit_val_batches=1)
    ratios = logged(tmp_path, "act/compression_ratio")
    saved = logged(tmp_path, "act/saved_mib")
    stored = logged(tmp_path, "act/stored_mib")
    assert len(ratios) == 6
    assert ratios[-1] == pytest.approx(saved[-1] / stored[-1], rel=1e-3)
    report = callback.last_report
    assert report.counts["compressed"] >= 4
    # 32-bit activations compress ~15x at 2 bits, 16-bit ones ~7.5x; small tensors and
    # BatchNorm statistics are kept as they are, which costs a little.
    assert report.ratio > (10 if precision == "32" else 5)
    assert not callback.capture.active


def test_validation_is_never_captured(tmp_path):
    model = SmallCNN()
    fit(model, [ActCompression(bits=2)], tmp_path, val_check_interval=2, limit_val_batches=2)
    assert model.capture_active_in_validation and not any(model.capture_active_in_validation)


@pytest.mark.parametrize("mode", ["manual", pytest.param("accumulate", marks=pytest.mark.slow)])
def test_manual_optimization_and_accumulation_train_normally(tmp_path, mode):
    kwargs = {"accumulate_grad_batches": 2} if mode == "accumulate" else {}
    torch.manual_seed(0)  # both start from the same weights, whatever ran before
    model = SmallCNN(manual=mode == "manual")
    callback = ActCompression(bits=4)
    fit(model, [callback], tmp_path, max_steps=16, limit_val_batches=0, **kwargs)
    torch.manual_seed(0)
    baseline = SmallCNN(manual=mode == "manual")
    fit(baseline, [], tmp_path / "baseline", max_steps=16, limit_val_batches=0, **kwargs)
    assert callback.last_report.counts["compressed"] >= 4
    assert model.losses[-1] < model.losses[0] * 0.85  # it learns
    assert abs(model.losses[-1] - baseline.losses[-1]) < 0.1 * baseline.losses[0]


def test_exception_in_training_step_leaves_no_hooks(tmp_path):
    callback = ActCompression(bits=2)
    with pytest.raises(RuntimeError, match="failure inside training_step"):
        fit(SmallCNN(fail_at_step=2), [callback], tmp_path, limit_val_batches=0)
    assert not callback.capture.active
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # stack popped


def test_rounding_noise_leaves_the_global_generator_alone(tmp_path):
    with_compression, without = SmallCNN(), SmallCNN()
    fit(with_compression, [ActCompression(bits=8)], tmp_path / "a", limit_val_batches=0)
    after_with = torch.rand(3)
    fit(without, [], tmp_path / "b", limit_val_batches=0)
    after_without = torch.rand(3)
    assert torch.equal(after_with, after_without)


def test_invalid_settings_name_the_knob():
    with pytest.raises(ValueError, match=r"bits=3 is not supported; allowed: 1, 2, 4, 8"):
        ActCompression(bits=3)
    with pytest.raises(ValueError, match="min_numel=-1"):
        ActCompression(min_numel=-1)


def test_logs_the_step_peak_and_per_module_memory_for_fixed_bits(tmp_path):
    callback = ActCompression(bits=2)
    fit(SmallCNN(), [callback], tmp_path, limit_val_batches=0)
    report = callback.last_report
    compressed = [name for name, m in report.modules.items() if m.compressed]
    assert compressed
    for name, memory in report.modules.items():
        assert logged(tmp_path, f"act/stored_mib/{name}")[-1] == pytest.approx(memory.stored_bytes / 2**20, rel=1e-6)
        assert logged(tmp_path, f"act/saved_mib/{name}")[-1] == pytest.approx(memory.saved_bytes / 2**20, rel=1e-6)
    for name in compressed:
        assert logged(tmp_path, f"act/bits/{name}")[-1] == 2.0
    total = sum(logged(tmp_path, f"act/stored_mib/{name}")[-1] for name in report.modules)
    assert total == pytest.approx(logged(tmp_path, "act/stored_mib")[-1], rel=1e-6)
    if callback._step_peak.source is None:
        pytest.skip("no step peak on this platform (needs a GPU or Linux /proc)")
    peaks = logged(tmp_path, "act/peak_mib")
    assert len(peaks) == 6
    # Absolute: the process holds at least the model, the batch and what the step stored.
    assert min(peaks) * 2**20 > report.stored_bytes
    assert callback.max_peak_bytes == pytest.approx(max(peaks) * 2**20, rel=1e-6)


def test_fit_summary_states_kept_memory_and_peak(tmp_path, caplog):
    callback = ActCompression(bits=2)
    with caplog.at_level("INFO"):
        fit(SmallCNN(), [callback], tmp_path, limit_val_batches=0)
    summary = next(r.getMessage() for r in caplog.records if "activation memory of the last" in r.getMessage())
    report = callback.last_report
    assert f"kept for backward: {report.stored_bytes / 2**20:.2f} MiB stored instead of" in summary
    if callback.last_peak_bytes is None:
        assert "step peak: not measured on this device" in summary
    else:
        assert f"{callback.last_peak_bytes / 2**20:.2f} MiB in the last step" in summary


@pytest.mark.parametrize(
    "accelerator",
    [
        pytest.param("cpu", marks=pytest.mark.slow),  # a batch search: 2.5 s
        pytest.param(
            "gpu",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_batch_size_finder_runs_with_the_callback(tmp_path, accelerator):
    from lightning.pytorch.tuner import Tuner

    class Tunable(SmallCNN):
        def __init__(self):
            super().__init__()
            self.batch_size = 16

        def train_dataloader(self):
            return DataLoader(make_images(n=4096), batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(make_images(n=64), batch_size=64)

    callback = ActCompression(bits=2)
    model = Tunable()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=4,
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    found = Tuner(trainer).scale_batch_size(model, mode="power", init_val=16, steps_per_trial=2, max_trials=4)
    assert found == model.batch_size == 16 * 2**3  # every trial fits: the finder doubled each time
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hooks left behind
    trainer.fit(model)
    assert callback.last_report.counts["compressed"] >= 4
    assert callback.last_report.slots and all(
        m.shape[0] == found for m in callback.last_report.slots.values() if len(m.shape) == 4
    )
