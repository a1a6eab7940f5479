"""Calibrate this machine for the planner: run ranks and measure (what the figures are and
how they are fit, saved and loaded: :mod:`plait.plan.calibration`)."""

from __future__ import annotations

from typing import Any

from plait.launch.pool import RankPool
from plait.plan.calibration import (
    COLLECTIVES,
    Calibration,
    Line,
    Overhead,
    Residual,
    default_path,
    fastest,
    fit_line,
    format_calibration,
    load,
    save,
)
from plait.plan.measure import probe

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
    "measure_rank",
    "run",
    "save",
]


def measure_rank(**options: Any) -> dict[str, Any]:
    """Runs on every rank of the world: :func:`plait.plan.measure.probe.measure_rank`."""
    return probe.measure_rank(**options)


def run(ranks: int, *, iters: int = 8, timeout: float = 600) -> Calibration:
    """Start ``ranks`` local ranks (the transport ``PLAIT_TRANSPORT`` selects, default
    shared memory) and measure (:func:`measure_rank`)."""
    if ranks < 2:
        raise ValueError(f"calibrate: ranks={ranks}; measure links with 2 or more ranks")
    with RankPool(ranks, timeout=timeout) as pool:
        out = pool.run(probe.measure_rank, iters=iters, timeout=timeout)[0]
    return Calibration.from_dict(out)
