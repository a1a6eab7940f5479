"""Ranks agreeing on a checkpoint: exchange small JSON documents over the group.

Communication: :func:`gather_json` is two ``all_gather`` calls on ``group`` (the lengths
as one int64 per rank, then the UTF-8 JSON bytes, uneven blocks); every rank gets every
rank's document. Collective: every rank of ``group`` must call it, in the same order;
it blocks for at most the group's timeout, and a dead peer makes it raise on the others
(a ``CollectiveError`` naming the group). ``group=None`` is a single process: no
communication.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from plait import comm
from plait.comm.group import Group

SAME_ARGS = "every rank must call the same function (save or load) with the same root and step"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, agreed on, verified or loaded."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The ranks of the group passed different arguments (root, step) or hold different
    state where they must agree."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated or does not match its recorded SHA-256."""


def resolve(group: Group | None) -> Group | None:
    """``group``, else the world after ``plait.init``, else None (one process)."""
    return group if group is not None else comm.world_or_none()


def rank_of(group: Group | None) -> int:
    return 0 if group is None else group.rank


def size_of(group: Group | None) -> int:
    return 1 if group is None else group.size


def gather_json(obj: Any, group: Group | None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in group-rank order, on every rank. Collective."""
    data = json.dumps(obj, sort_keys=True).encode()
    if group is None or group.size == 1:
        return [json.loads(data)]
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = torch.empty(group.size, dtype=torch.int64)
    comm.all_gather(lengths, length, group=group)
    blocks = [torch.empty(int(n), dtype=torch.uint8) for n in lengths.tolist()]
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    comm.all_gather(blocks, mine, group=group)
    return [json.loads(bytes(b.numpy().tobytes())) for b in blocks]


def require_same(who: str, what: str, values: list[Any], *, hint: str) -> None:
    """Raise :class:`CheckpointMismatch` (on every rank: all hold the same ``values``)
    naming each rank whose value differs from rank 0's."""
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if not differing:
        return
    shown = "; ".join(f"rank {r} has {values[r]!r}" for r in differing[:4])
    more = f" (and {len(differing) - 4} more ranks)" if len(differing) > 4 else ""
    raise CheckpointMismatch(
        f"{who}: the ranks disagree on {what}: rank 0 has {values[0]!r}; {shown}{more}. {hint}"
    )


def raise_failures(who: str, statuses: list[dict[str, Any]], *, kind: type[Exception]) -> None:
    """Raise ``kind`` on every rank if any rank's status holds an ``error``, naming them."""
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s.get("error")]
    if not failed:
        return
    lines = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
    raise kind(f"{who}: failed on rank(s) {[r for r, _ in failed]}: {lines}")
