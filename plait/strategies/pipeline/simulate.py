"""Play a schedule forward in time: makespan, idle time per rank, bubble, memory.

Each rank runs its list in order, one action at a time. A compute action starts when the
rank is free and its input exists: a forward needs the previous stage's activation (sent,
plus ``comm`` seconds of transfer, and a receive posted on this rank), a backward the next
stage's gradient; sends and receive postings take no time (they run asynchronously), and
``gap`` seconds pass after every compute action (the runtime's own overhead, idle time).
Costs are per action kind (``Costs(f=1, b=2, i=1, w=1)``, the unit costs of the bubble
formulas) or measured: per (kind, stage) (``per_stage``: the mean of a step) or per action
(``per_action``: each action's own measured time, a replay of the step, which keeps the
variation from one micro-batch to the next that a mean smooths away), and per rank the
time between two of its actions (``gap``, or ``per_rank_gap``) and the latency of a
message (``comm``).

F&B pairs (DualPipe, ``Schedule.pairs``): by default a pair is what plait's runtime runs,
the forward then the backward, each starting when its own input is there. With
``Costs(pair=x)`` a pair is one unit, as DualPipe runs it on a GPU: it starts when both
inputs are there and takes ``x (F + B)`` (``x = 1``: nothing overlapped; ``x < 1``: the
share the overlap saves). Ranks sharing fewer cores than there are ranks:
:func:`~.cores.run_on_cores`.

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
    """Seconds (or units) per action: by kind, overridden by ``(kind, stage)`` in
    ``per_stage``, overridden by the action itself in ``per_action``."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    gap: float = 0.0  # a rank's time between two compute actions (Python, posting messages)
    per_stage: Mapping[tuple[str, int], float] = field(default_factory=dict)
    pair: float | None = None  # F&B pairs as one unit taking pair * (F + B); None: apart
    per_action: Mapping[Action, float] = field(default_factory=dict)
    per_rank_gap: Mapping[int, float] = field(default_factory=dict)  # overrides gap per rank

    def of(self, a: Action) -> float:
        if a in self.per_action:
            return self.per_action[a]
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


def _needs(
    sched: Schedule, rank: int, a: Action, split: set[tuple[int, int]]
) -> tuple[Action | None, Action | None]:
    """(message this compute action reads, local action it reads) for ``a`` on ``rank``;
    ``split`` holds the (stage, micro-batch) pairs whose backward is split into I and W."""
    place, last = sched.placement, sched.stages - 1
    if a.kind is Kind.F and a.stage > 0:
        if place[a.stage - 1] == rank:
            return None, Action(Kind.F, a.stage - 1, a.mb)
        return Action(Kind.SEND_F, a.stage - 1, a.mb), None
    if a.kind in (Kind.B, Kind.I) and a.stage < last:
        if place[a.stage + 1] == rank:
            kind = Kind.I if (a.stage + 1, a.mb) in split else Kind.B
            return None, Action(kind, a.stage + 1, a.mb)
        return Action(Kind.SEND_B, a.stage + 1, a.mb), None
    return None, None


def _split(sched: Schedule) -> set[tuple[int, int]]:
    """(stage, micro-batch) pairs backwarded as I + W (a schedule may mix them with B)."""
    return {(a.stage, a.mb) for acts in sched.ranks for a in acts if a.kind is Kind.I}


def run(sched: Schedule, costs: Costs) -> list[Slot]:
    """Execute ``sched`` in simulated time; raises :class:`Stuck` on a deadlock."""
    p = sched.p
    split = _split(sched)
    compute = [[a for a in acts if a.kind.is_compute] for acts in sched.ranks]
    opens = [sched.paired(r) if costs.pair is not None else set() for r in range(p)]
    pos = [0] * p
    nth = [0] * p  # compute actions done per rank
    clock = [0.0] * p
    scale = [1.0] * p  # cost factor of the next compute action (pair * ... inside a pair)
    sent: dict[Action, float] = {}  # SEND action -> time its data arrives
    done: dict[tuple[int, Action], float] = {}  # (rank, compute action) -> end
    posted: set[tuple[int, Action]] = set()
    slots: list[Slot] = []

    def ready(r: int, a: Action) -> float | None:
        """When ``a``'s inputs are there on rank ``r`` (None: not yet known)."""
        msg, local = _needs(sched, r, a, split)
        t = 0.0
        if msg is not None:
            if msg not in sent:
                return None
            t = sent[msg]
        if local is not None:
            if (r, local) not in done:
                return None
            t = max(t, done[(r, local)])
        return t

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
                    t = ready(r, a)
                    if t is None:
                        break
                    start = max(clock[r], t)
                    if nth[r] in opens[r]:  # a pair: both inputs first, then pair * (F + B)
                        b = compute[r][nth[r] + 1]
                        tb = ready(r, b)
                        if tb is None:
                            break
                        start = max(start, tb)
                        assert costs.pair is not None
                        scale[r] = costs.pair
                    end = start + scale[r] * costs.of(a)
                    done[(r, a)] = end
                    # inside a pair, the backward follows at once (no gap) at the same scale
                    inside = nth[r] in opens[r]
                    clock[r] = end + (0.0 if inside else costs.per_rank_gap.get(r, costs.gap))
                    if not inside:
                        scale[r] = 1.0
                    nth[r] += 1
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
                    msg, local = _needs(sched, r, a, split)
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
    """Per stage, the most micro-batches forwarded and not yet fully backwarded (B, or
    W when split)."""
    peak: dict[int, int] = {}
    for acts in sched.ranks:
        held: dict[int, int] = {}
        for a in acts:
            if a.kind is Kind.F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                held[a.stage] -= 1
    return dict(sorted(peak.items()))


def peak_per_rank(sched: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activations held at once over its stages."""
    out = []
    for acts in sched.ranks:
        held = peak = 0
        for a in acts:
            if a.kind is Kind.F:
                held += 1
                peak = max(peak, held)
            elif a.kind in (Kind.B, Kind.W):
                held -= 1
        out.append(peak)
    return tuple(out)


def formula_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction under unit costs (F=1, B=2, I=W=1 per whole stage).

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(v m + p-1). ZB-H1: idle time per
    rank (p-1)F, a third of 1F1B's (p-1)(F+B), so (p-1)/(3m+p-1) of the time. ZBV: 0 after
    the fill (the fill itself is returned by the simulator, not by a formula). DualPipeV:
    the DualPipe README's (PP/2-1)(F&B+B-3W) per rank with PP = 2p chunks of F = 1/2,
    B = 1, W = 1/2 and F&B = F + B: (p-1) idle beside 3m busy, (p-1)/(3m+p-1) (plait's
    runtime, running a pair's halves apart, idles half that: :mod:`.dualpipe`).
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "zbv":
        return 0.0
    if name == "dualpipev":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"no bubble formula for schedule {name!r}")
