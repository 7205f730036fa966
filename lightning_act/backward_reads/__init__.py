"""How backward reads each saved tensor, read off the backward itself.

Stochastic rounding stores a tensor right on average, so a gradient computed from it is
unbiased exactly where backward reads the tensor *linearly*; elsewhere, how backward reads it
decides how it may be stored. Rather than a list of ops, this package follows each saved
tensor's node in an aten graph of the backward to the gradients.

* :func:`classify` is the analysis: a degree algebra over aten ops (views, sums and additions
  keep the degree; a product adds degrees; comparisons, casts, divisions and transcendental
  functions are recorded as what they are), giving a :class:`Read`.
* :func:`graph_reads` applies it to a compiled region's backward graph, its backward kernels
  decomposed as in eager mode first, so both paths read the same aten ops.
* :func:`call_reads` applies it in eager mode: it traces the saving call forward and backward
  with ``make_fx`` on fake tensors, saved-tensor hooks marking where backward reads each
  save. One trace per call signature, cached for the process.

What a :class:`Use` means for storage (:mod:`lightning_act.capture.decide` applies it):

========== ====================================================== ==========================
use        backward                                               stored
========== ====================================================== ==========================
NONE       reads no value of it (its shape at most)                by the policy
REGION     only compares it with constants (``x <= 0``)            exact, unless a codec keeps
                                                                   the comparisons (masks)
LINEAR     is linear in it                                         by the policy, any bits
QUADRATIC  multiplies two uses of it (a normalisation's input,     4 bits or more
           a recurrent op's gates, ``y (1 - y)``)
SMOOTH     puts it through a smooth nonlinearity (exp, sigmoid,    8 bits or more; a pointwise
           erf, clamps) or compares it and reads its value          derivative is stored instead
SINGULAR   divides by it, or takes its log, root or a power        exact
           below 1, or an aten op not described here and not
           measured linear in it
EXACT      compares it with another value (``amax``'s              exact (an equality with
           ``x == result``), casts it to an integer or rounds it,  other saves: its outcome)
           passes it to an op outside aten (``torchvision::*``)
           not measured linear in it, or the backward could not
           be traced
========== ====================================================== ==========================

An op the algebra does not describe (another library's, or an aten op torch adds) is
measured on random values (:func:`linear_arguments`) and counts as multilinear in the
arguments it is linear in; elsewhere the strict reading above holds.

A saved input of a pointwise op whose input gradient is ``grad * h(x)`` (SiLU, GELU, ELU)
gets a :class:`PointwiseDerivative`: ``h(x)`` is stored instead of ``x``, so backward is
linear in what is stored, and unpack hands back the input on ``h``'s monotone branch with
that derivative.
"""

from lightning_act.backward_reads.aten import in_fresh_thread, size_hint
from lightning_act.backward_reads.derivative import PointwiseDerivative
from lightning_act.backward_reads.linearity import linear_arguments, probe_cost
from lightning_act.backward_reads.trace import call_reads, classify, graph_reads, is_tangent, untraced_reason
from lightning_act.backward_reads.walk import ATTENTION_MASK, STATISTIC_RATIO, Match, Read, Recompute, Saves, Use

__all__ = [
    "ATTENTION_MASK",
    "STATISTIC_RATIO",
    "Match",
    "PointwiseDerivative",
    "Read",
    "Recompute",
    "Saves",
    "Use",
    "call_reads",
    "classify",
    "graph_reads",
    "in_fresh_thread",
    "is_tangent",
    "linear_arguments",
    "probe_cost",
    "size_hint",
    "untraced_reason",
]
