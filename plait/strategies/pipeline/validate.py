"""Check a schedule without processes; every refusal names the rank, the action and the rule.

Rules:

1. ``placement`` gives each of the ``p * v`` stages one rank in ``0..p-1``; a rank runs
   actions only on stages it holds.
2. Every stage forwards every micro-batch ``0..m-1`` exactly once and backwards it exactly
   once: one ``B``, or one ``I`` and one ``W`` (never both forms for one micro-batch).
3. On its rank, a micro-batch's ``F`` comes before its ``B``/``I``, and ``I`` before ``W``.
4. Every tensor that crosses ranks has exactly one send (after the action producing it,
   on the producing rank) and one receive (before the action reading it, on the reading
   rank); neighbouring stages on the same rank exchange nothing.
5. No deadlock: playing the schedule (sends never block, a reader waits for its message)
   finishes. A compute-only schedule is checked as :func:`~.schedules.add_comms` lowers it.
"""

from __future__ import annotations

from collections import Counter

from plait.strategies.pipeline.actions import Action, Kind, Schedule, ScheduleError
from plait.strategies.pipeline.simulate import Costs, Stuck, run


def validate(sched: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first broken rule; return None if valid."""
    p, m, n = sched.p, sched.m, sched.stages
    if len(sched.ranks) != p:
        raise ScheduleError(f"{sched.name}: {len(sched.ranks)} action lists for p={p} ranks")
    if len(sched.placement) != n:
        raise ScheduleError(
            f"{sched.name}: placement lists {len(sched.placement)} stages, but p*v = {n}"
        )
    for s, r in enumerate(sched.placement):
        if not 0 <= r < p:
            raise ScheduleError(f"{sched.name}: stage {s} is placed on rank {r}, not in 0..{p - 1}")
    if not any(a.kind.is_comm for acts in sched.ranks for a in acts):
        from plait.strategies.pipeline.schedules import (
            add_comms,  # deferred: schedules imports this
        )

        sched = add_comms(sched)
    _check_ownership(sched)
    _check_counts(sched)
    _check_order(sched)
    _check_comms(sched)
    _check_fifo(sched)
    try:
        run(sched, Costs())
    except Stuck as stuck:
        lines = [
            f"rank {r} at step {i} ({a}) waits for {what}"
            for r, (i, a, what) in sorted(stuck.waits.items())
        ]
        raise ScheduleError(
            f"{sched.name}: deadlock (no rank can make progress): " + "; ".join(lines)
        ) from None
    del m


def _check_ownership(sched: Schedule) -> None:
    for r, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            if not 0 <= a.stage < sched.stages:
                raise ScheduleError(
                    f"{sched.name}: rank {r} step {i} ({a}): stage {a.stage} does not exist "
                    f"(stages 0..{sched.stages - 1})"
                )
            if sched.placement[a.stage] != r:
                raise ScheduleError(
                    f"{sched.name}: rank {r} step {i} ({a}): stage {a.stage} is on rank "
                    f"{sched.placement[a.stage]}, not on rank {r}"
                )
            if not 0 <= a.mb < sched.m:
                raise ScheduleError(
                    f"{sched.name}: rank {r} step {i} ({a}): micro-batch {a.mb} is not in "
                    f"0..{sched.m - 1}"
                )


def _check_counts(sched: Schedule) -> None:
    count = Counter(a for acts in sched.ranks for a in acts if a.kind.is_compute)
    for s in range(sched.stages):
        r = sched.placement[s]
        for mb in range(sched.m):
            f, b = count[Action(Kind.F, s, mb)], count[Action(Kind.B, s, mb)]
            i, w = count[Action(Kind.I, s, mb)], count[Action(Kind.W, s, mb)]
            if f != 1:
                raise ScheduleError(
                    f"{sched.name}: rank {r} forwards micro-batch {mb} on stage {s} {f} times; "
                    f"every micro-batch must be forwarded exactly once per stage"
                )
            if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                raise ScheduleError(
                    f"{sched.name}: rank {r}, stage {s}, micro-batch {mb}: B x{b}, I x{i}, "
                    f"W x{w}; the backward must run exactly once, as one B or as one I and "
                    f"one W"
                )


def _check_order(sched: Schedule) -> None:
    for r, acts in enumerate(sched.ranks):
        seen: set[Action] = set()
        for i, a in enumerate(acts):
            need = None
            if a.kind in (Kind.B, Kind.I):
                need = Action(Kind.F, a.stage, a.mb)
            elif a.kind is Kind.W:
                need = Action(Kind.I, a.stage, a.mb)
            if need is not None and need not in seen:
                raise ScheduleError(
                    f"{sched.name}: rank {r} step {i} ({a}) runs before {need}; "
                    f"{'a backward needs its forward' if a.kind is not Kind.W else 'W needs I'}"
                    f" first on the same rank"
                )
            seen.add(a)


def _check_fifo(sched: Schedule) -> None:
    """Receives from a peer are posted in the order that peer sends (rule 4: a pair's
    messages are delivered in order, so an out-of-order receive could wait forever
    behind a send whose receive is posted only later)."""
    place = sched.placement
    sent: dict[tuple[int, int], list[Action]] = {}
    for q, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind is Kind.SEND_F:
                recv = Action(Kind.RECV_F, a.stage + 1, a.mb)
            elif a.kind is Kind.SEND_B:
                recv = Action(Kind.RECV_B, a.stage - 1, a.mb)
            else:
                continue
            sent.setdefault((q, place[recv.stage]), []).append(recv)
    for r, acts in enumerate(sched.ranks):
        got: dict[int, list[Action]] = {}
        for a in acts:
            if a.kind is Kind.RECV_F:
                got.setdefault(place[a.stage - 1], []).append(a)
            elif a.kind is Kind.RECV_B:
                got.setdefault(place[a.stage + 1], []).append(a)
        for q, order in got.items():
            want = sent.get((q, r), [])
            if order != want:
                i = next(i for i, (x, y) in enumerate(zip(order, want, strict=False)) if x != y)
                raise ScheduleError(
                    f"{sched.name}: rank {r} posts {order[i]} where rank {q} sends the "
                    f"tensor of {want[i]} next; post receives from a peer in the order it "
                    f"sends (messages between two ranks are delivered in order)"
                )


def _check_comms(sched: Schedule) -> None:
    place, last = sched.placement, sched.stages - 1
    for r, acts in enumerate(sched.ranks):
        seen: Counter[Action] = Counter()
        for i, a in enumerate(acts):
            where = f"{sched.name}: rank {r} step {i} ({a})"
            if a.kind is Kind.SEND_F or a.kind is Kind.SEND_B:
                fwd = a.kind is Kind.SEND_F
                peer_stage = a.stage + 1 if fwd else a.stage - 1
                if not 0 <= peer_stage <= last:
                    raise ScheduleError(f"{where}: there is no stage {peer_stage} to send to")
                if place[peer_stage] == r:
                    raise ScheduleError(
                        f"{where}: stage {peer_stage} is on this rank too; neighbouring "
                        f"stages on one rank hand over locally, without a send"
                    )
                producer = Action(Kind.F, a.stage, a.mb) if fwd else None
                made = (
                    producer in seen
                    if producer
                    else (
                        Action(Kind.B, a.stage, a.mb) in seen
                        or Action(Kind.I, a.stage, a.mb) in seen
                    )
                )
                if not made:
                    raise ScheduleError(
                        f"{where}: sends a tensor before the action that computes it"
                    )
                want = Action(Kind.RECV_F if fwd else Kind.RECV_B, peer_stage, a.mb)
                n = sum(1 for x in sched.ranks[place[peer_stage]] if x == want)
                if n != 1:
                    raise ScheduleError(
                        f"{where}: needs exactly one matching {want} on rank "
                        f"{place[peer_stage]}, found {n}"
                    )
            elif a.kind in (Kind.F, Kind.B, Kind.I):
                fwd = a.kind is Kind.F
                src = a.stage - 1 if fwd else a.stage + 1
                if 0 <= src <= last and place[src] != r:
                    want = Action(Kind.RECV_F if fwd else Kind.RECV_B, a.stage, a.mb)
                    if seen[want] != 1:
                        raise ScheduleError(
                            f"{where}: reads a tensor from rank {place[src]} but {want} is "
                            f"not posted before it on this rank"
                        )
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                fwd = a.kind is Kind.RECV_F
                src = a.stage - 1 if fwd else a.stage + 1
                if not 0 <= src <= last or place[src] == r:
                    raise ScheduleError(
                        f"{where}: there is no stage on another rank to receive from"
                    )
                want = Action(Kind.SEND_F if fwd else Kind.SEND_B, src, a.mb)
                n = sum(1 for x in sched.ranks[place[src]] if x == want)
                if n != 1 or seen[a]:
                    raise ScheduleError(
                        f"{where}: needs exactly one matching {want} on rank {place[src]} "
                        f"(found {n}) and one receive here"
                    )
            seen[a] += 1
