"""ZeRO stages 1 and 2: optimizer state, and in stage 2 gradients, sharded over the group.

Every rank keeps a full replica of the parameters and computes gradients on its share of
the global batch, as in DDP. What is not replicated: the trainable parameters are laid end
to end in one flat index space of S elements (param-group order, then each group's order),
and rank r owns the contiguous range ``[lo_r, hi_r)``; range sizes differ by at most one
element, and a large tensor is split across ranks rather than assigned whole
(:func:`partition` gives the pieces as plain data). Param groups are contiguous in the flat
space, so each group is one sub-range of a rank's range (possibly empty): the wrapped
optimizer (``optimizer_class``) runs on one flat ``nn.Parameter`` per group holding a copy
of this rank's part of that group (in float32, or wider when the parameters are), with the
group's hyper-parameters, so its state (Adam's ``exp_avg`` and ``exp_avg_sq``) is about
1/n of the replicated one.

Modules: :mod:`~plait.strategies.zero.partition` (the layout, plain data),
:mod:`~plait.strategies.zero.groups` (param groups in, constructor keywords out),
:mod:`~plait.strategies.zero.guard` (what ``param.grad`` is after backward),
:mod:`~plait.strategies.zero.gradients` (hooks, reduce-scatters, clipping and unscaling on
the averaged shard), :mod:`~plait.strategies.zero.optimizer` (:class:`ZeroOptimizer`),
:mod:`~plait.strategies.zero.state` (state dicts), :mod:`~plait.strategies.zero.prepare`.

Communication contract, on ``group`` (n ranks, b bytes per element, S_r = hi_r - lo_r):

- construction: the (name, shape, dtype) lists are compared through the store
  (:func:`plait.strategies.consistency.verify_same_parameters`), then the parameters are
  broadcast from group rank 0 (one flat broadcast), so every replica starts equal;
- stage 1, in ``step()`` (or earlier in ``clip_grad_norm_`` / loss-scaler unscaling, which
  ``step()`` then reuses): the gradients are averaged with ``reduce_scatter`` (op avg),
  bucket by bucket (buckets of about ``bucket_mb`` MiB, whole parameters, in the reverse of
  the model's registration order, the order backward produces gradients in, whatever the
  param groups; a rank's block of a bucket is the concatenation of the bucket's parts in
  the rank's range), so
  rank r receives only the averaged gradient of its range. With the ring each rank sends
  (S - S_r)·b ≈ (n-1)/n·S·b in all: exactly the reduce-scatter half of a ring all-reduce.
  The full local gradients stay allocated (behind the ``.grad`` guards), as in DDP;
- stage 2, during ``backward()``: the same reduce-scatters, launched asynchronously from a
  post-accumulate-grad hook per parameter as soon as a bucket's gradients are all ready
  (strictly in bucket order, so every rank issues the same collectives in the same
  order), overlapping the rest of backward. Once a bucket is launched the ``.grad`` of its
  parameters is dropped (replaced by a one-element guard), so full gradients are never all
  alive at once and none remains after backward; each rank keeps only its shard of the
  averaged gradient. ``step()`` waits for the outstanding reduce-scatters. A parameter
  that got no gradient is reduced as zeros (at the end of backward);
- ``clip_grad_norm_``: one all-reduce of one scalar (sum, or max for the inf norm);
  loss-scaler unscaling (``unscale_grads_``, reached by ``torch.amp.GradScaler``): one
  all-reduce (max) of one float;
- both stages, at the end of ``step()``: the local optimizer updates its shards, and the
  updated shards are ``all_gather``-ed (uneven per-rank blocks, bucket by bucket) into the
  model parameters, so every replica ends bitwise identical. With the ring rank r sends
  every block but its right neighbour's, (S - S_{r+1})·b ≈ (n-1)/n·S·b. In all a step
  sends about 2(n-1)/n·S·b per rank, what DDP's ring all-reduce sends (tests/test_zero.py
  checks both counts exactly);
- ``state_dict()``: one ``all_gather`` per param group and per-element state entry (two
  for Adam); every rank returns the same consolidated dict. ``load_state_dict``,
  ``sharded_state_dict`` and ``load_sharded_state_dict`` do not communicate.

With ``algorithm="auto"`` small buckets may go through the ``naive`` algorithm (via group
rank 0), which sends more from rank 0 and less from the others. At world size 1 nothing
is communicated and the result is bitwise that of the plain optimizer.

Every function that communicates is a collective (every rank of ``group`` must call it)
and blocks on the other ranks for at most the group's timeout. With a ``tracer`` every
reduce-scatter and all-gather is recorded as a ``comm`` span from launch to completion, and
each backward as a ``backward`` span from its first parameter gradient to its end (so
``plait.trace.overlap_report`` sees what stage 2 hides).
"""

import warnings

from plait.strategies.zero.guard import GuardedGrad, ShardedGradientError
from plait.strategies.zero.optimizer import ZeroOptimizer
from plait.strategies.zero.partition import (
    PartitionBucket,
    Piece,
    describe_partition,
    partition,
    reduction_buckets,
    shard_bounds,
)
from plait.strategies.zero.prepare import ZERO_OPTIONS, prepare_zero

__all__ = [
    "ZERO_OPTIONS",
    "PartitionBucket",
    "Piece",
    "GuardedGrad",
    "ShardedGradientError",
    "ZeroOptimizer",
    "describe_partition",
    "partition",
    "prepare_zero",
    "reduction_buckets",
    "shard_bounds",
]

_RENAMED = {"Bucket": "PartitionBucket", "ShardedGrad": "GuardedGrad"}


def __getattr__(name: str) -> object:
    """The earlier names of two classes (they clashed with DDP's ``Bucket`` and FSDP's
    ``ShardGrad``), kept for one release with a ``DeprecationWarning``."""
    if name in _RENAMED:
        warnings.warn(
            f"plait.strategies.zero.{name} is deprecated; use {_RENAMED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'plait.strategies.zero' has no attribute {name!r}")
