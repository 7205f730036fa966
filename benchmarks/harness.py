"""One harness for memory, speed, largest batch and accuracy: this library against no
compression and the usual alternatives, on every example model, with one command.

Models: ResNet-18 with the CIFAR stem (32x32), ResNet-50 at 224x224, the character
transformer, a ViT (torchvision's ``VisionTransformer``: ViT-B/16's sizes on a GPU, a
small one on the CPU, so both suites run the implementation published numbers come from),
GCN and GAT on Cora. Methods:

* ``none``: fp32, nothing else;
* ``bf16``: bfloat16 autocast alone, as Lightning's ``bf16-mixed`` sets it up;
* ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) on every residual block,
  transformer block or GNN layer;
* ``offload``: ``torch.autograd.graph.save_on_cpu`` (pinned host memory on a GPU; on the
  CPU it keeps tensors where they are, so it equals ``none`` there);
* ``act_4bit``, ``act_2bit``: this library, every saved tensor at 4 or 2 bits;
* ``act_adaptive2``: this library's adaptive policy at a 2-bit budget, bits allocated once
  from GACT's probes as :class:`~lightning_act.ActCompression` does on its first
  recalibration;
* ``act_division2``, ``act_pool2``: the DIVISION and pool codecs at 2 bits (block 8).

Parts (each writes its results as it goes, so an interrupted run still leaves numbers):

* ``memory``: per model, batch size and method: the activation bytes saved and stored
  (the library's exact accounting, :class:`~lightning_act.CompressionReport`), the memory
  the forward really keeps for backward and the peak above the step's start (CPU: the
  profiler's allocation events; GPU: ``torch.cuda.memory_allocated`` and
  ``max_memory_allocated``), and the median time of a training step (forward and
  backward; the optimizer update is the same for every method and left out), timed
  round-robin across methods so a busy machine slows all of them alike;
* ``batch`` (GPU only): the largest batch whose step fits, by doubling then bisection,
  each try in its own process so an out-of-memory error cannot poison the next;
* ``accuracy``: the same seeds trained with and without compression through Lightning
  (:class:`~lightning_act.ActCompression`): ResNet-18 on CIFAR-10, GCN on Cora over 10
  seeds, the character transformer on Tiny Shakespeare.

Outputs in ``--out``: ``harness_<suite>.json`` (every number, the environment and the git
commit), ``harness_<suite>.md`` (tables) and ``harness_<suite>_{memory,throughput,
accuracy}.png``; ``--quick`` runs byte accounting and kept memory at each model's main
batch only, for every method but ``act_adaptive2`` (whose probes take minutes on a CPU),
into ``harness_<suite>_quick.*``.

    python benchmarks/harness.py --suite cpu                 # this CPU, about 20 minutes
    python benchmarks/harness.py --suite cpu --quick         # accounting only, CI-sized
    python benchmarks/harness.py --suite gpu --data-dir .data --out "$OUT"   # see gpu_suite.sh

``--data-dir`` holds ``cifar10/cifar10_jpeg_{train,test}.npz``, ``planetoid/Cora/raw/`` and
``tinyshakespeare/input.txt`` (the layout of ``../shared/data``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning_act import ActCompression, ActivationCapture, CompressionConfig, CompressionReport
from lightning_act.ops import ensure_kernels, loaded_kernels
from lightning_act.policy import AdaptiveBits, FixedBits
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
# The probe estimator's batch slice, ActCompression's default ``probe_samples``.
PROBE_SAMPLES = 8
# What the child process of one largest-batch try prints before its result.
TRY_RESULT_PREFIX = "harness-try-result "
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


# --------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One model with one batch on one device: what every method runs a step of."""

    model: nn.Module
    batch: tuple  # the loss function's arguments after the model
    loss_fn: Callable[..., torch.Tensor]
    blocks: list[nn.Module]  # what activation checkpointing wraps
    samples: int  # batch size (1: the whole graph)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def loss(self, batch: tuple | None = None) -> torch.Tensor:
        return self.loss_fn(self.model, *(self.batch if batch is None else batch))

    def leading_rows(self, rows: int) -> tuple:
        """The first ``rows`` samples, as the probe estimator sees them (a graph stays whole)."""
        return tuple(t[:rows] if isinstance(t, torch.Tensor) else t for t in self.batch)


def _classification_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(images), labels)


def _next_token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _node_loss(model: nn.Module, graph) -> torch.Tensor:
    logits = model(graph.x, graph.edge_index)
    return nn.functional.cross_entropy(logits[graph.train_mask], graph.y[graph.train_mask])


def _images(batch: int, size: int, classes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Random pixels: memory and time depend on shapes, not on what the images show.
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, size, size, generator=generator)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    return images.to(device), labels.to(device)


def build_resnet(
    batch: int, device: torch.device, data_dir: Path, arch: str, image_size: int, cifar_stem: bool, num_classes: int
) -> Workload:
    from lightning_act.examples.vision import ImageClassifier
    from torchvision.models.resnet import BasicBlock, Bottleneck

    model = ImageClassifier(arch=arch, num_classes=num_classes, cifar_stem=cifar_stem).net.to(device)
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    return Workload(model, _images(batch, image_size, num_classes, device), _classification_loss, blocks, batch)


def build_vit(batch: int, device: torch.device, data_dir: Path, **sizes) -> Workload:
    from torchvision.models.vision_transformer import EncoderBlock, VisionTransformer

    model = VisionTransformer(**sizes).to(device)
    # torchvision zero-initialises the classifier, so at initialisation no gradient reaches
    # the encoder and a gradient's error would be the classifier's alone. A trained head is
    # not zero: drawn as a linear layer's.
    model.heads.head.reset_parameters()
    blocks = [m for m in model.modules() if isinstance(m, EncoderBlock)]
    return Workload(
        model, _images(batch, sizes["image_size"], sizes["num_classes"], device), _classification_loss, blocks, batch
    )


def build_char_transformer(batch: int, device: torch.device, data_dir: Path, **sizes) -> Workload:
    from lightning_act.examples.language import VOCAB_SIZE, CharTransformer

    model = CharTransformer(**sizes).to(device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB_SIZE, (batch, sizes["block_size"] + 1), generator=generator).to(device)
    return Workload(model, (tokens[:, :-1], tokens[:, 1:]), _next_token_loss, list(model.blocks), batch)


def build_graph_network(batch: int, device: torch.device, data_dir: Path, conv: str) -> Workload:
    from lightning_act.examples.graph import NodeClassifier

    cora = planetoid(data_dir)
    model = NodeClassifier(conv=conv, in_channels=cora.num_features, num_classes=cora.num_classes).to(device)
    return Workload(model, (cora.data.to(device),), _node_loss, [model.conv1, model.conv2], 1)


def planetoid(data_dir: Path):
    """Cora; PlanetoidDataModule builds it in a writable cache when ``data_dir`` is read-only."""
    from lightning_act.examples.graph import PlanetoidDataModule

    cora = PlanetoidDataModule(root=str(data_dir / "planetoid"), name="Cora")
    cora.prepare_data()
    cora.setup("fit")
    return cora


BUILDERS = {
    "resnet18_cifar": functools.partial(build_resnet, arch="resnet18", image_size=32, cifar_stem=True, num_classes=10),
    "resnet50": functools.partial(build_resnet, arch="resnet50", image_size=224, cifar_stem=False, num_classes=1000),
    "char_transformer": build_char_transformer,
    "vit": build_vit,
    "gcn_cora": functools.partial(build_graph_network, conv="gcn"),
    "gat_cora": functools.partial(build_graph_network, conv="gat"),
}


def build_workload(name: str, batch: int, sizes: dict, device: torch.device, data_dir: Path) -> Workload:
    torch.manual_seed(0)  # the same weights for every method: accounting is reproducible
    workload = BUILDERS[name](batch, device, data_dir, **sizes)
    workload.model.train()
    return workload


# --------------------------------------------------------------------------- methods
class Method:
    """One way to hold activations for backward; ``active`` wraps the training forward."""

    description = "fp32, nothing else"
    #: Lightning Trainer arguments for the accuracy runs; None: not trained there.
    trainer_options: dict | None = {}

    def attach(self, workload: Workload) -> None:
        """Set-up outside every measurement (the adaptive policy's calibration)."""

    def active(self, workload: Workload) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def report(self) -> CompressionReport | None:
        """The library's accounting of the last forward, None for the other methods."""
        return None


class Bf16Autocast(Method):
    description = "torch.autocast(bfloat16, cache_enabled=False), as Lightning's bf16-mixed"
    trainer_options = {"precision": "bf16-mixed"}

    def active(self, workload: Workload) -> contextlib.AbstractContextManager:
        # cache_enabled=False is Lightning's bf16-mixed setting: weights are cast at every use.
        return torch.autocast(workload.device.type, dtype=torch.bfloat16, cache_enabled=False)


class Checkpointing(Method):
    description = "torch.utils.checkpoint(use_reentrant=False) on each residual / transformer block / GNN layer"
    # Recomputation is exact (the random state is replayed): accuracy equals none's.
    trainer_options = None

    @contextlib.contextmanager
    def active(self, workload: Workload):
        # An instance attribute shadows the class's forward for the step only; module
        # hooks still run, because nn.Module.__call__ calls self.forward.
        for block in workload.blocks:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        try:
            yield
        finally:
            for block in workload.blocks:
                del block.forward


class Offload(Method):
    description = "torch.autograd.graph.save_on_cpu(pin_memory=True on a GPU)"
    # Copies are exact: accuracy equals none's.
    trainer_options = None

    def active(self, workload: Workload) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=workload.device.type == "cuda")


class Compression(Method):
    """This library: fixed bits, or the adaptive policy calibrated by probes once."""

    def __init__(self, bits: int = 2, budget: float | None = None, codec: str = "quant"):
        self.settings = {"bits": bits, "codec": codec} if budget is None else {"budget": budget}
        self.description = f"ActCompression({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"
        self.config = CompressionConfig(bits=bits, codec=codec)
        self.budget = budget
        self.capture: ActivationCapture | None = None
        self.calibration_s = 0.0

    @property
    def trainer_options(self) -> dict:
        return {"callbacks": [ActCompression(**self.settings)]}

    def attach(self, workload: Workload) -> None:
        policy = FixedBits(self.config.bits) if self.budget is None else AdaptiveBits(self.budget)
        self.capture = ActivationCapture(self.config, workload.model, policy)
        if self.budget is not None:
            started = time.perf_counter()
            # What ActCompression's first probe recalibration does, without a Trainer.
            sample = workload.leading_rows(PROBE_SAMPLES)
            self.capture.calibrate(lambda: workload.loss(sample), inputs=sample)
            self.calibration_s = time.perf_counter() - started

    def active(self, workload: Workload) -> contextlib.AbstractContextManager:
        return self.capture.capturing(inputs=workload.batch)

    @property
    def report(self) -> CompressionReport:
        return self.capture.report


METHODS: dict[str, Callable[[], Method]] = {
    "none": Method,
    "bf16": Bf16Autocast,
    "checkpoint": Checkpointing,
    "offload": Offload,
    "act_4bit": functools.partial(Compression, bits=4),
    "act_2bit": functools.partial(Compression, bits=2),
    "act_adaptive2": functools.partial(Compression, budget=2.0),
    "act_division2": functools.partial(Compression, bits=2, codec="division"),
    "act_pool2": functools.partial(Compression, bits=2, codec="pool"),
}


# --------------------------------------------------------------------------- suites
@dataclass(frozen=True)
class ModelRun:
    """A model's sizes in one suite and the batch sizes it is measured at."""

    title: str
    sizes: dict
    batches: tuple[int, ...]  # the last one is the main table's
    largest_batch_cap: int = 0  # the batch search stops there (0: not searched)

    @property
    def main_batch(self) -> int:
        return self.batches[-1]


@dataclass(frozen=True)
class Suite:
    device: str
    models: dict[str, ModelRun]
    warmup_steps: int
    timed_steps: int
    accuracy: dict[str, dict]
    budgets_s: dict[str, float]  # per part: no new item starts once it is spent
    notes: tuple[str, ...] = ()
    try_timeout_s: float = 90.0
    threads: int | None = None  # intra-op threads; None: torch's default


CPU_SUITE = Suite(
    device="cpu",
    models={
        "resnet18_cifar": ModelRun("ResNet-18, CIFAR stem, 32x32", {}, (8, 16, 32)),
        "resnet50": ModelRun("ResNet-50, 224x224", {}, (2,)),
        "char_transformer": ModelRun(
            "char transformer d128 L2 T64", {"d_model": 128, "n_layers": 2, "n_heads": 4, "block_size": 64}, (8, 16, 32)
        ),
        "vit": ModelRun(
            "ViT 32x32, patch 4, d192 L6",
            {
                "image_size": 32,
                "patch_size": 4,
                "num_layers": 6,
                "num_heads": 3,
                "hidden_dim": 192,
                "mlp_dim": 768,
                "num_classes": 10,
            },
            (16,),
        ),
        "gcn_cora": ModelRun("GCN on Cora (whole graph)", {}, (1,)),
        "gat_cora": ModelRun("GAT on Cora (whole graph)", {}, (1,)),
    },
    # OpenMP threads wait for each other at every op: on a machine shared with other jobs,
    # two threads on two busy cores ran ResNet-50 ten times slower than one. One thread
    # measures the methods rather than the neighbours.
    threads=1,
    warmup_steps=0,
    timed_steps=5,
    # In order of what a CPU can show: CIFAR-10 last, as its CPU schedule is only a smoke test.
    accuracy={
        "cora_gcn": {"seeds": 10, "epochs": 200, "methods": ("none", "act_2bit", "act_adaptive2")},
        "shakespeare": {
            "sizes": {"d_model": 128, "n_layers": 2, "n_heads": 4, "block_size": 64, "lr": 3e-3, "warmup_steps": 20},
            "batch_size": 32,
            "steps": 300,
            "val_every": 100,
            "val_batches": 40,
            "seeds": 3,
            "methods": ("none", "act_4bit", "act_2bit", "act_adaptive2"),
        },
        "cifar10_resnet18": {
            "limit": 1024,
            "batch_size": 32,
            "epochs": 2,
            "lr": 0.05,
            "warmup_steps": 10,
            "num_workers": 0,
            "methods": ("none", "act_2bit"),
        },
    },
    budgets_s={"memory": 900.0, "accuracy": 1800.0},
    notes=(
        "CPU: one intra-op thread: on this machine, shared with other jobs, two OpenMP threads ran up to ten "
        "times slower than one.",
        "CPU: offload (save_on_cpu) keeps CPU tensors where they are, so it equals none here.",
        "CPU: CIFAR-10 is a short schedule on a fixed 1,024-image subset of each split (2 epochs): "
        "a smoke test of convergence, not the accuracy of a full run.",
    ),
)
GPU_SUITE = Suite(
    device="cuda",
    models={
        "resnet18_cifar": ModelRun("ResNet-18, CIFAR stem, 32x32", {}, (64, 128, 256), largest_batch_cap=65536),
        "resnet50": ModelRun("ResNet-50, 224x224", {}, (16, 32, 64), largest_batch_cap=8192),
        "char_transformer": ModelRun(
            "char transformer d256 L4 T128",
            {"d_model": 256, "n_layers": 4, "n_heads": 4, "block_size": 128},
            (32, 64, 128),
            largest_batch_cap=32768,
        ),
        "vit": ModelRun(
            "ViT-B/16, 224x224 (torchvision vit_b_16's sizes)",
            {
                "image_size": 224,
                "patch_size": 16,
                "num_layers": 12,
                "num_heads": 12,
                "hidden_dim": 768,
                "mlp_dim": 3072,
                "num_classes": 1000,
            },
            (16, 32, 64),
            largest_batch_cap=8192,
        ),
        "gcn_cora": ModelRun("GCN on Cora (whole graph)", {}, (1,)),
        "gat_cora": ModelRun("GAT on Cora (whole graph)", {}, (1,)),
    },
    warmup_steps=2,
    timed_steps=10,
    accuracy={
        "cifar10_resnet18": {
            "limit": None,
            "batch_size": 256,
            "epochs": 3,
            "lr": 0.1,
            "warmup_steps": 50,
            "num_workers": 8,
            "methods": ("none", "act_2bit"),
        },
        "cora_gcn": {"seeds": 10, "epochs": 200, "methods": ("none", "act_2bit")},
        "shakespeare": {
            "sizes": {"d_model": 256, "n_layers": 4, "n_heads": 4, "block_size": 128, "lr": 1e-3, "warmup_steps": 50},
            "batch_size": 64,
            "steps": 600,
            "val_every": 200,
            "val_batches": 40,
            "methods": ("none", "act_4bit", "act_2bit", "act_adaptive2"),
        },
    },
    # With the CUDA kernel tests first (about 2 minutes), the whole of gpu_suite.sh stays
    # under 10 minutes on one H100.
    budgets_s={"memory": 150.0, "batch": 120.0, "accuracy": 150.0},
    notes=("GPU: CIFAR-10 is a 3-epoch schedule on the full training set, evaluated on the test set.",),
)
SUITES = {"cpu": CPU_SUITE, "gpu": GPU_SUITE}
# Largest-batch search: which methods first, when the time budget cannot cover them all.
BATCH_SEARCH_MODELS = ("resnet50", "vit", "char_transformer", "resnet18_cifar")
BATCH_SEARCH_METHODS = (
    "none",
    "act_2bit",
    "bf16",
    "checkpoint",
    "act_4bit",
    "act_division2",
    "act_pool2",
    "offload",
    "act_adaptive2",
)


# --------------------------------------------------------------------------- measurement
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(workload: Workload, method: Method) -> torch.Tensor:
    workload.model.zero_grad(set_to_none=True)
    with method.active(workload):
        loss = workload.loss()
    loss.backward()
    return loss


FORWARD_RANGE = "harness.forward"


def step_memory(workload: Workload, method: Method, device: torch.device) -> dict:
    """Bytes the forward keeps for backward and the step's peak above its start (gradients
    are allocated during backward, so they are in the peak)."""
    workload.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        with method.active(workload):
            loss = workload.loss()
        synchronize(device)
        kept = torch.cuda.memory_allocated(device) - start
        loss.backward()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"kept_bytes": kept, "peak_step_bytes": peak - start, "peak_bytes": peak, "start_bytes": start}
    # The CPU allocator has no counters: the profiler's allocation events are the record.
    # The forward's allocations sum to what it keeps (the same figure as summing
    # self_cpu_memory_usage over prof.events()), their running sum over the step peaks.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(FORWARD_RANGE):
            with method.active(workload):
                loss = workload.loss()
        loss.backward()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    forward = next(node for node in tree if node.name == FORWARD_RANGE)
    kept = sum(node.extra_fields.alloc_size for node in _allocations([forward]))
    step = sorted(_allocations(tree), key=lambda node: node.start_time_ns)
    peak = max(itertools.accumulate(node.extra_fields.alloc_size for node in step), default=0)
    return {"kept_bytes": kept, "peak_step_bytes": peak}


def _allocations(nodes):
    from torch._C._profiler import _EventType

    for node in nodes:
        if node.tag == _EventType.Allocation:
            yield node
        yield from _allocations(node.children)


def accounting(report: CompressionReport | None) -> dict:
    if report is None:
        return {}
    return {
        "saved_bytes": report.saved_bytes,
        "stored_bytes": report.stored_bytes,
        "reported_ratio": report.ratio,
        "decisions": dict(sorted(report.counts.items())),
    }


def median_step_seconds(
    workload: Workload, methods: dict[str, Method], device: torch.device, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Step times, round-robin: one step of each method in turn, so drifting load on a
    shared machine hits every method alike."""
    for method in methods.values():
        for _ in range(warmup):
            train_step(workload, method)
    times = {name: [] for name in methods}
    for _ in range(repeats):
        for name, method in methods.items():
            synchronize(device)
            started = time.perf_counter()
            train_step(workload, method)
            synchronize(device)
            times[name].append(time.perf_counter() - started)
    return times


# --------------------------------------------------------------------------- results
class Results:
    """The JSON document, rewritten after every item so a killed run leaves numbers."""

    def __init__(self, suite_name: str, quick: bool, out: Path, device: torch.device, data_dir: Path):
        self.out = out
        self.stem = f"harness_{suite_name}" + ("_quick" if quick else "")
        self.data = {
            "suite": suite_name,
            "quick": quick,
            "device_type": device.type,
            "command": "python benchmarks/harness.py " + " ".join(sys.argv[1:]),
            "environment": environment(device),
            "data_dir": str(data_dir),
            "methods": {name: make().description for name, make in METHODS.items()},
            "notes": [],
            "part_seconds": {},
            "memory": {},
            "largest_batch": {},
            "accuracy": {},
        }

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.stem}.json"
        partial = path.with_suffix(".json.part")
        partial.write_text(json.dumps(self.data, indent=1) + "\n")
        partial.replace(path)


def environment(device: torch.device) -> dict:
    import lightning
    import torch_geometric
    import torchvision

    # The kernels loaded (built where needed) before they are recorded: the run's first op
    # would load them anyway, and read before it the record said False for kernels it used.
    ensure_kernels(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        name = _cpu_name()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": name,
        "device_memory_bytes": memory,
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torchvision": torchvision.__version__,
        "torch_geometric": torch_geometric.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get("GIT_COMMIT", "unknown"),
        # Uncommitted changes to the library make the commit alone an incomplete record.
        "git_modified": (_git("diff", "--name-only", "HEAD", "--", "lightning_act", "csrc") or "").split(),
        "kernels_loaded": loaded_kernels(),
    }


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- part: memory
def memory_part(
    suite: Suite,
    models: list[str],
    methods: list[str],
    quick: bool,
    device: torch.device,
    data_dir: Path,
    results: Results,
    deadline: float,
) -> None:
    # Every model's main batch first, then the sweeps: a spent budget costs plot points, not tables.
    items = [(name, suite.models[name].main_batch) for name in models]
    if not quick:
        items += [(name, batch) for name in models for batch in suite.models[name].batches[:-1]]
    for model_name, batch in items:
        run = suite.models[model_name]
        entry = results.data["memory"].setdefault(
            model_name, {"title": run.title, "sizes": run.sizes, "main_batch": run.main_batch, "batches": {}}
        )
        if time.perf_counter() > deadline:
            log(f"memory: time budget spent, skipping {model_name} batch {batch}")
            results.data["notes"].append(f"memory: {model_name} batch {batch} skipped (time budget)")
            continue
        entry["batches"][str(batch)] = measure_model(model_name, run, batch, methods, suite, quick, device, data_dir)
        results.save()


def measure_model(
    model_name: str,
    run: ModelRun,
    batch: int,
    method_names: list[str],
    suite: Suite,
    quick: bool,
    device: torch.device,
    data_dir: Path,
) -> dict:
    workload = build_workload(model_name, batch, run.sizes, device, data_dir)
    methods = {name: METHODS[name]() for name in method_names}
    rows: dict[str, dict] = {}
    for name, method in methods.items():
        method.attach(workload)
        train_step(workload, method)  # first-step costs (lazy initialisation) are not what a step keeps
        row = step_memory(workload, method, device)
        row.update(accounting(method.report))
        if isinstance(method, Compression) and method.budget is not None:
            row["calibration_s"] = method.calibration_s
        rows[name] = row
        stored = row.get("stored_bytes")
        log(
            f"memory {model_name} batch {batch} {name}: kept {row['kept_bytes'] / MIB:.2f} MiB, "
            f"peak {row['peak_step_bytes'] / MIB:.2f} MiB"
            + ("" if stored is None else f", saved {row['saved_bytes'] / MIB:.2f} -> stored {stored / MIB:.2f} MiB")
        )
    if "none" in rows:
        for row in rows.values():
            row["kept_reduction"] = rows["none"]["kept_bytes"] / max(row["kept_bytes"], 1)
    if not quick and suite.timed_steps:
        times = median_step_seconds(workload, methods, device, suite.warmup_steps, suite.timed_steps)
        for name, seconds in times.items():
            rows[name]["step_s"] = statistics.median(seconds)
            rows[name]["step_s_all"] = seconds
            rows[name]["samples_per_s"] = workload.samples / rows[name]["step_s"]
        if "none" in rows:
            for row in rows.values():
                row["time_vs_none"] = row["step_s"] / rows["none"]["step_s"]
        log(
            f"time {model_name} batch {batch}: "
            + ", ".join(f"{name} {row['step_s'] * 1e3:.0f} ms" for name, row in rows.items())
        )
    del workload, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- part: largest batch
def batch_part(
    suite: Suite, models: list[str], methods: list[str], args: argparse.Namespace, results: Results, deadline: float
) -> None:
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total = torch.cuda.get_device_properties(0).total_memory
    for model_name, method in itertools.product(
        [m for m in BATCH_SEARCH_MODELS if m in models], [m for m in BATCH_SEARCH_METHODS if m in methods]
    ):
        run = suite.models[model_name]
        if time.perf_counter() > deadline:
            results.data["largest_batch"].setdefault(model_name, {})[method] = {"skipped": "time budget"}
            continue
        measured = results.data["memory"].get(model_name, {}).get("batches", {}).get(str(run.main_batch), {})
        cap = run.largest_batch_cap
        if method == "offload" and "none" in measured:
            # Offloaded activations live in pinned host memory: stay within half of it.
            cap = min(cap, int(0.5 * host_bytes * run.main_batch / measured["none"]["kept_bytes"]))
        start = run.main_batch
        if method in measured:
            row = measured[method]
            per_sample = row["peak_step_bytes"] / run.main_batch
            predicted = (0.95 * total - row["start_bytes"]) / per_sample
            start = max(run.main_batch, 2 ** int(math.log2(max(predicted, 1))))
        log(f"largest batch {model_name} {method}: from {start}, cap {cap}")
        tries: dict[int, dict] = {}

        def fits(batch: int) -> bool:
            tries[batch] = try_batch(args, model_name, method, batch, suite.try_timeout_s)
            log(
                f"  batch {batch}: {'fits' if tries[batch]['fits'] else 'does not fit'}"
                + (f" ({tries[batch]['error']})" if "error" in tries[batch] else "")
            )
            return tries[batch]["fits"]

        largest, reached_cap = largest_batch(fits, run.main_batch, start, cap, deadline)
        results.data["largest_batch"].setdefault(model_name, {})[method] = {
            "largest_batch": largest,
            "reached_cap": reached_cap,
            "cap": cap,
            "tries": {str(b): t for b, t in sorted(tries.items())},
        }
        results.save()


def largest_batch(
    fits: Callable[[int], bool], known: int, start: int, cap: int, deadline: float, tolerance: float = 1.1
) -> tuple[int, bool]:
    """The largest batch that fits, within ``tolerance``: doubling from ``start`` until a
    failure or ``cap``, then bisection. ``known`` is a batch known to fit."""
    low, high, batch = known, None, min(start, cap)
    while high is None:
        if batch > known and not fits(batch):
            high = batch
        else:
            low = batch
            if batch >= cap or time.perf_counter() > deadline:
                return low, batch >= cap
            batch = min(2 * batch, cap)
    while high / low > tolerance and high - low > 1 and time.perf_counter() < deadline:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, False


def try_batch(args: argparse.Namespace, model: str, method: str, batch: int, timeout_s: float) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--suite",
        args.suite,
        "--data-dir",
        str(args.data_dir),
        "--try-batch",
        model,
        method,
        str(batch),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"fits": False, "error": f"step took over {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(TRY_RESULT_PREFIX):
            return json.loads(line[len(TRY_RESULT_PREFIX) :])
    return {"fits": False, "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}


def run_one_try(suite: Suite, model: str, method_name: str, batch: int, device: torch.device, data_dir: Path) -> dict:
    """The child process of one largest-batch try: two training steps at ``batch``."""
    try:
        workload = build_workload(model, batch, suite.models[model].sizes, device, data_dir)
        method = METHODS[method_name]()
        method.attach(workload)
        started = time.perf_counter()
        for _ in range(2):
            train_step(workload, method)
        synchronize(device)
        return {
            "fits": True,
            "peak_bytes": torch.cuda.max_memory_allocated(device),
            "two_steps_s": time.perf_counter() - started,
        }
    except torch.OutOfMemoryError:
        return {"fits": False}
    except RuntimeError as error:  # pinned host memory running out is a plain RuntimeError
        if "out of memory" in str(error):
            return {"fits": False, "error": str(error).splitlines()[0]}
        raise


# --------------------------------------------------------------------------- part: accuracy
def accuracy_part(
    suite: Suite,
    tasks: list[str],
    methods: list[str],
    device: torch.device,
    data_dir: Path,
    results: Results,
    deadline: float,
) -> None:
    for task in tasks:
        settings = suite.accuracy[task]
        entry = results.data["accuracy"].setdefault(task, {"settings": settings, "methods": {}})
        for method in (m for m in settings["methods"] if m in methods):
            runs = []
            for seed in range(settings.get("seeds", 1)):
                if time.perf_counter() > deadline:
                    log(f"accuracy: time budget spent, skipping {task} {method} seed {seed}")
                    results.data["notes"].append(f"accuracy: {task} {method} seed {seed} skipped (time budget)")
                    break
                L.seed_everything(seed, verbose=False)
                runs.append(ACCURACY_TASKS[task](settings, METHODS[method](), device, data_dir))
                log(
                    f"accuracy {task} {method} seed {seed}: {runs[-1]['metric']} {runs[-1]['final']:.4f} "
                    f"({runs[-1]['seconds']:.0f} s)"
                )
            if runs:
                finals = [r["final"] for r in runs]
                entry["methods"][method] = {
                    "metric": runs[0]["metric"],
                    "mean": statistics.fmean(finals),
                    "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                    "runs": runs,
                }
                results.save()


class CurveRecorder(Callback):
    """Training loss at every step and the validation metric at every validation."""

    def __init__(self, metric: str):
        self.metric = metric
        self.train: list[list[float]] = []
        self.val: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append([trainer.global_step, float(outputs["loss"])])

    def on_validation_end(self, trainer, pl_module):
        self.val.append([trainer.global_step, float(trainer.callback_metrics[self.metric])])


def fit(model, datamodule, method: Method, device: torch.device, metric: str, test: bool, **trainer_args) -> dict:
    recorder = CurveRecorder(metric)
    options = dict(method.trainer_options)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, *options.pop("callbacks", [])],
        **options,
        **trainer_args,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    if test:
        final_metric = metric.replace("val/", "test/")
        final = trainer.test(model, datamodule, verbose=False)[0][final_metric]
    else:
        final_metric, final = metric, recorder.val[-1][1]
    return {
        "metric": final_metric,
        "final": float(final),
        "seconds": time.perf_counter() - started,
        "train_loss": recorder.train,
        "val": recorder.val,
        "val_metric": metric,
    }


def accuracy_cifar10(settings: dict, method: Method, device: torch.device, data_dir: Path) -> dict:
    from lightning_act.examples.vision import CIFAR10DataModule, ImageClassifier

    model = ImageClassifier(arch="resnet18", cifar_stem=True, lr=settings["lr"], warmup_steps=settings["warmup_steps"])
    data = CIFAR10DataModule(
        str(data_dir / "cifar10"),
        batch_size=settings["batch_size"],
        num_workers=settings["num_workers"],
        limit=settings["limit"],
    )
    return fit(model, data, method, device, "val/acc", test=True, max_epochs=settings["epochs"])


def accuracy_cora(settings: dict, method: Method, device: torch.device, data_dir: Path) -> dict:
    from lightning_act.examples.graph import NodeClassifier

    cora = planetoid(data_dir)
    model = NodeClassifier(conv="gcn", in_channels=cora.num_features, num_classes=cora.num_classes)
    return fit(
        model, cora, method, device, "val/acc", test=True, max_epochs=settings["epochs"], check_val_every_n_epoch=10
    )


def accuracy_shakespeare(settings: dict, method: Method, device: torch.device, data_dir: Path) -> dict:
    from lightning_act.examples.language import CharTextDataModule, CharTransformer

    model = CharTransformer(**settings["sizes"])
    data = CharTextDataModule(
        str(data_dir / "tinyshakespeare" / "input.txt"),
        block_size=settings["sizes"]["block_size"],
        batch_size=settings["batch_size"],
    )
    # check_val_every_n_epoch=None: validation every val_every steps, across epoch ends.
    return fit(
        model,
        data,
        method,
        device,
        "val/loss",
        test=False,
        max_steps=settings["steps"],
        val_check_interval=settings["val_every"],
        check_val_every_n_epoch=None,
        limit_val_batches=settings["val_batches"],
    )


ACCURACY_TASKS = {
    "cifar10_resnet18": accuracy_cifar10,
    "cora_gcn": accuracy_cora,
    "shakespeare": accuracy_shakespeare,
}
ACCURACY_TITLES = {
    "cifar10_resnet18": "ResNet-18 on CIFAR-10, test accuracy",
    "cora_gcn": "GCN on Cora, test accuracy",
    "shakespeare": "char transformer on Tiny Shakespeare, validation loss",
}


# --------------------------------------------------------------------------- report: markdown
def write_markdown(results: Results) -> Path:
    data = results.data
    env = data["environment"]
    lines = [
        f"# Benchmark harness, {data['suite']} suite{' (quick)' if data['quick'] else ''}",
        "",
        f"`{data['command']}` on {env['device']}, {env['date']}; torch {env['torch']}, lightning "
        f"{env['lightning']}, commit `{env['git_commit'][:12]}`"
        + (f" with uncommitted changes to {len(env['git_modified'])} library files" if env["git_modified"] else "")
        + ". Every number below was measured in this run; ratios compare methods measured side by side.",
        "",
        "Columns: *saved* is what autograd would keep and *stored* what the library stores instead (its exact "
        "accounting; parameters and the input batch are in neither); *kept* is the memory the forward really "
        "keeps for backward and *peak* the step's peak above its start, both measured ("
        + (
            "`torch.cuda.memory_allocated` and `max_memory_allocated`"
            if data["device_type"] == "cuda"
            else "the profiler's allocation events"
        )
        + "); *kept vs none* is none's kept bytes over the method's; *step* is the median step time "
        "(forward + backward) and *time vs none* its ratio to none's.",
        "",
    ]
    for entry in data["memory"].values():
        batch = str(entry["main_batch"])
        rows = entry["batches"].get(batch)
        if not rows:
            continue
        lines += [
            f"## {entry['title']}, batch {batch}" if batch != "1" else f"## {entry['title']}",
            "",
            "| method | saved MiB | stored MiB | kept MiB | kept vs none | peak MiB | step ms | time vs none |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, row in rows.items():
            lines.append(
                f"| {method} | {_mib(row.get('saved_bytes'))} | {_mib(row.get('stored_bytes'))} "
                f"| {_mib(row['kept_bytes'])} | {_ratio(row.get('kept_reduction'))} "
                f"| {_mib(row['peak_step_bytes'])} | {_number(row.get('step_s'), 1e3)} "
                f"| {_ratio(row.get('time_vs_none'))} |"
            )
        lines.append("")
    if data["largest_batch"]:
        lines += [
            "## Largest batch that fits",
            "",
            "Doubling then bisection to 10%, each try a fresh process running two training steps.",
            "",
            "| model | " + " | ".join(BATCH_SEARCH_METHODS) + " |",
            "|---|" + "---:|" * len(BATCH_SEARCH_METHODS),
        ]
        for model_name, found in data["largest_batch"].items():
            cells = []
            for method in BATCH_SEARCH_METHODS:
                result = found.get(method)
                if result is None or "skipped" in result:
                    cells.append("-")
                else:
                    cells.append(f"{'>= ' if result['reached_cap'] else ''}{result['largest_batch']}")
            lines.append(f"| {model_name} | " + " | ".join(cells) + " |")
        lines.append("")
    if data["accuracy"]:
        lines += ["## Accuracy, same seeds with and without compression", ""]
        for task, entry in data["accuracy"].items():
            methods = entry["methods"]
            if not methods:
                continue
            seeds = max(len(m["runs"]) for m in methods.values())
            lines += [
                f"**{ACCURACY_TITLES[task]}** ({_task_schedule(task, entry['settings'])}"
                + (f", {seeds} seeds" if seeds > 1 else "")
                + ")",
                "",
                "| method | metric | mean | std | change vs none | seconds per run |",
                "|---|---|---:|---:|---:|---:|",
            ]
            base = methods.get("none", {}).get("mean")
            for method, result in methods.items():
                change = f"{100 * (result['mean'] / base - 1):+.1f}%" if base else "-"
                seconds = statistics.fmean(r["seconds"] for r in result["runs"])
                lines.append(
                    f"| {method} | {result['metric']} | {result['mean']:.4f} | {result['std']:.4f} "
                    f"| {change} | {seconds:.0f} |"
                )
            lines.append("")
    if data["notes"]:
        lines += ["## Notes", ""] + [f"* {note}" for note in data["notes"]] + [""]
    lines += ["## Methods", ""] + [f"* `{name}`: {text}" for name, text in data["methods"].items()] + [""]
    lines += ["Seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in data["part_seconds"].items()), ""]
    path = results.out / f"{results.stem}.md"
    path.write_text("\n".join(lines))
    return path


def _task_schedule(task: str, settings: dict) -> str:
    if task == "cifar10_resnet18":
        subset = f"{settings['limit']} images of each split" if settings["limit"] else "full training set"
        return f"{settings['epochs']} epochs, batch {settings['batch_size']}, {subset}"
    if task == "cora_gcn":
        return f"{settings['epochs']} full-graph epochs"
    return f"{settings['steps']} steps, batch {settings['batch_size']}, {settings['val_batches']} validation batches"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _number(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.0f}"


# --------------------------------------------------------------------------- report: plots
def write_plots(results: Results) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    swept = {name: entry for name, entry in results.data["memory"].items() if len(entry["batches"]) > 1}
    for kind, key, scale, ylabel in (
        ("memory", "kept_bytes", 1 / MIB, "kept by the forward, MiB"),
        ("throughput", "samples_per_s", 1.0, "samples / s"),
    ):
        if not swept or (kind == "throughput" and results.data["quick"]):
            continue
        figure, axes = plt.subplots(1, len(swept), figsize=(5 * len(swept), 4), squeeze=False)
        for axis, entry in zip(axes[0], swept.values()):
            batches = sorted(entry["batches"], key=int)
            methods = entry["batches"][batches[-1]]
            for method in methods:
                points = [
                    (int(b), entry["batches"][b][method][key] * scale)
                    for b in batches
                    if key in entry["batches"][b].get(method, {})
                ]
                # The library's methods solid, the alternatives dashed.
                axis.plot(*zip(*points), marker="o", label=method, linestyle="-" if method.startswith("act_") else "--")
            axis.set(
                title=entry["title"],
                xlabel="batch size",
                ylabel=ylabel,
                xscale="log",
                yscale="log" if kind == "memory" else "linear",
            )
            axis.set_xticks([int(b) for b in batches], labels=batches)
            axis.minorticks_off()
        axes[0][-1].legend(fontsize=7)
        figure.tight_layout()
        written.append(_save(figure, results, kind))
    tasks = {task: entry for task, entry in results.data["accuracy"].items() if entry["methods"]}
    if tasks:
        figure, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
        for column, (task, entry) in enumerate(tasks.items()):
            for method, result in entry["methods"].items():
                train = _mean_curve([r["train_loss"] for r in result["runs"]])
                axes[0][column].plot(*zip(*_running_mean(train, 10)), label=method)
                val = _mean_curve([r["val"] for r in result["runs"]])
                axes[1][column].plot(*zip(*val), marker="o", label=method)
            axes[0][column].set(title=ACCURACY_TITLES[task], xlabel="step", ylabel="training loss (10-step mean)")
            val_metric = next(iter(entry["methods"].values()))["runs"][0]["val_metric"]
            axes[1][column].set(xlabel="step", ylabel=val_metric + " (mean over seeds)")
            axes[1][column].legend(fontsize=7)
        figure.tight_layout()
        written.append(_save(figure, results, "accuracy"))
    plt.close("all")
    return written


def _mean_curve(curves: list[list[list[float]]]) -> list[tuple[float, float]]:
    """The mean over seeds, step by step (every seed runs the same steps)."""
    return [(points[0][0], statistics.fmean(p[1] for p in points)) for points in zip(*curves)]


def _running_mean(curve: list[tuple[float, float]], width: int) -> list[tuple[float, float]]:
    return [
        (curve[i][0], statistics.fmean(v for _, v in curve[max(0, i - width + 1) : i + 1])) for i in range(len(curve))
    ]


def _save(figure, results: Results, kind: str) -> Path:
    path = results.out / f"{results.stem}_{kind}.png"
    figure.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="byte accounting and kept memory at each model's main batch only (CI-sized)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=REPO.parent / "shared" / "data",
        help="folder with cifar10/, planetoid/Cora/raw/ and tinyshakespeare/input.txt",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--models", nargs="+", choices=sorted(BUILDERS), help="default: all")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        help="default: all (--quick: all but act_adaptive2, whose probes take minutes on a CPU)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("memory", "batch", "accuracy"),
        help="default: all the suite has (accuracy and batch are skipped by --quick)",
    )
    parser.add_argument("--accuracy-tasks", nargs="+", choices=sorted(ACCURACY_TASKS), help="default: all")
    parser.add_argument(
        "--time-limit", type=float, help="seconds for the whole run: no part starts a new item after it (default: none)"
    )
    parser.add_argument("--threads", type=int, help="intra-op CPU threads (default: the suite's)")
    parser.add_argument("--try-batch", nargs=3, metavar=("MODEL", "METHOD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    suite = SUITES[args.suite]
    device = torch.device(suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--suite gpu needs a CUDA GPU")
    # Lightning's start-up banners and the callback's end-of-fit table would bury the progress lines.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    if args.try_batch:
        model, method, batch = args.try_batch
        result = run_one_try(suite, model, method, int(batch), device, args.data_dir)
        print(TRY_RESULT_PREFIX + json.dumps(result), flush=True)
        return

    threads = args.threads or suite.threads
    if threads:
        torch.set_num_threads(threads)
    models = args.models or list(suite.models)
    methods = args.methods or [m for m in METHODS if not (args.quick and m == "act_adaptive2")]
    parts = args.parts or (["memory"] if args.quick else ["memory", "batch", "accuracy"])
    if device.type != "cuda" and "batch" in parts:
        parts.remove("batch")  # the largest batch is a GPU question
    # Built (or loaded from the cache) before anything is timed, as ActCompression.setup does.
    ensure_kernels(device)
    results = Results(args.suite, args.quick, args.out, device, args.data_dir)
    results.data["notes"].extend(suite.notes)
    log(f"{args.suite} suite on {results.data['environment']['device']}: parts {', '.join(parts)}")
    end = STARTED + (args.time_limit or math.inf)
    for part in parts:
        started = time.perf_counter()
        deadline = min(started + suite.budgets_s.get(part, math.inf), end)
        if part == "memory":
            memory_part(suite, models, methods, args.quick, device, args.data_dir, results, deadline)
        elif part == "batch":
            batch_part(suite, models, methods, args, results, deadline)
        else:
            accuracy_part(
                suite, args.accuracy_tasks or list(suite.accuracy), methods, device, args.data_dir, results, deadline
            )
        results.data["part_seconds"][part] = time.perf_counter() - started
        results.save()
        written = [write_markdown(results), *write_plots(results)]
        log(
            f"{part} done in {results.data['part_seconds'][part]:.0f} s; wrote "
            + ", ".join(str(p) for p in [results.out / f"{results.stem}.json", *written])
        )


if __name__ == "__main__":
    main()
