"""The examples in README.md and docs/ run as written, so the documentation cannot drift
from the code.

An example is a ```python block right after a line ``<!-- example: NAME -->``; each runs
in a fresh namespace (in a temporary directory, where Lightning writes its logs), and the
names it leaves behind are checked against what the text around it promises.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning_act import ActCompression

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
EXAMPLE = re.compile(r"^<!-- example: (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
YAML_BLOCK = re.compile(r"^```yaml\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def _examples() -> dict[str, tuple[Path, int, str]]:
    found: dict[str, tuple[Path, int, str]] = {}
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in EXAMPLE.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            assert match["name"] not in found, f"example {match['name']!r} is named twice ({document.name}:{line})"
            found[match["name"]] = (document, line, match["code"])
    return found


EXAMPLES = _examples()


def _run(name: str) -> dict:
    document, line, code = EXAMPLES[name]
    # Pad with blank lines so a traceback points at the line in the document.
    compiled = compile("\n" * (line - 1) + code, str(document.relative_to(ROOT)), "exec")
    namespace = {"__name__": "__main__"}
    torch.manual_seed(0)
    exec(compiled, namespace)
    return namespace


def test_the_documents_mark_their_complete_examples():
    assert {"lightning", "pytorch", "settings", "adaptive-pytorch", "plain-target"} <= set(EXAMPLES)
    assert EXAMPLES["lightning"][0].name == EXAMPLES["pytorch"][0].name == "README.md"


def test_lightning_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _run("lightning")
    trainer = ns["trainer"]
    callback = next(c for c in trainer.callbacks if isinstance(c, ActCompression))
    assert trainer.state.finished and trainer.global_step == 16
    # 2 bits in groups of 256 with 32-bit statistics per group: 15x on fp32 activations.
    assert 14.0 < callback.last_report.ratio < 15.1
    assert (tmp_path / "lightning_logs").is_dir()


def test_plain_pytorch_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns = _run("pytorch")
    report = ns["capture"].report
    assert 14.0 < report.ratio < 15.1
    out = capsys.readouterr().out
    assert f"activation memory {report.ratio:.1f}x smaller" in out and "total" in out


def test_settings_example():
    callback = _run("settings")["callback"]
    # Building the callback validates every setting and rule (a bad one raises ValueError).
    assert isinstance(callback, ActCompression) and not callback.adaptive and callback.config.bits == 2


@pytest.mark.slow  # 1.5 s
def test_adaptive_pytorch_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _run("adaptive-pytorch")
    capture = ns["capture"]
    assert capture.policy.assignment, "calibrate allocated no bits"
    assert set(capture.policy.assignment) <= set(capture.slots)
    assert capture.report.stored_bytes < capture.report.saved_bytes


@pytest.mark.slow  # a target's plans over several steps: 8 s
def test_plain_target_example():
    """In a process of its own: the target bounds every live tensor of the process, and a
    test session holds others."""
    document, line, code = EXAMPLES["plain-target"]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, target = map(float, re.search(r"peak ([\d.]+) MiB of a (\d+) MiB target", done.stdout).groups())
    assert 0 < peak <= target


def _callback_yaml_blocks() -> list:
    blocks = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in YAML_BLOCK.finditer(text):
            if "class_path: ActCompression" in match["code"]:
                line = text.count("\n", 0, match.start("code")) + 1
                blocks.append(pytest.param(match["code"], id=f"{document.name}:{line}"))
    return blocks


@pytest.mark.parametrize("block", _callback_yaml_blocks())
def test_callback_settings_in_yaml_blocks_are_accepted(block):
    loaded = yaml.safe_load(block)
    entries = loaded if isinstance(loaded, list) else loaded["trainer"]["callbacks"]
    callbacks = [ActCompression(**entry["init_args"]) for entry in entries if entry["class_path"] == "ActCompression"]
    assert callbacks


def _anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_documents_resolve():
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            assert linked.is_file(), f"{document.name} links to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.MULTILINE)
                assert anchor in {_anchor(h) for h in headings}, f"{document.name} links to {target}: no such heading"
