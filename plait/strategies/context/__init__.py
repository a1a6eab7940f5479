"""Context parallelism: the sequence split over the mesh's ``cp`` dimension, through
attention itself.

- ``layout``: which chunks of the sequence a cp rank holds (balanced for causal masks or
  contiguous), their position ids, :func:`shard_sequence`, the work per rank;
- ``ring``: one ring step on the cp group (posted send and receive);
- ``ring_attention``: :func:`ring_attention`, keys and values around the ring with an
  online softmax, recomputed blockwise in backward;
- ``ulysses``: :func:`ulysses_attention`, all-to-all from sequence-split to head-split and
  back;
- ``style``: :func:`context_parallel`, a model's attention kernel swapped (plait's GPT, any
  model calling ``scaled_dot_product_attention``, Hugging Face models through their
  attention registry);
- ``recipe``: :func:`prepare_cp`, tp (first), the kernel swap, then gradients averaged over
  cp x dp: all-reduced (``zero=0``), or ZeRO-1/2 / FSDP sharded over cp x dp
  (``zero=1|2|3``).
- ``moe``: MoE models under cp: a Hugging Face family's router logits gathered over the
  ranks for its load-balancing loss; plait's own MoE layer refused.
"""

from plait.strategies.context.layout import (
    chunks_of,
    imbalance,
    positions,
    ring_work,
    shard_sequence,
)
from plait.strategies.context.recipe import prepare_cp
from plait.strategies.context.ring_attention import ring_attention
from plait.strategies.context.style import ContextParallelInfo, context_parallel
from plait.strategies.context.ulysses import ulysses_attention

__all__ = [
    "ContextParallelInfo",
    "chunks_of",
    "context_parallel",
    "imbalance",
    "positions",
    "prepare_cp",
    "ring_attention",
    "ring_work",
    "shard_sequence",
    "ulysses_attention",
]
