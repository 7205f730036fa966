"""Models from the public model libraries, through the public capture API.

HF ``transformers``, ``timm``, PyG, ``torch.nn`` RNNs, a diffusers U-Net and a torchvision
detector in training mode, built from their configs (random weights, small sizes, CPU, fp32)
on real data. For each model:

* it runs: forward and backward under the capture, a finite gradient;
* at 8 bits the weight gradient is within 1e-2 (relative L2) of uncompressed training's;
* at 2 bits it is unbiased: the mean gradient of 16 rounding seeds is at least 3x closer to
  the exact one than one seed's (sqrt(16) = 4x for an unbiased estimate, 1x for pure bias);
* the forward keeps at least 6x less memory at 2 bits, measured by the profiler (the saved
  tensors of every model here are mostly fp32 activations, 15x smaller at 2 bits);
* the peak of forward + backward is never above no compression's;
* every call's backward is read by a trace (none of its saves kept whole for lack of one).

The measurement is ``benchmarks/model_libraries.py``'s (its ``find_culprits`` names the saved
tensors behind a failure). A criterion a model misses today is an expected failure (strict:
it fails the suite once fixed, so the mark goes) whose reason is the measured cause.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from benchmarks.model_libraries import (
    CASES,
    DATA,
    MAX_ERROR_8BIT,
    MIN_KEPT_RATIO,
    MIN_UNBIASED_RATIO,
    Measurement,
    measure,
)

LIBRARY_MODULES = {
    "transformers": ("transformers",),
    "transformers+peft": ("transformers", "peft"),
    "timm": ("timm",),
    "torch_geometric": ("torch_geometric",),
    "torch.nn": (),
    "diffusers": ("diffusers",),
    "torchvision": ("torchvision",),
}
LIBRARY_DATA = {
    "transformers": "tinyshakespeare/input.txt",
    "transformers+peft": "tinyshakespeare/input.txt",
    "timm": "cifar10",
    "torch_geometric": "planetoid/Cora/raw",
    "torch.nn": "tinyshakespeare/input.txt",
    "diffusers": "cifar10",
    "torchvision": "cifar10",
}
# Four models, about 17 s together on a busy 2-core CPU; the others are slow.
FAST = frozenset({"hf_llama", "torch_lstm"})

# What each model misses today, and why (measured with benchmarks/model_libraries.py).
KNOWN_FAILURES = {
    ("hf_llama_checkpointing", "kept_memory"): (
        "4.47x: checkpointing leaves few saved tensors: each decoder layer's input, from which backward "
        "recomputes the layer, at its 8-bit floor (2 x 33,280 bytes), and cross_entropy's log-probabilities "
        "(512, 256) at theirs (133,120 bytes), most of the 0.24 MiB kept"
    ),
    ("hf_llama_checkpointing", "peak_memory"): (
        "1.009x of none (+33 KB, about one layer input's 8-bit record): at the peak, while a layer is "
        "recomputed in backward, its stored record is alive next to the decoded full copy"
    ),
    ("timm_mobilenetv3_small_100", "error_8bit"): (
        "8-bit error 0.014 (0.016 before Hardswish's input was stored as its derivative): 8-bit rounding "
        "noise (0.9% of a Gaussian tensor's norm with groups of 256) added up over the tensors stored "
        "behind the stem, whose weight gradient carries most of the gradient's norm"
    ),
    ("timm_efficientnet_b0", "error_8bit"): (
        "8-bit error 0.021 (0.037 before SiLU's input was stored as its derivative): 8-bit rounding noise "
        "added up over the 175 tensors stored behind the stem, whose weight gradient (62% of the "
        "gradient's norm) carries most of it"
    ),
    ("torchvision_fasterrcnn", "error_8bit"): (
        "8-bit error 0.016: 8-bit rounding noise added up over the 141 tensors stored (unbiased: 2-bit "
        "16-seed ratio 4.47); Hardswish's stored derivatives alone give 0.013, the conv and batch_norm "
        "inputs 0.006-0.007 each. roi_align's boxes, which its backward indexes with, are exact"
    ),
    ("pyg_pna", "error_8bit"): (
        "8-bit error 0.016: rounding noise added up over the aggregation towers' mul inputs (0.0083 with them "
        "alone compressed, 8 tensors of 19.9M values) and the linear inputs (0.0061 alone); no single tensor "
        "carries it (benchmarks/model_libraries.py find_culprits, 2 seeds)"
    ),
    ("hf_mixtral_bf16", "kept_memory"): (
        "5.22x: its values are bfloat16, so 2 bits keep at most 8x less (16x in float32); the floors (8 bits "
        "for the log-softmax and attention's query and key, 4 for the RMSNorm inputs) and what stays exact "
        "(143 KB: the router's top-k and token indices, attention's logsumexp, RMSNorm's factors, the router's "
        "normalising divisions) take it to 5.2x"
    ),
    ("torch_lstm", "kept_memory"): (
        "1.16x: oneDNN's uint8 workspace (8,011,776 bytes per layer, 83% of what the forward keeps) is an "
        "opaque byte buffer spanning all 256 values: kept as it is (no narrower code exists); the float "
        "tensors around it are compressed. unfused_recurrent=True runs aten's per-step ops instead "
        "(benchmarks/recurrent.py: 7.79x kept, the peak 4.57x lower, 1.87x the fused step's time)"
    ),
}


@functools.cache
def _measure(name: str) -> Measurement:
    # One thread: models this small gain nothing from more, and on a busy machine OpenMP's
    # waiting threads cost more than the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure(name)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def measured(request) -> Measurement:
    name = request.param
    library = CASES[name].library
    for module in LIBRARY_MODULES[library]:
        pytest.importorskip(module)
    if not (DATA / LIBRARY_DATA[library]).exists():
        pytest.skip(f"needs {DATA / LIBRARY_DATA[library]}")
    return _measure(name)


def _cases(criterion: str):
    for name in CASES:
        marks = [] if name in FAST else [pytest.mark.slow]
        reason = KNOWN_FAILURES.get((name, criterion))
        if reason is not None:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        yield pytest.param(name, marks=marks, id=name)


def _criterion(name: str):
    return pytest.mark.parametrize("measured", list(_cases(name)), indirect=True)


@_criterion("runs")
def test_runs(measured):
    values = (measured.error_8bit, measured.error_2bit, measured.mean_error_2bit)
    assert all(math.isfinite(v) for v in values), values
    assert measured.stored_bytes > 0, "nothing was compressed"


@_criterion("error_8bit")
def test_8bit_gradient_error(measured):
    assert measured.error_8bit < MAX_ERROR_8BIT


@_criterion("unbiased")
def test_2bit_gradient_unbiased(measured):
    assert measured.unbiased_ratio >= MIN_UNBIASED_RATIO, (
        f"one seed {measured.error_2bit:.4g}, mean of {measured.seeds} seeds {measured.mean_error_2bit:.4g}"
    )


@_criterion("kept_memory")
def test_kept_memory(measured):
    assert measured.kept_ratio >= MIN_KEPT_RATIO, (
        f"{measured.kept_bytes_none / 2**20:.2f} MiB -> {measured.kept_bytes_2bit / 2**20:.2f} MiB"
    )


@_criterion("peak_memory")
def test_peak_memory_not_above_none(measured):
    assert measured.peak_bytes_2bit <= measured.peak_bytes_none, (
        f"{measured.peak_bytes_none / 2**20:.2f} MiB -> {measured.peak_bytes_2bit / 2**20:.2f} MiB"
    )


@_criterion("traced")
def test_every_call_is_read_by_a_trace(measured):
    """No saved tensor is kept whole for lack of a trace: the report names any that are."""
    assert measured.untraced == {}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_falcon", "timm_repvgg_a0"])
def test_model_families_beyond_the_suite_keep_their_gradient(name):
    """``benchmarks/model_families.py``'s cases build and measure as the suite's do. HF
    Falcon's saved causal mask made its gradient NaN, and timm RepVGG's BatchNorm read a ReLU
    output's copy grouped across channels (8-bit error 0.074)."""
    pytest.importorskip("timm" if name.startswith("timm") else "transformers")
    from benchmarks import model_families

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = model_families.measure(name, seeds=8)  # the sweep's measure, which knows its families
    finally:
        torch.set_num_threads(threads)
    assert math.isfinite(m.error_2bit) and m.error_8bit < MAX_ERROR_8BIT
