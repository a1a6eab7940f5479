"""Debug mode: every rank checks a collective's signature before any data moves.

Enabled by ``PLAIT_DEBUG=1`` or ``plait.init(debug=True)``. Each rank writes the signature
of the collective it is about to run (collective, algorithm, op, shape, dtype, root and
the sequence number) to the rendezvous store under ``plait/debug/<group>/<seq>/<rank>``,
waits for every rank of the group to do the same, and compares. If any differ, every rank
raises :class:`CollectiveMismatch` naming the ranks that disagree with the majority and
what each of them passed, instead of exchanging mismatched buffers. A rank that never
writes is named by a :class:`CollectiveTimeout`. It costs a few store round trips per
collective; leave it off for speed.
"""

from __future__ import annotations

import datetime
from collections import Counter
from typing import TYPE_CHECKING

from plait.comm import progress
from plait.comm.errors import CollectiveMismatch, CollectiveTimeout

if TYPE_CHECKING:
    from plait.comm.group import Call


def _key(group_name: str, seq: int, rank: int) -> str:
    return f"plait/debug/{group_name}/{seq}/{rank}"


def check_signature(call: Call, signature: str) -> None:
    """Compare ``signature`` across the group; raise on every rank if they differ.

    Blocks until every rank of the group reaches this collective, at most the group's
    timeout.
    """
    group = call.group
    store = progress.store()
    if store is None:
        raise RuntimeError(
            "debug mode needs the rendezvous store address: set MASTER_ADDR and MASTER_PORT "
            "(plait.init and plait.spawn do)"
        )
    me = group.global_rank
    mine = f"{call.collective} seq={call.seq} {signature}"
    store.set(_key(group.name, call.seq, me), mine)
    if call.seq > 2:  # everyone finished reading seq-2 before writing seq-1
        store.delete_key(_key(group.name, call.seq - 2, me))
    keys = [_key(group.name, call.seq, r) for r in group.ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=group.timeout))
    except Exception as exc:  # the store raises its own timeout type
        missing = [r for r, k in zip(group.ranks, keys, strict=True) if not store.check([k])]
        raise CollectiveTimeout(
            f"{call.describe()}: rank {me} waited {group.timeout:g}s for the other ranks to "
            f"reach this collective. Ranks that did not arrive at #{call.seq}: {missing}. "
            f"{progress.describe(group)}Every rank of the group must call the same "
            f"collectives in the same order.",
            missing,
        ) from exc
    theirs = {r: store.get(k).decode() for r, k in zip(group.ranks, keys, strict=True)}
    counts = Counter(theirs.values())
    if len(counts) == 1:
        return
    (majority, top), (_, second) = counts.most_common(2)
    if top == second:  # no majority: every rank is part of the disagreement
        disagreeing = sorted(theirs)
    else:
        disagreeing = sorted(r for r, s in theirs.items() if s != majority)
    details = "; ".join(f"rank {r}: {theirs[r]}" for r in disagreeing)
    raise CollectiveMismatch(
        f"{call.describe()}: ranks {disagreeing} disagree with the rest of the group. "
        f"Most ranks called: {majority}. Disagreeing: {details}. Make every rank pass the "
        f"same collective, op, shape, dtype and root, in the same order.",
        disagreeing,
    )
