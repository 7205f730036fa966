"""Builds and loads the fused C++ (CPU) and CUDA kernels of :mod:`lightning_act.ops`.

The kernels are compiled with ninja the first time an op runs on a device type, cached on
disk, and register themselves with the dispatcher for that device, overriding the
pure-PyTorch reference there. A build that fails costs one warning and nothing else: the
reference computes the same bits, only slower. The sources are ``csrc/`` of a source
checkout, shipped as ``lightning_act/_csrc`` in an installed package.

Environment variables:

* ``LIGHTNING_ACT_KERNELS``: ``auto`` (default) builds the kernels, ``reference`` never
  builds them and uses the reference everywhere. It is read when a device type's kernels
  are first needed.
* ``LIGHTNING_ACT_BUILD_DIR``: root of the build cache, ``~/.cache/lightning_act`` by
  default. Each build goes to a subfolder named after the torch version, the Python
  version, the device type and a hash of the sources and flags, so changing any of them
  triggers a fresh build instead of reusing a stale library.

``python -m lightning_act.ops.extension --compile-cuda`` compiles the CUDA sources with
nvcc alone, which needs neither a GPU nor the CUDA runtime (for CI machines without GPUs).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["BUILD_DIR_ENV", "KERNELS_ENV", "compile_cuda_sources", "ensure_kernels", "loaded_kernels"]

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
_SOURCES = {"cpu": ("quant_cpu.cpp", "division_cpu.cpp"), "cuda": ("quant_cuda.cu", "division_cuda.cu")}


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
    """Makes sure the fused kernels for ``device``'s type were built and loaded, once.

    Called by every op before dispatching. The first call for ``cpu`` (or for ``cuda`` when
    CUDA is available) builds the kernels, which can take a minute; later calls return at
    once. Other device types have no fused kernels and use the reference.

    Raises:
        ValueError: ``LIGHTNING_ACT_KERNELS`` holds a value other than ``auto`` or
            ``reference``.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if device_type in _loaded:
        return
    with _lock:
        if device_type not in _loaded:
            _loaded[device_type] = _load(device_type)


def loaded_kernels() -> dict[str, bool]:
    """Whether the fused kernels serve each device type.

    ``cpu`` and ``cuda`` are always listed, other device types once an op ran on them.
    False means the reference serves that device type: the kernels were not needed yet,
    have no build for it, are disabled, or failed to build (which warned).
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
    sources = [_SOURCE_DIR / name for name in _SOURCES[device_type]]
    missing = [str(path) for path in sources + [_SOURCE_DIR / name for name in _HEADERS] if not path.is_file()]
    if missing:
        _warn_fallback(device_type, f"Kernel sources not found: {', '.join(missing)}.")
        return False

    # Imported on demand: importing it probes for a CUDA toolkit and may log about it.
    from torch.utils import cpp_extension

    cflags, cuda_flags, ldflags = _build_flags(device_type)
    build_dir = _build_dir(device_type, sources, cflags + cuda_flags + ldflags)
    _LOGGER.info("building lightning_act %s kernels (first use) in %s", device_type, build_dir)
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=f"lightning_act_{device_type}",
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
    except Exception as error:  # noqa: BLE001 - any build or load failure falls back to the reference
        _warn_fallback(device_type, f"Build error:\n{_first_error_lines(error)}")
        return False
    _LOGGER.info("lightning_act %s kernels ready in %.1f s", device_type, time.perf_counter() - started)
    return True


def _build_flags(device_type: str) -> tuple[list[str], list[str], list[str]]:
    """(C++ flags, nvcc flags, linker flags) of one device type's extension."""
    if device_type == "cuda":
        return list(_HOST_FLAGS), list(_CUDA_FLAGS), []
    # at::parallel_for is expanded in the extension itself: without the OpenMP flags torch
    # was built with, it silently runs on one thread.
    openmp = ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() else []
    return _HOST_FLAGS + openmp, [], openmp


def _build_dir(device_type: str, sources: list[Path], flags: list[str]) -> Path:
    digest = hashlib.sha256()
    for path in sorted(sources + [_SOURCE_DIR / name for name in _HEADERS]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update("\0".join(flags).encode())
    default_root = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "lightning_act"
    root = Path(os.environ.get(BUILD_DIR_ENV) or default_root).expanduser()
    name = f"{torch.__version__}-{sys.implementation.cache_tag}-{device_type}-{digest.hexdigest()[:12]}"
    return root / name


def _first_error_lines(error: BaseException) -> str:
    """The compiler's error lines of a build failure, or else the start of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    # torch's first line is "Error building extension '...': " followed by ninja's echo of
    # the whole compiler command; the command is noise here.
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


def compile_cuda_sources(arch: str = "90", output_dir: str | os.PathLike | None = None) -> None:
    """Compiles every ``csrc/*.cu`` to an object file with nvcc alone.

    Needs the CUDA toolkit (``CUDA_HOME`` or nvcc on ``PATH``) but no GPU and no CUDA
    runtime, so CI machines without GPUs can check that the CUDA kernels compile.

    Args:
        arch: compute capability without the dot, e.g. ``"90"`` for H100.
        output_dir: where the object files go; a temporary folder, removed afterwards, by
            default.

    Raises:
        FileNotFoundError: no nvcc or no ``.cu`` source was found.
        subprocess.CalledProcessError: nvcc failed; its output is in ``output``.
    """
    from torch.utils import cpp_extension  # see _load

    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not nvcc.is_file():
        raise FileNotFoundError(f"nvcc not found under CUDA_HOME={cuda_home!r}; set CUDA_HOME to the CUDA toolkit")
    sources = sorted(_SOURCE_DIR.glob("*.cu"))
    if not sources:
        raise FileNotFoundError(f"no CUDA sources in {_SOURCE_DIR}")
    includes = [*cpp_extension.include_paths(device_type="cuda"), str(Path(cuda_home, "include")), str(_SOURCE_DIR)]
    flags = [
        "-DTORCH_EXTENSION_NAME=lightning_act_cuda",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *cpp_extension.COMMON_NVCC_FLAGS,
        "-std=c++20",
        "--compiler-options",
        "-fPIC",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        *_CUDA_FLAGS,
        *(f"-I{path}" for path in dict.fromkeys(includes)),
    ]
    with tempfile.TemporaryDirectory(prefix="lightning_act_nvcc_") as scratch:
        target = Path(output_dir) if output_dir is not None else Path(scratch)
        target.mkdir(parents=True, exist_ok=True)
        for source in sources:
            command = [str(nvcc), "-c", str(source), "-o", str(target / f"{source.stem}.o"), *flags]
            subprocess.run(command, check=True, capture_output=True, text=True)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_act.ops.extension", description=__doc__.split("\n")[0])
    parser.add_argument("--compile-cuda", action="store_true", help="compile csrc/*.cu with nvcc (no GPU needed)")
    parser.add_argument("--arch", default="90", help="compute capability for --compile-cuda (default: 90)")
    parser.add_argument("--output-dir", help="keep the object files of --compile-cuda here")
    args = parser.parse_args(argv)
    if not args.compile_cuda:
        parser.print_help()
        return 2
    sources = ", ".join(path.name for path in sorted(_SOURCE_DIR.glob("*.cu")))
    started = time.perf_counter()
    try:
        compile_cuda_sources(args.arch, args.output_dir)
    except subprocess.CalledProcessError as error:
        print(f"nvcc failed (exit {error.returncode}) on {sources}:\n{error.stdout}{error.stderr}", file=sys.stderr)
        return 1
    print(f"compiled {sources} from {_SOURCE_DIR} for sm_{args.arch} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
