"""The benchmark harness in its quick CPU mode, on two small models: its byte accounting
equals the committed results exactly, the memory it measures agrees with that accounting,
and it writes its JSON and markdown."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The harness runs in its own interpreter and trains two models: a long check.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "harness_cpu.json"
DATA = REPO.parent / "shared" / "data"
MODELS = ("char_transformer", "gcn_cora")
# Fixed bit widths and codecs: what they store follows from the model, the batch and the
# library alone. (The adaptive policy's also follows from measured sensitivities, and the
# quick mode leaves it out.)
ACCOUNTED = ("act_4bit", "act_2bit", "act_division2", "act_pool2")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not (DATA / "planetoid" / "Cora" / "raw").is_dir():
        pytest.skip(f"needs Cora in {DATA}")
    out = tmp_path_factory.mktemp("harness")
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "harness.py"),
        "--suite",
        "cpu",
        "--quick",
        "--models",
        *MODELS,
        "--data-dir",
        str(DATA),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode:
        pytest.fail(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / "harness_cpu_quick.json").read_text()), out


def _main_rows(results: dict, model: str) -> dict:
    entry = results["memory"][model]
    return entry["batches"][str(entry["main_batch"])]


def test_accounting_equals_committed_results(quick_run):
    results, _ = quick_run
    committed = json.loads(COMMITTED.read_text())
    for model in MODELS:
        assert results["memory"][model]["main_batch"] == committed["memory"][model]["main_batch"]
        got, want = _main_rows(results, model), _main_rows(committed, model)
        for method in ACCOUNTED:
            for key in ("saved_bytes", "stored_bytes", "decisions"):
                assert got[method][key] == want[method][key], (
                    f"{model} {method} {key}: {got[method][key]} now, {want[method][key]} in {COMMITTED.name}; "
                    "if the library changed on purpose, rerun the CPU suite (docs/results.md)"
                )


def test_measured_memory_agrees_with_accounting(quick_run):
    results, _ = quick_run
    for model in MODELS:
        rows = _main_rows(results, model)
        for method in ACCOUNTED:
            row = rows[method]
            # What the forward really keeps is what the report says it stores, within 1% of
            # what it would have kept (the loss itself is kept too).
            assert abs(row["kept_bytes"] - row["stored_bytes"]) <= 0.01 * row["saved_bytes"], (model, method)
            assert row["kept_reduction"] > 1.0
        assert rows["none"]["kept_bytes"] == pytest.approx(rows["act_2bit"]["saved_bytes"], rel=0.01)


def test_outputs_are_written(quick_run):
    results, out = quick_run
    environment = results["environment"]
    for key in ("device", "torch", "lightning", "date", "git_commit"):
        assert environment[key]
    assert results["suite"] == "cpu" and results["quick"]
    for model in MODELS:
        rows = _main_rows(results, model)
        assert set(rows) == set(results["methods"]) - {"act_adaptive2"}
        assert all(row["kept_bytes"] > 0 and row["peak_step_bytes"] > 0 for row in rows.values())
    markdown = (out / "harness_cpu_quick.md").read_text()
    assert "| method | saved MiB | stored MiB | kept MiB |" in markdown
    for model in MODELS:
        assert f"## {results['memory'][model]['title']}" in markdown
