"""What a calibration of this machine holds, how it is fit, saved and loaded (the planner's
side: it imports nothing that runs ranks; :mod:`plait.plan.measure.calibrate` measures).

``plait.plan.hardware.local_cpu`` times layouts with link constants and a compute speed.
Read from the wrong transport they mislead: gloo's loopback costs ~1 ms per small
collective, while ranks of one host talk through shared memory (``PLAIT_TRANSPORT=auto``,
:mod:`plait.comm.shm`) in tens of microseconds.
:func:`plait.plan.measure.calibrate.measure_rank` runs on every rank of a world of ``n``
ranks and measures, with the algorithm ``"auto"`` picks (what the strategies
call) and every group of a size busy at once (as a layout runs them):

* ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` over groups of each
  size ``g`` dividing ``n`` (``Mesh(dp=n/g, tp=g)``'s tp groups): the slowest rank's time,
  median of calls, at a few sizes; ``S`` the full tensor (the input of all-reduce,
  reduce-scatter and all-to-all (equal blocks), the gathered output of all-gather);
* ``p2p``: a send one way between the two ranks of each pair (``Mesh(pp=2, dp=n/2)``'s
  pp groups, every pair at once), half a round trip;
* ``adam``: ``torch.optim.Adam``'s step over a few sizes of parameters, every rank at once
  (the optimizer step is memory-bound; ZeRO divides it by ``dp``);
* ``block_overhead``: a tiny GPT block's forward and backward (almost no FLOPs): what a
  block costs per micro-batch whatever its size (operator dispatch), which small
  micro-batches and tensor-parallel shards pay in full;
* the strategies' own work (:mod:`plait.plan.measure.probe_runtime`, a tiny GPT under each
  strategy against its plain step with the same collectives): DDP's, ZeRO-1/2's and FSDP's
  seconds per step per parameter tensor and per gradient byte (:class:`Overhead`), the 1D
  tensor-parallel layers' seconds per collective (``tp_call``, per group size), the
  pipeline runtime's seconds per action (``pipe_action``);
* ranks sharing cores, per pipeline size (:mod:`plait.plan.measure.probe_pipeline`, a calibration
  GPT through GPipe, 1F1B, interleaved 1F1B and ZB-H1): what a compute action woken by a
  message pays on top of its work, per schedule (``wake``), and ZB's split backward's work
  against B's (``zb_split``); what 1D tensor parallelism costs beyond the planner's other
  terms, per group size (:mod:`plait.plan.measure.probe_tensor`: ``tp_residual``, per collective
  and per token x hidden x block);
* ``gemm``: ``M x K @ K x N`` float32 matmuls (one thread) at the shapes a GPT block's
  linears take when split over ``t`` ranks, repeated for ~20 ms on every rank at once (the
  cores shared as in a run):
  :class:`Calibration.gemm_flops` interpolates the rate by the matmul's FLOPs.

Each (collective, group size) is fit as ``t = latency + S / bandwidth`` over its sizes
(:func:`fit_line`): a measured line per collective, no ring model in between, since on a
shared-memory host a collective's cost is set by the copies and the wake-ups of ranks that
share cores, not by link hops. The file (:func:`save` / :func:`load`, default
``runs/plan_calibration_n<N>.json``) is what ``local_cpu(ranks=N)`` reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class Line:
    """``seconds = latency + bytes / bandwidth``, fit to ``points`` measurements."""

    latency: float
    bandwidth: float
    points: int

    def seconds(self, size: float) -> float:
        return self.latency + size / self.bandwidth


@dataclass(frozen=True)
class Overhead:
    """A strategy's own seconds per step: ``per_tensor`` per parameter tensor the rank
    holds and ``per_byte`` per byte of its gradients (:mod:`plait.plan.measure.probe_runtime`)."""

    per_tensor: float
    per_byte: float

    def seconds(self, tensors: float, nbytes: float) -> float:
        return self.per_tensor * tensors + self.per_byte * nbytes


@dataclass(frozen=True)
class Residual:
    """A 1D tensor-parallel micro-batch's seconds beyond the planner's other terms on ranks
    that share cores (:mod:`plait.plan.measure.probe_tensor`): ``per_call`` per collective (the
    group waiting for its last rank) and ``per_element`` per token x hidden x block (the
    work every rank repeats in full)."""

    per_call: float
    per_element: float

    def seconds(self, calls: float, elements: float) -> float:
        return self.per_call * calls + self.per_element * elements


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What :func:`measure_rank` found on ``ranks`` ranks sharing ``cores`` cores."""

    ranks: int
    cores: int
    transport: str  # "shm" or "gloo": what carried the messages
    links: dict[str, dict[int, Line]]  # collective -> group size -> fit, between bursts
    idle_links: dict[str, dict[int, Line]] = field(default_factory=dict)  # back to back
    gemm: list[tuple[int, int, int, float]] = field(default_factory=list)  # M, K, N, FLOP/s
    # torch.optim.Adam's step: seconds = latency + parameter elements / bandwidth
    adam: Line | None = None
    # seconds of a GPT block's forward and backward that do not grow with its FLOPs
    # (operator dispatch): a tiny block's, every rank busy
    block_overhead: float = 0.0
    # the strategies' own work (plait.plan.measure.probe_runtime): DDP's and ZeRO-1/2's per step,
    # per tensor-parallel collective (by group size), per pipeline action
    ddp: Overhead | None = None
    zero: Overhead | None = None
    fsdp: Overhead | None = None
    tp_call: dict[int, float] = field(default_factory=dict)
    pipe_action: float = 0.0
    # ranks sharing cores (plait.plan.measure.probe_pipeline): per schedule and pipeline size, the
    # seconds (every rank busy) a compute action woken by a message pays on top; per
    # pipeline size, ZB's backward work as I + W over B's
    wake: dict[str, dict[int, float]] = field(default_factory=dict)
    zb_split: dict[int, float] = field(default_factory=dict)
    # 1D tensor parallelism's residual per group size (plait.plan.measure.probe_tensor)
    tp_residual: dict[int, Residual] = field(default_factory=dict)
    raw: list[dict[str, Any]] = field(default_factory=list)

    def line(self, collective: str, n: int) -> Line | None:
        """The fit for ``collective`` over ``n`` ranks (``p2p``: any ``n``), or the nearest
        measured group size; None if the collective was not measured."""
        per = self.links.get(collective)
        if not per:
            return None
        if collective == "p2p":
            return next(iter(per.values()))
        return per[min(per, key=lambda k: (abs(k - n), k))]

    def tp_call_seconds(self, n: int) -> float:
        """The tensor-parallel layers' own seconds per collective over ``n`` ranks (the
        nearest measured group size; 0 if not measured)."""
        if n <= 1 or not self.tp_call:
            return 0.0
        return self.tp_call[min(self.tp_call, key=lambda k: (abs(k - n), k))]

    def pipeline_figures(self, schedule: str, g: int) -> tuple[float, float] | None:
        """``(wake, zb_split)`` for ``schedule`` on a pipeline of ``g`` ranks: the
        schedule's own wake if measured, else 1F1B's; the nearest measured size. None if
        the pipeline probe did not run."""
        per = self.wake.get(schedule) or self.wake.get("1f1b")
        if not per:
            return None
        k = min(per, key=lambda x: (abs(x - g), x))
        split = 1.0
        if self.zb_split:
            split = self.zb_split[min(self.zb_split, key=lambda x: (abs(x - g), x))]
        return per[k], split

    def residual(self, t: int) -> Residual | None:
        """The tensor-parallel residual over ``t`` ranks (the nearest measured size), or
        None if not measured (or ``t = 1``)."""
        if t <= 1 or not self.tp_residual:
            return None
        return self.tp_residual[min(self.tp_residual, key=lambda k: (abs(k - t), k))]

    def gemm_flops(self, flops: float) -> float:
        """FLOP/s of a matmul of ``flops`` FLOPs on one rank while every rank computes:
        log-linear between the measured shapes, clamped at the ends."""
        pts = sorted((2.0 * m * k * n, rate) for m, k, n, rate in self.gemm)
        if not pts:
            raise ValueError("Calibration has no gemm rows; rerun the calibration")
        if flops <= pts[0][0]:
            return pts[0][1]
        if flops >= pts[-1][0]:
            return pts[-1][1]
        for (f0, r0), (f1, r1) in zip(pts, pts[1:], strict=False):
            if f0 <= flops <= f1:
                if f1 == f0:
                    return max(r0, r1)
                w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("links", "idle_links"):
            d[key] = {
                c: {str(n): asdict(v) for n, v in per.items()}
                for c, per in getattr(self, key).items()
            }
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Calibration:
        def lines(key: str) -> dict[str, dict[int, Line]]:
            return {
                c: {int(n): Line(**v) for n, v in per.items()} for c, per in d.get(key, {}).items()
            }

        links = lines("links")
        if not links:
            raise KeyError("links")
        adam = d.get("adam")
        ddp, zero, fsdp = d.get("ddp"), d.get("zero"), d.get("fsdp")
        return Calibration(
            ddp=Overhead(**ddp) if ddp else None,
            zero=Overhead(**zero) if zero else None,
            fsdp=Overhead(**fsdp) if fsdp else None,
            tp_call={int(g): float(s) for g, s in d.get("tp_call", {}).items()},
            pipe_action=float(d.get("pipe_action", 0.0)),
            wake={
                str(name): {int(g): float(x) for g, x in per.items()}
                for name, per in d.get("wake", {}).items()
            },
            zb_split={int(g): float(x) for g, x in d.get("zb_split", {}).items()},
            tp_residual={int(t): Residual(**v) for t, v in d.get("tp_residual", {}).items()},
            adam=Line(**adam) if adam else None,
            block_overhead=float(d.get("block_overhead", 0.0)),
            ranks=int(d["ranks"]),
            cores=int(d["cores"]),
            transport=str(d["transport"]),
            links=links,
            idle_links=lines("idle_links"),
            gemm=[(int(m), int(k), int(n), float(r)) for m, k, n, r in d.get("gemm", [])],
            raw=list(d.get("raw", [])),
        )


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares ``t = a + S / b`` over ``(S, t)`` points; a negative intercept is
    clamped to 0 (and the slope refit through the origin); a non-positive slope (noise
    larger than the sizes' cost) keeps the fastest time as the latency and the largest
    message's time over its size as the slope."""
    if len(points) < 2:
        raise ValueError(f"fit_line: need 2 or more sizes, got {len(points)}")
    n = len(points)
    sx = sum(s for s, _ in points)
    st = sum(t for _, t in points)
    sxx = sum(s * s for s, _ in points)
    sxt = sum(s * t for s, t in points)
    det = n * sxx - sx * sx
    slope = (n * sxt - sx * st) / det if det else 0.0
    a = (st - slope * sx) / n
    if a < 0:
        a, slope = 0.0, sxt / sxx
    if slope <= 0:  # noise hid the size's cost: the fastest call as latency, and the
        s, t = max(points)  # largest message's whole time as its transfer (conservative)
        a, slope = min(t for _, t in points), t / s
    return Line(latency=a, bandwidth=1.0 / slope, points=n)


def fastest(cals: Sequence[Calibration]) -> Calibration:
    """Figure by figure, the least disturbed of several calibrations of the same ranks (on
    a shared machine other jobs' load only slows a measurement): per collective and group
    size the line that is faster at 1 MiB, the higher rate per matmul shape, Adam's line
    faster at 1M elements, the smaller dispatch, per strategy the own work smaller at 50
    tensors and 1 MiB, per group size the smaller tensor-parallel call, the smaller
    pipeline action; the figures fit from two timings each (per schedule and pipeline size
    the wake, per pipeline size the ZB split, per tensor-parallel size the residual) the
    mean (a disturbed reference moves them one way, a disturbed run the other). Raw rows:
    the first calibration's."""
    if not cals:
        raise ValueError("fastest: no calibration given")
    first = cals[0]
    for c in cals[1:]:
        if (c.ranks, c.transport) != (first.ranks, first.transport):
            raise ValueError(
                f"fastest: calibrations of {first.ranks} ranks ({first.transport}) and "
                f"{c.ranks} ranks ({c.transport}) do not mix"
            )

    def lines(key: str) -> dict[str, dict[int, Line]]:
        out: dict[str, dict[int, Line]] = {}
        for c in cals:
            for coll, per in getattr(c, key).items():
                for n, ln in per.items():
                    best = out.setdefault(coll, {}).get(n)
                    if best is None or ln.seconds(1 << 20) < best.seconds(1 << 20):
                        out[coll][n] = ln
        return out

    def least(items: list[Any], cost: Any) -> Any:
        present = [x for x in items if x is not None]
        return min(present, key=cost) if present else None

    gemm: dict[tuple[int, int, int], float] = {}
    for c in cals:
        for m, k, n, r in c.gemm:
            gemm[(m, k, n)] = max(r, gemm.get((m, k, n), 0.0))
    tp_call: dict[int, float] = {}
    for c in cals:
        for g, sec in c.tp_call.items():
            tp_call[g] = min(sec, tp_call.get(g, sec))
    # fit from a ratio of two timings (a disturbed reference moves them one way, a
    # disturbed run the other): the mean of the calibrations that measured them
    woken: dict[str, dict[int, list[float]]] = {}
    splits: dict[int, list[float]] = {}
    residuals: dict[int, list[Residual]] = {}
    for c in cals:
        for name, per in c.wake.items():
            for g, x in per.items():
                woken.setdefault(name, {}).setdefault(g, []).append(x)
        for g, x in c.zb_split.items():
            splits.setdefault(g, []).append(x)
        for t, res in c.tp_residual.items():
            residuals.setdefault(t, []).append(res)
    wake = {name: {g: _mean(xs) for g, xs in per.items()} for name, per in woken.items()}
    zb_split = {g: _mean(xs) for g, xs in splits.items()}
    residual = {
        t: Residual(
            per_call=_mean([r.per_call for r in rs]),
            per_element=_mean([r.per_element for r in rs]),
        )
        for t, rs in residuals.items()
    }

    def own(key: str) -> Overhead | None:
        return least([getattr(c, key) for c in cals], lambda o: o.seconds(50, 1 << 20))

    return Calibration(
        ranks=first.ranks,
        cores=first.cores,
        transport=first.transport,
        links=lines("links"),
        idle_links=lines("idle_links"),
        gemm=[(m, k, n, r) for (m, k, n), r in gemm.items()],
        adam=least([c.adam for c in cals], lambda a: a.seconds(1 << 20)),
        block_overhead=min(c.block_overhead for c in cals),
        ddp=own("ddp"),
        zero=own("zero"),
        fsdp=own("fsdp"),
        tp_call=tp_call,
        pipe_action=min(c.pipe_action for c in cals),
        wake=wake,
        zb_split=zb_split,
        tp_residual=residual,
        raw=first.raw,
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def default_path(ranks: int) -> Path:
    return Path(f"runs/plan_calibration_n{ranks}.json")


def save(cal: Calibration, path: str | Path | None = None) -> Path:
    p = Path(path) if path is not None else default_path(cal.ranks)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal.to_dict(), indent=1) + "\n")
    return p


def load(path: str | Path) -> Calibration:
    try:
        return Calibration.from_dict(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: not a plait plan calibration ({e}); rerun `plait bench calibrate`"
        ) from None


def format_calibration(cal: Calibration) -> str:
    """A short table of the fits and the matmul rates."""
    lines = [
        f"calibration: {cal.ranks} ranks on {cal.cores} cores, transport {cal.transport}",
        f"{'collective':<16}{'n':>3}{'latency(us)':>14}{'bandwidth(GB/s)':>18}"
        f"{'b2b lat(us)':>16}{'b2b bw(GB/s)':>18}",
        "(between 2 ms compute bursts on every rank, as a step runs them; b2b: back to back)",
    ]
    for c, per in cal.links.items():
        for n, ln in sorted(per.items()):
            row = f"{c:<16}{n:>3}{ln.latency * 1e6:>14.1f}{ln.bandwidth / 1e9:>18.3f}"
            b2b = cal.idle_links.get(c, {}).get(n)
            if b2b is not None:
                row += f"{b2b.latency * 1e6:>16.1f}{b2b.bandwidth / 1e9:>18.3f}"
            lines.append(row)
    if cal.adam is not None:
        a = cal.adam
        lines.append(
            f"{'adam step':<16}{'':>3}{a.latency * 1e6:>14.1f}{a.bandwidth / 1e9:>14.3f} G params/s"
        )
    lines.append(f"{'block overhead':<19}{cal.block_overhead * 1e6:>14.1f} us per block")
    for name, ov in (("ddp", cal.ddp), ("zero-1/2", cal.zero), ("fsdp", cal.fsdp)):
        if ov is not None:
            lines.append(
                f"{name + ' own work':<19}{ov.per_tensor * 1e6:>14.1f} us per tensor"
                f" + {ov.per_byte * 1e9:.3f} ns per byte"
            )
    for g, sec in sorted(cal.tp_call.items()):
        lines.append(f"{f'tp call, n={g}':<19}{sec * 1e6:>14.1f} us per collective")
    lines.append(f"{'pipeline action':<19}{cal.pipe_action * 1e6:>14.1f} us per action")
    for schedule, by_size in sorted(cal.wake.items()):
        for g, x in sorted(by_size.items()):
            lines.append(f"{f'{schedule}, pp={g}':<19}{x * 1e6:>14.1f} us per woken action")
    for g, x in sorted(cal.zb_split.items()):
        lines.append(f"{f'zb split, pp={g}':<19}{x:>14.2f} x B's work for I + W")
    for t, res in sorted(cal.tp_residual.items()):
        lines.append(
            f"{f'tp residual, n={t}':<19}{res.per_call * 1e6:>14.1f} us per collective"
            f" + {res.per_element * 1e9:.3f} ns per token x hidden x block"
        )
    lines.append(f"{'gemm M x K x N':<24}{'GFLOP/s per rank':>18}")
    for m, k, n, r in cal.gemm:
        lines.append(f"{f'{m}x{k}x{n}':<24}{r / 1e9:>18.2f}")
    return "\n".join(lines)


__all__ = [
    "COLLECTIVES",
    "Calibration",
    "Line",
    "Overhead",
    "Residual",
    "default_path",
    "fastest",
    "fit_line",
    "format_calibration",
    "load",
    "save",
]
