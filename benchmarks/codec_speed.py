"""Pack and unpack time of every codec on one activation-sized tensor, next to a plain copy.

The tensor is ResNet-18's first activation at batch 64 (64 x 64 x 32 x 32, fp32, 16 MiB);
its ReLU mask, and the int64 indices a 2x2 max-pool of it would save. The table gives the
fastest of repeated runs (on a shared machine the fastest run is the one least disturbed by
others), on the CPU unless --device cuda.

The fused kernels are then timed against the clone side by side: each round times the
clone and every kernel once after another (fastest of a few runs each) and divides, so load
that drifts between rounds hits both sides of a ratio alike. The median ratio over the
rounds is reported and written, with the machine, to
``benchmarks/results/codec_speed_<device>.json``. On the CPU this is done twice: in wall
time with all threads, and in the CPU time of one thread (``time.thread_time``), which
counts only the time the thread ran and so stays exact on a machine shared with other
work, where wall times of a few milliseconds swing by several times.

    python benchmarks/codec_speed.py --repeats 15 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from lightning_act import ops
from lightning_act.codecs import GroupQuantCodec
from lightning_act.codecs.division import DivisionCodec
from lightning_act.codecs.exact import IndexCodec, MaskCodec, SignMaskCodec
from lightning_act.codecs.pool import PoolCodec
from lightning_act.ops import reference


def best_ms(fn, repeats: int, device: str, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = clock()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - started)
    return min(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=9, help="side-by-side rounds of the kernels against the clone")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = args.device
    ops.ensure_kernels(device)

    torch.manual_seed(0)
    x = torch.relu(torch.randn(64, 64, 32, 32, device=device))
    mask = x > 0
    indices = torch.nn.functional.max_pool2d(torch.randn(64, 64, 32, 32, device=device), 2, return_indices=True)[1]
    planes = x.view(-1, 32, 32)

    clone = ("copy (clone) of the fp32 activation", x, lambda: x.clone(), None)
    kernels = [
        ("quant 2-bit, group 256 (kernel)", x, *_codec_pair(GroupQuantCodec(256), x)),
        # Groups along the rows of each 32 x 32 plane, and down the tokens of a (batch,
        # tokens, features) view (64 x 1024 matrices): a strided read and write.
        ("quant 2-bit, group 256, along axis 2 (kernel)", x, *_codec_pair(GroupQuantCodec(256), x, group_axis=2)),
        (
            "quant 2-bit, group 256, (64, 64, 1024) axis 1",
            x,
            *_codec_pair(GroupQuantCodec(256), x.view(64, 64, 1024), group_axis=1),
        ),
        ("DIVISION block 8, 2-bit (kernel)", x, *_codec_pair(DivisionCodec(8), x)),
    ]
    cases = [
        clone,
        *kernels,
        (
            "DIVISION block 8, 2-bit (reference)",
            x,
            lambda: reference.division_pack(planes, 8, 8, 2, 256, 0, torch.bfloat16),
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
        # The reference takes seconds per call: a few runs of it show its speed well enough.
        repeats = min(args.repeats, 3) if "(reference)" in name else args.repeats
        pack_ms = best_ms(pack, repeats, device)
        unpack_text = f"{best_ms(unpack, repeats, device):>10.2f}" if unpack is not None else f"{'':>10}"
        print(f"{name:<46} {tensor.numel():>10} {pack_ms:>9.2f} {unpack_text}")

    timers = {"wall, all threads": (time.perf_counter, torch.get_num_threads())}
    if device == "cpu":
        timers["thread CPU time, 1 thread"] = (time.thread_time, 1)
    threads = torch.get_num_threads()
    results = {}
    for timer, (clock, timer_threads) in timers.items():
        torch.set_num_threads(timer_threads)
        rounds = side_by_side(clone[2], kernels, args.rounds, device, clock)
        print(
            f"\n{timer}, side by side with the clone, {args.rounds} rounds (fastest of 5 runs each): "
            "median ratio [min, max]"
        )
        ratios = {}
        for name, times in rounds.items():
            if name == "clone":
                continue
            per_round = [t / c for t, c in zip(times, rounds["clone"])]
            ratios[name] = statistics.median(per_round)
            print(f"{name:<46} {ratios[name]:>5.2f}x  [{min(per_round):.2f}, {max(per_round):.2f}]")
        results[timer] = {"threads": timer_threads, "ratio_to_clone_median": ratios, "rounds_ms": rounds}
    torch.set_num_threads(threads)
    result = {
        "device": device,
        "machine": machine_description(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "tensor": "fp32 [64, 64, 32, 32] (16 MiB), ReLU output",
        "side_by_side": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"codec_speed_{device}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def side_by_side(clone, kernels, rounds: int, device: str, clock) -> dict[str, list[float]]:
    """Per round, the fastest of 5 runs of the clone and of each kernel's pack and unpack."""
    times = {"clone": []}
    for _ in range(rounds):
        times["clone"].append(best_ms(clone, 5, device, clock))
        for name, _, pack, unpack in kernels:
            times.setdefault(f"{name} pack", []).append(best_ms(pack, 5, device, clock))
            times.setdefault(f"{name} unpack", []).append(best_ms(unpack, 5, device, clock))
    return times


def machine_description(device: str) -> str:
    """The processor's model name, its cores and the instruction sets the kernels choose from."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    vector = "AVX2" if "avx2" in flags else "SSE2"
    return f"{model}, {os.cpu_count()} cores, {vector} kernels"


def _codec_pair(codec, tensor, **options):
    """(pack, unpack) callables of one codec on one tensor."""
    return (lambda: codec.pack(tensor, 2, 0, **options)), codec.pack(tensor, 2, 0, **options).unpack


def reference_unpacker(planes):
    packed = reference.division_pack(planes, 8, 8, 2, 256, 0, torch.bfloat16)
    return lambda: reference.division_unpack(*packed, 32, 32, 8, 8, 2, 256, torch.float32)


if __name__ == "__main__":
    main()
