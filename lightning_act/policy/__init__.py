"""How many bits each saved tensor gets: fixed, or adapted to its measured sensitivity."""

from lightning_act.policy.allocation import allocate_bits, quantization_variance
from lightning_act.policy.bits import EXACT, AdaptiveBits, BitPolicy, FixedBits, Rule, SaveRules, SlotInfo

__all__ = [
    "EXACT",
    "AdaptiveBits",
    "BitPolicy",
    "FixedBits",
    "Rule",
    "SaveRules",
    "SlotInfo",
    "allocate_bits",
    "quantization_variance",
]
