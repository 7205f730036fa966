"""The capture engine and what it reports: every tensor autograd saves for backward is
stored as :func:`~lightning_act.capture.decide.decide` says, attributed to its module and
accounted.

* :mod:`~lightning_act.capture.decide`: how one saved tensor must be stored (pure rules);
* :mod:`~lightning_act.capture.engine`: :class:`ActivationCapture`, the hooks, sessions,
  storage sharing between saves, accounting and probing;
* :mod:`~lightning_act.capture.compiled`: the same inside ``torch.compile`` graphs (hooks
  torch inlines into them, decided from the compiled backward);
* :mod:`~lightning_act.capture.active`: the captures capturing now and the seed mixer, which
  the engine and the graph ops both read (the graph ops import it, not the engine);
* :mod:`~lightning_act.capture.records`: what autograd holds instead of a saved tensor;
* :mod:`~lightning_act.capture.report`: the per-module and per-slot byte report.
"""

from lightning_act.capture.engine import ActivationCapture, compress_activations, splitmix64
from lightning_act.capture.report import OUTSIDE_MODULES, CompressionReport, ModuleMemory, Outcome, SlotMemory

__all__ = [
    "OUTSIDE_MODULES",
    "ActivationCapture",
    "CompressionReport",
    "ModuleMemory",
    "Outcome",
    "SlotMemory",
    "compress_activations",
    "splitmix64",
]
