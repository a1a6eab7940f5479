"""Play a schedule forward in time: makespan, idle time per rank, bubble, memory.

Each rank runs its list in order, one action at a time. A compute action starts when the
rank is free and its input exists: a forward needs the previous stage's activation (sent,
plus ``comm`` seconds of transfer, and a receive posted on this rank), a backward the next
stage's gradient; sends and receive postings take no time (they run asynchronously), and
``gap`` seconds pass after every compute action (the runtime's own overhead, idle time).
Costs are per action kind (``Costs(f=1, b=2, i=1, w=1)``, the unit costs of the bubble
formulas) or measured per (kind, stage) (``Costs.measured(...)``).

The bubble is the share of ``p x makespan`` in which ranks were idle. The in-flight count
of a stage is the number of micro-batches whose forward ran and whose backward (B, or W
when split) has not: what the stage holds in activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from plait.strategies.pipeline.actions import Action, Kind, Schedule


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) per action. ``per_stage`` overrides by ``(kind, stage)``."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    gap: float = 0.0  # a rank's time between two compute actions (Python, posting messages)
    per_stage: Mapping[tuple[str, int], float] = field(default_factory=dict)

    def of(self, a: Action) -> float:
        k = a.kind.value
        if (k, a.stage) in self.per_stage:
            return self.per_stage[(k, a.stage)]
        return {"F": self.f, "B": self.b, "I": self.i, "W": self.w}.get(k, 0.0)

    @staticmethod
    def per_chunk(v: int, *, comm: float = 0.0) -> Costs:
        """Unit costs of a whole stage (F=1, B=2, I=W=1) cut into ``v`` chunks."""
        return Costs(f=1 / v, b=2 / v, i=1 / v, w=1 / v, comm=comm)


@dataclass(frozen=True)
class Slot:
    """One compute action as simulated (or measured): rank, action, start and end."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found. ``bubble`` = idle / (p * makespan)."""

    schedule: str
    p: int
    m: int
    v: int
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble: float
    peak_in_flight: dict[int, int]  # stage -> micro-batches held at most
    peak_per_rank: tuple[int, ...]  # rank -> (stage, micro-batch) pairs held at most at once
    slots: tuple[Slot, ...]

    def describe(self) -> str:
        idle = ", ".join(f"{x:.3g}" for x in self.idle)
        return (
            f"{self.schedule} p={self.p} m={self.m} v={self.v}: makespan {self.makespan:.4g}, "
            f"bubble {100 * self.bubble:.1f}%, idle per rank [{idle}], "
            f"peak in-flight per stage {self.peak_in_flight}"
        )


class Stuck(Exception):
    """The schedule cannot make progress; ``waits`` says on what each blocked rank waits."""

    def __init__(self, waits: dict[int, tuple[int, Action, str]]) -> None:
        super().__init__(waits)
        self.waits = waits


def _needs(sched: Schedule, rank: int, a: Action) -> tuple[Action | None, Action | None]:
    """(message this compute action reads, local action it reads) for ``a`` on ``rank``."""
    place, last = sched.placement, sched.stages - 1
    if a.kind is Kind.F and a.stage > 0:
        if place[a.stage - 1] == rank:
            return None, Action(Kind.F, a.stage - 1, a.mb)
        return Action(Kind.SEND_F, a.stage - 1, a.mb), None
    if a.kind in (Kind.B, Kind.I) and a.stage < last:
        if place[a.stage + 1] == rank:
            return None, _backward_of(sched, a.stage + 1, a.mb)
        return Action(Kind.SEND_B, a.stage + 1, a.mb), None
    return None, None


def _backward_of(sched: Schedule, stage: int, mb: int) -> Action:
    kind = Kind.I if sched.split_backward else Kind.B
    return Action(kind, stage, mb)


def run(sched: Schedule, costs: Costs) -> list[Slot]:
    """Execute ``sched`` in simulated time; raises :class:`Stuck` on a deadlock."""
    p = sched.p
    pos = [0] * p
    clock = [0.0] * p
    sent: dict[Action, float] = {}  # SEND action -> time its data arrives
    done: dict[tuple[int, Action], float] = {}  # (rank, compute action) -> end
    posted: set[tuple[int, Action]] = set()
    slots: list[Slot] = []
    while True:
        progress = False
        for r in range(p):
            acts = sched.ranks[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent[a] = clock[r] + costs.comm
                elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                    posted.add((r, a))
                else:
                    msg, local = _needs(sched, r, a)
                    start = clock[r]
                    if msg is not None:
                        if msg not in sent:
                            break
                        start = max(start, sent[msg])
                    if local is not None:
                        if (r, local) not in done:
                            break
                        start = max(start, done[(r, local)])
                    end = start + costs.of(a)
                    done[(r, a)] = end
                    clock[r] = end + costs.gap
                    slots.append(Slot(r, a, start, end))
                pos[r] += 1
                progress = True
        if all(pos[r] == len(sched.ranks[r]) for r in range(p)):
            return slots
        if not progress:
            waits = {}
            for r in range(p):
                if pos[r] < len(sched.ranks[r]):
                    a = sched.ranks[r][pos[r]]
                    msg, local = _needs(sched, r, a)
                    if msg is not None and msg not in sent:
                        src = sched.placement[msg.stage]
                        waits[r] = (pos[r], a, f"{msg} from rank {src}")
                    else:
                        waits[r] = (pos[r], a, f"{local} on this rank")
            raise Stuck(waits)


def simulate(sched: Schedule, costs: Costs | None = None) -> Simulation:
    """Time ``sched`` with ``costs`` (default: unit costs F=1, B=2, I=W=1)."""
    slots = run(sched, costs or Costs())
    makespan = max((s.end for s in slots), default=0.0)
    busy = [0.0] * sched.p
    for s in slots:
        busy[s.rank] += s.end - s.start
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (sched.p * makespan) if makespan else 0.0
    return Simulation(
        sched.name,
        sched.p,
        sched.m,
        sched.v,
        makespan,
        tuple(busy),
        idle,
        bubble,
        peak_in_flight(sched),
        peak_per_rank(sched),
        tuple(slots),
    )


def peak_in_flight(sched: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches forwarded and not yet fully backwarded."""
    split = sched.split_backward
    peak: dict[int, int] = {}
    for acts in sched.ranks:
        held: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
            elif a.kind is (Kind.W if split else Kind.B):
                held[a.stage] -= 1
    return dict(sorted(peak.items()))


def peak_per_rank(sched: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activations held at once over its stages."""
    split = sched.split_backward
    out = []
    for acts in sched.ranks:
        held = peak = 0
        for a in acts:
            if a.kind is Kind.F:
                held += 1
                peak = max(peak, held)
            elif a.kind is (Kind.W if split else Kind.B):
                held -= 1
        out.append(peak)
    return tuple(out)


def formula_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction under unit costs (F=1, B=2, I=W=1 per whole stage).

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(v m + p-1). ZB-H1: idle time per
    rank (p-1)F, a third of 1F1B's (p-1)(F+B), so (p-1)/(3m+p-1) of the time. ZBV: 0 after
    the fill (the fill itself is returned by the simulator, not by a formula).
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "zbv":
        return 0.0
    raise ValueError(f"no bubble formula for schedule {name!r}")
