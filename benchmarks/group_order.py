"""Less rounding noise at the same bits: three remedies for outlier features, measured.

On every model of the model-library suite (``benchmarks/model_libraries.py``), at 2 bits and
the same stored bytes, the gradient's rounding variance (mean over seeds of
``||g - g_exact||**2``) of:

* ``memory``: groups of 256 consecutive values in memory order (along the last axis);
* ``group axis``: what the library ships, ``group_order="auto"``: each saved tensor's
  groups run along the axis where its first step measures the least noise;
* ``rotation``: a randomized Hadamard transform (random signs, then a 256-point Hadamard)
  over each group before rounding, undone after decoding (unbiased for linear reads; it
  spreads an outlier over the group);
* ``outliers apart``: the 1% of last-axis features with the largest magnitude kept exact
  beside the codes (they then cost 16 bits each), the rest quantized.

``rotation`` and ``outliers apart`` are emulated here in PyTorch around the quantizer; only
the order of the groups needs no extra bytes or passes, which is why it is the one in the
kernels. Per tensor kind (the op that saved it), each remedy's noise energy relative to
memory order's, weighted by the tensor's share of the gradient variance (GACT's probes at
2 bits), over all models: which kinds of tensor each remedy helps.

    python benchmarks/group_order.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import time
import warnings
from pathlib import Path

import torch
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.codecs import quant
from lightning_act.policy import FixedBits
from lightning_act.policy.estimators import probe_sensitivities

import model_libraries as ml

SEEDS = 4
GROUP = 256
REMEDIES = ("memory", "group axis", "rotation", "outliers apart")


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


HADAMARD = _hadamard(GROUP)
SIGNS = torch.where(torch.rand(GROUP, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0)


class _Emulated:
    """A record decoded through a transform: what the codec's record would be."""

    codec = "quant"

    def __init__(self, record, restore):
        self.record, self.restore = record, restore

    stats = property(lambda self: self.record.stats)
    nbytes = property(lambda self: self.record.nbytes)

    def unpack(self):
        return self.restore(self.record.unpack())


_plain_pack = quant.GroupQuantCodec.pack
_remedy = {"now": "memory"}


def _rotated_pack(codec, dense, bits, seed):
    flat = dense.reshape(-1).float()
    numel = flat.numel()
    groups = torch.nn.functional.pad(flat, (0, (-numel) % GROUP)).view(-1, GROUP)
    record = _plain_pack(codec, ((groups * SIGNS) @ HADAMARD).view(-1), bits, seed)
    return _Emulated(
        record, lambda y: ((y.view(-1, GROUP) @ HADAMARD) * SIGNS).view(-1)[:numel].view(dense.shape).to(dense.dtype)
    )


def _outliers_apart_pack(codec, dense, bits, seed):
    features = dense.shape[-1]
    columns = dense.abs().reshape(-1, features).amax(0).topk(max(1, features // 100)).indices
    kept = dense[..., columns].clone()
    rest = dense.clone()
    rest[..., columns] = 0
    record = _plain_pack(codec, rest, bits, seed)

    def restore(decoded):
        decoded = decoded.clone()
        decoded[..., columns] = kept
        return decoded

    return _Emulated(record, restore)


def _pack(codec, dense, bits, seed, group_axis=None):
    remedy = _remedy["now"]
    if remedy == "rotation" and codec.group_size == GROUP:
        return _rotated_pack(codec, dense, bits, seed)
    if remedy == "outliers apart" and codec.group_size == GROUP and dense.dim() >= 2 and dense.shape[-1] >= 16:
        return _outliers_apart_pack(codec, dense, bits, seed)
    return _plain_pack(codec, dense, bits, seed, group_axis)


quant.GroupQuantCodec.pack = _pack


def _config(remedy: str) -> CompressionConfig:
    return CompressionConfig(bits=2, group_order="auto" if remedy == "group axis" else "memory")


def measured_variance(workload, exact: torch.Tensor, remedy: str) -> tuple[float, int]:
    _remedy["now"] = remedy
    try:
        capture = ActivationCapture(_config(remedy), workload.model, FixedBits(2))
        ml.weight_grad(workload, capture, seed=1)  # "group axis": the step that surveys the axes
        total = 0.0
        for seed in range(SEEDS):
            total += (ml.weight_grad(workload, capture, seed=1000 + seed) - exact).square().sum().item()
        return total / SEEDS, capture.report.stored_bytes
    finally:
        _remedy["now"] = "memory"


def noise_by_kind(workload) -> dict[str, dict[str, float]]:
    """Per op kind: the probes' 2-bit variance share and each remedy's weighted noise energy."""
    params = [p for p in workload.model.parameters() if p.requires_grad]
    sensitivity = probe_sensitivities(
        ActivationCapture(_config("memory"), workload.model), workload.loss, params, inputs=workload.inputs
    )
    capture = ActivationCapture(_config("group axis"), workload.model)
    with capture.capturing(inputs=workload.inputs):  # surveys the group orders
        workload.loss()
    with capture.probing(inputs=workload.inputs) as probe:
        workload.loss()
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(("share", *REMEDIES), 0.0))
    for slot, (dense, codec, group_axis) in probe._held.items():
        weight = sensitivity.get(slot, {}).get(2, 0.0)
        if weight <= 0.0:
            continue
        energies = {}
        for remedy in REMEDIES:
            _remedy["now"] = remedy if remedy != "group axis" else "memory"
            axis = group_axis if remedy == "group axis" else None
            energies[remedy] = sum(
                (codec.pack(dense, 2, seed, axis).unpack() - dense).float().square().sum().item()
                for seed in range(SEEDS)
            )
        _remedy["now"] = "memory"
        kind = kinds[capture.slots[slot].op or "other"]
        kind["share"] += weight
        for remedy in REMEDIES:
            kind[remedy] += weight * energies[remedy] / energies["memory"] if energies["memory"] > 0 else weight
    return kinds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ml.DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="*", choices=sorted(ml.CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    results = {
        "device": "cpu",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "seeds": SEEDS,
        "models": {},
    }
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(("share", *REMEDIES), 0.0))
    print(f"{'model':28s} " + " ".join(f"{r:>15s}" for r in REMEDIES[1:]) + "   (variance vs memory order, same bytes)")
    for name in args.only or ml.CASES:
        started = time.perf_counter()
        workload = ml.build(name, args.data)
        exact = ml.weight_grad(workload)
        variance = {remedy: measured_variance(workload, exact, remedy) for remedy in REMEDIES}
        base = variance["memory"][0]
        row = {
            remedy: {"variance_vs_memory": v / base if base else 1.0, "stored_bytes": b}
            for remedy, (v, b) in variance.items()
        }
        kinds = noise_by_kind(workload)
        total_share = sum(k["share"] for k in kinds.values()) or 1.0
        for op, kind in kinds.items():
            for key in kind:
                totals[op][key] += kind[key] / total_share  # every model weighs the same
        results["models"][name] = row
        print(
            f"{name:28s} "
            + " ".join(f"{row[r]['variance_vs_memory']:15.3f}" for r in REMEDIES[1:])
            + f"   {time.perf_counter() - started:.0f} s",
            flush=True,
        )
    results["by_kind"] = {
        op: {"share": kind["share"], **{r: kind[r] / kind["share"] for r in REMEDIES[1:]}}
        for op, kind in sorted(totals.items(), key=lambda item: -item[1]["share"])
    }
    print("\nnoise energy vs memory order, per kind of tensor (weighted by its share of the 2-bit variance)")
    for op, kind in results["by_kind"].items():
        print(f"  {op:32s} share {kind['share']:6.2f}  " + "  ".join(f"{r} {kind[r]:.3f}" for r in REMEDIES[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "group_order_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
