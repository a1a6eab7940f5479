"""How a pipeline runs on ranks that share cores, measured for the planner.

When ``n`` ranks share ``c < n`` cores, the operating system shares the cores among the
runnable ranks (processor sharing): a rank waiting in a pipeline's bubble frees its share,
and a rank that has a core to itself runs up to ``n / c`` times faster than with every rank
busy. Played that way alone, a pipeline on this two-core machine came out 15-25% faster
than it ran: each time a rank wakes for a message it pays more than the transfer (a
context switch, caches refilled, a core to win back from ranks mid-action), and plait's
ZB-H1 split backward (I then W) costs more than B. A pipeline with one micro-batch (few
wake-ups, one rank of each pipeline computing at a time) runs close to the plain play.

Two figures, fit per pipeline size ``g`` on a calibration GPT (not the model being
planned; :data:`MODEL`) that :func:`measure_rank` runs through
:func:`plait.strategies.compose.compose` on ``Mesh(pp=g, dp=n/g)``, every pipeline at once:

=============  ================================================================  ==========
figure         probe                                                             charged to
=============  ================================================================  ==========
``wake``       GPipe, 1F1B, interleaved 1F1B, ``m = 2g`` each: the seconds (at   each
               the busy speed) for which :func:`played` (the schedule under      compute
               processor sharing, :func:`~plait.strategies.pipeline.cores.        action that
               run_on_cores`, with that much more work on every compute action    reads a
               that reads a message) ends when the measured step ended            message
               (:func:`fit_wake`), per schedule
``zb_split``   ZB-H1, ``m = 2g``, with 1F1B's wake: the factor on the            B's work,
               backward's work (I + W against B) for which :func:`played`         as I + W
               ends when the measured step ended (:func:`fit_split`)
=============  ================================================================  ==========

Each action's work in :func:`played`: the plain calibration GPT's forward and backward of
one micro-batch with every rank busy (measured in the same rounds), over ``g`` stages,
forward a third and backward two thirds, plus the pipeline runtime's own seconds per
action (``pipe_action`` of :mod:`plait.plan.measure.probe_runtime`) as the planner charges them,
all times the shared share of a core; each message the calibration's ``p2p`` line for the
activation's bytes. The planner plays a layout's schedule the same way
(:func:`plait.plan.costs.shared_cores_path`).

Communication of the probe: per micro-batch and stage boundary an activation forward and
a gradient backward on the ``pp`` group; the compose step's loss all-reduce; barriers and
an all-reduce (max) of the times on the world.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import plait
from plait.models import GPT, GPTConfig
from plait.plan.costs import pipeline_actions, shared_cores_path
from plait.plan.layout import Layout
from plait.plan.measure.probe_runtime import paired
from plait.strategies.compose import compose
from plait.strategies.pipeline.schedules import default_chunks

# the calibration GPT (vocab, layers, heads, width, sequence) and its micro-batch rows
MODEL = (64, 8, 4, 96, 32)
ROWS = 2
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")  # 1F1B first: ZB-H1 uses its wake


def layout(schedule: str, g: int) -> Any:
    """The planner's :class:`~plait.plan.layout.Layout` of a ``g``-stage ``schedule``
    (its default chunks per rank)."""

    return Layout(pp=g, schedule=schedule, v=default_chunks(schedule))


def played(
    schedule: str,
    g: int,
    m: int,
    *,
    busy_mb: float,
    cores: float,
    ranks: int,
    comm: float,
    pipe_action: float = 0.0,
    split: float = 1.0,
    wake: float = 0.0,
) -> float:
    """Seconds ``schedule`` (``g`` stages, ``m`` micro-batches) takes as the planner plays
    it (:func:`plait.plan.costs.shared_cores_path`): a stage's micro-batch ``busy_mb / g``
    (the whole model's forward and backward with every rank busy, over the stages) plus
    ``pipe_action`` per action of the busiest rank, ``split`` the backward's factor when
    cut into I and W, ``comm`` seconds per message, ``wake`` seconds more (with every rank
    busy) on each compute action that reads a message, on the pipeline's share of the
    cores under processor sharing."""

    lay = layout(schedule, g)
    runtime = pipeline_actions(lay, m) * pipe_action
    out = shared_cores_path(
        lay,
        m,
        busy_mb / g + runtime,
        0.0,
        comm,
        runtime=runtime,
        cores=cores,
        ranks=ranks,
        split=split,
        wake=wake,
    )
    if out is None:
        raise ValueError(f"probe_pipeline: {schedule} with p={g}, m={m} is too large to play")
    return out


def _bisect(at: Callable[[float], float], lo: float, hi: float, makespan: float) -> float:
    """The x in [lo, hi] where the increasing ``at(x)`` reaches ``makespan`` (clamped)."""
    if at(lo) >= makespan:
        return lo
    if at(hi) <= makespan:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        if at(mid) < makespan:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _check(g: int, m: int, busy_mb: float, makespan: float, cores: float, ranks: int) -> None:
    if g < 2 or m < 1 or busy_mb <= 0 or makespan <= 0 or cores <= 0 or ranks < g:
        raise ValueError(
            f"probe_pipeline: need g >= 2, m >= 1, ranks >= g and positive times and cores; "
            f"got g={g}, m={m}, ranks={ranks}, busy_mb={busy_mb}, makespan={makespan}, "
            f"cores={cores}"
        )


def fit_wake(
    schedule: str,
    g: int,
    m: int,
    *,
    busy_mb: float,
    makespan: float,
    cores: float,
    ranks: int,
    comm: float,
    pipe_action: float = 0.0,
    most: float = 0.05,
) -> float:
    """The ``wake`` in [0, ``most``] seconds for which ``schedule``'s :func:`played` ends
    at ``makespan`` (the makespan grows with it): 0 when even none is slower than
    measured, ``most`` when that much is still faster."""
    _check(g, m, busy_mb, makespan, cores, ranks)

    def at(wake: float) -> float:
        return played(
            schedule,
            g,
            m,
            busy_mb=busy_mb,
            cores=cores,
            ranks=ranks,
            comm=comm,
            pipe_action=pipe_action,
            wake=wake,
        )

    return _bisect(at, 0.0, most, makespan)


def fit_split(
    g: int,
    m: int,
    *,
    busy_mb: float,
    makespan: float,
    cores: float,
    ranks: int,
    comm: float,
    wake: float,
    pipe_action: float = 0.0,
) -> float:
    """The factor in [1, 3] on the backward's work for which ZB-H1's :func:`played` (with
    ``wake``) ends at ``makespan`` (1 when ZB-H1 ran as fast as an even split predicts,
    or faster)."""
    _check(g, m, busy_mb, makespan, cores, ranks)

    def at(split: float) -> float:
        return played(
            "zb-h1",
            g,
            m,
            busy_mb=busy_mb,
            cores=cores,
            ranks=ranks,
            comm=comm,
            pipe_action=pipe_action,
            split=split,
            wake=wake,
        )

    return _bisect(at, 1.0, 3.0, makespan)


def fit(
    rows: list[dict[str, Any]], *, cores: float, ranks: int, p2p: Any, pipe_action: float
) -> tuple[dict[str, dict[int, float]], dict[int, float]]:
    """``(wake, zb_split)`` from :func:`measure_rank`'s rows: the wake per schedule
    measured (ZB-H1 aside) and pipeline size, ZB's split per pipeline size (with 1F1B's
    wake); each message the ``p2p`` line (a :class:`~plait.plan.measure.calibrate.Line`) for its
    bytes."""
    wake: dict[str, dict[int, float]] = {}
    split: dict[int, float] = {}
    for r in rows:
        g, m = r["g"], r["m"]
        kw: dict[str, Any] = dict(
            busy_mb=r["busy_mb_s"],
            cores=cores,
            ranks=ranks,
            comm=p2p.seconds(r["message_bytes"]),
            pipe_action=pipe_action,
        )
        for name, makespan in r["steps_s"].items():
            if name != "zb-h1":
                wake.setdefault(name, {})[g] = fit_wake(name, g, m, makespan=makespan, **kw)
        if "zb-h1" in r["steps_s"] and "1f1b" in r["steps_s"]:
            split[g] = fit_split(g, m, makespan=r["steps_s"]["zb-h1"], wake=wake["1f1b"][g], **kw)
    return wake, split


def measure_rank(*, iters: int = 5, schedules: tuple[str, ...] = SCHEDULES) -> list[dict[str, Any]]:
    """Runs on every rank of the world (collective; barriers, the pipelines' messages and
    all-reduces, each bounded by the group timeout): per pipeline size ``g`` dividing the
    world, the slowest rank's median step of the calibration GPT under each of
    :data:`SCHEDULES` (``m = 2g``) and of its plain forward and backward of one
    micro-batch with every rank busy, taking turns round by round."""

    world = plait.world()
    n = world.size
    vocab, layers, heads, width, seq = MODEL
    cfg = GPTConfig(vocab=vocab, layers=layers, heads=heads, width=width, seq_len=seq)
    torch.manual_seed(0)
    plain = GPT(cfg)
    one = torch.zeros(ROWS, seq, dtype=torch.long)

    def reference() -> None:
        plain.zero_grad()
        plain(one).sum().backward()

    out = []
    for g in (d for d in range(2, n + 1) if n % d == 0 and layers % d == 0):
        m = 2 * g
        mesh = plait.Mesh(pp=g, dp=n // g, tp=1)
        ids = torch.zeros(mesh.size("dp") * m * ROWS, seq, dtype=torch.long)
        runs: dict[str, Callable[[], None]] = {"reference": reference}
        for name in schedules:
            if layers % (g * default_chunks(name)):
                continue  # the calibration GPT's blocks do not split into its chunks
            torch.manual_seed(0)
            model = GPT(cfg)
            ptdp = compose(
                model,
                torch.optim.Adam(model.parameters(), lr=1e-3),
                mesh=mesh,
                schedule=name,
                microbatches=m,
            )

            def step(ptdp: Any = ptdp, ids: Any = ids) -> None:
                ptdp.optimizer.zero_grad()
                ptdp.step(ids, ids)

            runs[name] = step
        seconds = paired(list(runs.values()), world, iters=iters, block=1)
        med = dict(zip(runs, seconds, strict=True))
        out.append(
            {
                "g": g,
                "m": m,
                "busy_mb_s": med.pop("reference"),
                "steps_s": med,
                "message_bytes": 4.0 * ROWS * seq * width,
            }
        )
    return out


__all__ = [
    "MODEL",
    "ROWS",
    "SCHEDULES",
    "layout",
    "fit",
    "fit_wake",
    "fit_split",
    "measure_rank",
    "played",
]
