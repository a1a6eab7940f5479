"""PTD-P in reproducible mode (``compose(..., reproducible=True)``): dp x pp with tp = 1,
bitwise the same parameters as one process running the ``M = dp * microbatches``
micro-batches on the fixed tree (:mod:`plait.strategies.reproducible`).

Why the bits match, line by line:

1. Replica ``d`` of ``dp`` takes rows ``d*B/dp ... (d+1)*B/dp - 1`` of the global batch
   and its pipeline cuts them into ``microbatches`` contiguous micro-batches: it holds
   micro-batches ``d*M/dp ... (d+1)*M/dp - 1``, one whole subtree of the tree over all
   ``M`` (the DDP layout of ``ReproducibleRunner.block``).
2. Its pipeline is built with ``reproducible=True``: each stage parameter's micro-batch
   gradients are added along that subtree whatever the schedule, each loss divided by the
   local count ``M/dp``.
3. :func:`tree_average` adds the replicas' subtree sums with
   :func:`~plait.strategies.reproducible.tree_all_reduce` (the top ``log2 dp`` levels, in
   dp-rank order), then divides by ``dp``. Both divisors are powers of two, so
   ``(g / (M/dp)) / dp`` has exactly the bits of ``g / M``: the gradient of one process.

What cannot keep that order is refused by :func:`check_reproducible`, naming it.
No communication beyond the one tree-ordered all-reduce over dp per optimizer step.
"""

from __future__ import annotations

import torch

from plait.comm.group import Group
from plait.strategies.reproducible import LayoutError, tree_all_reduce
from plait.strategies.reproducible.tree import is_power_of_two


def check_reproducible(
    *,
    pp: int,
    dp: int,
    tp: int,
    ep: int,
    microbatches: int,
    zero: int,
    moe: bool,
    scaler: bool,
    reduction: str,
    tied: str | None = None,
) -> None:
    """Refuse a PTD-P layout whose sums cannot follow the fixed tree (before any group
    carries a tensor). Pure: testable without processes."""
    where = f"ptdp(reproducible=True) on Mesh(pp={pp}, dp={dp}, tp={tp})"
    if tp > 1:
        raise ValueError(
            f"{where}: tp={tp} is refused: tensor parallelism splits each matmul's "
            f"reduction over ranks, so its bits change with the tp size; use tp=1"
        )
    if moe or ep > 1:
        raise ValueError(
            f"{where}: MoE blocks are refused: which tokens share an expert's matmul (and "
            f"its capacity) changes with the micro-batch and ep layout; use dense MLPs"
        )
    if zero:
        raise ValueError(
            f"{where}: zero={zero} is refused: the ZeRO optimizer reduce-scatters in its "
            f"own order; use zero=0 (a tree-ordered all-reduce over dp)"
        )
    if scaler:
        raise ValueError(
            f"{where}: a loss scaler is refused: its skipped steps and changing scale are "
            f"not part of the tree; train without scaler="
        )
    if reduction != "mean":
        raise ValueError(
            f"{where}: the pipeline plan's loss has reduction={reduction!r} (a count of "
            f"loss items over the global batch, not a power of two); the mode needs a loss "
            f"that is the mean over each micro-batch (reduction='mean')"
        )
    if tied is not None and pp > 1:
        raise ValueError(
            f"{where}: a tied parameter ({tied}, such as a tied embedding and head) sits on "
            f"two stages: each sums its share on its own tree and the two are added after, "
            f"another order than one process's per-micro-batch sum; untie it "
            f"(GPTConfig(tied=False), tie_word_embeddings=False) or use pp=1"
        )
    if not is_power_of_two(dp) or not is_power_of_two(microbatches):
        raise LayoutError(
            f"{where}: microbatches={microbatches} per replica and dp={dp} must be powers "
            f"of two, so that each replica's block of micro-batches is one whole subtree of "
            f"the tree over M = dp * microbatches = {dp * microbatches}"
        )


@torch.no_grad()
def tree_average(flat: torch.Tensor, *, group: Group, algorithm: str) -> None:
    """``flat`` (1-D, contiguous: this replica's subtree sums) becomes, in place, the sum
    over the dp replicas added in dp-rank order along the tree, divided by ``dp`` (a power
    of two: exact). Collective over ``group`` (one tree-ordered all-reduce, the bytes of a
    ring all-reduce); blocks on its ranks (the group's timeout)."""
    tree_all_reduce(flat, group=group, algorithm=algorithm)
    flat.div_(group.size)
