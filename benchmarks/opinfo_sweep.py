"""PyTorch's own OpInfo database with every saved tensor compressed, against exact gradients.

Every differentiable op (float32, CPU, up to three samples each) runs once exactly and once
under ``compress_activations(bits=..., min_numel=1)``, its inputs made intermediates first
(``x * 1.0``) so that what the op saves of them is compressed too; the gradients of a fixed
random projection of its outputs are compared. For each op and bit width it records whether
the compressed step raised, whether it gave a non-finite gradient where the exact one is
finite, and the largest relative error over the inputs. ``tests/test_opinfo.py`` asserts on
the same measurement.

    python benchmarks/opinfo_sweep.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_act import compress_activations

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
    # The same for a whole reduction: 0.06-0.23 at 8 bits, depending on the samples drawn.
    "prod": "products spanning orders of magnitude",
}
# An exact gradient that is zero up to round-off (normalize or layer_norm over a dimension of
# one, corrcoef of fewer than three observations) has no relative error to measure.
ZERO_GRADIENT = 1e-4


def differentiable_ops() -> list:
    """The database's ops with autograd and float32 on the CPU (it needs ``expecttest``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")]


def case_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def gradients(op, sample, compress_bits: int | None):
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


def relative_error(noisy, exact) -> float:
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


def nonfinite_where_exact_is_finite(noisy, exact) -> bool:
    return any(
        n is not None and e is not None and bool((torch.isfinite(e) & ~torch.isfinite(n)).any())
        for n, e in zip(noisy, exact)
    )


@dataclass
class Sweep:
    """One op at one bit width, over its samples."""

    op: str
    bits: int
    compared: int  # samples whose exact backward ran
    raised: str | None  # the compressed step's exception
    nonfinite: bool  # a non-finite gradient where the exact one is finite
    error: float  # the largest relative error (inputs whose exact gradient is not ~0)


def sweep(op, bits: int) -> Sweep:
    """Every sample of ``op`` at ``bits``, exactly and compressed."""
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:SAMPLES_PER_OP]
    result = Sweep(case_id(op), bits, 0, None, False, 0.0)
    for sample in samples:
        torch.manual_seed(0)
        try:
            exact = gradients(op, sample, None)
        except Exception:  # the op itself cannot differentiate this sample: nothing to compare
            continue
        if exact is None:
            continue
        try:
            noisy = gradients(op, sample, bits)
        except Exception as error:  # noqa: BLE001 - any exception is the failure measured
            result.raised = f"{type(error).__name__}: {error}"[:300]
            return result
        result.compared += 1
        result.nonfinite |= nonfinite_where_exact_is_finite(noisy, exact)
        result.error = max(result.error, relative_error(noisy, exact))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 2])
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the database's samples trigger the ops' own deprecation notices
    started = time.perf_counter()
    ops = differentiable_ops()
    rows = []
    for i, op in enumerate(ops):
        for bits in args.bits:
            rows.append(sweep(op, bits))
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{len(ops)} ops, {time.perf_counter() - started:.0f} s", flush=True)
    compared = {bits: sum(1 for r in rows if r.bits == bits and r.compared) for bits in args.bits}
    print(f"{len(ops)} differentiable ops; with a sample to compare: {compared}")
    for bits in args.bits:
        at = [r for r in rows if r.bits == bits]
        print(f"{bits} bits: {sum(r.raised is not None for r in at)} raise, "
              f"{sum(r.nonfinite for r in at)} non-finite")
    above = [r for r in rows if r.bits == 8 and r.error > ERROR_AT_8_BITS]
    print(f"above {ERROR_AT_8_BITS} relative error at 8 bits: {len(above)}")
    for r in sorted(above, key=lambda r: -r.error):
        name = r.op.split(".")[0] if r.op.split(".")[0] in ILL_CONDITIONED else r.op
        reason = ILL_CONDITIONED.get(r.op) or ILL_CONDITIONED.get(name) or "not ill-conditioned"
        print(f"  {r.op:48s} {r.error:10.3g}  {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "opinfo_sweep_cpu.json"
    path.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1), "rows": [asdict(r) for r in rows],
    }, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
