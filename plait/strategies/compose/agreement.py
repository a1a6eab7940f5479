"""Before any group carries a tensor, every rank of a PTD-P mesh agrees on its settings,
its model's structure and its dense weights (:func:`check_agreement`), through the
rendezvous store: three digests per rank, the lists only on a mismatch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from plait.strategies.consistency import agree, describe_parameters, fingerprint_lines


def describe_plan(plan: Any) -> Any:
    """A tensor-parallel plan as text every rank writes alike (for the agreement)."""
    if isinstance(plan, Mapping):
        return sorted((k, repr(v)) for k, v in plan.items())
    return repr(plan)


def check_agreement(model: nn.Module, settings: Mapping[str, Any], mesh: Any) -> None:
    """Before any group carries a tensor: every rank of the mesh has the same settings,
    the same model structure and the same dense weights (replicas must start equal: a
    rank seeded differently would train a different model silently). One error on every
    rank naming the ranks, the setting or parameter and both values. Collective over the
    mesh's ranks, through the rendezvous store (three digests per rank; the lists only on
    a mismatch)."""
    ranks = list(mesh.layout.ranks)
    tag = getattr(mesh, "tag", "")  # a mesh of a healing replica: its incarnation
    timeout = mesh.group(mesh.names[0]).timeout
    common = {"ranks": ranks, "me": mesh.global_rank, "timeout": timeout, "who": "ptdp"}
    agree(
        [f"{k}: {v}" for k, v in settings.items()],
        label=f"ptdp-settings{tag}{ranks}",
        what="setting",
        problem="the ranks were given different settings",
        advice="Every rank must call compose / prepare(strategy='ptdp') with the same mesh, "
        "schedule, micro-batches, chunks, ZeRO stage and plan.",
        **common,
    )
    agree(
        describe_parameters(model.named_parameters()),
        label=f"ptdp-structure{tag}{ranks}",
        what="parameter",
        problem="the ranks built different models",
        advice="Every rank must build the same model (same modules, order, shapes, dtypes).",
        **common,
    )
    agree(
        fingerprint_lines(model.state_dict().items()),
        label=f"ptdp-weights{tag}{ranks}",
        what="tensor",
        problem="the ranks' models start from different weights",
        advice="Build the model with the same seed on every rank (torch.manual_seed before "
        "constructing it), or load the same checkpoint on every rank, before composing.",
        **common,
    )
