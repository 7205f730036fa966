"""Model families beyond the model-library suite, measured as it measures them.

The suite (``benchmarks/model_libraries.py``) holds one model per kind that its tests check
criterion by criterion. This sweep runs more of each library's families the same way (small
configs, random weights, the same batches), to find what the suite's models do not show: a
crash, a NaN, a gradient error far from its family's. HF causal LMs (OPT, GPT-NeoX, Mistral,
Phi, Qwen2, Gemma, Falcon, GPT-J, Bloom, GPT-2, Mamba), encoders (RoBERTa, ELECTRA, DistilBERT, ALBERT,
DeBERTa-v2), vision models (ViT, DeiT, ConvNeXt, ResNet), speech (Whisper, Wav2Vec2 with CTC), CLIP and
Segformer; torchvision's RegNet and RAFT (optical flow); Fourier layers (complex FFT weights);
timm CNNs, ViTs and MLPs; PyG convolutions (GraphConv, Cheb, EdgeConv, GAT, APPNP, SGConv, GCN2, PNA), each with a
BatchNorm between its layers; ``torch.nn`` RNNs and an ``LSTMCell`` loop.

Each row has ``model_libraries.measure``'s figures with ``--seeds`` rounding seeds (the
mean of k seeds is sqrt(k) closer than one seed for an unbiased gradient: 2.83 for 8).

    python benchmarks/model_families.py                      # eager, every family
    python benchmarks/model_families.py --compiled hf_bloom  # compiled with inductor
    python benchmarks/model_families.py --first-steps 3 --compiled hf_whisper hf_clip

``--first-steps N`` measures instead the peak of each of a fresh model's first ``N`` steps
in one process (no warm-up: a compiled model compiles in its first), without compression
and at 2 bits: compression must not raise any of them, the first included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_act import ActivationCapture, CompressionConfig
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_libraries import (
    CASES,
    DATA,
    Workload,
    _byte_class,
    _case,
    _seeded,
    build,
    cifar_images,
    cora,
    failures,
    measure,
    shakespeare_bytes,
    step_memory,
    timm_model,
)

#: HF causal LMs: (config class, model class, config fields besides the vocabulary).
_CAUSAL = {
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
        ),
    ),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_layer=2, n_head=4)),
    # GPT-2 trains with dropout on its attention probabilities: SDPA's math path when compiled.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    # Mamba without its CUDA kernels: the selective scan stepped in Python.
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, state_size=8)),
}
_ENCODER = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=130
)
#: HF sequence classifiers on bytes: (config class, model class, config fields).
_ENCODERS = {
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", _ENCODER),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", dict(_ENCODER, embedding_size=32)),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForSequenceClassification",
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    ),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", dict(_ENCODER, embedding_size=32)),
    "deberta": ("DebertaV2Config", "DebertaV2ForSequenceClassification", _ENCODER),
}
_PATCHES = dict(
    image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)
_STAGES = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
#: HF image classifiers on CIFAR-10: (config class, model class, config fields).
_VISION = {
    "vit": ("ViTConfig", "ViTForImageClassification", _PATCHES),
    "deit": ("DeiTConfig", "DeiTForImageClassification", _PATCHES),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", _STAGES),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", dict(_STAGES, embedding_size=16)),
}
#: timm architectures on CIFAR-10 images, batch 8, with the arguments that fit them to 32 x 32.
_TIMM = {
    "poolformer_s12": {},
    "levit_128s": dict(img_size=32),
    "deit_tiny_patch16_224": dict(img_size=32, patch_size=4, depth=2),
    "resnet18": {},
    "regnetx_002": {},
    "densenet121": {},
    "mobilevit_xxs": {},
    "coatnet_nano_rw_224": dict(img_size=32),
    "ghostnet_100": {},
    "repvgg_a0": {},
    "xcit_nano_12_p8_224": dict(img_size=32, depth=2),
    "cait_xxs24_224": dict(img_size=32, patch_size=4, depth=2),
    "beit_base_patch16_224": dict(img_size=32, patch_size=4, depth=2, embed_dim=64, num_heads=4),
    "hrnet_w18_small": {},
    "dla34": {},
    "nfnet_l0": {},
    "tresnet_m": {},
    "rexnet_100": {},
    "mobileone_s0": {},
    "fastvit_t8": {},
    "resnest14d": {},
    "edgenext_xx_small": {},
}


def hf_model(data: Path, kind: str, task: str) -> Workload:
    """An HF model from its config, random weights: a causal LM, an encoder or a vision model."""
    import transformers

    table = {"causal": _CAUSAL, "encoder": _ENCODERS, "vision": _VISION}[task]
    config_class, model_class, fields = table[kind]
    labels = {} if task == "causal" else {"num_labels": 4 if task == "encoder" else 10}
    vocabulary = {} if task == "vision" else {"vocab_size": 256}
    config = getattr(transformers, config_class)(**vocabulary, **labels, **fields)
    model = getattr(transformers, model_class)(config).train()
    if task == "vision":
        x, y = cifar_images(data, 16)
        return Workload(model, _seeded(lambda: model(pixel_values=x, labels=y).loss), (x, y))
    tokens = shakespeare_bytes(data, batch=8 if task == "causal" else 16, length=64)
    if task == "causal":
        return Workload(model, _seeded(lambda: model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss), tokens)
    x, y = tokens[:, :-1], _byte_class(tokens[:, -1])
    return Workload(model, _seeded(lambda: model(input_ids=x, labels=y).loss), (x, y))


def hf_whisper(data: Path) -> Workload:
    """Speech to text: a convolutional stem over log-mel features, an encoder and a decoder
    with cross-attention; the features are random, the labels Tiny Shakespeare's bytes."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        attn_implementation="sdpa",
    )
    model = WhisperForConditionalGeneration(config).train()
    features = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))
    labels = shakespeare_bytes(data, batch=4, length=24)[:, 1:].contiguous()
    return Workload(model, _seeded(lambda: model(input_features=features, labels=labels).loss), (features, labels))


def hf_wav2vec2_ctc(data: Path) -> Workload:
    """Speech recognition: a convolutional feature extractor over raw audio (random here),
    a transformer with dropout on its attention, and the CTC loss."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        pad_token_id=0,
        ctc_loss_reduction="mean",
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
        mask_time_prob=0.0,
    )
    model = Wav2Vec2ForCTC(config).train()
    generator = torch.Generator().manual_seed(0)
    audio = torch.randn(4, 4000, generator=generator)
    labels = torch.randint(1, 32, (4, 12), generator=generator)
    return Workload(model, _seeded(lambda: model(input_values=audio, labels=labels).loss), (audio, labels))


def hf_clip(data: Path) -> Workload:
    """Contrastive image-text training: a ViT and a text transformer, CIFAR-10 images against
    Tiny Shakespeare lines, the loss over the batch's similarity matrix."""
    from transformers import CLIPConfig, CLIPModel

    layers = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(vocab_size=256, max_position_embeddings=64, **layers),
        vision_config=dict(image_size=32, patch_size=4, **layers),
        projection_dim=32,
    )
    model = CLIPModel(config).train()
    images, _ = cifar_images(data, 16)
    text = shakespeare_bytes(data, batch=16, length=31)
    return Workload(
        model, _seeded(lambda: model(input_ids=text, pixel_values=images, return_loss=True).loss), (images, text)
    )


def hf_segformer(data: Path) -> Workload:
    """Semantic segmentation: overlapping patch merging, attention over a reduced sequence,
    depthwise convolutions, and an upsampled per-pixel loss (four brightness bands)."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[3, 3],
        strides=[2, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=32,
        num_labels=4,
    )
    model = SegformerForSemanticSegmentation(config).train()
    images, _ = cifar_images(data, 8)
    labels = (images.mean(1) * 2).clamp(-1.99, 1.99).add(2).long()
    return Workload(model, _seeded(lambda: model(pixel_values=images, labels=labels).loss), (images, labels))


def torchvision_regnet(data: Path) -> Workload:
    import torchvision

    model = torchvision.models.regnet_y_400mf(num_classes=10).train()
    x, y = cifar_images(data, 16)
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x), y)), (x, y))


def torchvision_raft(data: Path) -> Workload:
    """Optical flow (RAFT small, instance norms) between two CIFAR-10 images at 128 x 128, three
    refinement steps, the final flow's mean magnitude as the loss."""
    import torchvision

    model = torchvision.models.optical_flow.raft_small(weights=None).train()
    frames = F.interpolate(cifar_images(data, 2)[0], size=128, mode="bilinear")
    return Workload(model, _seeded(lambda: model(frames[:1], frames[1:], num_flow_updates=3)[-1].abs().mean()), frames)


class FourierLayers(nn.Module):
    """Fourier layers as neural operators write them: complex weights mixing the lowest modes of
    an ``rfft2``, written into a zero buffer and transformed back."""

    def __init__(self, channels: int = 16, modes: int = 8, classes: int = 10):
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(torch.randn(2, channels, channels, modes, modes, dtype=torch.cfloat) / channels)
        self.lift, self.head = nn.Conv2d(3, channels, 1), nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, m = self.lift(x), self.modes
        for weights in self.weights:
            spectrum = torch.fft.rfft2(x)
            mixed = torch.zeros_like(spectrum)
            mixed[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], weights)
            x = F.gelu(x + torch.fft.irfft2(mixed, s=x.shape[-2:]))
        return self.head(x.mean((2, 3)))


def fourier_layers(data: Path) -> Workload:
    torch.manual_seed(0)
    model = FourierLayers().train()
    x, y = cifar_images(data, 16)
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x), y)), (x, y))


class GraphFamily(nn.Module):
    """Two PyG layers of one family with dropout, a BatchNorm and a ReLU between them."""

    def __init__(self, conv: str, graph, hidden: int = 64, classes: int = 7):
        super().__init__()
        from torch_geometric import nn as gnn
        from torch_geometric.utils import degree

        features = graph.num_features
        self.conv = conv
        if conv == "graphconv":
            self.first, self.second = gnn.GraphConv(features, hidden), gnn.GraphConv(hidden, classes)
        elif conv == "cheb":
            self.first, self.second = gnn.ChebConv(features, hidden, K=3), gnn.ChebConv(hidden, classes, K=3)
        elif conv == "edgeconv":  # max aggregation of edge MLPs
            self.first = gnn.EdgeConv(
                nn.Sequential(nn.Linear(2 * features, hidden), nn.ReLU(), nn.Linear(hidden, hidden)), aggr="max"
            )
            self.second = gnn.EdgeConv(nn.Linear(2 * hidden, classes), aggr="max")
        elif conv == "gat":
            self.first, self.second = gnn.GATConv(features, hidden // 4, heads=4), gnn.GATConv(hidden, classes)
        elif conv == "appnp":  # an MLP, then personalized-PageRank propagation
            self.first, self.second = nn.Linear(features, hidden), nn.Linear(hidden, classes)
            self.propagate = gnn.APPNP(K=5, alpha=0.1)
        elif conv == "sg":
            self.first, self.second = gnn.SGConv(features, hidden, K=2), gnn.SGConv(hidden, classes, K=1)
        elif conv == "gcn2":  # the second layer mixes in the first's output
            self.first, self.second = gnn.GCNConv(features, hidden), gnn.GCN2Conv(hidden, alpha=0.1)
            self.head = nn.Linear(hidden, classes)
        elif conv == "pna":  # scaled by the graph's degree histogram
            histogram = torch.bincount(degree(graph.edge_index[1], graph.num_nodes, dtype=torch.long))
            pna = dict(aggregators=["mean", "max", "std"], scalers=["identity", "amplification"], deg=histogram)
            self.first, self.second = gnn.PNAConv(features, hidden, **pna), gnn.PNAConv(hidden, classes, **pna)
        else:
            raise ValueError(f"conv={conv!r} is not supported; allowed: {', '.join(_GRAPH_FAMILIES)}")
        self.dropout = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        if self.conv == "appnp":
            h = F.relu(self.norm(self.first(self.dropout(x))))
            return self.propagate(self.second(self.dropout(h)), edge_index)
        h = F.relu(self.norm(self.first(self.dropout(x), edge_index)))
        if self.conv == "gcn2":
            return self.head(self.second(self.dropout(h), h, edge_index))
        return self.second(self.dropout(h), edge_index)


_GRAPH_FAMILIES = ("graphconv", "cheb", "edgeconv", "gat", "appnp", "sg", "gcn2", "pna")


def graph_family(data: Path, conv: str) -> Workload:
    graph = cora(data)
    model = GraphFamily(conv, graph).train()
    loss = lambda: F.cross_entropy(model(graph.x, graph.edge_index)[graph.train_mask], graph.y[graph.train_mask])  # noqa: E731
    return Workload(model, _seeded(loss), graph)


class ByteRNN(nn.Module):
    """Byte embedding, a recurrent layer (or an ``LSTMCell`` stepped in Python), a classifier."""

    def __init__(self, cell: str, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.cell = cell
        if cell == "rnn_tanh":
            self.rnn = nn.RNN(width, width, num_layers=2, batch_first=True)
        elif cell == "rnn_relu":
            self.rnn = nn.RNN(width, width, nonlinearity="relu", batch_first=True)
        elif cell == "bilstm":
            self.rnn = nn.LSTM(width, width // 2, num_layers=2, bidirectional=True, batch_first=True)
        else:
            self.rnn = nn.LSTMCell(width, width)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.cell != "lstmcell":
            return self.head(self.rnn(x)[0])
        h = c = x.new_zeros(x.shape[0], x.shape[2])
        steps = []
        for t in range(x.shape[1]):
            h, c = self.rnn(x[:, t], (h, c))
            steps.append(h)
        return self.head(torch.stack(steps, 1))


def byte_rnn(data: Path, cell: str) -> Workload:
    model = ByteRNN(cell).train()
    tokens = shakespeare_bytes(data, batch=16, length=32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return Workload(model, _seeded(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten())), tokens)


#: The families, by case name; importing this module adds them to ``model_libraries.CASES``.
FAMILIES = {
    **{f"hf_{kind}": _case("transformers", hf_model, kind, "causal") for kind in _CAUSAL},
    **{f"hf_{kind}": _case("transformers", hf_model, kind, "encoder") for kind in _ENCODERS},
    **{f"hf_vision_{kind}": _case("transformers", hf_model, kind, "vision") for kind in _VISION},
    **{f"timm_{arch}": _case("timm", timm_model, arch, 8, **kwargs) for arch, kwargs in _TIMM.items()},
    **{f"pyg_{conv}": _case("torch_geometric", graph_family, conv) for conv in _GRAPH_FAMILIES},
    **{f"torch_{cell}": _case("torch.nn", byte_rnn, cell) for cell in ("rnn_tanh", "rnn_relu", "bilstm", "lstmcell")},
    "hf_whisper": _case("transformers", hf_whisper),
    "hf_wav2vec2_ctc": _case("transformers", hf_wav2vec2_ctc),
    "hf_clip": _case("transformers", hf_clip),
    "hf_segformer": _case("transformers", hf_segformer),
    "torchvision_regnet_y_400mf": _case("torchvision", torchvision_regnet),
    "torchvision_raft_small": _case("torchvision", torchvision_raft),
    "torch_fourier_layers": _case("torch.fft", fourier_layers),
}
CASES.update(FAMILIES)


def first_step_peaks(name: str, data: Path, steps: int, compiled: bool) -> dict:
    """The peak of each of the first ``steps`` steps of a fresh model (and a fresh compile),
    without compression and with every saved tensor at 2 bits."""
    peaks = {}
    for method in ("none", "act_2bit"):
        torch._dynamo.reset()
        workload = build(name, data)
        if compiled:
            workload.model.compile(backend="inductor")
        capture = None if method == "none" else ActivationCapture(CompressionConfig(bits=2), workload.model)
        peaks[method] = [step_memory(workload, capture)[1] for _ in range(steps)]
    peaks["worst_over_none"] = max(peaks["act_2bit"]) / max(max(peaks["none"]), 1)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"default: every family ({', '.join(FAMILIES)})")
    parser.add_argument("--compiled", action="store_true", help="each model under torch.compile (inductor)")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument(
        "--first-steps",
        type=int,
        default=0,
        metavar="N",
        help="the peaks of a fresh model's first N steps instead, none and 2 bits",
    )
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - FAMILIES.keys())
    if unknown:
        parser.error(f"unknown cases {unknown}; allowed: {', '.join(FAMILIES)}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "compiled" if args.compiled else "eager"
    path = args.out / f"model_families_{mode}{'_first_steps' if args.first_steps else ''}_cpu.json"
    rows = json.loads(path.read_text())["cases"] if path.exists() else {}
    command = " ".join(["python", *sys.argv])
    for name in args.cases or FAMILIES:
        started = time.perf_counter()
        try:
            if args.first_steps:
                row = first_step_peaks(name, args.data, args.first_steps, args.compiled)
                line = "peaks " + "; ".join(
                    f"{method} " + ", ".join(f"{peak / 2**20:.2f}" for peak in row[method])
                    for method in ("none", "act_2bit")
                )
                line += f" MiB, worst 2-bit / worst none {row['worst_over_none']:.2f}"
            else:
                m = measure(name, args.data, args.seeds, args.compiled)
                missed = [f for f in failures(m) if "closer than one seed" not in f]  # its own seeds: printed
                row = {
                    "error_8bit": m.error_8bit,
                    "error_2bit": m.error_2bit,
                    "unbiased_ratio": m.unbiased_ratio,
                    "kept_ratio": m.kept_ratio,
                    "peak_ratio": m.peak_ratio,
                    "stored_bytes": m.stored_bytes,
                    "missed": missed,
                }
                line = (
                    f"8-bit {m.error_8bit:.4f}  2-bit {m.error_2bit:.3f}  mean of {args.seeds} "
                    f"{m.unbiased_ratio:.2f}x closer  kept {m.kept_ratio:5.2f}x  peak {m.peak_ratio:.3f}  "
                    + "; ".join(missed)
                )
        except Exception as error:
            row = {"failed": f"{type(error).__name__}: {str(error)[:2000]}"}
            line = f"failed: {row['failed'][:300]}"
        rows[name] = row
        print(f"{name:28s} {line}  {time.perf_counter() - started:4.0f} s", flush=True)
        # Written after every case: a long sweep stopped midway keeps what it measured.
        path.write_text(
            json.dumps(
                {
                    "command": command,
                    "torch": torch.__version__,
                    "seeds": args.seeds,
                    "date": time.strftime("%Y-%m-%d"),
                    "cases": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
