"""Fixtures and helpers shared by the tests of the fused kernels (test_ops.py, test_codecs.py)."""

from __future__ import annotations

import random

import pytest
import torch
from lightning_act import ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = (
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=(pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
    ),
)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """A device whose fused kernels are loaded.

    A failed build fails the tests instead of letting them compare the reference with itself.
    """
    ops.ensure_kernels(request.param)
    assert ops.loaded_kernels()[request.param], f"the fused {request.param} kernels did not load"
    return request.param


@pytest.fixture
def generator() -> torch.Generator:
    """Fresh random inputs on every run; the printed seed reproduces a failing case."""
    seed = random.SystemRandom().randrange(2**63)
    print(f"input generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads are not part of the format)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    actual, expected = actual.cpu(), expected.cpu()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    if actual.is_floating_point():
        actual, expected = actual.view(_INT_VIEW[actual.dtype]), expected.view(_INT_VIEW[expected.dtype])
    mismatch = (actual != expected) & ~nan
    if mismatch.any():
        index = int(mismatch.nonzero()[0, 0])
        raise AssertionError(
            f"{what}: {int(mismatch.sum())} of {actual.numel()} differ; first at {index}: "
            f"{actual[index].item():#x} != {expected[index].item():#x}"
        )
