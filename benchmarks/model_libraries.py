"""Models from the public model libraries, measured through the public capture API.

Each case builds a small model the way a user would (HF ``transformers`` and ``timm`` from
their configs with random weights, PyG convolutions, ``torch.nn`` RNNs; CPU, fp32, training
mode) on a batch of real data (Tiny Shakespeare bytes, CIFAR-10 images, Cora), and measures
what :class:`~lightning_act.ActivationCapture` does to it:

* ``error_8bit``: relative L2 error of the weight gradient (all trainable parameters, one
  step, same batch and dropout masks) at 8 bits against no compression;
* ``error_2bit`` and ``mean_error_2bit``: the same at 2 bits, for one rounding seed (the mean
  over the seeds of each one's error) and for the mean gradient of ``seeds`` rounding seeds.
  Their ratio is ``sqrt(seeds)`` where every saved tensor is used linearly by backward
  (unbiased) and 1 where the error is all bias;
* ``kept_ratio``: bytes the forward keeps for backward without compression over those it
  keeps at 2 bits, both measured by the profiler (allocations minus frees of the forward);
* ``peak_ratio``: the peak of the whole forward + backward at 2 bits over the peak without
  compression (profiler allocation events replayed in time order, running sum): above 1, the
  compression costs memory.

For a case whose gradient is biased or inexact at 8 bits, :func:`find_culprits` compresses
the saved tensors of one op at a time (then single tensors of the worst ops), every other
saved tensor kept exact, and estimates their share of the 2-bit gradient's bias from the
one-seed and mean-of-seeds errors (``e1^2 = b^2 + v``, ``ek^2 = b^2 + v / k``), and their
8-bit error; tensors are named by module and op.

``--side-by-side`` measures every case eager and compiled by ``torch.compile`` (inductor, the
module compiled in place) in one process, the saved tensors decided inside the graphs:
stored bytes, 8-bit errors and seed ratios next to each other
(``model_libraries_side_by_side_cpu.json``; no culprit search: each slot alone is a policy of
its own, so a recompile each).

    python benchmarks/model_libraries.py --data ../shared/data --out benchmarks/results
    python benchmarks/model_libraries.py --side-by-side --seeds 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig
from lightning_act.policy import EXACT, BitPolicy
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEEDS = 16
FORWARD_RANGE = "model_libraries.forward"


@dataclass
class Workload:
    """A model and a closure that runs its forward on one fixed batch and returns the loss."""

    model: nn.Module
    loss: Callable[[], torch.Tensor]
    #: Tensors alive for the whole step (the batch): the capture leaves them as they are.
    inputs: Any = None


# --------------------------------------------------------------------------- real data
def shakespeare_bytes(data: Path, batch: int, length: int, offset: int = 0) -> torch.Tensor:
    """``batch`` windows of ``length + 1`` bytes of Tiny Shakespeare, as int64 token ids."""
    text = (data / "tinyshakespeare" / "input.txt").read_bytes()
    stride = len(text) // (batch + 1)
    rows = [list(text[offset + i * stride : offset + i * stride + length + 1]) for i in range(batch)]
    return torch.tensor(rows, dtype=torch.long)


def cifar_images(data: Path, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_act.examples.vision import CIFAR10DataModule

    cifar = CIFAR10DataModule(str(data / "cifar10"), batch_size=batch, limit=batch)
    cifar.setup("fit")
    images, labels = zip(*(cifar.test_set[i] for i in range(batch)))
    return torch.stack(images), torch.tensor(labels)


def cora(data: Path):
    from lightning_act.examples.graph import PlanetoidDataModule

    module = PlanetoidDataModule(root=str(data / "planetoid"), name="Cora")
    module.prepare_data()
    module.setup("fit")
    return module.data


def _byte_class(byte: torch.Tensor) -> torch.Tensor:
    """Four classes of the byte after a window: letter, space, newline, other."""
    letter = ((byte >= 65) & (byte <= 90)) | ((byte >= 97) & (byte <= 122))
    return torch.where(letter, 0, torch.where(byte == 32, 1, torch.where(byte == 10, 2, 3)))


# --------------------------------------------------------------------------- the models
def _seeded(loss: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Every forward draws the same dropout masks (the capture never touches torch's generator)."""

    def run() -> torch.Tensor:
        torch.manual_seed(1)
        return loss()

    return run


def hf_llama(data: Path, checkpointing: bool = False, lora: bool = False) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        # The adapter starts as the identity (B = 0), so A's gradient would be zero: a trained one.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    tokens = shakespeare_bytes(data, batch=8, length=64)
    model.train()
    return Workload(model, _seeded(lambda: model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss), tokens)


def hf_mixtral(data: Path, dtype: torch.dtype = torch.bfloat16) -> Workload:
    """A mixture of experts, its experts run through ``torch.nn.functional.grouped_mm`` (one matmul
    per group of routed tokens), as transformers runs them on a GPU; in float32, torch's fake
    kernel refuses the call its CPU kernel runs, and compiled, transformers runs its own op."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(dtype).train()
    tokens = shakespeare_bytes(data, batch=8, length=64)
    return Workload(model, _seeded(lambda: model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss), tokens)


def hf_bert(data: Path) -> Workload:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=4,
        attn_implementation="sdpa",
    )
    model = BertForSequenceClassification(config).train()
    tokens = shakespeare_bytes(data, batch=16, length=64)
    x, y = tokens[:, :-1], _byte_class(tokens[:, -1])
    return Workload(model, _seeded(lambda: model(input_ids=x, labels=y).loss), (x, y))


def hf_t5(data: Path) -> Workload:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config).train()
    tokens = shakespeare_bytes(data, batch=8, length=64)
    # Continue the text: the encoder reads 32 bytes, the decoder writes the next 32.
    x, y = tokens[:, :32], tokens[:, 32:64].contiguous()
    return Workload(model, _seeded(lambda: model(input_ids=x, labels=y).loss), (x, y))


def timm_model(data: Path, arch: str, batch: int = 16, **kwargs) -> Workload:
    import timm

    model = timm.create_model(arch, pretrained=False, num_classes=10, **kwargs).train()
    x, y = cifar_images(data, batch)
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x), y)), (x, y))


class GraphNetwork(nn.Module):
    """Two PyG convolutions with dropout on the features and between the layers."""

    def __init__(self, conv: str, in_channels: int, hidden: int, classes: int, degrees: torch.Tensor | None = None):
        super().__init__()
        from torch_geometric import nn as gnn

        if conv == "gcn":
            self.conv1, self.conv2 = gnn.GCNConv(in_channels, hidden), gnn.GCNConv(hidden, classes)
        elif conv == "sage":
            self.conv1, self.conv2 = gnn.SAGEConv(in_channels, hidden), gnn.SAGEConv(hidden, classes)
        elif conv == "gin":
            self.conv1 = gnn.GINConv(
                nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            )
            self.conv2 = gnn.GINConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)))
        elif conv == "sage_max":  # max aggregation: scatter_reduce's amax
            self.conv1 = gnn.SAGEConv(in_channels, hidden, aggr="max")
            self.conv2 = gnn.SAGEConv(hidden, classes, aggr="max")
        elif conv == "pna":  # min, max and std aggregators: amin's and amax's equality tests, a root
            options = dict(
                aggregators=["mean", "min", "max", "std"],
                scalers=["identity", "amplification", "attenuation"],
                deg=degrees,
            )
            self.conv1 = gnn.PNAConv(in_channels, hidden, **options)
            self.conv2 = gnn.PNAConv(hidden, classes, **options)
        elif conv == "gatv2":
            self.conv1 = gnn.GATv2Conv(in_channels, hidden // 4, heads=4)
            self.conv2 = gnn.GATv2Conv(hidden, classes, heads=1)
        elif conv == "transformer":
            self.conv1 = gnn.TransformerConv(in_channels, hidden // 4, heads=4)
            self.conv2 = gnn.TransformerConv(hidden, classes, heads=1)
        else:
            raise ValueError(
                f"conv={conv!r} is not supported; allowed: gcn, sage, sage_max, pna, gin, gatv2, transformer"
            )
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(self.dropout(x), edge_index))
        return self.conv2(self.dropout(x), edge_index)


def pyg_cora(data: Path, conv: str) -> Workload:
    graph = cora(data)
    from torch_geometric.utils import degree

    in_degrees = degree(graph.edge_index[1], graph.num_nodes, dtype=torch.long)
    model = GraphNetwork(conv, graph.num_features, 64, 7, torch.bincount(in_degrees)).train()
    return Workload(
        model,
        _seeded(lambda: F.cross_entropy(model(graph.x, graph.edge_index)[graph.train_mask], graph.y[graph.train_mask])),
        graph,
    )


class CharRNN(nn.Module):
    """Byte embedding, a two-layer ``nn.LSTM`` or ``nn.GRU``, a byte classifier."""

    def __init__(self, cell: str, width: int = 128):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def torch_rnn(data: Path, cell: str) -> Workload:
    model = CharRNN(cell).train()
    tokens = shakespeare_bytes(data, batch=16, length=64)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten())), tokens)


def diffusers_unet(data: Path, batch: int = 8) -> Workload:
    """A diffusers ``UNet2DModel`` (GroupNorm, SiLU, attention) on CIFAR images, trained to
    predict the noise of DDPM's forward process at a random step."""
    from diffusers import UNet2DModel

    model = UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64),
        norm_num_groups=8,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    ).train()
    images, _ = cifar_images(data, batch)
    generator = torch.Generator().manual_seed(0)
    steps = torch.randint(0, 1000, (batch,), generator=generator)
    alpha_bar = torch.cos((steps.float() / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2  # a cosine schedule
    noise = torch.randn(images.shape, generator=generator)
    noisy = alpha_bar.sqrt().view(-1, 1, 1, 1) * images + (1 - alpha_bar).sqrt().view(-1, 1, 1, 1) * noise
    return Workload(model, _seeded(lambda: F.mse_loss(model(noisy, steps).sample, noise)), (noisy, steps, noise))


def torchvision_detector(data: Path, batch: int = 4, size: int = 160) -> Workload:
    """torchvision's Faster R-CNN with a MobileNetV3 FPN backbone, in training mode (its losses
    over region proposals, ``roi_align`` among the ops), on CIFAR images upsampled to ``size``
    with two synthetic boxes each."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=11, min_size=size, max_size=size
    ).train()
    images, labels = cifar_images(data, batch)
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    generator = torch.Generator().manual_seed(0)
    targets = []
    for label in labels:
        corners = torch.rand(2, 2, generator=generator) * size * 0.5
        sizes = 16 + torch.rand(2, 2, generator=generator) * size * 0.4
        boxes = torch.cat([corners, (corners + sizes).clamp(max=size - 1)], dim=1)
        targets.append({"boxes": boxes, "labels": torch.stack([label + 1, (label + 5) % 10 + 1])})
    image_list = list(images)
    return Workload(model, _seeded(lambda: sum(model(image_list, targets).values())), (images, targets))


@dataclass(frozen=True)
class Case:
    """A model from a public library, as a user would build it."""

    library: str
    build: Callable[[Path], Workload]


class DeformableNetwork(nn.Module):
    """A convolutional stem, then torchvision's modulated deformable convolution (offsets and
    mask predicted from the features, as DCNv2 does), pooled into a classifier."""

    def __init__(self, channels: int = 128, classes: int = 10):
        super().__init__()
        from torchvision.ops import DeformConv2d

        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.offsets = nn.Conv2d(channels, 18, 3, padding=1)
        self.mask = nn.Conv2d(channels, 9, 3, padding=1)
        self.deform = DeformConv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(self.deform(h, self.offsets(h), torch.sigmoid(self.mask(h))))
        return self.head(h.mean((2, 3)))


def torchvision_deformable(data: Path, batch: int = 8) -> Workload:
    model = DeformableNetwork().train()
    x, y = cifar_images(data, batch)
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x), y)), (x, y))


def _case(library: str, build: Callable, *args, **kwargs) -> Case:
    return Case(library, lambda data: build(data, *args, **kwargs))


CASES: dict[str, Case] = {
    "hf_llama": _case("transformers", hf_llama),
    "hf_llama_checkpointing": _case("transformers", hf_llama, checkpointing=True),
    "hf_llama_lora": _case("transformers+peft", hf_llama, lora=True),
    "hf_bert": _case("transformers", hf_bert),
    "hf_t5": _case("transformers", hf_t5),
    "hf_mixtral_bf16": _case("transformers", hf_mixtral),
    "hf_mixtral_fp32": _case("transformers", hf_mixtral, dtype=torch.float32),
    "timm_mobilenetv3_small_100": _case("timm", timm_model, "mobilenetv3_small_100"),
    "timm_efficientnet_b0": _case("timm", timm_model, "efficientnet_b0"),
    "timm_convnext_atto": _case("timm", timm_model, "convnext_atto"),
    "timm_vit_tiny": _case("timm", timm_model, "vit_tiny_patch16_224", batch=8, img_size=32, patch_size=4, depth=4),
    "timm_swin_tiny": _case(
        "timm",
        timm_model,
        "swin_tiny_patch4_window7_224",
        img_size=32,
        patch_size=2,
        window_size=4,
        embed_dim=48,
        depths=(2, 2),
        num_heads=(3, 6),
    ),
    "pyg_gcn": _case("torch_geometric", pyg_cora, "gcn"),
    "pyg_sage": _case("torch_geometric", pyg_cora, "sage"),
    "pyg_sage_max": _case("torch_geometric", pyg_cora, "sage_max"),
    "pyg_pna": _case("torch_geometric", pyg_cora, "pna"),
    "pyg_gin": _case("torch_geometric", pyg_cora, "gin"),
    "pyg_gatv2": _case("torch_geometric", pyg_cora, "gatv2"),
    "pyg_transformer": _case("torch_geometric", pyg_cora, "transformer"),
    "torch_lstm": _case("torch.nn", torch_rnn, "lstm"),
    "torch_gru": _case("torch.nn", torch_rnn, "gru"),
    "diffusers_unet": _case("diffusers", diffusers_unet),
    "torchvision_fasterrcnn": _case("torchvision", torchvision_detector),
    "torchvision_deformable": _case("torchvision", torchvision_deformable),
}


def build(name: str, data: Path = DATA) -> Workload:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # libraries' deprecation notices about their own internals
        return CASES[name].build(data)


# --------------------------------------------------------------------------- measurement
class SomeSlots(BitPolicy):
    """``bits`` for the given slots (at least each op's floor), every other saved tensor exact."""

    def __init__(self, slots: set[str], bits: int):
        super().__init__()
        self.slots, self.bits = slots, bits

    def choose(self, slot: str) -> int | None:
        return self.bits if slot in self.slots else EXACT


def weight_grad(workload: Workload, capture: ActivationCapture | None = None, seed: int | None = None) -> torch.Tensor:
    params = [p for p in workload.model.parameters() if p.requires_grad]
    if capture is None:
        loss = workload.loss()
    else:
        with capture.capturing(inputs=workload.inputs, seed=seed):
            loss = workload.loss()
    # In float32, so that a bfloat16 model's seeds average without rounding again.
    return torch.cat([g.flatten().float() for g in torch.autograd.grad(loss, params)])


def relative_error(g: torch.Tensor, exact: torch.Tensor) -> float:
    return ((g - exact).norm() / exact.norm()).item()


def seed_errors(workload: Workload, capture: ActivationCapture, exact: torch.Tensor, seeds: int) -> tuple[float, float]:
    """One seed's error (the mean over seeds) and the error of the mean gradient over seeds."""
    total = torch.zeros_like(exact)
    single = 0.0
    for seed in range(seeds):
        g = weight_grad(workload, capture, seed=1000 + seed)
        single += relative_error(g, exact)
        total += g
    return single / seeds, relative_error(total / seeds, exact)


def step_memory(workload: Workload, capture: ActivationCapture | None) -> tuple[int, int]:
    """Bytes the forward keeps for backward and the peak of forward + backward above the
    step's start, from the profiler's allocation events (the CPU allocator has no counters)."""
    from torch._C._profiler import _EventType

    def allocations(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                yield node
            yield from allocations(node.children)

    params = [p for p in workload.model.parameters() if p.requires_grad]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(FORWARD_RANGE):
            if capture is None:
                loss = workload.loss()
            else:
                with capture.capturing(inputs=workload.inputs, seed=0):
                    loss = workload.loss()
        grads = torch.autograd.grad(loss, params)
        del loss, grads
    tree = prof.profiler.kineto_results.experimental_event_tree()
    forward = next(node for node in tree if node.name == FORWARD_RANGE)
    kept = sum(node.extra_fields.alloc_size for node in allocations([forward]))
    step = sorted(allocations(tree), key=lambda node: node.start_time_ns)
    return kept, max(itertools.accumulate(node.extra_fields.alloc_size for node in step), default=0)


@dataclass
class Measurement:
    case: str
    error_8bit: float
    error_2bit: float
    mean_error_2bit: float
    seeds: int
    kept_bytes_none: int
    kept_bytes_2bit: int
    peak_bytes_none: int
    peak_bytes_2bit: int
    saved_bytes: int
    stored_bytes: int
    seconds: float
    counts: dict = field(default_factory=dict)
    slots: list = field(default_factory=list)
    #: The tensors kept whole because no trace could read them, by op: [tensors, bytes, why].
    untraced: dict = field(default_factory=dict)

    @property
    def unbiased_ratio(self) -> float:
        """How much closer the mean of the seeds is than one seed: sqrt(seeds) if unbiased."""
        return self.error_2bit / self.mean_error_2bit

    @property
    def kept_ratio(self) -> float:
        return self.kept_bytes_none / self.kept_bytes_2bit

    @property
    def peak_ratio(self) -> float:
        return self.peak_bytes_2bit / self.peak_bytes_none

    def row(self) -> dict:
        return {
            **asdict(self),
            "unbiased_ratio": self.unbiased_ratio,
            "kept_ratio": self.kept_ratio,
            "peak_ratio": self.peak_ratio,
        }


def measure(name: str, data: Path = DATA, seeds: int = SEEDS, compiled: bool = False) -> Measurement:
    """Every criterion of one case, through :class:`ActivationCapture` with a fixed policy."""
    started = time.perf_counter()
    workload = build(name, data)
    if compiled:
        torch._dynamo.reset()
        workload.model.compile(backend="inductor")
    exact = weight_grad(workload)
    capture8 = ActivationCapture(CompressionConfig(bits=8), workload.model)
    error_8bit = relative_error(weight_grad(workload, capture8, seed=0), exact)
    capture2 = ActivationCapture(CompressionConfig(bits=2), workload.model)
    error_2bit, mean_error_2bit = seed_errors(workload, capture2, exact, seeds)
    report = capture2.report
    step_memory(workload, None)  # the first profiled step allocates lazily-built state
    kept_none, peak_none = step_memory(workload, None)
    kept_2bit, peak_2bit = step_memory(workload, capture2)
    slots = [{"slot": slot, **asdict(s)} for slot, s in capture2.report.slots.items()]
    return Measurement(
        name,
        error_8bit,
        error_2bit,
        mean_error_2bit,
        seeds,
        kept_none,
        kept_2bit,
        peak_none,
        peak_2bit,
        report.saved_bytes,
        report.stored_bytes,
        time.perf_counter() - started,
        dict(report.counts),
        slots,
        dict(report.untraced),
    )


def _alone(workload: Workload, exact: torch.Tensor, slots: set[str], seeds: int) -> dict:
    """The gradient error when only ``slots`` are compressed: at 2 bits for one seed and for
    the mean of ``seeds``, the bias that implies (``e1^2 = b^2 + v``, ``ek^2 = b^2 + v / k``),
    and at 8 bits; all relative to the exact gradient's norm."""
    two = ActivationCapture(CompressionConfig(), workload.model, SomeSlots(slots, 2))
    single, mean = seed_errors(workload, two, exact, seeds)
    eight = ActivationCapture(CompressionConfig(), workload.model, SomeSlots(slots, 8))
    return {
        "error_2bit": single,
        "mean_error_2bit": mean,
        "bias_2bit": math.sqrt(max(0.0, (seeds * mean**2 - single**2) / (seeds - 1))),
        "error_8bit": relative_error(weight_grad(workload, eight, seed=0), exact),
    }


def find_culprits(name: str, data: Path = DATA, seeds: int = 8, top_ops: int = 3, per_op: int = 6) -> dict:
    """Which saved tensors make a case biased or its 8-bit gradient inexact.

    First every op's compressed tensors alone at 2 and 8 bits (all others exact); then, of the
    ``top_ops`` ops with the largest bias and the ``top_ops`` with the largest 8-bit error,
    up to ``per_op`` tensors each alone (evenly spaced through the model's depth).

    Returns:
        ``{"ops": [...], "slots": [...]}``, each sorted by bias, largest first; a slot row
        names its module, op, shape and how it is stored at 2 bits.
    """
    workload = build(name, data)
    exact = weight_grad(workload)
    full = ActivationCapture(CompressionConfig(bits=2), workload.model)
    weight_grad(workload, full, seed=0)
    compressed = {slot: memory for slot, memory in full.report.slots.items() if memory.bits is not None}
    by_op: dict[str, list[str]] = {}
    for slot, memory in compressed.items():
        by_op.setdefault(str(memory.op), []).append(slot)
    ops = [
        {
            "op": op,
            "slots": len(slots),
            "numel": sum(math.prod(compressed[s].shape) for s in slots),
            **_alone(workload, exact, set(slots), seeds),
        }
        for op, slots in by_op.items()
    ]
    suspects = {
        row["op"]
        for key in ("bias_2bit", "error_8bit")
        for row in sorted(ops, key=lambda row: row[key], reverse=True)[:top_ops]
    }
    rows = []
    for op in suspects:
        slots = by_op[op]
        for slot in dict.fromkeys(slots[i * len(slots) // per_op] for i in range(per_op)):
            memory = compressed[slot]
            rows.append(
                {
                    "slot": slot,
                    "module": memory.module,
                    "op": memory.op,
                    "shape": list(memory.shape),
                    "codec": memory.codec,
                    "bits": memory.bits,
                    **_alone(workload, exact, {slot}, seeds),
                }
            )
    rows.sort(key=lambda row: row["bias_2bit"], reverse=True)
    ops.sort(key=lambda row: row["bias_2bit"], reverse=True)
    return {"ops": ops, "slots": rows}


# --------------------------------------------------------------------------- criteria
MAX_ERROR_8BIT = 1e-2
MIN_UNBIASED_RATIO = 3.0  # of sqrt(16) = 4 for an unbiased gradient
# fp32 activations at 2 bits are 15x smaller; what every model here keeps is mostly those.
MIN_KEPT_RATIO = 6.0


def failures(m: Measurement) -> list[str]:
    """The criteria a measurement misses, in words."""
    missed = []
    if not m.error_8bit < MAX_ERROR_8BIT:
        missed.append(f"8-bit error {m.error_8bit:.3g} >= {MAX_ERROR_8BIT}")
    if not m.unbiased_ratio >= MIN_UNBIASED_RATIO:
        missed.append(f"2-bit mean of {m.seeds} seeds only {m.unbiased_ratio:.2f}x closer than one seed")
    if not m.kept_ratio >= MIN_KEPT_RATIO:
        missed.append(f"kept memory {m.kept_ratio:.2f}x < {MIN_KEPT_RATIO}x")
    if not m.peak_ratio <= 1.0:
        missed.append(f"peak memory {m.peak_ratio:.3f}x of none")
    return missed


def _results_of_run(args, path: Path) -> tuple[str, dict]:
    """This run's command and the results it writes to ``path``: cases not run now keep
    their earlier rows, and each row names the command that measured it."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    results = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "seeds": args.seeds,
        "cases": earlier.get("cases", {}),
    }
    return " ".join(["python", *sys.argv]), results


def _print_untraced(m: Measurement, mode: str) -> None:
    """The tensors ``m``'s model kept whole because no trace could read them."""
    where = f" {mode}" if mode else ""
    for op, (tensors, stored, why) in m.untraced.items():
        print(f"    kept whole{where}, untraced: {op}: {tensors} tensors, {stored / 2**20:.3f} MiB ({why})")


def side_by_side(args) -> None:
    """Each case eager and compiled (inductor) in one process: what the compiled graphs store
    against what eager stores, with both gradients' 8-bit error and seed-mean ratio."""
    path = args.out / "model_libraries_side_by_side_cpu.json"
    command, results = _results_of_run(args, path)
    print(f"{'case':<28} {'stored eager':>13} {'compiled':>10} {'c / e':>6} {'8-bit e / c':>16} {'ratio e / c':>12}")
    for name in args.only or CASES:
        row = {"case": name, "command": command}
        try:
            eager, compiled = (measure(name, args.data, args.seeds, compiled) for compiled in (False, True))
        except Exception as error:
            print(f"{name:<28} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            row["failed"] = f"{type(error).__name__}: {str(error)[:2000]}"
        else:
            ratio = compiled.stored_bytes / max(eager.stored_bytes, 1)
            row.update(eager=eager.row(), compiled=compiled.row(), compiled_over_eager=ratio)
            print(
                f"{name:<28} {eager.stored_bytes / 2**20:>9.2f} MiB {compiled.stored_bytes / 2**20:>6.2f} MiB"
                f" {ratio:>5.2f}x {eager.error_8bit:>7.4f} / {compiled.error_8bit:.4f}"
                f" {eager.unbiased_ratio:>5.2f} / {compiled.unbiased_ratio:.2f}",
                flush=True,
            )
            _print_untraced(eager, "eager")
            _print_untraced(compiled, "compiled")
        results["cases"][name] = row
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--culprit-seeds", type=int, default=8, help="rounding seeds per slot in the culprit search")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="each model eager and compiled in one run: stored bytes, errors and bias side by side",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.side_by_side:
        side_by_side(args)
        return
    path = args.out / "model_libraries_cpu.json"
    command, results = _results_of_run(args, path)
    print(f"{'case':<28} {'8-bit':>8} {'2-bit':>8} {'mean':>8} {'ratio':>6} {'kept':>7} {'peak':>6} {'s':>5}")
    for name in args.only or CASES:
        try:
            m = measure(name, args.data, args.seeds)
        except Exception as error:
            print(f"{name:<28} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            results["cases"][name] = {
                "case": name,
                "failed": f"{type(error).__name__}: {str(error)[:2000]}",
                "command": command,
            }
            path.write_text(json.dumps(results, indent=1))
            continue
        row = m.row()
        row["failures"] = failures(m)
        row["command"] = command
        print(
            f"{name:<28} {m.error_8bit:>8.4f} {m.error_2bit:>8.4f} {m.mean_error_2bit:>8.4f}"
            f" {m.unbiased_ratio:>5.2f}x {m.kept_ratio:>6.2f}x {m.peak_ratio:>5.3f} {m.seconds:>5.1f}",
            flush=True,
        )
        _print_untraced(m, "")
        if m.error_8bit >= MAX_ERROR_8BIT or m.unbiased_ratio < MIN_UNBIASED_RATIO:
            row["culprits"] = find_culprits(name, args.data, args.culprit_seeds)
            for kind in ("ops", "slots"):
                for c in row["culprits"][kind]:
                    label = c["op"] if kind == "ops" else f"{c['slot']} ({c['op']}, {tuple(c['shape'])})"
                    print(
                        f"    {label:<70} bias {c['bias_2bit']:.4f}  one seed {c['error_2bit']:.4f}"
                        f"  8-bit {c['error_8bit']:.4f}",
                        flush=True,
                    )
        results["cases"][name] = row
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
