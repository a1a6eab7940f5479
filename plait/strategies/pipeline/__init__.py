"""Pipeline parallelism: schedules as data, a simulator, and a runtime that runs them.

- ``actions``: :class:`Action` (``"2F0"``), :class:`Schedule` (per-rank action lists).
- ``schedules``: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV; :func:`build`, :func:`add_comms`.
- ``validate``: :func:`validate` (counts, order, matched sends, no deadlock).
- ``simulate``: :func:`simulate` (makespan, idle, bubble, in-flight micro-batches).
- ``draw``: :func:`table` (text) and :func:`draw_png` (timeline picture).
"""

from plait.strategies.pipeline.actions import Action, Kind, Schedule, ScheduleError
from plait.strategies.pipeline.draw import draw_png, table
from plait.strategies.pipeline.schedules import SCHEDULES, add_comms, build
from plait.strategies.pipeline.simulate import Costs, Simulation, formula_bubble, simulate
from plait.strategies.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "add_comms",
    "build",
    "draw_png",
    "formula_bubble",
    "simulate",
    "table",
    "validate",
]
