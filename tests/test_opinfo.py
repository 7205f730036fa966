"""Every differentiable op of PyTorch's own OpInfo database with every saved tensor compressed
(``benchmarks/opinfo_sweep.py``'s measurement): never an exception, never a non-finite
gradient where the exact one is finite, and at 8 bits within 0.1 of the exact gradient
except for the ops the benchmark exempts, each with its measured reason (an ill-conditioned
sample, or storage that loses the gradient). The default run
sweeps the ops whose saved tensors broke a storage rule written from a list (equalities,
domain edges, divisors, opaque dtypes and layouts); the whole database is marked ``slow``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # the OpInfo database imports it
from benchmarks.opinfo_sweep import ERROR_AT_8_BITS, EXEMPT_AT_8_BITS, case_id, differentiable_ops, sweep


def check(op, bits: int) -> None:
    measured = sweep(op, bits)
    assert measured.raised is None, f"{measured.op}: {measured.raised}"
    assert not measured.nonfinite, f"{measured.op}: non-finite gradient"
    if not measured.compared:
        pytest.skip(f"{measured.op}: no sample its exact backward differentiates")
    if bits == 8 and op.name not in EXEMPT_AT_8_BITS:
        assert measured.error <= ERROR_AT_8_BITS, f"{measured.op}: relative error {measured.error:.3g} at 8 bits"


# The ops that broke a storage rule written from a list: equality between saved values, a
# domain edge, a divisor or log input not floored, a dtype, layout or view no codec takes, a
# softmax over rows too short for groups of their own.
_BROKE_A_LIST = {
    "scatter_reduce",
    "aminmax",
    "norm",
    "asin",
    "atanh",
    "erfinv",
    "ctc_loss",
    "masked.log_softmax",
    "masked.logaddexp",
    "logcumsumexp",
    "amax",
    "amin",
    "max",
    "min",
    "linalg.vector_norm",
    "softmax",
    "float_power",
    "as_strided",
    "addcdiv",
    "log1p",
    "nn.functional.normalize",
    "corrcoef",
    "cumprod",
    "nn.functional.grid_sample",
    "nn.functional.scaled_dot_product_attention",
    "lgamma",
    "digamma",
    "polygamma",
    "to_sparse",
    "nn.functional.silu",
    "nn.functional.gelu",
    "nn.functional.mish",
    "nn.functional.hardswish",
    "nn.functional.elu",
    "masked.softmin",
    "nn.functional.multi_head_attention_forward",
}
_ALL = differentiable_ops()
_LISTED = [op for op in _ALL if op.name in _BROKE_A_LIST]


@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("op", _LISTED, ids=case_id)
def test_ops_that_broke_a_listed_rule(op, bits):
    check(op, bits)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("op", [op for op in _ALL if op.name not in _BROKE_A_LIST], ids=case_id)
def test_every_differentiable_op(op, bits):
    check(op, bits)
