"""Enumerate the layouts of a job on a cluster, keep those that fit, rank them by time.

Every factorisation ``world = dp * tp * cp * pp * ep`` (``tp`` dividing the heads, ``pp *
v`` the layers, ``ep`` the experts, ``cp`` the sequence: context parallelism with ring
attention or Ulysses, :data:`SearchSpace.contexts`) is crossed with the micro-batch size,
the schedule and its chunks, the ZeRO stage, recomputation and sequence parallelism of
:class:`SearchSpace`.
A layout :func:`plait.plan.layout.check` refuses is counted with its reason; the others
are evaluated (:func:`evaluate`: model states, activations, step time) and those whose
memory per rank fits the device (``Cluster.usable_memory``) are ranked by predicted step
time, fastest first; ties go to less memory. Memory per rank is the model states, the
saved activations and the communication buffers (:mod:`plait.plan.buffers`), each rank's
own summed; a layout's is its largest rank's.

No rule of thumb is built in: PTD-P's "tp inside a node, pp across nodes" must come out of
the costs (``benchmarks/plan_validate.py`` checks that it does on the 1T / 3072-GPU case).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from plait.plan.activations import ActivationMemory, rank_activations
from plait.plan.buffers import buffer_bytes
from plait.plan.hardware import Cluster
from plait.plan.layout import Job, Layout, LayoutError, check
from plait.plan.model import RECOMPUTE, ModelSpec
from plait.plan.states import ModelStates, rank_states
from plait.plan.time import Overlap, StepTime, step_time


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which values of each choice the search tries (``None``: every divisor that fits)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    contexts: tuple[str, ...] = ("ring", "ulysses")  # cp's attention, when cp > 1
    microbatch: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    chunks: tuple[int, ...] = (2, 3, 4)  # v for "interleaved" ("zbv", "dualpipev" always 2)
    zero: tuple[int, ...] = (0, 1)
    recompute: tuple[str, ...] = RECOMPUTE
    sp: tuple[bool, ...] = (False, True)
    tp_modes: tuple[str, ...] = ("1d",)


@dataclass(frozen=True)
class Plan:
    """One layout, evaluated: memory per rank and predicted step time. ``memory_bytes`` is
    the largest rank's (pipeline rank ``rank``): its own model states, activations and
    communication buffers, which ``states`` and ``activations`` are."""

    layout: Layout
    states: ModelStates
    activations: ActivationMemory
    memory_bytes: float
    usable_bytes: float
    time: StepTime
    buffers: float = 0.0  # communication buffers (plait.plan.buffers), in memory_bytes
    rank: int = 0  # the pipeline rank of memory_bytes (states and activations are its own)

    @property
    def headroom(self) -> float:
        """Usable bytes left on the largest rank (negative: short by that much)."""
        return self.usable_bytes - self.memory_bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


@dataclass(frozen=True)
class SearchResult:
    """The ranked feasible plans, the fastest that do not fit, and what was refused."""

    model: ModelSpec
    job: Job
    cluster: Cluster
    plans: tuple[Plan, ...]  # fit, fastest first
    too_big: tuple[Plan, ...]  # do not fit, fastest first (at most 20 kept)
    refused: int
    refusals: tuple[str, ...] = field(default=())  # distinct reasons, at most 20

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans else None


def evaluate(
    model: ModelSpec,
    job: Job,
    layout: Layout,
    cluster: Cluster,
    *,
    overlap: Overlap | None = None,
    simulate_bubble: bool = False,
) -> Plan:
    """Memory and time of one layout; :class:`LayoutError` if it cannot run."""
    check(model, job, layout, world=cluster.devices)
    states = rank_states(model, job, layout)
    acts = rank_activations(model, job, layout)
    t = step_time(model, job, layout, cluster, overlap=overlap, simulate_bubble=simulate_bubble)
    buffers = buffer_bytes(model, job, layout)
    # each pipeline rank's own parts; the plan's memory is the rank whose sum is largest
    totals = [st.total_bytes + ac.total + buffers for st, ac in zip(states, acts, strict=True)]
    r = max(range(len(totals)), key=totals.__getitem__)
    return Plan(layout, states[r], acts[r], totals[r], cluster.usable_memory, t, buffers, rank=r)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelSpec, job: Job, world: int, space: SearchSpace) -> Iterator[Layout]:
    """Every combination of ``space`` on ``world`` ranks (unchecked)."""
    for tp, cp, pp, ep in _degrees(model, world, space):
        dp = world // (tp * cp * pp * ep)
        for context, (mode, depth), (sched, v) in itertools.product(
            space.contexts if cp > 1 else ("ring",),
            _tp_modes(tp, space),
            _schedules(pp, space),
        ):
            for sp, zero, b, rc in itertools.product(
                space.sp if (tp > 1 and mode == "1d") else (False,),
                space.zero if dp * ep * cp > 1 else (0,),
                space.microbatch,
                space.recompute,
            ):
                if rc == "selective" and job.flash_attention:
                    continue  # fused attention: what it recomputes
                yield Layout(
                    dp=dp,
                    tp=tp,
                    cp=cp,
                    pp=pp,
                    ep=ep,
                    v=v,
                    schedule=sched,
                    microbatch=b,
                    zero=zero,
                    recompute=rc,
                    sp=sp,
                    tp_mode=mode,
                    depth=depth,
                    context=context,
                )


def _degrees(
    model: ModelSpec, world: int, space: SearchSpace
) -> Iterator[tuple[int, int, int, int]]:
    """``(tp, cp, pp, ep)`` of ``space`` whose product divides ``world`` (dp the rest)."""

    def pick(given: tuple[int, ...] | None, n: int) -> list[int]:
        return [d for d in divisors(n) if given is None or d in given]

    for tp in pick(space.tp, world):
        for cp in pick(space.cp, world // tp):
            for pp in pick(space.pp, world // (tp * cp)):
                for ep in pick(space.ep, world // (tp * cp * pp)):
                    dp = world // (tp * cp * pp * ep)
                    if space.dp is not None and dp not in space.dp:
                        continue
                    if ep > 1 and not model.experts:
                        continue
                    yield tp, cp, pp, ep


def _tp_modes(tp: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(mode, depth) pairs for ``tp`` ranks: 2.5D at every depth >= 2 leaving a square."""
    if tp == 1:
        return [("1d", 1)]
    out: list[tuple[str, int]] = []
    for mode in space.tp_modes:
        if mode == "2.5d":
            out.extend(
                (mode, d)
                for d in divisors(tp)
                if d >= 2 and tp // d >= 4 and math.isqrt(tp // d) ** 2 == tp // d
            )
        else:
            out.append((mode, 1))
    return out


def _schedules(pp: int, space: SearchSpace) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)]
    out: list[tuple[str, int]] = []
    for s in space.schedules:
        if s == "interleaved":
            out.extend((s, v) for v in space.chunks if v >= 2)
        elif s in ("zbv", "dualpipev"):
            out.append((s, 2))
        else:
            out.append((s, 1))
    return out


def search(
    model: ModelSpec,
    job: Job,
    cluster: Cluster,
    *,
    space: SearchSpace | None = None,
    overlap: Overlap | None = None,
) -> SearchResult:
    """Every layout of ``space`` on ``cluster``, ranked (module doc)."""
    space = space or SearchSpace()
    fit: list[Plan] = []
    big: list[Plan] = []
    refused = 0
    reasons: list[str] = []
    for lay in layouts(model, job, cluster.devices, space):
        try:
            plan = evaluate(model, job, lay, cluster, overlap=overlap)
        except LayoutError as e:
            refused += 1
            if len(reasons) < 20 and str(e) not in reasons:
                reasons.append(str(e))
            continue
        (fit if plan.fits else big).append(plan)

    def key(p: Plan) -> tuple[float, float]:
        return (p.time.total, p.memory_bytes)

    fit.sort(key=key)
    big.sort(key=key)
    return SearchResult(model, job, cluster, tuple(fit), tuple(big[:20]), refused, tuple(reasons))


__all__ = ["Plan", "SearchResult", "SearchSpace", "divisors", "evaluate", "layouts", "search"]
