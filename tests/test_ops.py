"""The fused kernels against the pure-PyTorch reference, bit for bit, and their loader.

Inputs are fresh random draws on every run; a failing case prints the generator seed that
reproduces it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning_act import ops
from lightning_act.ops import extension, layout, reference

from tests.conftest import DTYPES, assert_same_bits

BITS = (1, 2, 4, 8)


def _segment(kind: str, numel: int, g: torch.Generator) -> torch.Tensor:
    normal = torch.randn(numel, generator=g)
    if kind == "mixed_signs":
        return normal * torch.empty(numel).exponential_(generator=g) * 10.0 ** torch.randint(-3, 4, (1,), generator=g)
    if kind == "relu":  # many exact zeros: zero-preserving groups, some all zero
        return torch.relu(normal - torch.rand(1, generator=g) * 2)
    if kind == "positive":  # no zeros, no negatives
        return normal.abs() + 0.5
    if kind == "large_offset":  # low's bfloat16 rounding dominates
        return 3.0e4 + normal * 10.0 ** torch.randint(-2, 3, (1,), generator=g)
    if kind == "tiny":  # float32 subnormals and values near them
        return normal * 1.0e-39 + torch.randint(-1, 2, (numel,), generator=g) * 1.0e-38
    if kind == "constant":  # zero step wherever a group falls inside the segment
        return torch.full((numel,), float(normal[0]))
    if kind == "binary":  # zeros and one positive value (dropped binary features): zero step
        return (torch.rand(numel, generator=g) < 0.05).float() * float(normal[0].abs() + 0.1)
    if kind == "integers":  # ties and exact grid points
        return torch.randint(-4, 5, (numel,), generator=g).float()
    raise ValueError(kind)


_KINDS = ("mixed_signs", "relu", "positive", "large_offset", "tiny", "constant", "binary", "integers")


def random_input(numel: int, dtype: torch.dtype, g: torch.Generator, nonfinite: bool = True) -> torch.Tensor:
    """Segments of different kinds, unaligned with the groups, with some NaN and +-Inf."""
    parts, filled = [], 0
    while filled < numel:
        length = min(numel - filled, int(torch.randint(1, 600, (1,), generator=g)))
        parts.append(_segment(_KINDS[int(torch.randint(len(_KINDS), (1,), generator=g))], length, g))
        filled += length
    x = torch.cat(parts) if parts else torch.empty(0)
    if nonfinite and numel > 16:
        where = torch.randint(numel, (max(1, numel // 5000),), generator=g)
        x[where] = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.arange(len(where)) % 3]
    x = x.to(dtype)
    # Converting tiny negatives to float16 makes -0.0; the reference's choice between -0.0
    # and +0.0 as a group's minimum depends on the order of the values, so keep zeros +0.0
    # here (test_signed_zeros covers -0.0).
    return torch.where(x == 0, torch.zeros((), dtype=dtype), x)


def check_against_reference(
    x: torch.Tensor, bits: int, group_size: int, seed: int, device: str, column_major: bool = False
) -> None:
    codes, stats = ops.quantize_pack(x.to(device), bits, group_size, seed, column_major)
    expected_codes, expected_stats = reference.quantize_pack(x, bits, group_size, seed, column_major)
    case = f"shape={tuple(x.shape)} dtype={x.dtype} bits={bits} group_size={group_size} seed={seed}"
    case += " column_major" if column_major else ""
    assert_same_bits(codes, expected_codes, f"codes ({case})")
    assert_same_bits(stats, expected_stats, f"stats ({case})")
    matrix = x.shape[-2:] if column_major else (0, 0)
    for dtype in {x.dtype, torch.float32}:
        decoded = ops.unpack_dequantize(codes, stats, bits, group_size, x.numel(), dtype, *matrix)
        expected = reference.unpack_dequantize(
            expected_codes, expected_stats, bits, group_size, x.numel(), dtype, *matrix
        )
        assert_same_bits(decoded, expected, f"decoded as {dtype} ({case})")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_bit_for_bit(device, dtype, bits, generator):
    for group_size in (8, 16, 32, 64, 256, 1024, 65536):
        if group_size <= 1024:
            numels = {0, 1, 7, 8, group_size - 1, group_size, group_size + 1, 3 * group_size + 5}
            numels.add(int(torch.randint(1, 5000, (1,), generator=generator)))
        else:  # the reference pays for whole padded groups: a few cases suffice
            numels = {1, group_size + 3}
        for numel in sorted(numels):
            seed = int(torch.randint(2**62, (1,), generator=generator)) * 2 + int(numel % 2)
            check_against_reference(random_input(numel, dtype, generator), bits, group_size, seed, device)


@pytest.mark.parametrize(
    ("numel", "dtype", "bits", "group_size"),
    [
        # Crosses the reference's 2**22-element passes with a ragged last group.
        ((1 << 22) + 1000 + 3, torch.float32, 2, 256),
        (3_000_001, torch.bfloat16, 4, 65536),
        (2_000_003, torch.float16, 1, 8),
    ],
)
def test_matches_reference_on_large_tensors(device, numel, dtype, bits, group_size, generator):
    # One NaN or Inf per 5,000 values would make every group of 65,536 a NaN group, leaving
    # the finite path of the largest groups (many chunks per lane) untested.
    x = random_input(numel, dtype, generator, nonfinite=group_size <= 256)
    check_against_reference(x, bits, group_size, 2**63 - 12345, device)


def test_multidimensional_input(device, generator):
    x = random_input(3 * 5 * 7 * 11, torch.float32, generator).view(3, 5, 7, 11)
    check_against_reference(x, 2, 32, 99, device)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_major_matches_reference_bit_for_bit(device, dtype, bits, generator):
    """Groups down the columns: matrices shorter and taller than a group, columns that end
    inside a chunk of 8, a single row or column, a ragged last group; more columns than the
    kernel's tiles hold, with groups that end inside a tile, across one or across matrices,
    matrices so tall that a tile holds fewer columns, and rows so long (512 values or more)
    that a tile takes 64 columns, the last tile fewer."""
    shapes = [
        (1, 9),
        (9, 1),
        (5, 7, 11),
        (3, 128, 40),
        (2, 300, 3),
        (13, 67),
        (4, 2, 64, 33),
        (2, 64, 520),
        (3, 100, 70),
        (4500, 20),
        (2, 300, 1100),
        (70, 1030),
    ]
    for group_size in (8, 64, 256):
        for shape in shapes:
            x = random_input(torch.Size(shape).numel(), dtype, generator).view(shape)
            seed = int(torch.randint(2**62, (1,), generator=generator))
            check_against_reference(x, bits, group_size, seed, device, column_major=True)


def test_column_major_reads_the_transposed_order(device, generator):
    """The same codes as the transposed tensor's in memory order; decoding gives the input's
    memory order back."""
    x = random_input(6 * 50 * 24, torch.float32, generator, nonfinite=False).view(6, 50, 24).to(device)
    codes, stats = ops.quantize_pack(x, 4, 64, 3, column_major=True)
    transposed_codes, transposed_stats = ops.quantize_pack(x.transpose(1, 2).contiguous(), 4, 64, 3)
    assert torch.equal(codes, transposed_codes) and torch.equal(
        stats.view(torch.int16), transposed_stats.view(torch.int16)
    )
    decoded = ops.unpack_dequantize(codes, stats, 4, 64, x.numel(), torch.float32, 50, 24).view(x.shape)
    plain = ops.unpack_dequantize(transposed_codes, transposed_stats, 4, 64, x.numel(), torch.float32)
    assert torch.equal(decoded, plain.view(6, 24, 50).transpose(1, 2))
    # Within a step of 4 bits: 15 steps over a group's range, 14 in a zero-preserving group.
    assert (decoded - x).abs().max() < (x.max() - x.min()) / 14 * 1.01


def test_signed_zeros(device):
    zeros = torch.zeros(64)
    negative_zeros = -zeros
    mixed = torch.tensor([0.0, -0.0] * 32)
    relu_like = torch.tensor([0.0, -0.0, 1.5, 0.25] * 16)
    x = torch.cat((zeros, negative_zeros, mixed, relu_like))
    for bits in BITS:
        codes, stats = ops.quantize_pack(x.to(device), bits, 64, 3)
        expected_codes, expected_stats = reference.quantize_pack(x, bits, 64, 3)
        assert_same_bits(codes, expected_codes, f"codes, bits={bits}")
        # A group holding both zeros may store either as its minimum (the reference's pick
        # depends on the order of its values); every other group must match exactly.
        ambiguous = torch.tensor([False, False, bits == 1, bits == 1])
        assert_same_bits(stats[~ambiguous], expected_stats[~ambiguous], f"stats, bits={bits}")
        decoded = ops.unpack_dequantize(codes, stats, bits, 64, x.numel(), torch.float32)
        expected = reference.unpack_dequantize(expected_codes, expected_stats, bits, 64, x.numel(), torch.float32)
        assert_same_bits(decoded, expected, f"decoded, bits={bits}")


def test_decode_of_hand_made_stats(device):
    """Decoding follows the stats bits alone, including a NaN whose sign bit is set."""
    stats_bits = torch.tensor([[0x3F80, 0x3E00], [0x3F80, 0xBE00], [0x7FC0, 0x7FC0], [0x4000, 0xFFC0]])
    stats = stats_bits.to(torch.int16).view(torch.bfloat16)  # plain, zero-preserving, NaN, NaN with sign
    codes = torch.arange(4 * 8, dtype=torch.uint8) % 4
    codes = (codes.view(-1, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(1).to(torch.uint8)
    decoded = ops.unpack_dequantize(codes.to(device), stats.to(device), 2, 8, 32, torch.float32)
    expected = reference.unpack_dequantize(codes, stats, 2, 8, 32, torch.float32)
    assert_same_bits(decoded, expected, "decoded")


def test_seed_changes_codes(device, generator):
    x = random_input(4096, torch.float32, generator, nonfinite=False).to(device)
    first, _ = ops.quantize_pack(x, 2, 256, 1)
    again, _ = ops.quantize_pack(x, 2, 256, 1)
    other, _ = ops.quantize_pack(x, 2, 256, 2)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: ops.quantize_pack(x, 3, 256, 0), "bits=3 is not supported; allowed: 1, 2, 4, 8"),
        (lambda x: ops.quantize_pack(x, 2, 96, 0), "group_size=96 must be a power of two in \\[8, 65536\\]"),
        (lambda x: ops.quantize_pack(x, 2, 4, 0), "group_size=4"),
        (lambda x: ops.quantize_pack(x.double(), 2, 256, 0), "input dtype is Double; allowed: Float, Half, BFloat16"),
        (lambda x: ops.quantize_pack(x.view(32, 32).t(), 2, 256, 0), "input must be contiguous"),
        (lambda x: ops.quantize_pack(x, 2, 256, 0, column_major=True), "column_major=True .* at least 2-D"),
    ],
)
def test_quantize_rejects_bad_arguments(device, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(1024, device=device))


def test_decode_rejects_bad_arguments(device):
    codes, stats = ops.quantize_pack(torch.randn(1024, device=device), 2, 256, 0)
    decode = torch.ops.lightning_act.unpack_dequantize
    with pytest.raises(RuntimeError, match="codes hold 255 bytes; 4 groups of 256 values at 2 bits need 256"):
        decode(codes[:-1], stats, 2, 256, 1024, torch.float32)
    with pytest.raises(RuntimeError, match="stats must have shape \\[groups, 2\\]"):
        decode(codes, stats.view(-1), 2, 256, 1024, torch.float32)
    with pytest.raises(RuntimeError, match="stats dtype is Float; allowed: BFloat16"):
        decode(codes, stats.float(), 2, 256, 1024, torch.float32)
    with pytest.raises(RuntimeError, match="numel=1025 must be in \\[0, 1024\\]"):
        decode(codes, stats, 2, 256, 1025, torch.float32)
    with pytest.raises(RuntimeError, match="dtype is Long; allowed: Float, Half, BFloat16"):
        decode(codes, stats, 2, 256, 1024, torch.int64)
    with pytest.raises(RuntimeError, match="codes hold 256 bytes; 4 groups of 256 values at 8 bits need 1024"):
        decode(codes, stats, 8, 256, 1024, torch.float32)
    with pytest.raises(RuntimeError, match="rows=3, columns=5: allowed are both 0 .* numel=1024 a multiple"):
        decode(codes, stats, 2, 256, 1024, torch.float32, 3, 5)
    with pytest.raises(RuntimeError, match="rows=32, columns=0"):
        decode(codes, stats, 2, 256, 1024, torch.float32, 32, 0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lookup_levels_reads_each_value_from_its_groups_row_by_its_code(device, dtype, bits, generator):
    """Against the reference (bit for bit) and against decoding: the table of what each
    group's codes decode to gives back the decoded tensor."""
    for group_size, numel in ((8, 1), (8, 61), (64, 1000), (256, 256 * 7 + 3), (1024, 150_001)):
        x = random_input(numel, dtype, generator).to(device)
        codes, stats = ops.quantize_pack(x, bits, group_size, 17)
        levels = torch.randn(stats.shape[0], 1 << bits, generator=generator).to(dtype).to(device)
        case = f"dtype={dtype} bits={bits} group_size={group_size} numel={numel}"
        assert_same_bits(
            ops.lookup_levels(codes, levels, bits, group_size, numel),
            reference.lookup_levels(codes.cpu(), levels.cpu(), bits, group_size, numel),
            case,
        )
        decoded_levels = ops.group_levels(stats, bits, dtype).contiguous()
        assert_same_bits(
            ops.lookup_levels(codes, decoded_levels, bits, group_size, numel),
            ops.unpack_dequantize(codes, stats, bits, group_size, numel, dtype),
            case,
        )


def test_lookup_levels_rejects_bad_arguments(device):
    codes, stats = ops.quantize_pack(torch.randn(1024, device=device), 2, 256, 0)
    levels = torch.randn(4, 4, device=device)
    for lookup in (torch.ops.lightning_act.lookup_levels, reference.lookup_levels):
        with pytest.raises(RuntimeError, match="levels must have shape \\[groups, 4\\] at bits=2; got"):
            lookup(codes, levels[:, :2].contiguous(), 2, 256, 1024)
        with pytest.raises(RuntimeError, match="codes hold 255 bytes; 4 groups of 256 values at 2 bits need 256"):
            lookup(codes[:-1], levels, 2, 256, 1024)
        with pytest.raises(RuntimeError, match="numel=1025 must be in \\[0, 1024\\]"):
            lookup(codes, levels, 2, 256, 1025)
        with pytest.raises(RuntimeError, match="levels dtype is .*; allowed: .*loat"):
            lookup(codes, levels.double(), 2, 256, 1024)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(device, dtype, generator):
    x = random_input(1000, dtype, generator, nonfinite=False).to(device)
    torch.library.opcheck(torch.ops.lightning_act.quantize_pack.default, (x, 2, 64, 5))
    codes, stats = ops.quantize_pack(x, 2, 64, 5)
    torch.library.opcheck(torch.ops.lightning_act.unpack_dequantize.default, (codes, stats, 2, 64, 1000, dtype))
    levels = torch.randn(stats.shape[0], 4, generator=generator).to(dtype).to(device)
    torch.library.opcheck(torch.ops.lightning_act.lookup_levels.default, (codes, levels, 2, 64, 1000))
    matrices = x.view(8, 125)
    torch.library.opcheck(torch.ops.lightning_act.quantize_pack.default, (matrices, 2, 64, 5, True))
    codes, stats = ops.quantize_pack(matrices, 2, 64, 5, column_major=True)
    torch.library.opcheck(torch.ops.lightning_act.unpack_dequantize.default, (codes, stats, 2, 64, 1000, dtype, 8, 125))


def test_cpu_kernels_are_loaded():
    ops.ensure_kernels("cpu")
    assert ops.loaded_kernels()["cpu"] is True


def test_device_types_without_kernels_use_the_reference():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.ensure_kernels("meta")
    assert ops.loaded_kernels()["meta"] is False


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as in a new process, building into an empty folder."""
    monkeypatch.setattr(extension, "_loaded", {})
    monkeypatch.setenv(extension.BUILD_DIR_ENV, str(tmp_path / "build"))
    monkeypatch.delenv(extension.KERNELS_ENV, raising=False)
    return tmp_path


def test_invalid_kernel_mode_is_rejected(fresh_loader, monkeypatch):
    monkeypatch.setenv(extension.KERNELS_ENV, "bogus")
    with pytest.raises(ValueError, match="LIGHTNING_ACT_KERNELS='bogus' is not supported; allowed: auto, reference"):
        ops.quantize_pack(torch.randn(64), 2, 8, 0)


def test_reference_mode_builds_nothing(fresh_loader, monkeypatch):
    monkeypatch.setenv(extension.KERNELS_ENV, "reference")
    ops.ensure_kernels("cpu")
    assert ops.loaded_kernels()["cpu"] is False
    assert not (fresh_loader / "build").exists()


def _quantize_collecting_warnings(x: torch.Tensor) -> tuple[list[warnings.WarningMessage], tuple]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ops.quantize_pack(x, 2, 8, 0)
        second = ops.quantize_pack(x, 2, 8, 0)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    return [w for w in caught if "lightning_act" in str(w.message)], first


def test_failed_build_warns_once_and_uses_the_reference(fresh_loader, monkeypatch):
    sources = fresh_loader / "csrc"
    sources.mkdir()
    for name in extension._HEADERS:
        (sources / name).write_text((extension._SOURCE_DIR / name).read_text())
    # The other sources empty: the failing build compiles nothing but the broken file.
    for name in extension._SOURCES["cpu"]:
        (sources / name).write_text("")
    (sources / "quant_cpu.cpp").write_text("this is not C++;\n")
    monkeypatch.setattr(extension, "_SOURCE_DIR", sources)
    x = torch.randn(100)

    caught, result = _quantize_collecting_warnings(x)

    assert len(caught) == 1
    message = str(caught[0].message)
    assert "fused cpu kernels are unavailable" in message and "pure-PyTorch reference" in message
    assert "quant_cpu.cpp:1:1: error" in message
    assert ops.loaded_kernels()["cpu"] is False
    for actual, expected in zip(result, reference.quantize_pack(x, 2, 8, 0)):
        assert torch.equal(actual, expected)


def test_missing_sources_warn_once(fresh_loader, monkeypatch):
    monkeypatch.setattr(extension, "_SOURCE_DIR", fresh_loader / "nowhere")
    caught, _ = _quantize_collecting_warnings(torch.randn(100))
    assert len(caught) == 1
    assert "Kernel sources not found" in str(caught[0].message)


def test_groups_spanning_beyond_float32_are_stored_as_nan(device, generator):
    x = torch.randn(1024, generator=generator).to(device)
    x[256:512] *= 1e38  # a group whose step overflows float32
    x[256] = -3.0e38
    x[257] = 3.0e38
    codes, stats = ops.quantize_pack(x, 2, 256, 0)
    ref_codes, ref_stats = reference.quantize_pack(x.cpu(), 2, 256, 0)
    assert torch.equal(codes.cpu(), ref_codes)
    assert torch.equal(stats.cpu().view(torch.int16), ref_stats.view(torch.int16))
    assert int(ops.count_nonfinite_groups(stats)) == 1
    decoded = ops.unpack_dequantize(codes, stats, 2, 256, 1024, torch.float32).cpu()
    assert decoded[256:512].isnan().all() and decoded[:256].isfinite().all() and decoded[512:].isfinite().all()


@pytest.mark.parametrize("bits", (1, 2, 4, 8))
@pytest.mark.parametrize("planar", (False, True), ids=("interleaved", "planar"))
def test_bit_fields_place_each_code_where_the_layout_says(bits, planar, generator):
    per_byte = 8 // bits
    numel = 8 * int(torch.randint(1, 200, (1,), generator=generator))
    codes = torch.randint(1 << bits, (numel,), generator=generator, dtype=torch.uint8)
    packed = layout.pack_bit_fields(codes, bits, planar)
    index = torch.arange(numel)
    if planar:  # code i in byte i mod m, field i // m, for m bytes
        byte, field = index % (numel // per_byte), index // (numel // per_byte)
    else:  # code i in byte i // per_byte, field i mod per_byte
        byte, field = index // per_byte, index % per_byte
    assert torch.equal((packed[byte] >> (field * bits).to(torch.uint8)) & ((1 << bits) - 1), codes)
    assert torch.equal(layout.unpack_bit_fields(packed, bits, planar, numel=numel), codes)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda x: reference.quantize_pack(x, 3, 256, 0),
            "quantize_pack: bits=3 is not supported; allowed: 1, 2, 4, 8",
        ),
        (lambda x: reference.quantize_pack(x, 2, 96, 0), "group_size=96 must be a power of two in \\[8, 65536\\]"),
        (
            lambda x: reference.quantize_pack(x.double(), 2, 256, 0),
            "input dtype is torch.float64; allowed: torch.float32",
        ),
        (lambda x: reference.quantize_pack(x.view(32, 32).t(), 2, 256, 0), "input must be contiguous"),
        (
            lambda x: reference.unpack_dequantize(*reference.quantize_pack(x, 2, 256, 0), 2, 256, 1025, torch.float32),
            "numel=1025 must be in \\[0, 1024\\]",
        ),
        (
            lambda x: reference.division_pack(x.view(4, 16, 16), 0, 8, 2, 256, 0, torch.bfloat16),
            "block_h=0 must be >= 1",
        ),
        (lambda x: reference.division_pack(x.view(4, 16, 16), 8, 8, 2, 256, 0, torch.int8), "lfc_dtype is torch.int8"),
    ],
)
def test_reference_rejects_bad_arguments_like_the_kernels(call, message):
    """The reference raises the kernels' error type, naming the bad value and what is allowed."""
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(1024))


def test_quant_settings_raise_value_errors():
    with pytest.raises(ValueError, match="bits=3 is not supported; allowed: 1, 2, 4, 8"):
        ops.check_quant_args(3, 256)
    with pytest.raises(ValueError, match="group_size=4 must be a power of two in \\[8, 65536\\]"):
        ops.check_quant_args(2, 4)
