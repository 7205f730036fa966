"""LSTM and GRU through oneDNN's fused kernel or aten's unfused per-step ops, with and without 2-bit capture.

On the CPU ``nn.LSTM`` runs oneDNN's fused RNN kernel (``mkldnn_rnn``), which saves for backward
a few float tensors (the layer inputs and outputs) and an opaque one-byte workspace (the
gates of every step) that no codec can read, so the capture must keep the workspace whole.
With oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``, forward and backward) aten
runs the same recurrence as per-step ``linear`` / ``sigmoid`` / ``tanh`` / ``mul`` ops whose
saves are ordinary float tensors the capture compresses; with a capture the unfused LSTM
and GRU rows run the capture's own ``unfused_recurrent=True``, which switches oneDNN off
around the recurrent modules alone. This measures, on one CPU thread,
whether that trade pays: the unfused path saves more (every gate of every step, in fp32) but
all of it compressible. ``nn.GRU`` has no oneDNN kernel on the CPU: both of its paths run the
unfused ops (the rows are there to show it). ``cells`` is the same LSTM written as a Python
loop of ``nn.LSTMCell`` sharing the LSTM's parameters.

Model: ``nn.LSTM`` / ``nn.GRU`` (input 128, hidden 256, 2 layers, batch_first) over a float
batch 32 x 64 steps, a linear head (32 classes) at every step and cross-entropy. For each
path, uncompressed and with ``CompressionConfig(bits=2)``:

* step time (forward + backward): the paths alternate in rounds, the fastest round counts;
* ``saved`` / ``stored`` bytes from the capture's report (kept ratio = saved / stored);
* the forward's kept bytes and the step's live-tensor peak above its start, from the
  profiler's allocation events, replayed as ``benchmarks/peak_memory.py`` does;
* the relative L2 error of the parameter gradient against the uncompressed gradient of the
  same path, at 8 bits and at 2 bits (the mean over seeds of single-seed errors), and the
  error of the mean of the 2-bit gradients over ``--seeds`` seeds: an unbiased codec's
  error shrinks by about sqrt(seeds) (2.8 for 8);
* what autograd saves on each path, counted by a pass-through ``saved_tensors_hooks``
  (number of saves and bytes per dtype, parameters and views included, no dedup).

    python benchmarks/recurrent.py            # about 1 minute on one thread
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_act import ActivationCapture, CompressionConfig

from peak_memory import FORWARD_RANGE, replay

MIB = 2**20
CLASSES = 32


class Tagger(nn.Module):
    """A recurrent net with a linear head at every step."""

    def __init__(self, kind: str, inputs: int, hidden: int, layers: int):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(inputs, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class CellLoop(nn.Module):
    """The same LSTM as a Python loop of ``nn.LSTMCell``, sharing the tagger's parameters."""

    def __init__(self, tagger: Tagger):
        super().__init__()
        lstm = tagger.rnn
        self.cells = nn.ModuleList()
        for layer in range(lstm.num_layers):
            cell = nn.LSTMCell(lstm.input_size if layer == 0 else lstm.hidden_size, lstm.hidden_size)
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                setattr(cell, name, getattr(lstm, f"{name}_l{layer}"))
            self.cells.append(cell)
        self.head = tagger.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        states = [None] * len(self.cells)
        outputs = []
        for t in range(steps):
            h = x[:, t]
            for layer, cell in enumerate(self.cells):
                states[layer] = cell(h, states[layer])
                h = states[layer][0]
            outputs.append(h)
        return self.head(torch.stack(outputs, 1))


def onednn(enabled: bool):
    return contextlib.nullcontext() if enabled else torch.backends.mkldnn.flags(enabled=False)


class Run:
    """One way to run the step: a model, oneDNN on or off, and a capture or none."""

    def __init__(self, model: nn.Module, fused: bool, bits: int | None, x: torch.Tensor, y: torch.Tensor):
        self.model, self.fused, self.bits, self.x, self.y = model, fused, bits, x, y
        # The capture switches oneDNN off around the recurrent modules itself
        # (``unfused_recurrent``): the product's setting, measured as users would run it.
        self.by_setting = bits is not None and not fused and isinstance(model, Tagger)
        self.captures = {} if bits is None else {bits: self.new_capture(bits)}
        self.capture = self.captures.get(bits)

    def new_capture(self, bits: int) -> ActivationCapture:
        return ActivationCapture(CompressionConfig(bits=bits, unfused_recurrent=self.by_setting), self.model)

    @property
    def switches(self):
        """oneDNN's switch for the step: off for the unfused paths the capture does not switch."""
        return onednn(self.fused or self.by_setting)

    def loss(self, seed: int | None = None) -> torch.Tensor:
        if self.capture is None:
            logits = self.model(self.x)
        else:
            with self.capture.capturing(inputs=self.x, seed=seed):
                logits = self.model(self.x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), self.y.flatten())

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        with self.switches:
            self.loss().backward()

    def grad(self, params: list[nn.Parameter], seed: int | None = None, bits: int | None = None) -> torch.Tensor:
        if bits is not None:
            if bits not in self.captures:
                self.captures[bits] = self.new_capture(bits)
            self.capture = self.captures[bits]
        with self.switches:
            grads = torch.autograd.grad(self.loss(seed), params)
        return torch.cat([g.flatten() for g in grads])

    def memory(self) -> tuple[int, int]:
        """Forward-kept and peak bytes of one step above its start (profiler allocation events)."""
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        gc.disable()
        try:
            with self.switches, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with record_function(FORWARD_RANGE):
                    loss = self.loss()
                loss.backward()
        finally:
            gc.enable()
        measured = replay(prof.profiler.kineto_results.experimental_event_tree())
        return measured.kept_bytes, measured.peak_bytes

    def saves(self) -> dict:
        """What autograd saves on this path, seen by a pass-through hook."""
        count, nbytes = Counter(), Counter()

        def pack(t: torch.Tensor) -> torch.Tensor:
            count[str(t.dtype)] += 1
            nbytes[str(t.dtype)] += t.numel() * t.element_size()
            return t

        with onednn(self.fused), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = self.model(self.x)
        del logits
        return {
            "saves": sum(count.values()),
            "saves_by_dtype": dict(count),
            "MiB_by_dtype": {k: v / MIB for k, v in nbytes.items()},
        }


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="sequence length")
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--no-cells", action="store_true", help="skip the nn.LSTMCell loop")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.length, args.inputs, generator=generator)
    y = torch.randint(0, CLASSES, (args.batch, args.length), generator=generator)

    paths: dict[str, Run] = {}
    params: dict[str, list[nn.Parameter]] = {}
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        tagger = Tagger(kind, args.inputs, args.hidden, args.layers).train()
        params[kind] = list(tagger.parameters())
        models = {"fused": (tagger, True), "unfused": (tagger, False)}
        if kind == "lstm" and not args.no_cells:
            models["cells"] = (CellLoop(tagger), False)
        for path, (model, fused) in models.items():
            for bits in (None, 2):
                paths[f"{kind} {path} {'2-bit' if bits else 'none'}"] = Run(model, fused, bits, x, y)

    for path in paths.values():  # warm-up: kernels, allocator, the capture's per-slot decisions
        path.step()
    rounds = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, path in paths.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                path.step()
            rounds[name].append((time.perf_counter() - started) / args.steps * 1e3)

    results = {}
    exact_grads = {}
    for name, path in paths.items():
        kind = name.split()[0]
        row = {"step_ms": min(rounds[name]), "rounds_ms": rounds[name]}
        row["kept_bytes"], row["peak_bytes"] = path.memory()
        if path.capture is not None:
            report = path.capture.report
            row.update(
                saved_bytes=report.saved_bytes,
                stored_bytes=report.stored_bytes,
                ratio=report.ratio,
                counts=dict(sorted(report.counts.items())),
            )
            exact = exact_grads[name.replace("2-bit", "none")]
            row["error_8bit"] = relative(path.grad(params[kind], seed=7, bits=8), exact)
            total, singles = torch.zeros_like(exact), []
            for seed in range(args.seeds):
                g = path.grad(params[kind], seed=1000 + seed, bits=2)
                singles.append(relative(g, exact))
                total += g
            row["error_2bit"] = sum(singles) / len(singles)
            row["error_2bit_mean_of_seeds"] = relative(total / args.seeds, exact)
            row["unbiased_ratio"] = row["error_2bit"] / row["error_2bit_mean_of_seeds"]
        else:
            exact_grads[name] = path.grad(params[kind])
            row.update(path.saves())
        results[name] = row

    for name, row in results.items():  # against the uncompressed fused step of the same net
        base = results[f"{name.split()[0]} fused none"]
        row["time_vs_fused_none"] = row["step_ms"] / base["step_ms"]
        row["peak_vs_fused_none"] = base["peak_bytes"] / row["peak_bytes"]
        row["kept_vs_fused_none"] = base["kept_bytes"] / row["kept_bytes"]
    path_agreement = {
        f"{kind} {path} vs fused": relative(exact_grads[f"{kind} {path} none"], exact_grads[f"{kind} fused none"])
        for kind, path in (("lstm", "unfused"), ("lstm", "cells"), ("gru", "unfused"))
        if f"{kind} {path} none" in exact_grads
    }

    print(
        f"nn.LSTM / nn.GRU {args.inputs}->{args.hidden} x{args.layers}, batch {args.batch}, {args.length} steps, "
        f"linear head + cross-entropy; 1 CPU thread; fastest of {args.rounds} rounds of {args.steps} steps"
    )
    print(
        f"{'path':<20} {'step ms':>8} {'x time':>7} {'saved':>7} {'stored':>7} {'ratio':>6} {'fwd kept':>8} "
        f"{'peak':>7} {'peak /':>7} {'err 8b':>8} {'err 2b':>7} {'mean8':>7} {'1/mean':>6}  saves (hook)"
    )
    print(f"{'':<20} {'':>8} {'fused':>7} {'MiB':>7} {'MiB':>7} {'':>6} {'MiB':>8} {'MiB':>7} {'fused':>7}")
    for name, row in results.items():
        compressed = "saved_bytes" in row

        def cell(key, fmt, scale=1.0, width=7):
            return f"{row[key] / scale:>{width}{fmt}}" if key in row else " " * (width - 1) + "-"

        saves = (
            f"{row['saves']} {', '.join(f'{k[6:]} {v:.1f}' for k, v in row['MiB_by_dtype'].items())} MiB"
            if not compressed
            else ""
        )
        print(
            f"{name:<20} {row['step_ms']:>8.1f} {row['time_vs_fused_none']:>6.2f}x "
            f"{cell('saved_bytes', '.1f', MIB)} {cell('stored_bytes', '.1f', MIB)} "
            f"{cell('ratio', '.2f', 1, 5) + 'x' if compressed else '     -'} "
            f"{row['kept_bytes'] / MIB:>8.1f} {row['peak_bytes'] / MIB:>7.1f} {row['peak_vs_fused_none']:>6.2f}x "
            f"{cell('error_8bit', '.5f', 1, 8)} {cell('error_2bit', '.4f')} {cell('error_2bit_mean_of_seeds', '.4f')} "
            f"{cell('unbiased_ratio', '.2f', 1, 6)}  {saves}"
        )
    print("exact gradients, other paths against fused: " + ", ".join(f"{k} {v:.1e}" for k, v in path_agreement.items()))

    summary = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "classes": CLASSES,
        "exact_gradient_agreement": path_agreement,
        "paths": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "recurrent_cpu.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
