"""Short real training runs: compressed training follows uncompressed training.

Real data from ``../shared/data`` (CIFAR-10, Tiny Shakespeare); skipped when it is absent.
Runs share the seed and the data order; the figure compared is the mean training loss of
the last 10 steps. The transformer trains at a learning rate (1e-3) where its loss falls
smoothly: at 3e-3 it sits on a plateau around step 100 whose exit time any perturbation
shifts, and a single loss there says more about that timing than about the gradients.
The transformer's losses at 4 and 2 bits are printed, not asserted: plain low-bit
quantization is known to hurt transformers, which is what the adaptive policy is for.
"""

from pathlib import Path

import pytest
import torch
from lightning_act import compress_activations
from lightning_act.examples.language import CharTransformer
from lightning_act.examples.vision import CIFAR10DataModule
from torch import nn

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not DATA.is_dir(), reason=f"real data not found at {DATA}")]


def train(model, batches, optimizer, bits):
    losses = []
    for step, (x, y) in enumerate(batches):
        if bits is None:
            loss = model(x, y)
        else:
            with compress_activations(model, inputs=x, bits=bits, seed=step):
                loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10


class CifarCNN(nn.Module):
    def __init__(self):
        super().__init__()
        layers, width = [], 3
        for out in (32, 64, 128):
            layers += [
                nn.Conv2d(width, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.features(x).mean((2, 3))), y)


def test_small_cnn_at_4_bits_matches_uncompressed_on_cifar10():
    data = CIFAR10DataModule(str(DATA / "cifar10"), limit=64 * 60)
    data.setup("fit")
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data.test_set), generator=generator)[: 64 * 60].view(60, 64)
    batches = [tuple(torch.stack(c) for c in zip(*(data.test_set[int(i)] for i in rows))) for rows in order]

    def run(bits):
        torch.manual_seed(0)
        model = CifarCNN()
        return train(model, batches, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), bits)

    baseline, compressed = run(None), run(4)
    print(f"CNN on CIFAR-10, mean loss of steps 51-60: none {baseline:.4f}, 4 bits {compressed:.4f}")
    assert abs(compressed - baseline) <= 0.05 * baseline


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = CharTransformer(d_model=64, n_layers=2, n_heads=4, block_size=32, dropout=0.0)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())


def test_small_transformer_at_8_bits_matches_uncompressed_on_shakespeare():
    text = (DATA / "tinyshakespeare" / "input.txt").read_bytes()
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - 33, (100, 16), generator=generator)
    batches = [
        (torch.stack([ids[s : s + 32] for s in row]), torch.stack([ids[s + 1 : s + 33] for s in row])) for row in starts
    ]

    def run(bits):
        torch.manual_seed(0)
        model = LanguageModel()
        return train(model, batches, torch.optim.AdamW(model.parameters(), lr=1e-3), bits)

    baseline = run(None)
    results = {bits: run(bits) for bits in (8, 4, 2)}
    print(
        f"char transformer, mean loss of steps 91-100: none {baseline:.4f}, "
        + ", ".join(f"{b} bits {v:.4f} ({100 * (v / baseline - 1):+.1f}%)" for b, v in results.items())
    )
    assert abs(results[8] - baseline) <= 0.01 * baseline
