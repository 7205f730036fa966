"""What the capture engine costs the host per saved tensor, apart from the codec's kernels.

A GPU runs a training step asynchronously while the host queues its kernels; the host's
own work per saved tensor (choosing the codec and bits, accounting, dedup) stays hidden
only while it is shorter than the kernels it queues. On small batches it is not, so this
measures it where the kernels cost almost nothing: a deep, narrow MLP (``--layers``
Linear+ReLU pairs of width 64, batch 4) on one CPU thread, every activation compressed
(``min_numel=1``), each layer saving three tensors (the Linear's input and weight, the
ReLU's output, which is also the next Linear's input and is stored once). Steps with and
without the capture alternate in rounds, so drifting load hits both alike; the fastest
round of each is compared.

Next to it, the part of that cost no Python-level capture can avoid: the same session with
a pack hook that passes every tensor through (the saved-tensor hooks, the op tracker and
the module hooks that name the saving module, with nothing decided or stored), and the
codec's own op calls for one layer (one pack of the ReLU output, which two backward nodes
decode), timed alone. Their sum is the floor for this design; below it, the hooks
themselves would have to move to C++.

Between the floor and the capture, two bounds on what any Python-level pack hook costs,
measured in the same rounds: a hook that stores every activation through the codec and does
nothing else (no decision, no sharing beyond one tensor's repeated saves, no report), and
the same hook that also computes each call's signature, which a capture must know before
it may reuse an earlier decision for a save. What the second costs above the floor is
spent before the capture has decided, shared or counted anything.

Then the same model under ``torch.compile`` (inductor), with and without the capture: no
Python hook runs per saved tensor there (the graph calls the library's pack and unpack
ops), so the cost per packed tensor is the ops' dispatch and the codec itself.

    python benchmarks/capture_overhead.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.capture.call_sites import call_key
from lightning_act.capture.records import Compressed, Layout
from lightning_act.codecs import GroupQuantCodec
from torch import nn


class CodecOnlyHook:
    """A pack hook that stores every activation at ``bits`` through ``codec`` and a parameter
    as it is, and nothing else: one record per tensor object (ReLU's output, which the next
    Linear saves again, is packed once). With ``tracker``, it first computes the signature
    of the call saving the tensor, as a capture must before reusing a decision."""

    def __init__(self, codec: GroupQuantCodec, bits: int, tracker=None):
        self.codec, self.bits, self.tracker = codec, bits, tracker
        self.layout = Layout.as_it_is()
        self.stored: dict[int, tuple[torch.Tensor, Compressed]] = {}

    def __call__(self, t: torch.Tensor):
        if self.tracker is not None:
            call_key(self.tracker.current_call())
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # Linear saves its weight's view
            return t.detach()
        earlier = self.stored.get(id(t))
        if earlier is not None and earlier[0] is t:
            return earlier[1]
        saved = Compressed(self.codec.pack(t, self.bits, len(self.stored)), self.layout)
        self.stored[id(t)] = (t, saved)
        return saved


def codec_calls_us(x: torch.Tensor, repeats: int) -> float:
    """One layer's codec op calls, alone: a ReLU output packed at 2 bits, decoded twice."""
    codec = GroupQuantCodec(CompressionConfig().group_size)
    activation = torch.relu(torch.nn.functional.linear(x, torch.randn(64, 64)))
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            record = codec.pack(activation, 2, 1)
            record.unpack()
            record.unpack()
        times.append((time.perf_counter() - started) / repeats * 1e6)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(args.layers) for m in (nn.Linear(64, 64), nn.ReLU())))
    x = torch.randn(4, 64)
    config = CompressionConfig(bits=2, min_numel=1)
    capture = ActivationCapture(config, model)
    hooks_only = ActivationCapture(config, model)
    hooks_only.pack = torch.Tensor.detach  # every save passes through: the mechanism alone
    codec = GroupQuantCodec(config.group_size)
    codec_only = ActivationCapture(config, model)
    codec_only.pack = CodecOnlyHook(codec, config.bits)
    signed = ActivationCapture(config, model)
    signed.pack = CodecOnlyHook(codec, config.bits, signed._tracker)
    sessions = {"plain": None, "hooks": hooks_only, "codec_only": codec_only, "signed": signed, "capture": capture}

    def step(run: nn.Module, session: ActivationCapture | None) -> None:
        if session is not None:
            with session.capturing(inputs=x):
                loss = run(x).sum()
        else:
            loss = run(x).sum()
        loss.backward()
        if session is not None and isinstance(session.pack, CodecOnlyHook):
            session.pack.stored.clear()

    def round_ms(run: nn.Module, session: ActivationCapture | None) -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            step(run, session)
        return (time.perf_counter() - started) / args.steps * 1e3

    compiled_model = torch.compile(model, backend="inductor")
    compiled_capture = ActivationCapture(config, model)
    runs = {name: (model, session) for name, session in sessions.items()}
    runs.update({"compiled_plain": (compiled_model, None), "compiled_capture": (compiled_model, compiled_capture)})
    for run, session in runs.values():  # warm-up: kernels loaded, graphs compiled, allocator primed
        round_ms(run, session)
    rounds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (run, session) in runs.items():
            rounds[name].append(round_ms(run, session))
    best = {name: min(times) for name, times in rounds.items()}
    compiled_counts = dict(sorted(compiled_capture.report.counts.items()))
    packed = compiled_counts.get("compressed", 0) + compiled_counts.get("lossless", 0)
    compiled_us = (best["compiled_capture"] - best["compiled_plain"]) * 1e3 / max(packed, 1)
    step(model, capture)
    counts = dict(sorted(capture.report.counts.items()))
    per_layer_us = (best["capture"] - best["plain"]) / args.layers * 1e3
    hooks_us = (best["hooks"] - best["plain"]) / args.layers * 1e3
    codec_us = codec_calls_us(x, args.rounds * args.steps)
    floor_us = hooks_us + codec_us
    bound_us = {name: (best[name] - best["plain"]) / args.layers * 1e3 for name in ("codec_only", "signed")}
    print(
        f"{args.layers} Linear+ReLU layers, batch 4, width 64: step {best['plain']:.2f} ms plain, "
        f"{best['hooks']:.2f} ms with pass-through hooks, {best['capture']:.2f} ms with the capture; per layer: "
        f"{per_layer_us:.1f} us more with the capture, of which the hooks take {hooks_us:.1f} us and the codec's "
        f"op calls {codec_us:.1f} us (floor {floor_us:.1f} us); saved tensors per step: {counts}"
    )
    print(
        f"per layer against the floor: a pack hook doing nothing but the codec {bound_us['codec_only']:.1f} us "
        f"({bound_us['codec_only'] / floor_us:.2f}x), with each call's signature {bound_us['signed']:.1f} us "
        f"({bound_us['signed'] / floor_us:.2f}x), the capture {per_layer_us:.1f} us ({per_layer_us / floor_us:.2f}x)"
    )
    print(
        f"compiled (inductor): step {best['compiled_plain']:.2f} ms plain, {best['compiled_capture']:.2f} ms with "
        f"the capture: {compiled_us:.1f} us per packed tensor, codec included ({packed} packed per step: "
        f"{compiled_counts})"
    )
    result = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "layers": args.layers,
        "plain_step_ms": best["plain"],
        "hooks_step_ms": best["hooks"],
        "capture_step_ms": best["capture"],
        "extra_us_per_layer": per_layer_us,
        "hooks_us_per_layer": hooks_us,
        "codec_calls_us_per_layer": codec_us,
        "floor_us_per_layer": floor_us,
        "codec_only_hook_us_per_layer": bound_us["codec_only"],
        "signed_codec_only_hook_us_per_layer": bound_us["signed"],
        "capture_over_floor": per_layer_us / floor_us,
        "codec_only_hook_over_floor": bound_us["codec_only"] / floor_us,
        "signed_codec_only_hook_over_floor": bound_us["signed"] / floor_us,
        "decisions_per_step": counts,
        "compiled_plain_step_ms": best["compiled_plain"],
        "compiled_capture_step_ms": best["compiled_capture"],
        "compiled_us_per_packed_tensor": compiled_us,
        "compiled_decisions_per_step": compiled_counts,
        "rounds_ms": rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "capture_overhead_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
