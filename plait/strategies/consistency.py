"""Wrap-time check that every rank built the same model.

A data-parallel wrapper pairs rank r's i-th parameter with every other rank's i-th
parameter: if one rank registered its modules in another order, or built another width,
buckets and shards silently mix unrelated tensors ("trains with scrambled weights"). Before
the first byte moves, :func:`verify_same_parameters` compares every rank's list of
``(name, shape, dtype)``.

Communication: each rank writes a SHA-256 digest of its list to the rendezvous store
(``plait/wrapcheck/<group>/<n>/<rank>``, 64 bytes) and reads the others'; only when the
digests differ does each rank also publish its whole list, so that every rank can name the
first rank and parameter that differ. No tensor crosses a process boundary and nothing is
pickled. Cost: two store round trips per rank at wrap time.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from plait.comm import progress
from plait.comm.errors import CollectiveTimeout

if TYPE_CHECKING:
    from plait.comm.group import Group


def describe_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per parameter: ``name (shape) dtype``, in registration order."""
    return [f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in named]


def _first_difference(mine: list[str], theirs: list[str]) -> tuple[int, str, str]:
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else "<no parameter>"
        b = theirs[i] if i < len(theirs) else "<no parameter>"
        if a != b:
            return i, a, b
    return -1, "", ""  # pragma: no cover - only called when the lists differ


def verify_same_parameters(
    named: Iterable[tuple[str, torch.Tensor]], group: Group, *, who: str
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold the same list.

    Collective: every rank of ``group`` must call it (at wrap time); blocks until all have
    published their digest, at most the group's timeout. ``who`` names the wrapper in the
    message. A group of one rank, or a run without a rendezvous store, is not checked.
    """
    lines = describe_parameters(named)
    if group.size == 1:
        return
    store = progress.store()
    if store is None:
        return
    count = getattr(group, "_plait_wrap_checks", 0)
    group._plait_wrap_checks = count + 1  # type: ignore[attr-defined]
    prefix = f"plait/wrapcheck/{group.name}/{count}"
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    me = group.global_rank
    store.set(f"{prefix}/digest/{me}", digest)
    keys = [f"{prefix}/digest/{r}" for r in group.ranks]
    _wait(store, keys, group, who)
    digests = {r: store.get(k).decode() for r, k in zip(group.ranks, keys, strict=True)}
    if len(set(digests.values())) == 1:
        return
    store.set(f"{prefix}/list/{me}", json.dumps(lines))
    list_keys = [f"{prefix}/list/{r}" for r in group.ranks]
    _wait(store, list_keys, group, who)
    lists = {
        r: json.loads(store.get(k).decode()) for r, k in zip(group.ranks, list_keys, strict=True)
    }
    reference = group.ranks[0]
    problems = []
    for r in group.ranks[1:]:
        if digests[r] == digests[reference]:
            continue
        i, ref_line, their_line = _first_difference(lists[reference], lists[r])
        problems.append(
            f"rank {r} differs from rank {reference} at parameter #{i}: rank {reference} has "
            f"{ref_line!r}, rank {r} has {their_line!r} ({len(lists[r])} vs "
            f"{len(lists[reference])} parameters)"
        )
    raise ValueError(
        f"{who}: the ranks of group {group.name!r} built different models; "
        + "; ".join(problems)
        + ". Every rank must build the same model (same modules, registered in the same "
        "order, same shapes and dtypes) before wrapping it."
    )


def _wait(store: object, keys: list[str], group: Group, who: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=group.timeout))  # type: ignore[attr-defined]
    except Exception as exc:  # the store raises its own timeout type
        missing = [r for r, k in zip(group.ranks, keys, strict=True) if not store.check([k])]  # type: ignore[attr-defined]
        raise CollectiveTimeout(
            f"{who}: rank {group.global_rank} waited {group.timeout:g}s for the other ranks of "
            f"group {group.name!r} to wrap their model; ranks {missing} never did. Every rank "
            f"must wrap the model (it is a collective).",
            missing,
        ) from exc
