"""How many bits each saved tensor gets: fixed, or adapted to its measured sensitivity."""

from lightning_act.policy.allocation import allocate_bits, quantization_variance
from lightning_act.policy.bits import (
    EXACT,
    AdaptiveBits,
    AllocatedBits,
    BitPolicy,
    FixedBits,
    Rule,
    SaveRules,
    SlotInfo,
)
from lightning_act.policy.memory_target import TargetBits, parse_memory_target

__all__ = [
    "EXACT",
    "AdaptiveBits",
    "AllocatedBits",
    "BitPolicy",
    "FixedBits",
    "Rule",
    "SaveRules",
    "SlotInfo",
    "TargetBits",
    "allocate_bits",
    "parse_memory_target",
    "quantization_variance",
]
