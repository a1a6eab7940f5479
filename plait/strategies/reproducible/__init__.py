"""Layout-invariant training: bitwise the same parameters whatever the data-parallel world
size, all-reduce algorithm, transport or pipeline depth (``reproducible=True``).

:mod:`.tree` holds the fixed summation tree over micro-batch index and the local
accumulator, :mod:`.collectives` the reductions that follow it across ranks, and
:mod:`.runner` the training step that cuts a batch into micro-batches and drives them.
"""

from plait.strategies.reproducible.collectives import tree_all_reduce, tree_reduce_scatter
from plait.strategies.reproducible.runner import ReproducibleRunner
from plait.strategies.reproducible.tree import (
    LayoutError,
    Microbatches,
    TreeSum,
    microbatch_count,
    tree_sum,
)

__all__ = [
    "LayoutError",
    "Microbatches",
    "ReproducibleRunner",
    "TreeSum",
    "microbatch_count",
    "tree_all_reduce",
    "tree_reduce_scatter",
    "tree_sum",
]
