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
from plait.strategies.tensor.parallelize import (
    Style,
    full_state_dict,
    loss_fn,
    parallelize,
    prepare_tp,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Style",
    "VocabParallelEmbedding",
    "full_state_dict",
    "loss_fn",
    "mappings",
    "parallelize",
    "prepare_tp",
    "vocab_parallel_cross_entropy",
]
