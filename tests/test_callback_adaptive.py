"""ActCompression with the adaptive policy: recalibration, monitoring, safety, resume."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_act import ActCompression
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from tests.test_callback import SmallCNN, make_images


def trainer_for(tmp_path, callbacks, max_steps, **kwargs):
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=kwargs.pop("logger", False),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **kwargs,
    )


def loader():
    torch.manual_seed(0)
    return DataLoader(make_images(), batch_size=32)


@pytest.mark.parametrize("estimator", ["gradient", pytest.param("probe", marks=pytest.mark.slow)])  # 2 s
def test_recalibrates_and_logs_every_panel_to_tensorboard(tmp_path, estimator):
    callback = ActCompression(
        budget=2.0, estimator=estimator, warmup_steps=2, calibration_steps=2, recalibrate_every_n_steps=4, min_numel=256
    )
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = trainer_for(tmp_path, [callback], 12, logger=logger, enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(SmallCNN(), loader())
    assert len(callback._history) >= 2  # recalibrated more than once
    assert set(callback.policy.assignment) <= set(callback.capture.slots)
    assert callback.last_report.counts["compressed"] >= 4
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert any(t.startswith("act/bits/net.") for t in tags["scalars"])
    assert {"act/compression_ratio", "act/recalibration_ms", "act/recalibration_pct", "act/mean_bits"} <= set(
        tags["scalars"]
    )
    assert "act/bits_histogram" in tags["histograms"]
    assert "act/bits_heatmap" in tags["images"]
    assert any(t.startswith("act/allocation") for t in tags["tensors"])  # add_text is stored as a tensor
    text = events.Tensors(next(t for t in tags["tensors"] if t.startswith("act/allocation")))[-1]
    table = text.tensor_proto.string_val[0].decode()
    assert table.startswith("| tensor | module | op | shape | bits | codec |") and "| net." in table


def test_recalibration_is_announced_when_it_starts_and_when_it_ends(tmp_path, caplog):
    # The probes are sized by a measured step after the fit's first: at step 2, not at the warm-up's end.
    callback = ActCompression(budget=2.0, warmup_steps=1, recalibrate_every_n_steps=100, min_numel=256)
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        trainer_for(tmp_path, [callback], 3, enable_checkpointing=False).fit(SmallCNN(), loader())
    lines = [record.getMessage() for record in caplog.records if "recalibrat" in record.getMessage()]
    assert lines[0].startswith(
        "lightning_act: recalibrating the bits at step 2: probing the saved tensors (linearized) on "
    )
    assert lines[1].startswith("lightning_act: recalibrated at step 2 in ")
    assert "% of the training time so far" in lines[1] and lines[1].endswith("next at step 102")
    widths = sum(int(part.split(" at ")[0]) for part in lines[1].split("width: ")[1].split(";")[0].split(", "))
    assert widths == len(callback.policy.assignment)


class Snapshot(Callback):
    """Records state around ActCompression's on_train_batch_start (probes run there)."""

    def __init__(self, store, key):
        self.store, self.key = store, key

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.store.setdefault(self.key, []).append(
            {
                "batch_idx": batch_idx,
                "rng": torch.get_rng_state(),
                "buffers": [b.clone() for b in pl_module.buffers()],
                "grads": [None if p.grad is None else p.grad.clone() for p in pl_module.parameters()],
            }
        )


@pytest.mark.slow  # 1.5 s
def test_probes_leave_rng_batchnorm_and_accumulated_grads_alone(tmp_path):
    store = {}
    callback = ActCompression(budget=2.0, estimator="probe", warmup_steps=1, recalibrate_every_n_steps=2, min_numel=256)
    trainer = trainer_for(
        tmp_path,
        [Snapshot(store, "before"), callback, Snapshot(store, "after")],
        6,
        accumulate_grad_batches=2,
        enable_checkpointing=False,
    )
    trainer.fit(SmallCNN(), loader())
    assert len(callback._history) >= 2
    for before, after in zip(store["before"], store["after"]):
        assert torch.equal(before["rng"], after["rng"])
        assert all(torch.equal(a, b) for a, b in zip(before["buffers"], after["buffers"]))
        if before["batch_idx"] % 2 == 0 and all(b is None for b in after["grads"]):
            continue  # the first batch of a window: its zero_grad clears them, so the probes may first
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before["grads"], after["grads"]))


def test_resume_restores_the_same_bits_without_recalibrating(tmp_path):
    first = ActCompression(
        budget=2.0,
        estimator="gradient",
        warmup_steps=1,
        calibration_steps=1,
        recalibrate_every_n_steps=100,
        min_numel=256,
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer_for(tmp_path, [first, checkpoint], 4).fit(SmallCNN(), loader())
    assert first.policy.assignment
    path = tmp_path / "ckpt" / "last.ckpt"
    torch.load(path, weights_only=True)  # primitives only: loads under the safe unpickler

    class Check(Callback):
        def on_train_start(self, trainer, pl_module):
            self.bits_at_start = dict(resumed.policy.assignment)

    resumed = ActCompression(
        budget=2.0,
        estimator="gradient",
        warmup_steps=1,
        calibration_steps=1,
        recalibrate_every_n_steps=100,
        min_numel=256,
    )
    check = Check()
    trainer_for(tmp_path, [resumed, check], 6).fit(SmallCNN(), loader(), ckpt_path=path)
    assert check.bits_at_start == first.policy.assignment
    assert resumed._history == []  # no recalibration happened after resuming


def test_adaptive_settings_are_validated():
    with pytest.raises(ValueError, match="estimator='fisher' is not supported; allowed: gradient, probe"):
        ActCompression(budget=2.0, estimator="fisher")
    with pytest.raises(ValueError, match="set bits for a fixed policy or budget for an adaptive one"):
        ActCompression(bits=4, budget=2.0)
    with pytest.raises(ValueError, match="recalibrate_every_n_steps=0 must be an int >= 1"):
        ActCompression(budget=2.0, recalibrate_every_n_steps=0)
    with pytest.raises(ValueError, match="budget=9 must be a number of bits in"):
        ActCompression(budget=9)


def test_allocation_table_shows_the_batch_and_the_bytes_of_its_bits(tmp_path):
    callback = ActCompression(
        budget=2.0, estimator="probe", probe_samples=8, warmup_steps=2, recalibrate_every_n_steps=100, min_numel=256
    )
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = trainer_for(tmp_path, [callback], 5, logger=logger, enable_checkpointing=False, log_every_n_steps=1)
    trainer.fit(SmallCNN(), loader())
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    table = events.Tensors("act/allocation/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert len(rows) == len(callback.policy.assignment)
    report = callback.last_report  # the end-of-fit table: same bits (no recalibration since)
    widths = set()
    for row in rows:
        slot, shape, bits, stored = row[0].lstrip("| "), row[3], row[4], float(row[7])
        memory = report.slots[slot]
        assert shape == "x".join(map(str, memory.shape))
        assert shape.startswith("32x")  # the batch's rows, not the probes' 8
        assert stored == pytest.approx(memory.stored_bytes / 1024, abs=0.05)
        widths.add(bits)
    assert len(widths) > 1  # several bit widths, each with its own stored bytes
    stored_by_bits = {}
    for row in rows:
        stored_by_bits.setdefault(row[4], set()).add(float(row[7]) / float(row[6]))
    ratios = sorted((min(v), k) for k, v in stored_by_bits.items() if k != "exact")
    assert [int(k) for _, k in ratios] == sorted(int(k) for _, k in ratios)  # more bits, more bytes per value


class StepPeaks(Callback):
    """Placed after ActCompression: the peak it measured for each step."""

    def __init__(self, act):
        self.act, self.peaks = act, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(self.act.last_peak_bytes)


@pytest.mark.slow  # 5 s
def test_a_recalibration_step_peaks_no_higher_than_the_steady_step(tmp_path, caplog):
    """The probes are counted in their step's peak, and run on as many rows as fit what the
    last step left: the steps that probe peak within 5% of the rest."""
    from tests.test_memory_target import _live_counter

    _live_counter()
    act = ActCompression(budget=2.0, warmup_steps=0, recalibrate_every_n_steps=2, min_numel=256)
    peaks = StepPeaks(act)
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        trainer_for(tmp_path, [act, peaks], 8, enable_checkpointing=False).fit(SmallCNN(), loader())
    assert act.recalibration_steps[0] == 2  # sized by a measured step after the fit's first
    probed = [r.getMessage() for r in caplog.records if "probing the saved tensors" in r.getMessage()]
    assert probed and all(" of the batch" in line for line in probed), probed
    # Each probing step against the next, which runs at the plan the probes chose.
    assert all(peaks.peaks[s] <= 1.05 * peaks.peaks[s + 1] for s in act.recalibration_steps if s + 1 < 8), (
        peaks.peaks,
        act.recalibration_steps,
    )


def test_probe_rows_follow_the_batch_and_the_measured_cost():
    from lightning_act.callback import ProbeCost, _batch_rows

    assert _batch_rows(torch.zeros(12, 3)) == 12
    assert _batch_rows({"x": torch.zeros(()), "y": [torch.zeros(5, 2)]}) == 5
    assert _batch_rows(object()) is None  # a graph batch: the probes take it whole
    cost = ProbeCost()
    cost.parameter_bytes = 1000
    first = cost.predict(4, 100.0)
    assert first == pytest.approx(ProbeCost.PER_ROW * 400 + ProbeCost.FIXED * 1000)
    cost.observe(4, 100.0, int(2 * first))  # the probe held twice the prediction
    assert cost.predict(4, 100.0) == pytest.approx(2 * first)
