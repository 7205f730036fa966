"""The capture engine and its report: every tensor autograd saves for backward is stored as
:func:`~lightning_act.capture.call_sites.decide` says, attributed to its module and accounted.

* :mod:`~lightning_act.capture.decide`: how one saved tensor must be stored (pure rules);
* :mod:`~lightning_act.capture.engine`: :class:`ActivationCapture`, the hooks and sessions;
* :mod:`~lightning_act.capture.store`: codecs, one copy shared between saves, accounting;
* :mod:`~lightning_act.capture.compiled` and :mod:`~lightning_act.capture.graph_ops`: the same
  inside ``torch.compile`` graphs, planned at compile time and run by the graph ops;
* :mod:`~lightning_act.capture.active`: the captures capturing now and the seed mixer (read by
  the graph ops without importing the engine);
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
