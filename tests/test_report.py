"""The end-of-fit summary table and the warning for rules that match nothing."""

import logging
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_act import ActCompression, ActivationCapture, CompressionConfig
from lightning_act.policy import FixedBits
from torch import nn
from torch.utils.data import DataLoader

from tests.test_callback import SmallCNN, make_images


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x):
        return self.net(x)


def one_step(rules=None, steps=1):
    torch.manual_seed(0)
    model = Net()
    capture = ActivationCapture(CompressionConfig(), model, FixedBits(2, rules))
    for _ in range(steps):
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
        with capture.capturing(inputs=x):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
    return capture


def table_rows(summary):
    lines = summary.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    total = next(i for i, line in enumerate(lines) if line.startswith("total"))
    return lines[header], [line for line in lines[header + 1 : total] if not line.startswith("...")], lines[total]


def test_summary_has_clear_headers_an_op_column_and_counts_that_agree():
    report = one_step().report
    summary = report.summary()
    header, rows, total = table_rows(summary)
    assert header.split()[:4] == ["module", "op", "autograd", "keeps"] and "stored as" in header
    assert "saved MiB" not in summary and "inf" not in summary
    by_module = {row.split()[0]: row.split() for row in rows}
    assert by_module["net.1"][1] == "batch_norm" and by_module["net.2"][1] == "relu"
    assert by_module["net.10"][1] == "linear" and by_module["net.6"][1] == "max_pool2d"
    # the conv after a ReLU saves the ReLU's output again: nothing of its own, so no ratio
    assert by_module["net.3"][4] == "-" and by_module["net.3"][-1] == "shared"
    # the tensors column, the total row, the count line and the itemized counts agree
    tensors_end = header.index("tensors") + len("tensors")
    tensors = sum(int(row[header.index("ratio") + len("ratio") : tensors_end]) for row in rows)
    assert int(total.split()[-1]) == tensors == sum(m.tensors for m in report.modules.values())
    listed = re.search(r"(\d+) saved tensors in the table:\n((?:  +\d+  .*\n)+)", summary)
    assert int(listed.group(1)) == tensors
    assert sum(int(line.split()[0]) for line in listed.group(2).splitlines()) == tensors
    uncounted = re.search(
        r"not in the table, alive anyway: parameters or their views: (\d+), from the batch or buffers: (\d+)", summary
    )
    assert (
        int(uncounted.group(1)) == report.counts["parameter"] and int(uncounted.group(2)) == report.counts["external"]
    )
    for word in ("external", "recast", "statistic", "deduplicated", "lossless"):  # outcome names
        assert not re.search(rf"\b{word}\b", summary)


def test_summary_cut_says_how_to_see_every_module():
    report = one_step().report
    short = report.summary(max_modules=3)
    assert len(table_rows(short)[1]) == 3
    assert f"... {len(report.modules) - 3} more modules: summary(max_modules=None) lists them all" in short
    full = report.summary(max_modules=None)
    assert len(table_rows(full)[1]) == len(report.modules) and "more modules" not in full


def test_rows_storing_a_tensor_another_module_saved_first_are_explained():
    # index_select and scatter_add_ save the same index: the second stores it again
    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.gather, self.scatter = nn.Identity(), nn.Identity()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, index):
            messages = self.lin(x).index_select(0, index)
            return torch.zeros_like(x).index_add(0, index.flip(0), messages)

    model = Gather()
    x, index = torch.randn(4096, 16), torch.randint(0, 4096, (20000,))
    capture = ActivationCapture(CompressionConfig(), model)
    with capture.capturing(inputs=(x,)):
        loss = model(x, index).square().mean()
    loss.backward()
    summary = capture.report.summary()
    assert "inf" not in summary and "0.00x" not in summary
    if any(m.stored_bytes > m.saved_bytes == 0 for m in capture.report.modules.values()):
        assert "stores again a tensor saved first elsewhere" in summary


def test_a_rule_that_matches_nothing_warns_once_with_the_nearest_names():
    with pytest.warns(UserWarning) as caught:
        capture = one_step({"nett.1": 8, "net.1": 8, "op:batchnorm": "exact", "op:relu": 4}, steps=3)
    messages = [str(w.message) for w in caught if "lightning_act: rules" in str(w.message)]
    assert len(messages) == 2, messages  # once each, though three steps ran
    (module_rule,) = [m for m in messages if "'nett.1'" in m]
    assert "matched no saved tensor" in module_rule and "nearest module names: net.1" in module_rule
    (op_rule,) = [m for m in messages if "'op:batchnorm'" in m]
    assert "nearest op names: op:batch_norm" in op_rule
    assert capture.policy.rules.matched == {"net.1", "op:relu"}


def test_rules_that_match_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture = one_step({"net.1": 8, "net.*": 4, "op:relu": "exact"})
    assert capture.policy.rules.matched == {"net.1", "net.*", "op:relu"}
    assert capture.report.counts["compressed"] >= 3


def test_end_of_fit_names_the_log_and_checkpoint_directories(tmp_path, caplog):
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=CSVLogger(tmp_path),
        callbacks=[ActCompression(bits=2)],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(SmallCNN(), DataLoader(make_images(64), batch_size=32))
    output = caplog.text
    assert "activation memory of the last training step" in output and "autograd keeps" in output
    assert f"logs: {trainer.log_dir}" in output
    assert f"checkpoints: {trainer.checkpoint_callback.dirpath}" in output
