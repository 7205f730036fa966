"""The CUDA kernels of csrc/, executed on the CPU by the lock-step emulator, bit for bit
against the CPU kernels.

``run_kernels.cpp`` compiles the kernel headers (``quant_kernels.cuh``,
``division_kernels.cuh``) with g++ under AddressSanitizer and UndefinedBehaviorSanitizer,
together with ``emulated_cuda.h`` and ``lockstep.cpp``, which run each CUDA thread as a fiber
and check CUDA's warp-shuffle rules. A sanitizer report or a broken rule aborts the emulator,
which fails the test with its message.

The cases cover every op, bits, dtype and a range of group sizes, with tails, misaligned
inputs and codes, and emulated devices of 1, 3 and 64 multiprocessors, so that the kernels'
grid-stride loops run several rounds, blocks are partly used and warps partly active.
Inputs are fresh random draws on every run; a failure prints the generator seed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_act import ops
from lightning_act.ops import extension

from tests.conftest import DTYPES, assert_same_bits
from tests.test_ops import random_input

pytestmark = pytest.mark.slow

EMU_DIR = Path(__file__).resolve().parent
BITS = (1, 2, 4, 8)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
MULTIPROCESSORS = (1, 3, 64)
# -ffp-contract=off as in the extension's build: a fused multiply-add rounds differently
# from the reference. -O1 keeps the sanitizers' reports readable and the build short. GCC's
# "undefined" leaves out the float checks: out-of-range float-to-int conversions are
# undefined in C++ and differ between CPU and GPU.
COMPILE_FLAGS = (
    "-std=c++20",
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-ffp-contract=off",
    "-fsanitize=address,undefined,float-cast-overflow,float-divide-by-zero",
    "-fno-sanitize-recover=all",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-pragmas",
)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    """The emulator executable, built from this checkout's kernel sources."""
    ops.ensure_kernels("cpu")
    assert ops.loaded_kernels()["cpu"], "the fused CPU kernels, which the emulated ones are compared with, did not load"
    compiler = os.environ.get("CXX", "g++")
    assert shutil.which(compiler), f"no C++ compiler {compiler!r} on PATH (set CXX)"
    executable = tmp_path_factory.mktemp("emu") / "run_kernels"
    command = [
        compiler,
        *COMPILE_FLAGS,
        f"-I{extension._SOURCE_DIR}",
        f"-I{EMU_DIR}",
        "-isystem",
        str(Path(torch.__file__).parent / "include"),
        str(EMU_DIR / "lockstep.cpp"),
        str(EMU_DIR / "run_kernels.cpp"),
        "-o",
        str(executable),
    ]
    started = time.perf_counter()
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, f"building the emulator failed:\n{built.stderr[-6000:]}"
    print(f"emulator built in {time.perf_counter() - started:.1f} s")
    return executable


def run_emulator(executable: Path, cases: list[str]) -> None:
    """Runs the cases; fails with the emulator's or a sanitizer's report if it aborts."""
    started = time.perf_counter()
    result = subprocess.run(
        [str(executable)],
        input="\n".join(cases) + "\n",
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:print_legend=0", "UBSAN_OPTIONS": "print_stacktrace=1"},
    )
    # ASan's one-line notice that it cannot vouch for every fiber switch; lockstep.cpp
    # announces each switch to it.
    report = "\n".join(line for line in result.stderr.splitlines() if "makecontext/swapcontext" not in line)
    # A sanitizer report says what and where first; ASan's ends with the case being run.
    shown = report if len(report) <= 8000 else f"{report[:6000]}\n...\n{report[-1000:]}"
    assert result.returncode == 0, f"emulator exit {result.returncode}:\n{shown}"
    assert not report.strip(), f"emulator printed:\n{shown}"
    assert result.stdout.strip() == f"{len(cases)} cases"
    print(f"{len(cases)} emulated cases in {time.perf_counter() - started:.1f} s")


def save(tensor: torch.Tensor, path: Path) -> str:
    tensor.contiguous().view(torch.uint8).numpy().tofile(path)
    return str(path)


def load(path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype).reshape(shape)


def misaligned_copy(x: torch.Tensor, offset: int) -> torch.Tensor:
    """x placed `offset` elements into a larger allocation, as a view the CPU kernels read."""
    storage = torch.empty(offset + x.numel(), dtype=x.dtype)
    view = storage[offset:].view(x.shape)
    view.copy_(x)
    return view


@dataclass
class QuantCase:
    dtype: torch.dtype
    bits: int
    group_size: int
    numel: int
    offset: int  # elements of misalignment of the input; bytes of the codes when decoding
    multiprocessors: int
    seed: int
    matrix: tuple[int, int] = (0, 0)  # rows, columns of a column_major pack; (0, 0): memory order


def quant_cases(g: torch.Generator) -> list[QuantCase]:
    """Every dtype and bits with group sizes from one lane per group to whole warps per group."""

    def draw(high: int) -> int:
        return int(torch.randint(high, (1,), generator=g))

    cases = []
    group_sizes = (8, 32, 256, 65536)
    for (d, dtype), (b, bits), (s, group_size) in itertools.product(
        enumerate(DTYPES), enumerate(BITS), enumerate(group_sizes)
    ):
        if group_size <= 32:  # several rounds of the grid-stride loops on 1 and 3 multiprocessors
            numel = 4096 + draw(8192)
        elif group_size == 256:
            numel = 1 + draw(20 * group_size)
        else:
            numel = group_size + 1 + draw(group_size)
        # Each dtype, bits and group size meets both alignments and every device size.
        offset = 0 if (d + b + s) % 2 == 0 else 1 + draw(7)
        multiprocessors = MULTIPROCESSORS[(d + b + s) % 3]
        cases.append(QuantCase(dtype, bits, group_size, numel, offset, multiprocessors, draw(2**62) * 2 + 1))
    # Tensors shorter than a chunk, a group, or a warp's groups.
    for numel in (1, 7, 8, 9, 100, 255, 257):
        dtype = DTYPES[draw(len(DTYPES))]
        cases.append(
            QuantCase(dtype, BITS[draw(4)], 8 << draw(6), numel, draw(3), MULTIPROCESSORS[draw(3)], draw(2**62))
        )
    # Column-major: matrices shorter and taller than a group, columns ending inside a chunk.
    for index, (rows, columns) in enumerate(((1, 9), (9, 1), (7, 11), (128, 40), (300, 3), (64, 33))):
        matrices = 1 + draw(4)
        cases.append(
            QuantCase(
                DTYPES[index % len(DTYPES)],
                BITS[index % len(BITS)],
                (8, 64, 256)[index % 3],
                matrices * rows * columns,
                draw(3),
                MULTIPROCESSORS[draw(3)],
                draw(2**62),
                (rows, columns),
            )
        )
    return cases


def test_quantize_pack_and_unpack_dequantize(emulator, tmp_path, generator):
    cases = quant_cases(generator)
    lines, expected = [], []
    for index, case in enumerate(cases):
        rows, columns = case.matrix
        shape = (-1, rows, columns) if rows else (-1,)
        x = misaligned_copy(random_input(case.numel, case.dtype, generator).view(shape), case.offset)
        codes, stats = ops.quantize_pack(x, case.bits, case.group_size, case.seed, column_major=rows > 0)
        name = DTYPE_NAMES[case.dtype]
        base = tmp_path / str(index)
        lines.append(
            f"quantize_pack {name} {case.bits} {case.group_size} {case.seed} {case.multiprocessors} {case.offset} "
            f"{case.numel} {save(x, base.with_suffix('.in'))} {base}.codes {base}.stats {rows} {columns}"
        )
        expected.append((f"{base}.codes", codes, f"quantize_pack codes, {case}"))
        expected.append((f"{base}.stats", stats, f"quantize_pack stats, {case}"))
        # The decoder reads the CPU kernels' codes, so it is checked apart from the encoder.
        save(codes, Path(f"{base}.cpu_codes"))
        save(stats, Path(f"{base}.cpu_stats"))
        for out_dtype in dict.fromkeys((case.dtype, torch.float32)):
            decoded = ops.unpack_dequantize(
                codes, stats, case.bits, case.group_size, case.numel, out_dtype, rows, columns
            )
            out = f"{base}.{DTYPE_NAMES[out_dtype]}"
            codes_offset = int(torch.randint(8, (1,), generator=generator))
            lines.append(
                f"unpack_dequantize {DTYPE_NAMES[out_dtype]} {case.bits} {case.group_size} {case.multiprocessors} "
                f"{codes_offset} {case.numel} {base}.cpu_codes {base}.cpu_stats {out} {rows} {columns}"
            )
            expected.append((out, decoded, f"unpack_dequantize to {out_dtype}, codes offset {codes_offset}, {case}"))

    run_emulator(emulator, lines)

    for path, want, what in expected:
        assert_same_bits(load(Path(path), want.dtype, tuple(want.shape)), want, what)


@dataclass
class DivisionCase:
    dtype: torch.dtype
    lfc_dtype: torch.dtype
    planes: int
    height: int
    width: int
    block_h: int
    block_w: int
    bits: int
    group_size: int
    offset: int
    multiprocessors: int
    seed: int


def division_cases(g: torch.Generator) -> list[DivisionCase]:
    """Every dtype and bits; tiles that divide the planes or leave partial tiles at the edges."""

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    blocks = ((8, 8), (4, 1), (3, 5), (1, 1), (16, 16))
    sizes = itertools.cycle(MULTIPROCESSORS)
    cases = []
    for index, (dtype, bits) in enumerate(itertools.product(DTYPES, BITS)):
        block_h, block_w = blocks[index % len(blocks)]
        cases.append(
            DivisionCase(
                dtype,
                DTYPES[draw(0, 2)],
                planes=draw(1, 6),
                height=draw(1, 40),
                width=draw(1, 40),
                block_h=block_h,
                block_w=block_w,
                bits=bits,
                group_size=(8, 64, 256)[index % 3],
                offset=draw(0, 3),
                multiprocessors=next(sizes),
                seed=draw(0, 2**62),
            )
        )
    return cases


def test_division_pack_and_unpack(emulator, tmp_path, generator):
    lines, expected = [], []
    for index, case in enumerate(division_cases(generator)):
        shape = (case.planes, case.height, case.width)
        x = random_input(case.planes * case.height * case.width, case.dtype, generator).view(shape)
        x = misaligned_copy(x, case.offset)
        args = (case.block_h, case.block_w, case.bits, case.group_size)
        lfc, codes, stats = ops.division_pack(x, *args, case.seed, case.lfc_dtype)
        decoded = ops.division_unpack(lfc, codes, stats, case.height, case.width, *args, case.dtype)
        base = tmp_path / str(index)
        geometry = (
            f"{DTYPE_NAMES[case.dtype]} {DTYPE_NAMES[case.lfc_dtype]} {case.planes} {case.height} {case.width} "
            f"{case.block_h} {case.block_w} {case.bits} {case.group_size}"
        )
        lines.append(
            f"division_pack {geometry} {case.seed} {case.multiprocessors} {case.offset} "
            f"{save(x, base.with_suffix('.in'))} {base}.lfc {base}.codes {base}.stats"
        )
        lines.append(
            f"division_unpack {geometry} {case.multiprocessors} {save(lfc, Path(f'{base}.cpu_lfc'))} "
            f"{save(codes, Path(f'{base}.cpu_codes'))} {save(stats, Path(f'{base}.cpu_stats'))} {base}.out"
        )
        for suffix, want, what in (
            ("lfc", lfc, "lfc"),
            ("codes", codes, "codes"),
            ("stats", stats, "stats"),
            ("out", decoded, "division_unpack"),
        ):
            expected.append((f"{base}.{suffix}", want, f"{what}, {case}"))

    run_emulator(emulator, lines)

    for path, want, what in expected:
        assert_same_bits(load(Path(path), want.dtype, tuple(want.shape)), want, what)
