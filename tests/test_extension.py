"""How the kernel loader builds: where a build is cached, and what it tells the user.

The loader's fallbacks (failed builds, missing sources, reference mode) are tested in
test_ops.py; the CUDA build itself is checked by CI through ``python -m lightning_act.ops
--build cuda``.
"""

from __future__ import annotations

import importlib
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from lightning_act.ops import extension

SOURCES = [extension._SOURCE_DIR / name for name in extension._SOURCES["cpu"]]


def test_two_environments_with_one_torch_version_build_apart(monkeypatch):
    here = extension._build_dir("cpu", SOURCES, ["-O3"])
    assert extension._build_dir("cpu", SOURCES, ["-O3"]) == here
    assert extension._build_dir("cpu", SOURCES, ["-O2"]) != here

    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    other_venv = extension._build_dir("cpu", SOURCES, ["-O3"])
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    other_torch = extension._build_dir("cpu", SOURCES, ["-O3"])

    assert len({here, other_venv, other_torch}) == 3
    for path in (other_venv, other_torch):
        assert path.parent == here.parent and path.name.startswith(torch.__version__)


def test_two_checkouts_with_the_same_sources_build_apart(monkeypatch, tmp_path):
    # ninja's build file names the sources by absolute path: a shared folder would rebuild.
    here = extension._build_dir("cpu", SOURCES, ["-O3"])
    copy = tmp_path / "csrc"
    shutil.copytree(extension._SOURCE_DIR, copy)
    monkeypatch.setattr(extension, "_SOURCE_DIR", copy)
    there = extension._build_dir("cpu", [copy / path.name for path in SOURCES], ["-O3"])
    assert there != here and there.parent == here.parent


def test_cuda_builds_for_other_architectures_build_apart(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    hopper = extension._build_dir("cuda", SOURCES, [])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert extension._build_dir("cuda", SOURCES, []) != hopper


class _FakeCompiler:
    """cpp_extension with a compiler that only writes the library file: the build's
    announcements are under test here, not the compiler."""

    LIB_EXT = ".so"

    def __init__(self):
        self.builds = 0

    def load(self, name, build_directory, **_):
        self.builds += 1
        (Path(build_directory) / f"{name}{self.LIB_EXT}").write_bytes(b"")


def test_a_build_is_announced_with_its_duration_and_a_cached_one_is_silent(monkeypatch, tmp_path, caplog):
    compiler = _FakeCompiler()
    monkeypatch.setattr(extension, "_cpp_extension", lambda: compiler)
    monkeypatch.setenv(extension.BUILD_DIR_ENV, str(tmp_path))

    with caplog.at_level(logging.WARNING, logger="lightning_act"):
        build_dir = extension.build_kernels("cpu")
    announced = [record for record in caplog.records if record.name == "lightning_act"]
    assert [record.levelno for record in announced] == [logging.WARNING, logging.WARNING]
    assert f"building the fused cpu kernels, once per environment, in {build_dir}" in announced[0].getMessage()
    assert announced[1].getMessage().startswith("lightning_act: built the fused cpu kernels in ")
    assert announced[1].getMessage().endswith(" s")

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="lightning_act"):
        assert extension.build_kernels("cpu") == build_dir
    assert compiler.builds == 2  # ninja is still asked, and finds nothing to do
    assert not [record for record in caplog.records if record.name == "lightning_act"]


def test_cuda_build_without_gpu_needs_architectures(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no GPU is visible to choose the CUDA architectures from; set TORCH_CUDA"):
        extension.build_kernels("cuda")


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in nvcc is a shell script")
def test_cuda_links_the_runtime_of_the_toolkit_behind_an_nvcc_wrapper(monkeypatch, tmp_path):
    # /usr/local/bin/nvcc running /usr/local/cuda-X/bin/nvcc: torch takes /usr/local for the
    # toolkit and finds no libcudart there; nvcc's dry run names the real folder.
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "lib64").mkdir()
    real_nvcc = toolkit / "bin" / "nvcc"
    real_nvcc.write_text(f'#!/bin/sh\necho "#$ _HERE_={toolkit}/bin" >&2\necho "#$ TOP={toolkit}/bin/.." >&2\n')
    wrapper_home = tmp_path / "local"
    (wrapper_home / "bin").mkdir(parents=True)
    wrapper = wrapper_home / "bin" / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {real_nvcc} "$@"\n')
    for script in (real_nvcc, wrapper):
        script.chmod(0o755)
    monkeypatch.setattr(extension._cpp_extension(), "CUDA_HOME", str(wrapper_home))

    assert extension._build_flags("cuda")[2] == [f"-L{toolkit / 'lib64'}"]


def test_unknown_device_type_is_rejected():
    with pytest.raises(ValueError, match="no fused kernels for device type 'mps'; allowed: cpu, cuda"):
        extension.build_kernels("mps")


def test_the_toolkit_probe_stays_quiet_on_machines_without_gpu(monkeypatch, tmp_path, caplog):
    # torch logs "No CUDA runtime is found" when it finds a CUDA toolkit but no GPU, as it
    # imports cpp_extension; here it is imported afresh, once bare and once by the loader.
    monkeypatch.setattr(torch.utils, "cpp_extension", extension._cpp_extension())
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    torch_logger.addHandler(caplog.handler)
    try:
        monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension")
        importlib.import_module("torch.utils.cpp_extension")

        assert any("No CUDA runtime is found" in record.getMessage() for record in caplog.records)
        caplog.clear()
        monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension")
        assert str(tmp_path) == extension._cpp_extension().CUDA_HOME
    finally:
        torch_logger.removeHandler(caplog.handler)
    assert not [record for record in caplog.records if "No CUDA runtime" in record.getMessage()]


@pytest.mark.skipif(extension.fcntl is None, reason="needs POSIX file locks")
def test_a_killed_build_does_not_hang_the_next(tmp_path):
    # torch waits without end for the lock file a killed build left behind.
    (tmp_path / "lock").write_text("")
    with extension._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").write_text("")  # a build under way: not ours to remove
    assert (tmp_path / "lock").exists()
