"""Pipeline parallelism: schedules as data, a simulator, and a runtime that runs them.

- ``actions``: :class:`Action` (``"2F0"``), :class:`Schedule` (per-rank action lists).
- ``schedules``: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV; :func:`build`, :func:`add_comms`.
- ``dualpipe``: DualPipeV (DeepSeek's DualPipe cut in half, F&B pairs as ``Schedule.pairs``).
- ``validate``: :func:`validate` (counts, order, matched sends, no deadlock).
- ``simulate``: :func:`simulate` (makespan, idle, bubble, in-flight micro-batches).
- ``draw``: :func:`table` (text) and :func:`draw_png` (timeline picture).
- ``split``: layers of a model, a balanced :class:`~.split.Partition`, :class:`~.split.Stage`.
- ``plan``: :class:`PipelinePlan`, a model as layers, per-stage context and loss (what a
  model family writes for the pipeline).
- ``agree``: the wrap-time agreement of every rank's settings over the pp group.
- ``runtime``: executes this rank's actions; ``messages``: its point-to-point messages.
- ``parallel``: :class:`PipelineParallel` and :func:`prepare_pipeline` (``plait.prepare``).
- ``report``: the bubble measured from the tracer beside the simulated one.
"""

from plait.strategies.pipeline.actions import Action, Kind, Schedule, ScheduleError
from plait.strategies.pipeline.agree import PipelineMismatchError
from plait.strategies.pipeline.draw import draw_png, table
from plait.strategies.pipeline.messages import PipelineError
from plait.strategies.pipeline.parallel import PipelineParallel, prepare_pipeline
from plait.strategies.pipeline.plan import PipelinePlan
from plait.strategies.pipeline.report import BubbleReport, bubble_report
from plait.strategies.pipeline.schedules import SCHEDULES, add_comms, build
from plait.strategies.pipeline.simulate import Costs, Simulation, formula_bubble, simulate
from plait.strategies.pipeline.split import (
    Layer,
    Partition,
    Stage,
    layers_of,
    partition,
    split,
)
from plait.strategies.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "BubbleReport",
    "Costs",
    "Kind",
    "Layer",
    "PipelineError",
    "PipelineMismatchError",
    "PipelinePlan",
    "Partition",
    "PipelineParallel",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Stage",
    "add_comms",
    "bubble_report",
    "build",
    "draw_png",
    "formula_bubble",
    "layers_of",
    "partition",
    "prepare_pipeline",
    "simulate",
    "split",
    "table",
    "validate",
]
