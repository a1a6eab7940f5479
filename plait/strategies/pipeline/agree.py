"""Wrap-time agreement of the pipeline's settings over the ``pp`` group.

A rank that runs another schedule, another micro-batch count, another number of chunks,
cuts the model elsewhere or built another model posts sends and receives its neighbours
never match: the pipeline deadlocks (or trains on scrambled activations) with nothing
named. Before any message moves, :func:`agree` compares every rank's settings and raises
on every rank, naming the ranks and both values of each setting that differs.

Communication: through the rendezvous store only (no tensor, nothing pickled): each rank
writes its settings as JSON under ``plait/ppagree/<group>/<n>/<rank>`` and waits (at most
the group's timeout) for the others'. Cost: one store write and one read per rank and
peer, at wrap time.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping

from plait.comm import progress
from plait.comm.errors import CollectiveTimeout
from plait.comm.group import Group


class PipelineMismatchError(ValueError):
    """The ranks of a pipeline group disagree on a setting; raised on every rank."""


def agree(settings: Mapping[str, str], group: Group) -> None:
    """Raise :class:`PipelineMismatchError` on every rank of ``group`` unless all ranks
    pass the same ``settings`` (name -> value). Blocks until every rank has published
    (at most the group's timeout; a rank that never does is named in a
    :class:`~plait.comm.errors.CollectiveTimeout`). A group of one rank, or a run without
    a rendezvous store, is not checked."""
    if group.size == 1:
        return
    store = progress.store()
    if store is None:
        return
    count = getattr(group, "_plait_pp_agree", 0)
    group._plait_pp_agree = count + 1  # type: ignore[attr-defined]
    prefix = f"plait/ppagree/{group.name}/{count}"
    store.set(f"{prefix}/{group.global_rank}", json.dumps(dict(settings)))
    keys = [f"{prefix}/{r}" for r in group.ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=group.timeout))
    except Exception as exc:  # the store raises its own timeout type
        missing = [r for r, k in zip(group.ranks, keys, strict=True) if not store.check([k])]
        raise CollectiveTimeout(
            f"pipeline: rank {group.global_rank} waited {group.timeout:g}s for the other "
            f"ranks of group {group.name!r} to build their pipeline; ranks {missing} never "
            f"did. Every rank of the pp group must build it (it is a collective).",
            missing,
        ) from exc
    seen = {r: json.loads(store.get(k).decode()) for r, k in zip(group.ranks, keys, strict=True)}
    first = group.ranks[0]
    problems = []
    for name in seen[first]:
        values = {r: seen[r].get(name, "<missing>") for r in group.ranks}
        for r in group.ranks[1:]:
            if values[r] != values[first]:
                problems.append(
                    f"{name}: rank {first} has {values[first]!r}, rank {r} has {values[r]!r}"
                )
    if problems:
        raise PipelineMismatchError(
            f"pipeline: the ranks of group {group.name!r} disagree, so their messages would "
            f"never match (a deadlock): "
            + "; ".join(problems)
            + ". Every rank of the pp group must pass the same schedule, microbatches, "
            "chunks and split, and build the same model."
        )
