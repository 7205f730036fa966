"""lightning_act: activation compressed training for PyTorch and PyTorch Lightning.

The tensors autograd saves for backward are stored at 1-8 bits per value and decoded just
before backward needs them. Use :class:`ActCompression` as a Lightning callback, or
:func:`compress_activations` around a plain PyTorch forward.
"""

from lightning_act.callback import ActCompression
from lightning_act.capture import ActivationCapture, CompressionReport, ModuleMemory, compress_activations
from lightning_act.config import CompressionConfig
from lightning_act.policy.memory_target import MemoryTargetError
from lightning_act.target import MemoryTarget

__all__ = [
    "ActCompression",
    "ActivationCapture",
    "CompressionConfig",
    "CompressionReport",
    "MemoryTarget",
    "MemoryTargetError",
    "ModuleMemory",
    "compress_activations",
]
