"""A CPU process's resident high-water mark over a training run, with and without
compression, under the C allocator's settings that decide how much freed memory it keeps.

Live tensors are what a GPU's allocator counts; on a CPU the process also keeps what glibc's
``malloc`` holds for reuse, and a freed block only returns to the system when it was
``mmap``-ed on its own or sits at the top of a heap. Each run is a fresh process (the
high-water mark is the process's) training ResNet-18 (CIFAR stem, batch 64, SGD with
momentum) through ``Trainer(callbacks=[...])`` for ``--steps`` steps, and prints its
``VmHWM`` and its live-tensor peak, for:

* ``default``: glibc as it comes (``M_MMAP_THRESHOLD`` adapts upwards to the largest block
  freed, so after the first steps most tensors come from the heaps, whose freed memory
  stays resident);
* ``mmap_threshold``: ``MALLOC_MMAP_THRESHOLD_=131072``, every block of 128 KiB or more
  ``mmap``-ed on its own and unmapped when freed;
* ``jemalloc``: jemalloc preloaded (``LD_PRELOAD``), where installed.

    python benchmarks/resident_memory.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
JEMALLOC = next(
    (
        p
        for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")
        if Path(p).exists()
    ),
    None,
)
ALLOCATORS = {"default": {}, "mmap_threshold": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
if JEMALLOC:
    ALLOCATORS["jemalloc"] = {"LD_PRELOAD": JEMALLOC}


def child(bits: int | None, steps: int) -> None:
    """One run in this process: prints its figures as JSON on the last line."""
    import lightning as L
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from lightning_act import ActCompression

    from peak_memory import MODELS, build

    workload = build("resnet18_cifar", MODELS["resnet18_cifar"].batch, torch.device("cpu"), REPO.parent / "shared")

    class Task(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = workload.model

        def training_step(self, batch, batch_idx):
            return workload.loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader([workload.batch] * steps, batch_size=None)

    act = ActCompression(bits=bits) if bits else None
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[act] if act else [],
    )
    trainer.fit(Task())
    status = Path("/proc/self/status").read_text()
    hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024
    print(
        json.dumps(
            {
                "resident_peak_mib": round(hwm / MIB, 1),
                "resident_end_mib": round(rss / MIB, 1),
                "live_peak_mib": None if act is None else round(act.max_peak_bytes / MIB, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--child", choices=["none", "2"], help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "resident_memory_cpu.json")
    args = parser.parse_args()
    if args.child:
        child(None if args.child == "none" else int(args.child), args.steps)
        return
    results = {"command": " ".join(["python", *sys.argv]), "steps": args.steps, "runs": {}}
    print("| allocator | none: resident peak (MiB) | 2 bits: resident peak | 2 bits: live peak |")
    print("|---|---:|---:|---:|")
    for allocator, env in ALLOCATORS.items():
        row = {}
        for bits in ("none", "2"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", bits, "--steps", str(args.steps)],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=True,
            )
            row[bits] = json.loads(done.stdout.strip().splitlines()[-1])
        results["runs"][allocator] = row
        print(
            f"| {allocator} | {row['none']['resident_peak_mib']} | {row['2']['resident_peak_mib']} | "
            f"{row['2']['live_peak_mib']} |",
            flush=True,
        )
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
