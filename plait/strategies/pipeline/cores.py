"""Ranks that share fewer cores than there are ranks: a schedule timed under time-slicing.

:func:`~.simulate.run` gives every rank a core of its own. When ``p`` ranks run on ``c < p``
cores (four pipeline ranks on a two-core machine), an action is slower while more than
``c`` ranks compute at once and faster when the others wait: the operating system shares
the cores among the runnable processes (a rank waiting on a message sleeps, it does not
spin for long). :func:`run_on_cores` models that as processor sharing: while ``n`` ranks
compute, each progresses at ``min(1, c / n)`` of its cost per second, so a cost is the
*work* of an action, the time it takes on a core of its own.

:func:`work_of` goes the other way for a measured step: each action's work is the time it
ran, weighted at every moment by the share of a core it had, ``min(1, c / n(t))`` with
``n(t)`` the ranks then computing (from the spans). Their mean per (kind, stage) fed back to
:func:`run_on_cores` predicts the step from costs that no longer carry the accident of
which actions happened to overlap.

Only the ranks of the schedule are counted: other processes on the machine are not seen.
F&B pairs run as two actions here (``Costs(pair=...)`` is not modelled with ``cores``).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.strategies.pipeline.actions import Action, Kind, Schedule
from plait.strategies.pipeline.simulate import Costs, Slot, Stuck, _needs, _split


def run_on_cores(sched: Schedule, costs: Costs, cores: float) -> list[Slot]:
    """Execute ``sched`` with ``cores`` cores shared by the computing ranks (module
    docstring); raises :class:`~.simulate.Stuck` on a deadlock."""
    if cores <= 0:
        raise ValueError(f"cores={cores}; need a positive number of cores")
    p, split = sched.p, _split(sched)
    pos = [0] * p
    free = [0.0] * p  # when the rank may start its next compute action
    running: dict[int, tuple[int, float, float]] = {}  # rank -> (action index, left, start)
    sent: dict[Action, float] = {}
    done: dict[tuple[int, Action], float] = {}
    slots: list[Slot] = []
    t = 0.0

    def advance(r: int) -> None:
        """Take rank ``r``'s sends and receive postings up to its next compute action."""
        acts = sched.ranks[r]
        while pos[r] < len(acts) and not acts[pos[r]].kind.is_compute:
            a = acts[pos[r]]
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sent[a] = free[r] + costs.comm
            pos[r] += 1

    def ready(r: int) -> float | None:
        """When rank ``r`` can start its next compute action (None: not known yet)."""
        if pos[r] == len(sched.ranks[r]):
            return None
        msg, local = _needs(sched, r, sched.ranks[r][pos[r]], split)
        at = free[r]
        if msg is not None:
            if msg not in sent:
                return None
            at = max(at, sent[msg])
        if local is not None:
            if (r, local) not in done:
                return None
            at = max(at, done[(r, local)])
        return at

    while True:
        for r in range(p):
            if r not in running:
                advance(r)
        starts = {}
        for r in range(p):
            if r not in running:
                at = ready(r)
                if at is not None:
                    starts[r] = at
        for r, at in starts.items():
            if at <= t + 1e-12:
                running[r] = (pos[r], costs.of(sched.ranks[r][pos[r]]), t)
        if not running and all(pos[r] == len(sched.ranks[r]) for r in range(p)):
            return slots
        rate = min(1.0, cores / len(running)) if running else 1.0
        events = [t + left / rate for _, left, _ in running.values()]
        events += [at for r, at in starts.items() if r not in running]
        if not events:
            waits = {
                r: (pos[r], sched.ranks[r][pos[r]], "its input")
                for r in range(p)
                if pos[r] < len(sched.ranks[r])
            }
            raise Stuck(waits)
        nxt = min(events)
        for r, (i, left, start) in list(running.items()):
            left -= rate * (nxt - t)
            if left <= 1e-12:
                a = sched.ranks[r][i]
                done[(r, a)] = nxt
                slots.append(Slot(r, a, start, nxt))
                free[r] = nxt + costs.per_rank_gap.get(r, costs.gap)
                pos[r] += 1
                del running[r]
            else:
                running[r] = (i, left, start)
        t = nxt


def work_of(slots: Sequence[Slot], cores: float) -> dict[Slot, float]:
    """Each measured action's work: its time weighted by the share of a core it had,
    ``min(1, cores / n(t))`` with ``n(t)`` the actions running at ``t``."""
    edges = sorted({x for s in slots for x in (s.start, s.end)})
    share = []  # (from, to, share of a core) between consecutive edges
    for a, b in zip(edges, edges[1:], strict=False):
        mid = (a + b) / 2
        n = sum(1 for s in slots if s.start <= mid < s.end)
        share.append((a, b, min(1.0, cores / n) if n else 1.0))
    out = {}
    for s in slots:
        out[s] = sum(
            (min(b, s.end) - max(a, s.start)) * k for a, b, k in share if a < s.end and b > s.start
        )
    return out
