"""Cut a model into pipeline stages: layers, a balanced partition, and stage modules.

:func:`layers_of` lists a model's layers in order: an ``nn.Sequential``'s children, or
the layers of the model's pipeline plan (:mod:`.plan`; plait's GPT: its embedding
(``tok`` + ``pos``), each block, and the head (``ln_f`` then ``head``)).
:func:`partition` groups them into contiguous stages, balanced by parameter count
(``by="params"``), by measured forward+backward time (``by="time"``, one profiling
pass on a sample batch), or at given points (``by=[2, 4]``: stages start at
layers 2 and 4). :class:`Stage` holds one group, its parameters under the dense model's
names (``blocks.1.attn.qkv.weight``), so the stages' state dicts together are the dense
model's.

Virtual stages: a schedule with ``v`` chunks per rank asks for ``p * v`` stages; which
rank holds which is the schedule's placement, not the partition's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.strategies.pipeline.simulate import Costs, simulate


@dataclass(frozen=True)
class Layer:
    """One unit the partition does not cut: its name, its modules under their dense
    names, and the function from its input to its output (``run(x)``, or ``run(x, ctx)``
    when ``contextual``: ``ctx`` is the plan's per-micro-batch context, see
    :mod:`.plan`)."""

    name: str
    modules: tuple[tuple[str, nn.Module], ...]
    run: Callable[..., torch.Tensor]
    contextual: bool = False

    def numel(self) -> int:
        seen: set[int] = set()
        n = 0
        for _, m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        return n


def layers_of(model: nn.Module, plan: Any = None) -> list[Layer]:
    """The layers of ``model`` in order: the ``plan``'s (a :class:`~.plan.PipelinePlan`),
    or an ``nn.Sequential``'s children. Any other model is refused, naming what to write."""
    from plait.strategies.pipeline.plan import (  # deferred: plan imports split
        refusal,
        sequential_plan,
    )

    if plan is not None:
        return list(plan.layers)
    if isinstance(model, nn.Sequential):
        return list(sequential_plan(model).layers)
    raise TypeError(refusal(model))


@dataclass(frozen=True)
class Partition:
    """Which layers each stage holds, with its share of parameters (and of time)."""

    bounds: tuple[tuple[int, int], ...]  # stage -> [first, last) layer index
    names: tuple[tuple[str, ...], ...]
    params: tuple[int, ...]
    seconds: tuple[float, ...] | None = None
    placement: tuple[int, ...] | None = None

    def __str__(self) -> str:
        total = sum(self.params) or 1
        ttotal = sum(self.seconds) if self.seconds else 0.0
        lines = []
        for s, names in enumerate(self.names):
            where = f" (rank {self.placement[s]})" if self.placement else ""
            line = (
                f"stage {s}{where}: {', '.join(names)} | {self.params[s]:,} params "
                f"({100 * self.params[s] / total:.0f}%)"
            )
            if self.seconds and ttotal:
                line += f", {100 * self.seconds[s] / ttotal:.0f}% of fwd+bwd time"
            lines.append(line)
        return "\n".join(lines)


def _balanced(weights: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into ``k`` non-empty parts minimising the largest
    part (dynamic programming over split points; ties go to the earliest split)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                cost = max(best[j - 1][c], prefix[i] - prefix[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    bounds, i = [], n
    for j in range(k, 0, -1):
        c = cut[j][i]
        bounds.append((c, i))
        i = c
    return bounds[::-1]


def _simulated(weights: Sequence[float], bounds: Sequence[tuple[int, int]], schedule: Any) -> float:
    """Makespan of ``schedule`` when a stage's F costs its layers' weight (B = 2F, I = W = F)."""

    per_stage: dict[tuple[str, int], float] = {}
    for s, (a, b) in enumerate(bounds):
        f = sum(weights[a:b])
        per_stage |= {("F", s): f, ("B", s): 2 * f, ("I", s): f, ("W", s): f}
    return simulate(schedule, Costs(per_stage=per_stage)).makespan


def _for_schedule(
    weights: Sequence[float], bounds: list[tuple[int, int]], schedule: Any
) -> list[tuple[int, int]]:
    """``bounds`` moved one layer at a time while the schedule's simulated makespan falls.

    The balanced cut minimises the largest stage, which is what a schedule with one stage
    per rank needs; with several stages per rank what counts is how the stages of one
    rank and the order the schedule visits them fit together (GPT's 6 blocks in the 4
    stages of ZBV at p = 2: blocks 1, 2, 2, 1 leave a 24% bubble, 2, 2, 1, 1 leave 6%)."""
    best = _simulated(weights, bounds, schedule)
    edges = [a for a, _ in bounds] + [bounds[-1][1]]
    improved = True
    while improved:
        improved = False
        for j in range(1, len(edges) - 1):
            for step in (-1, 1):
                e = edges[j] + step
                if not edges[j - 1] < e < edges[j + 1]:
                    continue
                trial = edges[:j] + [e] + edges[j + 1 :]
                cut = list(zip(trial[:-1], trial[1:], strict=True))
                t = _simulated(weights, cut, schedule)
                if t < best * (1 - 1e-9):
                    best, edges, improved = t, trial, True
    return list(zip(edges[:-1], edges[1:], strict=True))


def layer_seconds(
    layers: Sequence[Layer],
    sample: torch.Tensor,
    *,
    repeats: int = 3,
    context: Callable[[torch.Tensor], Any] | None = None,
) -> list[float]:
    """Forward + backward seconds of each layer on ``sample`` (median of ``repeats``);
    ``context``: the plan's, for contextual layers."""
    out = []
    x = sample

    def call(layer: Layer, inp: torch.Tensor) -> torch.Tensor:
        if layer.contextual:
            assert context is not None
            return layer.run(inp, context(inp))
        return layer.run(inp)

    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = call(layer, inp)
            y.float().sum().backward()
            times.append(time.perf_counter() - t0)
        for _, m in layer.modules:
            m.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = call(layer, x)
        out.append(sorted(times)[len(times) // 2])
    return out


def partition(
    layers: Sequence[Layer],
    stages: int,
    *,
    by: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
    context: Callable[[torch.Tensor], Any] | None = None,
    schedule: Any = None,
) -> Partition:
    """Group ``layers`` into ``stages`` contiguous stages (see the module docstring);
    ``context``: the plan's, for ``by="time"`` over contextual layers. ``by="schedule"``
    (with ``schedule``, a :class:`~.actions.Schedule` with that many stages): the cut
    balanced by parameters, then moved a layer at a time while the schedule's simulated
    makespan falls (stage costs proportional to the parameters; a V-shaped schedule's
    stages are visited in another order than a balanced cut assumes). ``"params"`` and
    ``"time"`` keep the balanced cut, whose memory per rank the planner models."""
    n = len(layers)
    if stages < 1 or stages > n:
        raise ValueError(
            f"pipeline: {stages} stages from {n} layers; every stage needs at least one "
            f"layer, so use at most {n} stages (ranks x chunks) or a deeper model"
        )
    seconds = None
    if isinstance(by, str):
        if by in ("params", "schedule"):
            if by == "schedule" and schedule is None:
                raise ValueError("pipeline: split by='schedule' needs the schedule")
            weights = [float(layer.numel()) for layer in layers]
        elif by == "time":
            if sample is None:
                raise ValueError("pipeline: split by='time' needs sample= (one micro-batch)")
            weights = layer_seconds(layers, sample, context=context)
        else:
            raise ValueError(
                f"pipeline: by={by!r}; use 'params', 'time', 'schedule' or a list of points"
            )
        bounds = _balanced(weights, stages)
        if by == "schedule" and stages > 1:
            bounds = _for_schedule(weights, bounds, schedule)
        if by == "time":
            seconds = tuple(sum(weights[a:b]) for a, b in bounds)
    else:
        points = list(by)
        if (
            len(points) != stages - 1
            or points != sorted(set(points))
            or (points and (points[0] < 1 or points[-1] > n - 1))
        ):
            raise ValueError(
                f"pipeline: split points {points} must be {stages - 1} increasing layer "
                f"indices in 1..{n - 1} (where stages 1..{stages - 1} start)"
            )
        edges = [0, *points, n]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    return Partition(
        tuple(bounds),
        tuple(tuple(layer.name for layer in layers[a:b]) for a, b in bounds),
        tuple(sum(layer.numel() for layer in layers[a:b]) for a, b in bounds),
        seconds,
    )


def split(
    model: nn.Module,
    *,
    stages: int,
    by: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
    plan: Any = None,
) -> tuple[list[Stage], Partition]:
    """``model`` cut into ``stages`` :class:`Stage` modules and the partition; print the
    partition to see what each stage holds and its share of parameters (and time).
    ``plan``: the model's :class:`~.plan.PipelinePlan` (``plait.models.plans.plan_for(model,
    "pipeline")``); not needed for an ``nn.Sequential``."""
    layers = layers_of(model, plan)
    context = None if plan is None else plan.context
    part = partition(layers, stages, by=by, sample=sample, context=context)
    extra = () if plan is None else plan.context_modules
    return [
        Stage(layers[a:b], s, context=context, context_modules=extra)
        for s, (a, b) in enumerate(part.bounds)
    ], part


class Stage(nn.Module):
    """Some consecutive layers, registered under the dense model's module names."""

    def __init__(
        self,
        layers: Sequence[Layer],
        index: int,
        *,
        context: Callable[..., Any] | None = None,
        context_modules: Sequence[tuple[str, nn.Module]] = (),
    ) -> None:
        super().__init__()
        self.index = index
        self.layer_names = [layer.name for layer in layers]
        self._runs = [layer.run for layer in layers]
        self._contextual = [layer.contextual for layer in layers]
        self._context = context if any(self._contextual) else None
        extra = list(context_modules) if self._context is not None else []
        for dotted, module in [m for layer in layers for m in layer.modules] + extra:
            parent: nn.Module = self
            parts = dotted.split(".")
            for part in parts[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.ModuleDict())
                parent = getattr(parent, part)
            parent.add_module(parts[-1], module)

    def forward(self, x: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        """The layers in order; the context (rotary embeddings, mask) is computed once,
        from the input of the first contextual layer and the micro-batch's per-micro-batch
        ``inputs`` (a padded batch's ``attention_mask``, see :mod:`.plan`), and passed to
        every contextual one. A stage without contextual layers ignores ``inputs``."""
        ctx: Any = None
        for run, contextual in zip(self._runs, self._contextual, strict=True):
            if contextual:
                if ctx is None:
                    assert self._context is not None
                    ctx = self._context(x, **inputs) if inputs else self._context(x)
                x = run(x, ctx)
            else:
                x = run(x)
        return x
