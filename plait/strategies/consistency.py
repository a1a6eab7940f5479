"""Wrap-time check that every rank built the same model.

A data-parallel wrapper pairs rank r's i-th parameter with every other rank's i-th
parameter: if one rank registered its modules in another order, or built another width,
buckets and shards silently mix unrelated tensors ("trains with scrambled weights"). Before
the first byte moves, :func:`verify_same_parameters` compares every rank's list of
``(name, shape, dtype)``.

Communication: each rank writes a SHA-256 digest of its list to the rendezvous store
(``plait/agree/<group>/<n>/digest/<rank>``, 64 bytes) and reads the others'; only when the
digests differ does each rank also publish its whole list, so that every rank can name the
first rank and parameter that differ. No tensor crosses a process boundary and nothing is
pickled. Cost: two store round trips per rank at wrap time.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Sequence
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
    if group.size == 1:
        return
    agree(
        describe_parameters(named),
        ranks=group.ranks,
        me=group.global_rank,
        label=group.name,
        timeout=group.timeout,
        who=who,
        what="parameter",
        problem=f"the ranks of group {group.name!r} built different models",
        advice="Every rank must build the same model (same modules, registered in the same "
        "order, same shapes and dtypes) before wrapping it.",
    )


def fingerprint_lines(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per tensor: its name, shape, dtype and two float64 sums (of the values and
    of their magnitudes) written exactly (``float.hex``): equal lines on two ranks mean,
    short of a collision no seed produces, equal tensors."""
    out = []
    for name, t in named:
        if t.is_meta:  # no values to compare (a model on the meta device)
            out.append(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} meta")
            continue
        x = t.detach().to(torch.float64) if t.is_floating_point() else t.detach().double()
        out.append(
            f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} "
            f"sum={float(x.sum()).hex()} abs={float(x.abs().sum()).hex()}"
        )
    return out


_counts: dict[str, int] = {}


def agree(
    lines: list[str],
    *,
    ranks: Sequence[int],
    me: int,
    label: str,
    timeout: float,
    who: str,
    what: str,
    problem: str,
    advice: str,
) -> None:
    """Raise ``ValueError`` on every rank of ``ranks`` unless all hold the same ``lines``.

    The error names, for each rank that differs from the first, the first differing
    ``what`` (a setting, a parameter, ...) with both ranks' values. Collective over
    ``ranks``, through the rendezvous store (a digest each, the lists only on a mismatch:
    no tensor moves, no process group is needed, so it can run before groups are built);
    every rank must call it with the same ``label`` in the same order. Blocks at most
    ``timeout`` seconds, then names the ranks that never arrived. Without a store (one
    process) nothing is checked.
    """
    store = progress.store()
    if store is None or len(ranks) < 2:
        return
    count = _counts.get(label, 0)
    _counts[label] = count + 1
    prefix = f"plait/agree/{label}/{count}"
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    store.set(f"{prefix}/digest/{me}", digest)
    keys = [f"{prefix}/digest/{r}" for r in ranks]
    _wait(store, keys, ranks, me, label, timeout, who)
    digests = {r: store.get(k).decode() for r, k in zip(ranks, keys, strict=True)}
    if len(set(digests.values())) == 1:
        return
    store.set(f"{prefix}/list/{me}", json.dumps(lines))
    list_keys = [f"{prefix}/list/{r}" for r in ranks]
    _wait(store, list_keys, ranks, me, label, timeout, who)
    lists = {r: json.loads(store.get(k).decode()) for r, k in zip(ranks, list_keys, strict=True)}
    reference = ranks[0]
    problems = []
    for r in ranks[1:]:
        if digests[r] == digests[reference]:
            continue
        i, ref_line, their_line = _first_difference(lists[reference], lists[r])
        problems.append(
            f"rank {r} differs from rank {reference} at {what} #{i}: rank {reference} has "
            f"{ref_line!r}, rank {r} has {their_line!r} ({len(lists[r])} vs "
            f"{len(lists[reference])} {what}s)"
        )
    raise ValueError(f"{who}: {problem}; " + "; ".join(problems) + ". " + advice)


def _wait(
    store: object,
    keys: list[str],
    ranks: Sequence[int],
    me: int,
    label: str,
    timeout: float,
    who: str,
) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))  # type: ignore[attr-defined]
    except Exception as exc:  # the store raises its own timeout type
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]  # type: ignore[attr-defined]
        raise CollectiveTimeout(
            f"{who}: rank {me} waited {timeout:g}s for the other ranks of {label!r} to "
            f"check that they agree; ranks {missing} never did. Every rank must make the "
            f"same call (it is a collective).",
            missing,
        ) from exc
