"""Wrap-time check that every rank of a tensor-parallel group holds the same dense model.

:func:`~plait.strategies.tensor.parallelize` slices the dense weights each rank built: rank
r keeps rows ``[r n/t, (r+1) n/t)`` of its own copy. If one rank was seeded differently
(or loaded another checkpoint), the slices come from different models and training runs
on a model that exists nowhere, without an error. Before slicing, :func:`check_agreement`
compares, across the group:

1. the structure: every parameter's ``name (shape) dtype`` and the plan's lines, through
   :func:`plait.strategies.consistency.verify_same_parameters` (SHA-256 digests through the
   rendezvous store; the lists only when they differ);
2. the values: a fingerprint of every parameter, its float64 sum and sum of squares, one
   all-gather of ``2 n`` float64 numbers over the group (``n`` parameters).

A disagreement raises the same ``ValueError`` on every rank, naming the ranks, the first
parameter that differs and both fingerprints, before any training collective.
Collective over ``group`` (blocks up to its timeout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.comm import ops
from plait.comm.device import control_device
from plait.comm.group import Group
from plait.strategies.consistency import verify_same_parameters

# relative difference of two fingerprints above which the tensors differ: the same tensor
# summed on two CPUs may round differently (~1e-16), differently seeded weights differ ~1
_RTOL = 1e-9


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """``(sum, sum of squares)`` of ``t`` in float64."""
    x = t.detach().to(torch.float64)
    return float(x.sum()), float((x * x).sum())


def _differ(a: torch.Tensor, b: torch.Tensor, numel: int) -> bool:
    """Fingerprints ``[sum, sumsq]`` a and b come from different tensors of ``numel``."""
    scale = float(max(a[1], b[1])) + 1e-300
    if abs(float(a[1] - b[1])) > _RTOL * scale:
        return True
    # |sum| <= sqrt(numel * sumsq): the sum's own scale
    return abs(float(a[0] - b[0])) > _RTOL * (numel * scale) ** 0.5


def check_agreement(
    named: Sequence[tuple[str, torch.Tensor]],
    plan_lines: Sequence[str],
    group: Group,
    *,
    who: str = "tensor parallelism",
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks hold the same
    parameters (names, shapes, dtypes, values by fingerprint) and the same plan (module
    doc). A group of one rank is not checked. Collective over ``group``."""
    if group.size == 1:
        return
    plan_entries = [(f"plan {line}", torch.empty(0)) for line in plan_lines]
    verify_same_parameters([*named, *plan_entries], group, who=who)
    if any(p.is_meta for _, p in named):
        return  # a model on the meta device holds no values to compare
    values = [fingerprint(p) for _, p in named] or [(0.0, 0.0)]
    where = control_device((p for _, p in named), group)  # NCCL: the GPU
    mine = torch.tensor(values, dtype=torch.float64, device=where)
    every = torch.empty((group.size, *mine.shape), dtype=torch.float64, device=where)
    ops.all_gather(every, mine, group=group)
    for i, (name, p) in enumerate(named):
        for r in range(1, group.size):
            if _differ(every[0, i], every[r, i], p.numel()):
                a, b = every[0, i].tolist(), every[r, i].tolist()
                raise ValueError(
                    f"{who}: parameter {name!r} differs across the tensor-parallel group "
                    f"{group.name!r} before it is split: rank {group.ranks[0]} has sum "
                    f"{a[0]!r}, sum of squares {a[1]!r}; rank {group.ranks[r]} has sum "
                    f"{b[0]!r}, sum of squares {b[1]!r}. Every rank must build the same dense "
                    f"model: seed it identically (torch.manual_seed(...) before building it) "
                    f"or load the same weights on every rank"
                )
