"""How a fused attention kernel's saved tensors can be stored, and what each way costs its gradient.

A fused attention (``scaled_dot_product_attention``'s flash kernel; ``nn.MultiheadAttention``
without its weights) saves the query, key, value, its output ``O`` and the rows'
logsumexp. Its backward recomputes the probabilities ``P = exp(q k^T s - lse)`` from the
stored query and key, and takes ``D = rowsum(dO * O)`` from the stored output and
``dO V^T`` from the stored value: on a saturated row the two nearly cancel. Three ways,
on random queries and keys scaled so that the logits reach from a few units to hundreds,
16 x 4 heads x 64 tokens x 16 dims, the CPU flash kernel called directly, every rounding
by the library's quantizer (groups of 256, stochastic rounding), three rounding seeds:

* ``as stored``: the output stored like the inputs: query and key at their 8-bit floor,
  value and output at ``--bits``, the logsumexp exact;
* ``recomputed``: what the capture does: query and key at 8 bits, value at ``--bits``, and
  the output and logsumexp recomputed from those stored values when backward needs them
  (one more forward of the attention, and the output not stored at all);
* ``written out``: the softmax written out, as ``nn.MultiheadAttention`` with its weights
  runs it: the probabilities at their 8-bit floor, query, key and value at ``--bits``.

Then a module through the capture itself (``nn.MultiheadAttention``, width 64, 4 heads,
batch 16 x 64 tokens), fused and written out, as a check of the last two.
The error is the largest relative L2 error over the query, key and value gradients (the
module's input gradient for the capture rows).

    python benchmarks/fused_attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.codecs import GroupQuantCodec
from torch import nn

SCALES = (1.0, 3.0, 10.0)
SEEDS = 3
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def relative_error(got, exact) -> float:
    return max(((g - e).norm() / e.norm()).item() for g, e in zip(got, exact))


def kernel_errors(scale: float, bits: int) -> dict:
    """The three ways on one draw of query, key and value, worst of ``SEEDS`` rounding seeds."""
    codec = GroupQuantCodec(256)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 4, 64, 16, generator=generator) for _ in range(3))
    q, k = q * scale, k * scale
    out, lse = _FLASH(q, k, v, 0.0, False)
    grad = torch.randn(out.shape, generator=generator)
    exact = _FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, False)
    seed = iter(range(1, 10_000))

    def stored(x, width):
        return codec.pack(x, width, next(seed)).unpack()

    errors = {"largest_logit": (q @ k.transpose(-1, -2) / 4).abs().max().item()}
    for way in ("as stored", "recomputed", "written out"):
        worst = 0.0
        for _ in range(SEEDS):
            if way == "written out":
                probabilities = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)
                p, v2, q2, k2 = stored(probabilities, 8), stored(v, bits), stored(q, bits), stored(k, bits)
                dp = grad @ v2.transpose(-1, -2)
                ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / 4
                got = (ds @ k2, ds.transpose(-1, -2) @ q2, p.transpose(-1, -2) @ grad)
            else:
                q2, k2, v2 = stored(q, 8), stored(k, 8), stored(v, bits)
                if way == "as stored":
                    o2, lse2 = stored(out, bits), lse
                else:
                    o2, lse2 = _FLASH(q2, k2, v2, 0.0, False)
                got = _FLASH_BACKWARD(grad, q2, k2, v2, o2, lse2, 0.0, False)
            worst = max(worst, relative_error(got, exact))
        errors[way] = worst
    return errors


def capture_errors(scale: float, bits: int) -> dict:
    """``nn.MultiheadAttention``'s input gradient through the capture, fused and written out."""
    errors = {}
    for way, need_weights in (("fused", False), ("written out", True)):
        torch.manual_seed(0)
        attention = nn.MultiheadAttention(64, 4, batch_first=True)
        x = torch.randn(16, 64, 64) * scale
        grad = torch.randn(16, 64, 64)

        def run():
            leaf = x.clone().requires_grad_(True)
            return leaf, attention(leaf * 1.0, leaf * 1.0, leaf * 1.0, need_weights=need_weights)[0]

        leaf, y = run()
        exact = torch.autograd.grad(y, leaf, grad)
        worst = 0.0
        for _ in range(SEEDS):
            capture = ActivationCapture(CompressionConfig(bits=bits, min_numel=1), attention)
            with capture.capturing():
                leaf, y = run()
            worst = max(worst, relative_error(torch.autograd.grad(y, leaf, grad), exact))
        errors[way] = worst
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'bits':>4} {'scale':>5} {'logit':>7}  kernel: {'as stored':>9} {'recomputed':>10} {'written out':>11}"
        f"   capture: {'fused':>7} {'written out':>11}"
    )
    for bits in args.bits:
        for scale in SCALES:
            row = {
                "bits": bits,
                "scale": scale,
                **kernel_errors(scale, bits),
                **{f"capture {way}": e for way, e in capture_errors(scale, bits).items()},
            }
            rows.append(row)
            print(
                f"{bits:>4} {scale:>5} {row['largest_logit']:>7.1f}          {row['as stored']:>9.3f} "
                f"{row['recomputed']:>10.3f} {row['written out']:>11.3f}            {row['capture fused']:>7.3f} "
                f"{row['capture written out']:>11.3f}"
            )
    result = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "seeds": SEEDS,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fused_attention_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
