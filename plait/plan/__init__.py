"""Planning before spending accelerator hours: how much memory each strategy needs per rank.

``estimate`` is the ZeRO paper's arithmetic (section 3, Figure 1); ``measure`` counts the
tensors a rank really holds, to check it against.
"""

from plait.plan.memory import (
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    MemoryEstimate,
    compare,
    estimate,
    format_table,
    measure,
)

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "MemoryEstimate",
    "compare",
    "estimate",
    "format_table",
    "measure",
]
