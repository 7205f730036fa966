"""Builds and loads the fused C++ (CPU) and CUDA kernels of :mod:`lightning_act.ops`.

The kernels are compiled with ninja the first time an op runs on a device type, cached on disk, and registered
for that device, overriding the pure-PyTorch reference. A failed build warns once; the reference computes the
same bits, only slower. Sources: ``csrc/`` of a checkout, ``lightning_act/_csrc`` when installed.

Environment variables:

* ``LIGHTNING_ACT_KERNELS``: ``auto`` (default) builds the kernels, ``reference`` never does.
* ``LIGHTNING_ACT_BUILD_DIR``: the build cache (default ``lightning_act`` under ``XDG_CACHE_HOME`` or
  ``~/.cache``), one folder per torch and Python version, device type and hash of the sources, flags, CUDA
  architectures, environment and source folder, so no stale build is reused and checkouts never collide.
* ``TORCH_CUDA_ARCH_LIST``: CUDA architectures to build for (default: those of the visible GPUs).

``python -m lightning_act.ops --build {cpu,cuda}`` builds and loads one device type's kernels as their first
use does, without running them; ``cuda`` needs nvcc but no GPU when ``TORCH_CUDA_ARCH_LIST`` is set (CI).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: torch's own lock file alone guards the build
    fcntl = None

import torch

__all__ = ["BUILD_DIR_ENV", "KERNELS_ENV", "build_kernels", "ensure_kernels", "loaded_kernels"]

KERNELS_ENV = "LIGHTNING_ACT_KERNELS"
BUILD_DIR_ENV = "LIGHTNING_ACT_BUILD_DIR"
_KERNEL_MODES = ("auto", "reference")

_LOGGER = logging.getLogger("lightning_act")

_HEADERS = (
    "quant_math.h",
    "quant_args.h",
    "quant_cpu.h",
    "quant_kernels.cuh",
    "quant_cuda.cuh",
    "division_math.h",
    "division.h",
    "division_kernels.cuh",
)
_SOURCES = {
    "cpu": ("quant_cpu.cpp", "division_cpu.cpp", "graph_saves.cpp", "live_memory.cpp"),
    "cuda": ("quant_cuda.cu", "division_cuda.cu"),
}


def _find_source_dir() -> Path:
    """``csrc/`` of an installed package (shipped as ``lightning_act/_csrc``) or of a checkout."""
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "_csrc", package.parent / "csrc")
    for candidate in candidates:
        if all((candidate / header).is_file() for header in _HEADERS):
            return candidate
    return candidates[-1]


_SOURCE_DIR = _find_source_dir()

# -ffp-contract=off and --fmad=false forbid fusing a multiply and an add into one FMA,
# which would round differently from the reference.
_HOST_FLAGS = ["-O3", "-ffp-contract=off"]
_CUDA_FLAGS = ["-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off"]
# The build log lines kept in a failure warning.
_ERROR_LINES = 8

_lock = threading.Lock()
# Device type -> whether its fused kernels are registered; present once resolved.
_loaded: dict[str, bool] = {}


def ensure_kernels(device: torch.device | str) -> None:
    """Builds and loads the fused kernels for ``device``'s type once (every op calls it before dispatching);
    the first call for ``cpu`` or ``cuda`` can take a minute. Other device types use the reference.

    Raises:
        ValueError: ``LIGHTNING_ACT_KERNELS`` is neither ``auto`` nor ``reference``.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if device_type in _loaded:
        return
    with _lock:
        if device_type not in _loaded:
            _loaded[device_type] = _load(device_type)


def loaded_kernels() -> dict[str, bool]:
    """Whether the fused kernels serve each device type (``cpu`` and ``cuda`` always listed, others once used).

    False: the reference serves it (kernels not needed yet, not available, disabled, or failed to build).
    """
    return {"cpu": False, "cuda": False, **_loaded}


def _kernel_mode() -> str:
    mode = os.environ.get(KERNELS_ENV, "auto")
    if mode not in _KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r} is not supported; allowed: {', '.join(_KERNEL_MODES)}")
    return mode


def _load(device_type: str) -> bool:
    """Builds and loads the kernels of one device type; True when they are registered."""
    if _kernel_mode() == "reference" or device_type not in _SOURCES:
        return False
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        build_kernels(device_type)
    except FileNotFoundError as error:
        _warn_fallback(device_type, str(error))
        return False
    except Exception as error:
        _warn_fallback(device_type, f"Build error:\n{_first_error_lines(error)}")
        return False
    return True


def build_kernels(device_type: str) -> Path:
    """Builds, links and loads the fused kernels of ``device_type`` exactly as the first op does; returns the
    build folder. Loading only registers them, so CUDA kernels load without a GPU given ``TORCH_CUDA_ARCH_LIST``.

    Raises:
        ValueError: ``device_type`` has no fused kernels, or it is ``cuda``, no GPU is
            visible and ``TORCH_CUDA_ARCH_LIST`` is not set.
        FileNotFoundError: a kernel source is missing.
        Exception: whatever the compiler, linker or loader raised, with their output.
    """
    if device_type not in _SOURCES:
        raise ValueError(f"no fused kernels for device type {device_type!r}; allowed: {', '.join(_SOURCES)}")
    sources = [_SOURCE_DIR / name for name in _SOURCES[device_type]]
    missing = [str(path) for path in sources + [_SOURCE_DIR / name for name in _HEADERS] if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"Kernel sources not found: {', '.join(missing)}.")
    if device_type == "cuda" and not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        raise ValueError(
            "no GPU is visible to choose the CUDA architectures from; set TORCH_CUDA_ARCH_LIST, e.g. to 9.0"
        )
    cpp_extension = _cpp_extension()
    name = f"lightning_act_{device_type}"
    cflags, cuda_flags, ldflags = _build_flags(device_type)
    build_dir = _build_dir(device_type, sources, cflags + cuda_flags + ldflags)
    cached = (build_dir / f"{name}{cpp_extension.LIB_EXT}").is_file()
    if not cached:
        _LOGGER.warning(
            "lightning_act: building the fused %s kernels, once per environment, in %s", device_type, build_dir
        )
    started = time.perf_counter()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_build(build_dir):
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_ldflags=ldflags,
            extra_include_paths=[str(_SOURCE_DIR)],
            build_directory=str(build_dir),
            with_cuda=device_type == "cuda",
            is_python_module=False,
            verbose=False,
        )
    if not cached:
        elapsed = time.perf_counter() - started
        _LOGGER.warning("lightning_act: built the fused %s kernels in %.1f s", device_type, elapsed)
    return build_dir


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """Holds an OS lock on ``build_dir`` while torch builds or loads there.

    torch before 2.14 guards a build with a plain ``lock`` file that a killed build leaves behind, hanging every
    later run. An OS lock dies with its process, so once it is held a ``lock`` file still there is stale: removed.
    """
    if fcntl is None:
        yield
        return
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported on demand without its "No CUDA runtime is found" notice, a false
    alarm for the CPU kernels and no news when building CUDA kernels without a GPU."""
    notice = logging.getLogger("torch.utils.cpp_extension")

    def not_the_cuda_notice(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")

    notice.addFilter(not_the_cuda_notice)
    try:
        from torch.utils import cpp_extension
    finally:
        notice.removeFilter(not_the_cuda_notice)
    return cpp_extension


def _build_flags(device_type: str) -> tuple[list[str], list[str], list[str]]:
    """(C++ flags, nvcc flags, linker flags) of one device type's extension."""
    if device_type == "cuda":
        return list(_HOST_FLAGS), list(_CUDA_FLAGS), _cuda_runtime_dirs()
    # at::parallel_for is expanded in the extension: without torch's OpenMP flags it runs on one thread.
    openmp = ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() else []
    return _HOST_FLAGS + openmp, [], openmp


def _cuda_runtime_dirs() -> list[str]:
    """Linker flags for the CUDA runtime of the toolkit whose nvcc torch compiles with.

    torch links ``-lcudart`` from ``CUDA_HOME`` or two levels above the ``nvcc`` on ``PATH``, which is wrong
    where that ``nvcc`` is a wrapper script. nvcc's dry run reports its real folder (``TOP=``).
    """
    nvcc = Path(_cpp_extension()._join_cuda_home("bin", "nvcc"))
    try:
        dry_run = subprocess.run(
            [str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return []  # torch's own build reports the missing or broken nvcc
    for line in (dry_run.stdout + dry_run.stderr).splitlines():
        if line.startswith("#$ TOP="):
            toolkit = Path(line.removeprefix("#$ TOP=")).resolve()
            return [f"-L{toolkit / lib}" for lib in ("lib64", "lib") if (toolkit / lib).is_dir()]
    return []


def _build_dir(device_type: str, sources: list[Path], flags: list[str]) -> Path:
    digest = hashlib.sha256()
    for path in sorted(sources + [_SOURCE_DIR / name for name in _HEADERS]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    # The install (environments keep their own builds), the source folder (ninja names sources by absolute
    # path) and, for CUDA, the architectures torch adds to the flags.
    environment = [*flags, sys.prefix, str(Path(torch.__file__).resolve().parent), str(_SOURCE_DIR.resolve())]
    if device_type == "cuda":
        environment.append(os.environ.get("TORCH_CUDA_ARCH_LIST") or _visible_architectures())
    digest.update("\0".join(environment).encode())
    default_root = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "lightning_act"
    root = Path(os.environ.get(BUILD_DIR_ENV) or default_root).expanduser()
    name = f"{torch.__version__}-{sys.implementation.cache_tag}-{device_type}-{digest.hexdigest()[:12]}"
    return root / name


def _visible_architectures() -> str:
    """The compute capabilities of the visible GPUs, e.g. "9.0;9.0"."""
    return ";".join(
        "{}.{}".format(*torch.cuda.get_device_capability(index)) for index in range(torch.cuda.device_count())
    )


def _first_error_lines(error: BaseException) -> str:
    """The compiler's error lines of a build failure, or else the start of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    # torch's first line ends with ninja's echo of the whole compiler command: noise here.
    headline = lines[0].split(": [", 1)[0]
    diagnostics = [line for line in lines[1:] if "error" in line.lower() and not line.startswith(("[", "FAILED"))]
    kept = [headline, *diagnostics][:_ERROR_LINES] if diagnostics else lines[:_ERROR_LINES]
    return "\n".join(line if len(line) <= 400 else line[:400] + " ..." for line in kept)


def _warn_fallback(device_type: str, reason: str) -> None:
    warnings.warn(
        f"lightning_act: the fused {device_type} kernels are unavailable, so the pure-PyTorch reference is used "
        f"on {device_type} (same results, slower). {reason}",
        RuntimeWarning,
        stacklevel=5,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_act.ops --build {cpu,cuda}``: :func:`build_kernels` from the shell."""
    parser = argparse.ArgumentParser(prog="python -m lightning_act.ops", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--build",
        choices=sorted(_SOURCES),
        required=True,
        help="build, link and load this device type's kernels as their first use does (no GPU needed for cuda "
        "when TORCH_CUDA_ARCH_LIST is set)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        build_dir = build_kernels(args.build)
    except Exception as error:
        print(f"building the {args.build} kernels failed: {error}", file=sys.stderr)
        return 1
    print(f"{args.build} kernels built and loaded in {time.perf_counter() - started:.1f} s: {build_dir}")
    return 0
