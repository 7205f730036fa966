"""The ``lightning-act`` command: every config runs, the quickstart ends with the memory
summary, and a bad setting fails with one line naming the setting, the value and what is
allowed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning_act import ActCompression
from lightning_act.cli import ActCLI, main, one_line
from lightning_act.examples import PlanetoidDataModule
from lightning_act.ops import SUPPORTED_BITS

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DATA = REPO.parent / "shared" / "data"
ALLOWED_BITS = ", ".join(map(str, SUPPORTED_BITS))

# Per config: the data it reads (None: generated) and the overrides that keep one
# fast_dev_run step small on a CPU; the settings under test (model, callbacks, logger,
# trainer flags, data paths) are left as the config has them.
CONFIG_RUNS = {
    "quickstart.yaml": (None, []),
    "cifar10_resnet18.yaml": ("cifar10", ["--data.limit=64", "--data.batch_size=16", "--data.num_workers=0"]),
    "resnet50_imagenet_shape.yaml": (None, ["--data.batch_size=2", "--data.image_size=32", "--data.num_workers=0"]),
    "shakespeare_transformer.yaml": ("tinyshakespeare", ["--data.batch_size=8"]),
    "cora_gcn.yaml": ("planetoid", []),
    "cora_gat.yaml": ("planetoid", []),
}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a scratch folder (logs land there) with a clean ``sys.argv``."""
    monkeypatch.chdir(tmp_path)
    # LightningCLI warns when given args while sys.argv holds pytest's own arguments.
    monkeypatch.setattr(sys, "argv", ["lightning-act"])
    return tmp_path


def run_module(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_act ARGS`` in a fresh interpreter, output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "lightning_act", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    """Lines of stderr other than Lightning's own progress and info messages."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("Seed set to")]


def test_every_config_has_a_run():
    assert sorted(CONFIG_RUNS) == sorted(path.name for path in CONFIGS.glob("*.yaml"))


# The quickstart's config in the default run; the others (2-4 s each) with the slow checks.
@pytest.mark.parametrize(
    "name",
    [name if name == "quickstart.yaml" else pytest.param(name, marks=pytest.mark.slow) for name in sorted(CONFIG_RUNS)],
)
def test_config_fast_dev_run(name, in_tmp):
    data, overrides = CONFIG_RUNS[name]
    if data is not None and not (DATA / data).is_dir():
        pytest.skip(f"{DATA / data} is absent: the shared real data sets are not on this machine")
    main(["fit", f"--config={CONFIGS / name}", "--trainer.fast_dev_run=true", *overrides])


def test_every_config_compresses_activations():
    for path in CONFIGS.glob("*.yaml"):
        callbacks = yaml.safe_load(path.read_text())["trainer"]["callbacks"]
        assert any(cb["class_path"] == "ActCompression" for cb in callbacks), path.name


def test_validate_and_test_subcommands(in_tmp):
    if not (DATA / "planetoid").is_dir():
        pytest.skip(f"{DATA / 'planetoid'} is absent: the shared real data sets are not on this machine")
    common = [f"--config={CONFIGS / 'cora_gcn.yaml'}", "--trainer.fast_dev_run=true"]
    main(["validate", *common])
    main(["test", *common])


def test_config_paths_resolve_against_the_repository_from_any_folder(in_tmp):
    # The config says root: ../shared/data/planetoid, relative to the repository root.
    if not (DATA / "planetoid").is_dir():
        pytest.skip(f"{DATA / 'planetoid'} is absent: the shared real data sets are not on this machine")
    main(["fit", f"--config={CONFIGS / 'cora_gcn.yaml'}", "--trainer.fast_dev_run=true"])
    assert sorted(path.name for path in in_tmp.iterdir()) in ([], ["lightning_logs"])


def test_missing_planetoid_fails_in_one_line_and_creates_nothing(in_tmp, capsys):
    config = yaml.safe_load((CONFIGS / "cora_gcn.yaml").read_text())
    config["data"]["init_args"]["root"] = "no/such/planetoid"
    path = in_tmp / "moved.yaml"
    path.write_text(yaml.safe_dump(config))
    for root, where in (([], REPO), (["--data.root=no/such/planetoid"], in_tmp)):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", f"--config={path}", *root])
        assert exit_info.value.code == 2
        # A relative path from a config file is the repository's; one typed on the command line, the shell's.
        expected_root = str(where / "no/such/planetoid") if where == REPO else "no/such/planetoid"
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith(f"lightning-act fit: error: PlanetoidDataModule: root={expected_root!r} does not hold")
        assert "download=true" in line
        assert not (where / "no").exists()


def test_planetoid_root_is_only_read(tmp_path):
    shared_raw = DATA / "planetoid" / "Cora" / "raw"
    if not shared_raw.is_dir():
        pytest.skip(f"{shared_raw} is absent: the shared real data sets are not on this machine")
    raw = tmp_path / "data" / "Cora" / "raw"
    raw.mkdir(parents=True)
    for file in shared_raw.iterdir():
        (raw / file.name).write_bytes(file.read_bytes())
    before = sorted(tmp_path.rglob("*"))
    datamodule = PlanetoidDataModule(root=str(tmp_path / "data"))
    datamodule.prepare_data()
    datamodule.setup("fit")
    assert sorted(tmp_path.rglob("*")) == before
    assert (datamodule.num_features, datamodule.num_classes) == (1433, 7)
    assert int(datamodule.data.train_mask.sum()) == 140


def test_quickstart_is_the_default(in_tmp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"].endswith("ImageClassifier")
    assert config["data"]["class_path"].endswith("SyntheticImageDataModule")
    (compression,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("ActCompression")]
    assert compression["init_args"]["bits"] == 2


@pytest.mark.slow  # the README's main job, 3 epochs: 14 s
def test_quickstart_runs_and_prints_the_summary(tmp_path):
    # The quickstart as shipped, cut to a few small steps; `python -m lightning_act` end to end.
    result = run_module(
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        "--trainer.max_epochs=1",
        "--data.batch_size=16",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "activation memory of the last training step" in output
    assert "saved tensors in the table:" in output and "logs: " in output
    total = next(line for line in output.splitlines() if line.startswith("total "))
    ratio = float(total.split()[3].rstrip("x"))
    assert ratio > 10.0, total  # 2-bit codes plus per-group statistics: 13.9x on this model
    assert list((tmp_path / "lightning_logs" / "quickstart").glob("version_*/events.out.tfevents.*"))


@pytest.mark.slow
def test_codecs_chosen_in_yaml_show_in_the_summary(tmp_path):
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    (compression,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"] == "ActCompression"]
    compression["init_args"].update(codec="quant", rules={"net.layer1.*": "pool", "op:batch_norm": "division:4"})
    path = tmp_path / "codecs.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_module(
        "fit",
        f"--config={path}",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in (result.stdout + result.stderr).splitlines() if line.strip()}
    # module, op, autograd keeps, stored, ratio, tensors, bits, stored as (codecs first)

    def bits_and_codec(module):
        return rows[module][6], rows[module][7].split(",")[0]

    assert bits_and_codec("net.bn1") == ("4", "division")  # the op rule
    assert bits_and_codec("net.layer1.0.bn1") == ("2", "pool")  # the module rule, listed first
    assert bits_and_codec("net.relu") == ("2", "quant")  # no rule


def test_bad_bits_on_the_command_line_fails_in_one_line(in_tmp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.callbacks+=ActCompression", "--trainer.callbacks.bits=3"])
    assert exit_info.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith("lightning-act fit: error: ActCompression: ")
    assert "bits=3" in lines[0] and ALLOWED_BITS in lines[0]


def test_bad_bits_in_a_config_fails_in_one_line(in_tmp, capsys):
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    (compression,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"] == "ActCompression"]
    compression["init_args"]["bits"] = 3
    path = in_tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={path}"])
    assert exit_info.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert lines == [f"lightning-act fit: error: ActCompression: bits=3 is not supported; allowed: {ALLOWED_BITS}"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--trainer.callbacks+=ActCompression", "--trainer.callbacks.bits=three"],
            "ActCompression (trainer.callbacks): bits=three is not valid; allowed: int",
        ),
        (["--model.optimizer=adam"], "ImageClassifier (model): optimizer=adam is not valid; allowed: 'sgd', 'adamw'"),
        (["--trainer.max_epochs=x"], "trainer.max_epochs=x is not valid; allowed: int, null"),
        (
            ["--model.arch=resnet19"],
            "ImageClassifier: arch='resnet19' is not a torchvision ResNet; allowed: resnet18, resnet34, resnet50",
        ),
        (["--model=NoSuchModel"], "model=NoSuchModel is not a known class; allowed: "),
    ],
)
def test_bad_values_fail_in_one_line(args, expected, in_tmp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert lines[0].startswith(f"lightning-act fit: error: {expected}")


def test_unknown_option_lists_the_accepted_ones(in_tmp, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.learning_rate=0.1"])
    (line,) = error_lines(capsys.readouterr().err)
    assert "option 'learning_rate' is not accepted; allowed: arch, num_classes, cifar_stem, optimizer, lr" in line


def test_missing_data_fails_in_one_line(in_tmp, capsys):
    with pytest.raises(SystemExit):
        main(["fit", f"--config={CONFIGS / 'cifar10_resnet18.yaml'}", f"--data.data_dir={in_tmp / 'nowhere'}"])
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("lightning-act fit: error: CIFAR10DataModule: data_dir=") and "download=true" in line


def test_fit_help_names_the_callbacks_help(in_tmp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    assert "fit --trainer.callbacks.help ActCompression" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.callbacks.help", "ActCompression"])
    assert "--trainer.callbacks.budget BUDGET" in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, overrides, bits, budget",
    [
        # bits on the command line replaces the config's adaptive policy ...
        ("shakespeare_transformer.yaml", ["--trainer.callbacks.bits=4"], 4, None),
        # ... budget on the command line the config's fixed bits ...
        ("cifar10_resnet18.yaml", ["--trainer.callbacks.budget=3"], 2, 3.0),
        # ... and a setting the command line leaves alone stays as the config has it.
        ("shakespeare_transformer.yaml", ["--trainer.callbacks.rules={}"], 2, 4.0),
    ],
)
def test_policy_on_the_command_line_replaces_the_configs(config, overrides, bits, budget, in_tmp):
    data = {"shakespeare_transformer.yaml": "tinyshakespeare", "cifar10_resnet18.yaml": "cifar10"}[config]
    if not (DATA / data).is_dir():
        pytest.skip(f"{DATA / data} is absent: the shared real data sets are not on this machine")
    cli = ActCLI([f"--config={CONFIGS / config}", *overrides], run=False)
    (compression,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActCompression)]
    assert compression.config.bits == bits
    assert compression.adaptive == (budget is not None)
    if budget is not None:
        assert compression.policy.budget == budget


def test_memory_target_on_the_command_line_replaces_the_configs_budget(in_tmp):
    if not (DATA / "tinyshakespeare").is_dir():
        pytest.skip(f"{DATA / 'tinyshakespeare'} is absent: the shared real data sets are not on this machine")
    config = f"--config={CONFIGS / 'shakespeare_transformer.yaml'}"
    cli = ActCLI([config, "--trainer.callbacks.memory_target=2GiB"], run=False)
    (compression,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActCompression)]
    assert compression.targeted and compression.policy.target_bytes == 2 * 2**30


def test_bits_and_budget_both_on_the_command_line_fail_in_one_line(in_tmp, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.callbacks.bits=4", "--trainer.callbacks.budget=3"])
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("lightning-act fit: error: ActCompression: bits=4 and budget=3")


def test_one_line_passes_single_lines_through():
    assert one_line("unrecognized arguments: --foo=1") == "unrecognized arguments: --foo=1"
