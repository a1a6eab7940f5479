"""The schedule families, each a function ``(p, m, v) -> Schedule``.

GPipe, 1F1B and interleaved 1F1B are written out by their rules (warm-up counts, then
one forward / one backward); the zero-bubble ones (ZB-H1, ZBV) come from a small list
scheduler (:func:`_greedy`) that plays the pipeline forward in time with unit costs and
at every free moment picks by a fixed priority: backward-for-input first (the previous
stage waits for it), then a forward while the stage holds fewer micro-batches than its
memory limit, then a deferred weight gradient to fill the gap. All of them return compute
actions; :func:`add_comms` then inserts the sends and receives: each send right after the
action that produced the tensor, each receive one compute action before the one that
reads it (so the buffer is posted while the previous action runs).

============  ===========================  =================================================
schedule      constraint                   bubble (equal F, B = 2F; I = W = F when split)
============  ===========================  =================================================
gpipe         v = 1                        (p-1)/(m+p-1), holds m micro-batches
1f1b          v = 1                        (p-1)/(m+p-1), holds at most p
interleaved   v >= 2, m % p == 0           (p-1)/(v*m+p-1)
zb-h1         v = 1                        idle (p-1)*F per rank: a third of 1F1B's 3(p-1)F
zbv           v = 2 (V placement)          the fill only
dualpipev     v = 2 (V placement), m >= 2p  (p-1)(F&B + B - 3W) per rank (:mod:`.dualpipe`)
============  ===========================  =================================================
"""

from __future__ import annotations

from collections.abc import Callable

from plait.strategies.pipeline.actions import (
    Action,
    B,
    F,
    I,
    Kind,
    Schedule,
    ScheduleError,
    W,
)
from plait.strategies.pipeline.validate import validate

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


def loop_placement(p: int, v: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % p``: rank ``r`` holds ``r, r + p, r + 2p, ...``."""
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """The V: rank ``r`` holds stages ``r`` and ``2p - 1 - r`` (first and last on rank 0)."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _check(name: str, p: int, m: int, v: int) -> None:
    if p < 1:
        raise ScheduleError(f"{name}: p={p} ranks; need at least 1")
    if m < 1:
        raise ScheduleError(f"{name}: microbatches={m}; need at least 1")
    if v < 1:
        raise ScheduleError(f"{name}: chunks={v}; need at least 1")


def _need_v1(name: str, v: int) -> None:
    if v != 1:
        raise ScheduleError(
            f"{name}: chunks={v}, but {name} runs one stage per rank (chunks=1); use "
            f"'interleaved' (chunks >= 2) or 'zbv' (chunks = 2) for several"
        )


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """Every forward, then every backward (fill, drain)."""
    _check("gpipe", p, m, v)
    _need_v1("gpipe", v)
    ranks = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return Schedule("gpipe", p, m, 1, loop_placement(p, 1), tuple(map(tuple, ranks)))


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-flush: ``p - r - 1`` warm-up forwards, then one forward / one backward,
    then the remaining backwards. Rank ``r`` never holds more than ``p - r`` micro-batches."""
    _check("1f1b", p, m, v)
    _need_v1("1f1b", v)
    ranks = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [F(r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [F(r, warm + i), B(r, i)]
        acts += [B(r, i) for i in range(m - warm, m)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, loop_placement(p, 1), tuple(ranks))


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: rank ``r`` holds stages ``r, r + p, ...``; micro-batches
    go through a rank's chunks in groups of ``p``, so ``m`` must be a multiple of ``p``.

    The k-th forward of a rank is chunk ``(k // p) % v`` of micro-batch
    ``(k // (p v)) p + k % p``; backwards visit the chunks in reverse. Warm-up:
    ``2 (p - r - 1) + (v - 1) p`` forwards, then one forward / one backward.
    """
    _check("interleaved", p, m, v)
    if v < 2:
        raise ScheduleError(
            f"interleaved: chunks={v}; interleaving needs chunks >= 2 per rank "
            f"(with one chunk use '1f1b')"
        )
    if m % p:
        raise ScheduleError(
            f"interleaved: microbatches={m} is not a multiple of p={p} ranks; micro-batches "
            f"pass each rank's chunks in groups of p, so use a multiple of {p}"
        )
    total = m * v

    def fwd(k: int, r: int) -> Action:
        chunk = (k // p) % v
        return F(chunk * p + r, (k // (p * v)) * p + k % p)

    def bwd(k: int, r: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return B(chunk * p + r, (k // (p * v)) * p + k % p)

    ranks = []
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [fwd(k, r) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k, r), bwd(k, r)]
        acts += [bwd(k, r) for k in range(total - warm, total)]
        ranks.append(tuple(acts))
    return Schedule("interleaved", p, m, v, loop_placement(p, v), tuple(ranks))


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into I and W.

    Rank ``r`` runs 1F1B's order with I in place of B (``p - r - 1`` warm-up forwards, then
    F, I pairs), but keeps up to ``r`` weight gradients W deferred: the later ranks, whose
    I the earlier ones wait for, push their W's out of the way, and everyone's W's fill the
    cool-down. A rank then holds at most ``p`` micro-batches (forwarded, W not done), 1F1B's
    peak. With F = I = W and ``m >= p`` each rank idles ``(p - 1) F``: a third of 1F1B's
    ``(p - 1)(F + B)``.
    """
    _check("zb-h1", p, m, v)
    _need_v1("zb-h1", v)
    ranks = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [F(r, i) for i in range(warm)]
        w_next = 0  # the oldest micro-batch whose W is still deferred
        for k in range(m - warm):
            acts += [F(r, warm + k), I(r, k)]
            if k >= r:
                acts.append(W(r, w_next))
                w_next += 1
        for k in range(m - warm, m):
            acts.append(I(r, k))
            if k >= r:
                acts.append(W(r, w_next))
                w_next += 1
        acts += [W(r, j) for j in range(w_next, m)]
        ranks.append(tuple(acts))
    return Schedule("zb-h1", p, m, 1, loop_placement(p, 1), tuple(ranks))


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZBV: two chunks per rank in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``),
    backward split into I and W, a memory limit of ``2p`` chunk-micro-batches per rank
    (what 1F1B's first rank holds in whole stages)."""
    _check("zbv", p, m, v)
    if v != 2:
        raise ScheduleError(
            f"zbv: chunks={v}; the V shape needs exactly 2 chunks per rank (chunks=2)"
        )
    placement = v_placement(p)
    ranks = _greedy(p, m, placement, limit=lambda r: 2 * p)
    return Schedule("zbv", p, m, 2, placement, ranks)


def _greedy(
    p: int, m: int, placement: tuple[int, ...], *, limit: Callable[[int], int]
) -> tuple[tuple[Action, ...], ...]:
    """List-schedule F, I and W with unit costs (no communication time).

    A rank free at time ``t`` runs, in this priority: the ready ``I`` of the lowest
    micro-batch (deepest stage first); a ready ``F`` (deepest stage first) if its held
    micro-batches are under ``limit(rank)``; the oldest pending ``W``. Held = forwarded,
    weight gradient not yet done.
    """
    n_stages = len(placement)
    last = n_stages - 1
    done: dict[Action, float] = {}  # action -> end time
    free = [0.0] * p
    held = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    todo = {r: 3 * m * placement.count(r) for r in range(p)}
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    next_f = {s: 0 for s in range(n_stages)}  # next micro-batch to forward, per stage
    next_i = {s: 0 for s in range(n_stages)}

    def ready_at(a: Action) -> float | None:
        """When ``a``'s inputs exist (None: not yet scheduled)."""
        if a.kind is Kind.F:
            dep = None if a.stage == 0 else F(a.stage - 1, a.mb)
            own = None
        else:  # I
            dep = None if a.stage == last else I(a.stage + 1, a.mb)
            own = F(a.stage, a.mb)
        times = []
        for d in (dep, own):
            if d is None:
                continue
            if d not in done:
                return None
            times.append(done[d])
        return max(times, default=0.0)

    def _pick(r: int, t: float) -> Action | None:
        mine = [s for s in range(n_stages) if placement[s] == r]
        cands_i = [I(s, next_i[s]) for s in mine if next_i[s] < next_f[s]]
        cands_f = [F(s, next_f[s]) for s in mine if next_f[s] < m]
        ready_i = [a for a in cands_i if (rt := ready_at(a)) is not None and rt <= t]
        ready_f = [a for a in cands_f if (rt := ready_at(a)) is not None and rt <= t]
        if ready_i:
            return min(ready_i, key=lambda a: (a.mb, -a.stage))
        if ready_f and held[r] < limit(r):
            return min(ready_f, key=lambda a: (a.mb, -a.stage))
        if pending_w[r]:
            return pending_w[r].pop(0)
        return None

    while any(todo.values()):
        t = min(free[x] for x in range(p) if todo[x])
        blocked = []
        for r in range(p):
            if not todo[r] or free[r] > t:
                continue
            choice = _pick(r, t)
            if choice is None:
                blocked.append(r)
                continue
            done[choice] = t + 1.0
            free[r] = t + 1.0
            orders[r].append(choice)
            todo[r] -= 1
            if choice.kind is Kind.F:
                next_f[choice.stage] += 1
                held[r] += 1
            elif choice.kind is Kind.I:
                next_i[choice.stage] += 1
                pending_w[r].append(W(choice.stage, choice.mb))
            else:
                held[r] -= 1
        if blocked:
            later = [e for e in done.values() if e > t] + [f for f in free if f > t]
            if not later:
                r = blocked[0]
                raise ScheduleError(
                    f"rank {r} can make no progress at time {t:g} (holds {held[r]} "
                    f"micro-batches, limit {limit(r)}): the memory limit is too small"
                )
            for r in blocked:
                free[r] = min(later)
    return tuple(tuple(o) for o in orders)


def add_comms(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule.

    A send follows the action that produced the tensor. A receive is posted before the
    compute action preceding its reader (before the reader itself when that is the rank's
    first action), and receives from one peer are posted in the order that peer sends:
    the transport delivers a pair's messages in order, so a send whose receive is not
    posted yet would hold up every later message to that rank (head-of-line blocking);
    a receive that is needed later is therefore posted early when an earlier-needed
    message comes after it. Neighbouring stages on one rank (the tip of a V) hand over
    locally, without messages.
    """
    place = schedule.placement
    last = schedule.stages - 1
    with_sends: list[list[Action]] = []
    for r in range(schedule.p):
        acts: list[Action] = []
        for a in schedule.ranks[r]:
            if not a.kind.is_compute:
                continue
            acts.append(a)
            if a.kind is Kind.F and a.stage < last and place[a.stage + 1] != r:
                acts.append(Action(Kind.SEND_F, a.stage, a.mb))
            elif a.kind in (Kind.B, Kind.I) and a.stage > 0 and place[a.stage - 1] != r:
                acts.append(Action(Kind.SEND_B, a.stage, a.mb))
        with_sends.append(acts)
    # per (sender, receiver): the receives, in the sender's order
    incoming: dict[tuple[int, int], list[Action]] = {}
    for q, acts in enumerate(with_sends):
        for a in acts:
            if a.kind is Kind.SEND_F:
                recv = Action(Kind.RECV_F, a.stage + 1, a.mb)
            elif a.kind is Kind.SEND_B:
                recv = Action(Kind.RECV_B, a.stage - 1, a.mb)
            else:
                continue
            incoming.setdefault((q, place[recv.stage]), []).append(recv)
    out: list[list[Action]] = []
    for r in range(schedule.p):
        compute = [a for a in with_sends[r] if a.kind.is_compute]
        posted: dict[int, int] = {}  # sender -> receives posted so far
        before: dict[int, list[Action]] = {}  # compute index -> receives to post first
        for i, a in enumerate(compute):
            if a.kind is Kind.F and a.stage > 0 and place[a.stage - 1] != r:
                need, src = Action(Kind.RECV_F, a.stage, a.mb), place[a.stage - 1]
            elif a.kind in (Kind.B, Kind.I) and a.stage < last and place[a.stage + 1] != r:
                need, src = Action(Kind.RECV_B, a.stage, a.mb), place[a.stage + 1]
            else:
                continue
            order = incoming[(src, r)]
            k = order.index(need)
            start = posted.get(src, 0)
            if k >= start:
                before.setdefault(max(i - 1, 0), []).extend(order[start : k + 1])
                posted[src] = k + 1
        acts = []
        ci = 0
        for a in with_sends[r]:
            if a.kind.is_compute:
                acts += before.get(ci, [])
                ci += 1
            acts.append(a)
        out.append(acts)
    return schedule.with_ranks(out)


def _dualpipev(p: int, m: int, v: int) -> Schedule:
    from plait.strategies.pipeline.dualpipe import dualpipev  # deferred: dualpipe imports this

    return dualpipev(p, m, v)


_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zbv": zbv,
    "dualpipev": _dualpipev,
}


def default_chunks(name: str) -> int:
    """Chunks per rank a schedule uses when none is given."""
    return 2 if name in ("interleaved", "zbv", "dualpipev") else 1


def build(name: str, *, p: int, m: int, v: int | None = None, comms: bool = True) -> Schedule:
    """The schedule ``name`` for ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank,
    with sends and receives (``comms=True``), validated."""

    key = name.lower().replace("_", "-")
    key = {
        "zbh1": "zb-h1",
        "zb1p": "zb-h1",
        "1f1b-interleaved": "interleaved",
        "dualpipe-v": "dualpipev",
    }.get(key, key)
    if key not in _BUILDERS:
        raise ScheduleError(f"unknown schedule {name!r}; use one of {list(SCHEDULES)}")
    sched = _BUILDERS[key](p, m, default_chunks(key) if v is None else v)
    if comms:
        sched = add_comms(sched)
    validate(sched)
    return sched
