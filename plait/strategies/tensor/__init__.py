"""1D tensor parallelism (Megatron-style) with sequence parallelism.

- ``mappings``: the conjugate communication functions (f / g, scatter / gather along the
  last dim, sequence all-gather / reduce-scatter) and :func:`sum_gradient_across`.
- ``layers``: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`.
- ``cross_entropy``: :func:`vocab_parallel_cross_entropy`.
- ``parallelize``: :func:`parallelize` turns a dense model into its tensor-parallel form.
"""

from plait.strategies.tensor import mappings
from plait.strategies.tensor.cross_entropy import vocab_parallel_cross_entropy
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "mappings",
    "vocab_parallel_cross_entropy",
]
