"""1D tensor parallelism (Megatron-style) with sequence parallelism.

- ``mappings``: the conjugate communication functions (f / g, scatter / gather along the
  last dim, sequence all-gather / reduce-scatter) and :func:`sum_gradient_across`.
- ``layers``: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`.
- ``cross_entropy``: :func:`vocab_parallel_cross_entropy`.
- ``plan``: :class:`TensorPlan` (styles by module pattern, :class:`AttentionHeads`), what a
  model family tells :func:`parallelize` (plans live with the models, ``plait/models/``).
- ``parallelize``: :func:`parallelize` turns a dense model into its tensor-parallel form.
  Its parts: ``style`` (:class:`Style`, the plan resolved against module paths),
  ``checks`` (what is refused up front), ``convert`` (each dense module's parallel layer or
  hooks), ``shards`` (placement, ties, the dense state gathered back), ``optimizer`` (the
  optimizer rebuilt over the shards).
- ``agreement``: :func:`check_agreement`, the wrap-time check that every rank holds the
  same dense model and plan.
- ``finite``: the ``check_finite`` policy (``"raise"``/``"skip"``/None) run before every
  optimizer step, agreed across the group.
- 2D / 2.5D / 3D (Colossal-AI's Optimus, Tesseract, 3D): ``grid`` (the grid from a mesh),
  ``summa``, ``tesseract``, ``three_d`` (the matmuls), ``layers_nd``, ``cross_entropy_nd``,
  ``parallelize_nd`` (styles ``"2d"``, ``"2.5d"``, ``"3d"``; :func:`gpt_plan`,
  :func:`prepare_nd`).
"""

from plait.strategies.tensor import mappings
from plait.strategies.tensor.agreement import check_agreement
from plait.strategies.tensor.cross_entropy import vocab_parallel_cross_entropy
from plait.strategies.tensor.grid import Grid, grid_from_mesh, grid_mesh, grid_shape
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    HeadSelectLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.layers_nd import EmbeddingND, LayerNormND, LinearND
from plait.strategies.tensor.parallelize import (
    Style,
    full_state_dict,
    loss_fn,
    parallelize,
    prepare_tp,
)
from plait.strategies.tensor.parallelize_nd import gpt_plan, prepare_nd
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan

__all__ = [
    "AttentionHeads",
    "ColumnParallelLinear",
    "EmbeddingND",
    "Grid",
    "HeadSelectLinear",
    "LayerNormND",
    "LinearND",
    "RowParallelLinear",
    "Style",
    "TensorPlan",
    "VocabParallelEmbedding",
    "check_agreement",
    "full_state_dict",
    "gpt_plan",
    "grid_from_mesh",
    "grid_mesh",
    "grid_shape",
    "loss_fn",
    "mappings",
    "parallelize",
    "prepare_nd",
    "prepare_tp",
    "vocab_parallel_cross_entropy",
]
