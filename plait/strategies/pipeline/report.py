"""The bubble, measured: the runtime's tracer spans beside the simulator and the formula.

With a :class:`~plait.trace.Tracer` the runtime records one span per compute action
(``F``, ``B``, ``I``, ``W`` with its stage and micro-batch) and one per wait on a
neighbour (stream ``comm``). From the spans of every rank for one step:

* measured bubble = 1 - (sum of compute time over ranks) / (p x step window), the window
  running from the first action's start to the last one's end on any rank;
* simulated bubble = the same schedule in :func:`~.simulate.simulate` with the measured
  mean cost of each (kind, stage) and no transfer time;
* the formula of the schedule (:func:`~.simulate.formula_bubble`), which assumes equal
  stages and F : B : I : W = 1 : 2 : 1 : 1;
* the measured idle time split into waiting on a neighbour's message (``wait`` spans:
  the bubble itself plus transfers) and the rest (Python between actions, posting
  messages, processes competing for cores);
* the simulator once more with the measured mean time between two actions of a rank
  (outside waits) added after every action: what the schedule's bubble is once the
  runtime's own overhead is counted;
* a replay: the simulator with each action's *own* measured time (not the mean of its
  kind and stage), each rank's own mean time between actions, and the measured latency of
  a message (median, over the actions that waited for one, of the time from the end of the
  action producing it to the start of the reader). What the replay does not explain
  (``measured - replayed``) is time nobody's dependencies account for: a rank that lost
  its core longer than its mean gap (ranks time-sliced on fewer cores than ranks, other
  processes), which the simulator cannot know; ``replayed - simulated`` is the variation
  of action times from one micro-batch to the next that the mean smooths away;
* with ``cores=c`` (fewer cores than ranks): the simulator with ranks sharing ``c`` cores
  (:mod:`.cores`), from each (kind, stage)'s mean *work* (its measured time weighted by the
  share of a core it had), plus the mean gap: a prediction that knows the ranks are
  time-sliced, which the one-core-per-rank simulator does not.

Ranks of one host share the clock (``perf_counter_ns``), so the window is exact there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from plait.strategies.pipeline.actions import Action, Kind, Schedule
from plait.strategies.pipeline.cores import run_on_cores, work_of
from plait.strategies.pipeline.simulate import Costs, Slot, formula_bubble, simulate
from plait.trace import Span

_COMPUTE = {"F", "B", "I", "W"}


def slots_from_spans(spans: Iterable[Span], *, origin_ns: int | None = None) -> list[Slot]:
    """Compute spans as :class:`Slot` s in seconds from ``origin_ns`` (default: the first)."""
    chosen = [s for s in spans if s.name in _COMPUTE and s.stream == "compute"]
    if not chosen:
        return []
    t0 = min(s.start_ns for s in chosen) if origin_ns is None else origin_ns
    return [
        Slot(
            s.rank,
            Action(Kind(s.name), int(s.args["stage"]), int(s.args["mb"])),  # type: ignore[call-overload]
            (s.start_ns - t0) / 1e9,
            (s.end_ns - t0) / 1e9,
        )
        for s in chosen
    ]


def measured_costs(slots: Sequence[Slot]) -> Costs:
    """Mean seconds of each (kind, stage) in ``slots``."""
    total: dict[tuple[str, int], list[float]] = {}
    for s in slots:
        total.setdefault((s.action.kind.value, s.action.stage), []).append(s.end - s.start)
    return Costs(per_stage={k: sum(v) / len(v) for k, v in total.items()})


@dataclass(frozen=True)
class BubbleReport:
    """Measured, simulated (with measured costs) and formula bubble of one step."""

    schedule: str
    p: int
    m: int
    v: int
    step_seconds: float
    measured: float
    simulated: float
    simulated_seconds: float
    formula: float
    costs: Costs
    waiting: float = 0.0  # share of p x window spent waiting on a neighbour's message
    gap_seconds: float = 0.0  # mean time between two compute actions of a rank, not waiting
    simulated_with_gap: float = 0.0  # the simulator's bubble with that gap after each action
    replayed: float = 0.0  # each action's own time, each rank's gap, message latency
    latency_seconds: float = 0.0  # measured: producer's end -> reader's start, when it waited
    cores: float | None = None  # cores the ranks shared, when fewer than ranks
    simulated_on_cores: float | None = None  # mean work on shared cores, plus the mean gap

    @property
    def other(self) -> float:
        """Idle share that is neither simulated bubble nor waiting on messages beyond it:
        Python between actions, posting messages, the processes competing for cores."""
        return self.measured - self.waiting

    def describe(self) -> str:
        return (
            f"{self.schedule} p={self.p} m={self.m} v={self.v}: step "
            f"{1e3 * self.step_seconds:.1f} ms "
            f"(simulated {1e3 * self.simulated_seconds:.1f} ms), bubble measured "
            f"{100 * self.measured:.1f}%, simulated {100 * self.simulated:.1f}%, formula "
            f"{100 * self.formula:.1f}% (waiting on messages {100 * self.waiting:.1f}%, "
            f"between actions {100 * self.other:.1f}%); with {1e3 * self.gap_seconds:.2f} ms "
            f"between actions the simulator gives {100 * self.simulated_with_gap:.1f}%; "
            f"replayed (each action's own time, each rank's gap, "
            f"{1e3 * self.latency_seconds:.2f} ms per message) {100 * self.replayed:.1f}%"
            + (
                f"; on {self.cores:g} shared cores the simulator gives "
                f"{100 * self.simulated_on_cores:.1f}%"
                if self.simulated_on_cores is not None and self.cores is not None
                else ""
            )
        )


def bubble_report(
    schedule: Schedule, spans: Iterable[Span], *, cores: float | None = None
) -> BubbleReport:
    """The report for one step from the spans of all ranks (gather them first). ``cores``:
    the cores the ranks shared (``os.cpu_count()`` on one host); with fewer cores than
    ranks the report adds the shared-cores simulation."""
    spans_list = list(spans)
    slots = slots_from_spans(spans_list)
    if not slots:
        raise ValueError("bubble_report: no compute spans; pass tracer= to the pipeline")
    window = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    measured = 1.0 - busy / (schedule.p * window) if window > 0 else 0.0
    costs = measured_costs(slots)
    sim = simulate(schedule, costs)
    origin = min(s.start_ns for s in spans_list if s.name in _COMPUTE and s.stream == "compute")
    waited = sum(
        max(0.0, min(s.end_ns - origin, window * 1e9) - max(s.start_ns - origin, 0)) / 1e9
        for s in spans_list
        if s.stream == "comm" and s.name == "wait"
    )
    gaps = _gaps(slots, spans_list, origin)
    every = [g for per in gaps.values() for g in per]
    gap = sum(every) / len(every) if every else 0.0
    with_gap = simulate(schedule, replace(costs, gap=gap))
    latency = _latency(schedule, slots)
    replayed = simulate(
        schedule,
        replace(
            costs,
            per_action={x.action: x.end - x.start for x in slots},
            per_rank_gap={r: sum(g) / len(g) for r, g in gaps.items() if g},
            comm=latency,
        ),
    )
    on_cores = None
    if cores is not None and cores < schedule.p:
        work = work_of(slots, cores)
        per: dict[tuple[str, int], list[float]] = {}
        for x, w in work.items():
            per.setdefault((x.action.kind.value, x.action.stage), []).append(w)
        mean_work = Costs(per_stage={k: sum(v) / len(v) for k, v in per.items()}, gap=gap)
        on_cores = _bubble(schedule.p, run_on_cores(schedule, mean_work, cores))
    return BubbleReport(
        schedule.name,
        schedule.p,
        schedule.m,
        schedule.v,
        window,
        measured,
        sim.bubble,
        sim.makespan,
        formula_bubble(schedule.name, schedule.p, schedule.m, schedule.v),
        costs,
        waited / (schedule.p * window) if window > 0 else 0.0,
        gap,
        with_gap.bubble,
        replayed.bubble,
        latency,
        cores if on_cores is not None else None,
        on_cores,
    )


def _bubble(p: int, slots: Sequence[Slot]) -> float:
    """Idle share of ``p`` ranks over the span of ``slots``."""
    window = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return 1.0 - busy / (p * window) if window > 0 else 0.0


def _gaps(slots: Sequence[Slot], spans: Sequence[Span], origin_ns: int) -> dict[int, list[float]]:
    """Per rank, the times between consecutive compute actions that are not waits."""
    waits: dict[int, list[tuple[float, float]]] = {}
    for s in spans:
        if s.stream == "comm" and s.name == "wait":
            waits.setdefault(s.rank, []).append(
                ((s.start_ns - origin_ns) / 1e9, (s.end_ns - origin_ns) / 1e9)
            )
    gaps: dict[int, list[float]] = {}
    by_rank: dict[int, list[Slot]] = {}
    for slot in slots:
        by_rank.setdefault(slot.rank, []).append(slot)
    for r, mine in by_rank.items():
        mine.sort(key=lambda x: x.start)
        for a, b in zip(mine, mine[1:], strict=False):
            idle = b.start - a.end
            waited = sum(max(0.0, min(e, b.start) - max(st, a.end)) for st, e in waits.get(r, []))
            gaps.setdefault(r, []).append(max(0.0, idle - waited))
    return gaps


def _latency(schedule: Schedule, slots: Sequence[Slot]) -> float:
    """Median time from the end of a message's producer to the start of its reader, over
    the readers that waited for it (whose rank was done with its previous action first)."""
    end = {(x.rank, x.action): x.end for x in slots}
    split = {(x.action.stage, x.action.mb) for x in slots if x.action.kind is Kind.I}
    place, last = schedule.placement, schedule.stages - 1
    by_rank: dict[int, list[Slot]] = {}
    for x in slots:
        by_rank.setdefault(x.rank, []).append(x)
    lags = []
    for r, mine in by_rank.items():
        mine.sort(key=lambda x: x.start)
        for prev, x in zip(mine, mine[1:], strict=False):
            a = x.action
            if a.kind is Kind.F and a.stage > 0:
                src = Action(Kind.F, a.stage - 1, a.mb)
            elif a.kind in (Kind.B, Kind.I) and a.stage < last:
                kind = Kind.I if (a.stage + 1, a.mb) in split else Kind.B
                src = Action(kind, a.stage + 1, a.mb)
            else:
                continue
            q = place[src.stage]
            if q == r or (q, src) not in end:
                continue
            if end[(q, src)] > prev.end:  # it waited for the message
                lags.append(max(0.0, x.start - end[(q, src)]))
    if not lags:
        return 0.0
    lags.sort()
    return lags[len(lags) // 2]
