"""Pack and unpack time of every codec on one activation-sized tensor, next to a plain copy.

The tensor is ResNet-18's first activation at batch 64 (64 x 64 x 32 x 32, fp32, 16 MiB);
its ReLU mask, and the int64 indices a 2x2 max-pool of it would save. The fastest of
repeated runs (on a shared machine the fastest run is the one least disturbed by others),
on the CPU unless --device cuda.

    python benchmarks/codec_speed.py --repeats 15
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_act import ops
from lightning_act.codecs import GroupQuantCodec
from lightning_act.codecs.division import DivisionCodec
from lightning_act.codecs.exact import IndexCodec, MaskCodec, SignMaskCodec
from lightning_act.codecs.pool import PoolCodec
from lightning_act.ops import division as division_ops


def best_ms(fn, repeats: int, device: str) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = args.device
    ops.ensure_kernels(device)

    torch.manual_seed(0)
    x = torch.relu(torch.randn(64, 64, 32, 32, device=device))
    mask = x > 0
    indices = torch.nn.functional.max_pool2d(torch.randn(64, 64, 32, 32, device=device), 2, return_indices=True)[1]
    planes = x.view(-1, 32, 32)

    cases = [
        ("copy (clone) of the fp32 activation", x, lambda: x.clone(), None),
        ("quant 2-bit, group 256 (kernel)", x, *_codec_pair(GroupQuantCodec(256), x)),
        ("DIVISION block 8, 2-bit (kernel)", x, *_codec_pair(DivisionCodec(8), x)),
        (
            "DIVISION block 8, 2-bit (reference)",
            x,
            lambda: division_ops.reference_pack(planes, 8, 8, 2, 256, 0, torch.bfloat16),
            reference_unpacker(planes),
        ),
        ("pool 2x2", x, *_codec_pair(PoolCodec(2), x)),
        ("sign mask (x > 0)", x, *_codec_pair(SignMaskCodec(), x)),
        ("copy (clone) of the bool mask", mask, lambda: mask.clone(), None),
        ("mask, 1 bit", mask, *_codec_pair(MaskCodec(), mask)),
        ("copy (clone) of the int64 max-pool indices", indices, lambda: indices.clone(), None),
        ("index, range measured (aminmax + 1 sync)", indices, *_codec_pair(IndexCodec(), indices)),
        (
            "index, range from the op (no sync)",
            indices,
            lambda: IndexCodec().pack(indices, 2, 0, value_range=(0, 32 * 32 - 1)),
            IndexCodec().pack(indices, 2, 0, value_range=(0, 32 * 32 - 1)).unpack,
        ),
    ]
    print(f"{device}, {torch.get_num_threads()} threads, fastest of {args.repeats} runs")
    print(f"{'':<46} {'values':>10} {'pack ms':>9} {'unpack ms':>10}")
    for name, tensor, pack, unpack in cases:
        pack_ms = best_ms(pack, args.repeats, device)
        unpack_text = f"{best_ms(unpack, args.repeats, device):>10.2f}" if unpack is not None else f"{'':>10}"
        print(f"{name:<46} {tensor.numel():>10} {pack_ms:>9.2f} {unpack_text}")


def _codec_pair(codec, tensor):
    """(pack, unpack) callables of one codec on one tensor."""
    return (lambda: codec.pack(tensor, 2, 0)), codec.pack(tensor, 2, 0).unpack


def reference_unpacker(planes):
    packed = division_ops.reference_pack(planes, 8, 8, 2, 256, 0, torch.bfloat16)
    return lambda: division_ops.reference_unpack(*packed, 32, 32, 8, 8, 2, 256, torch.float32)


if __name__ == "__main__":
    main()
