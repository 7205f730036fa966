"""Every differentiable op of PyTorch's own OpInfo database with every saved tensor compressed:
never an exception, never a non-finite gradient where the exact one is finite, and at 8 bits
close to the exact gradient.

Each op's samples (float32, CPU, up to three each) run once exactly and once under
``compress_activations(bits=..., min_numel=1)``, their inputs made intermediates first
(``x * 1.0``) so that what the op saves of them is compressed too. The default run sweeps the
ops whose saved tensors break a storage rule written from a list (equalities, domain edges,
divisors, opaque dtypes and layouts); the whole database is marked ``slow``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_act import compress_activations

pytest.importorskip("expecttest")  # the OpInfo database imports it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

SAMPLES_PER_OP = 3
# At 8 bits each gradient is within this relative error of the exact one, except where the
# exact gradient is itself ill-conditioned on the sample: there a rounding of 1/255 of a
# group's range moves it further, whatever the storage.
ERROR_AT_8_BITS = 0.1
ILL_CONDITIONED = {
    # Inverses and decompositions of random matrices: the gradient grows with the condition
    # number, and a sample's smallest singular value can be 1e-3 of its largest.
    "linalg.inv": "condition number", "linalg.inv_ex": "condition number", "linalg.solve": "condition number",
    "linalg.solve_ex": "condition number", "linalg.pinv": "condition number", "linalg.tensorinv": "condition number",
    "linalg.tensorsolve": "condition number", "linalg.eig": "eigenvalue gaps", "linalg.eigh": "eigenvalue gaps",
    "linalg.eigvals": "eigenvalue gaps", "linalg.eigvalsh": "eigenvalue gaps", "linalg.svd": "singular gaps",
    "linalg.svdvals": "singular gaps", "svd": "singular gaps", "svd_lowrank": "singular gaps",
    "pca_lowrank": "singular gaps", "linalg.lstsq": "condition number", "linalg.matrix_power": "condition number",
    "linalg.det": "condition number", "linalg.slogdet": "condition number", "logdet": "condition number",
    "det": "condition number", "linalg.lu_solve": "condition number", "lu_solve": "condition number",
    "cholesky_inverse": "condition number", "linalg.cholesky": "condition number",
    "linalg.cholesky_ex": "condition number", "triangular_solve": "condition number",
    "linalg.solve_triangular": "condition number", "linalg.lu": "condition number",
    "linalg.lu_factor": "condition number", "linalg.lu_factor_ex": "condition number", "lu": "condition number",
    "linalg.ldl_factor": "condition number", "linalg.ldl_factor_ex": "condition number",
    "linalg.householder_product": "condition number", "geqrf": "condition number", "linalg.qr": "condition number",
    "linalg.matrix_norm": "singular gaps", "linalg.norm": "singular gaps", "nuclear_norm": "singular gaps",
    "linalg.cond": "condition number", "linalg.matrix_rank": "singular gaps", "cdist": "zero distances",
    "pdist": "zero distances", "nn.functional.pdist": "zero distances",
    # Inputs of up to +-9 make logits of +-200: a saturated softmax, where rounding query and
    # key by 1/255 of their range moves a logit by several units.
    "nn.functional.scaled_dot_product_attention": "saturated softmax",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "saturated softmax",
    # The same through a mask of +-8 added to the logits: the query's and key's exact
    # gradients are 1e-21, and a masked softmin over five values of +-9 is one-hot (its
    # gradient 160x smaller than the unmasked sample's).
    "nn.functional.multi_head_attention_forward": "saturated softmax",
    "masked.softmin": "saturated softmax",
    # Products of up to ten values of +-9 span eight orders of magnitude within one group, and
    # backward reads each through its ratio to the input.
    "cumprod": "products spanning orders of magnitude",
    "scatter_reduce": "products spanning orders of magnitude",
}
# An exact gradient that is zero up to round-off (normalize or layer_norm over a dimension of
# one, corrcoef of fewer than three observations) has no relative error to measure.
ZERO_GRADIENT = 1e-4


def _differentiable_ops():
    return [op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")]


def _case_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _gradients(op, sample, compress_bits: int | None):
    """The gradients of a fixed random projection of the op's outputs with respect to its float
    inputs, computed exactly or with every saved tensor compressed."""
    inputs = torch.utils._pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return None

    def intermediate(x):
        return x * 1.0 if isinstance(x, torch.Tensor) and x.requires_grad else x

    def run():
        sample_input = torch.utils._pytree.tree_map(intermediate, sample.input)
        args = torch.utils._pytree.tree_map(intermediate, sample.args)
        kwargs = torch.utils._pytree.tree_map(intermediate, sample.kwargs)
        return op(sample_input, *args, **kwargs)

    if compress_bits is None:
        out = run()
    else:
        with compress_activations(bits=compress_bits, min_numel=1):
            out = run()
    # The projection is outside the compressed region: only what the op saves is rounded.
    outs = [o for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not outs:
        return None
    generator = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [g.to_dense() if g is not None and g.layout != torch.strided else g for g in grads]


def _relative_error(noisy, exact) -> float:
    """The largest relative error over the inputs whose exact gradient is not zero up to
    round-off (see ``ZERO_GRADIENT``)."""
    worst = 0.0
    for n, e in zip(noisy, exact):
        if n is None or e is None:
            continue
        norm = e.norm().item()
        if norm >= ZERO_GRADIENT and math.isfinite(norm):
            worst = max(worst, (n - e).norm().item() / norm)
    return worst


def _nonfinite_where_exact_is_finite(noisy, exact) -> bool:
    return any(
        n is not None and e is not None and bool((torch.isfinite(e) & ~torch.isfinite(n)).any())
        for n, e in zip(noisy, exact)
    )


def check(op, bits: int) -> None:
    """Every sample of ``op``: no exception, no new non-finite value, and at 8 bits close."""
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:SAMPLES_PER_OP]
    compared = 0
    for sample in samples:
        torch.manual_seed(0)
        try:
            exact = _gradients(op, sample, None)
        except Exception:  # the op itself cannot differentiate this sample: nothing to compare
            continue
        if exact is None:
            continue
        noisy = _gradients(op, sample, bits)  # must not raise
        compared += 1
        assert not _nonfinite_where_exact_is_finite(noisy, exact), f"{_case_id(op)}: non-finite gradient"
        if bits == 8 and op.name not in ILL_CONDITIONED:
            error = _relative_error(noisy, exact)
            assert error <= ERROR_AT_8_BITS, f"{_case_id(op)}: relative error {error:.3g} at 8 bits"
    if not compared:
        pytest.skip(f"{_case_id(op)}: no sample its exact backward differentiates")


# The ops that broke a storage rule written from a list: equality between saved values, a
# domain edge, a divisor or log input not floored, a dtype, layout or view no codec takes.
_BROKE_A_LIST = {
    "scatter_reduce", "aminmax", "norm", "asin", "atanh", "erfinv", "ctc_loss", "masked.log_softmax",
    "masked.logaddexp", "logcumsumexp", "amax", "amin", "max", "min", "linalg.vector_norm", "softmax",
    "float_power", "as_strided", "addcdiv", "log1p", "nn.functional.normalize", "corrcoef", "cumprod",
    "nn.functional.grid_sample", "nn.functional.scaled_dot_product_attention", "lgamma", "digamma",
    "polygamma", "to_sparse", "nn.functional.silu", "nn.functional.gelu", "nn.functional.mish",
    "nn.functional.hardswish", "nn.functional.elu",
}
_ALL = _differentiable_ops()
_LISTED = [op for op in _ALL if op.name in _BROKE_A_LIST]


@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("op", _LISTED, ids=_case_id)
def test_ops_that_broke_a_listed_rule(op, bits):
    check(op, bits)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("op", [op for op in _ALL if op.name not in _BROKE_A_LIST], ids=_case_id)
def test_every_differentiable_op(op, bits):
    check(op, bits)
