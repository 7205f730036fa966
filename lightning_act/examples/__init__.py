"""Models and data modules the ``configs/`` use, written to be reused as they are.

Importing this package makes every class here resolvable by its short name in
``lightning-act`` YAML and on its command line (``--model=ImageClassifier``).
"""

from lightning_act.examples.graph import NodeClassifier, PlanetoidDataModule
from lightning_act.examples.language import CharTextDataModule, CharTransformer
from lightning_act.examples.vision import CIFAR10DataModule, ImageClassifier, SyntheticImageDataModule

__all__ = [
    "CIFAR10DataModule",
    "CharTextDataModule",
    "CharTransformer",
    "ImageClassifier",
    "NodeClassifier",
    "PlanetoidDataModule",
    "SyntheticImageDataModule",
]
