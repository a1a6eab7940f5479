"""``PipelineParallel``: a model cut into stages over a ``pp`` group, trained by a schedule.

::

    mesh = plait.Mesh(pp=4)
    pipe = PipelineParallel(GPT(cfg), group=mesh.group("pp"), schedule="1f1b", microbatches=8)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)   # this rank's stages only
    for ids, targets in batches:
        opt.zero_grad()
        loss = pipe.step(ids, targets)   # every rank passes the same global batch
        opt.step()

Each rank builds the whole model (same seed), keeps the stages the schedule places on it
and drops the rest. ``step`` cuts the batch into ``microbatches`` equal micro-batches, runs
this rank's actions (:mod:`.runtime`), sums tied gradients (a tied embedding and head on
the first and last stage) and broadcasts the loss from the last stage, so it returns the
mean loss over the micro-batches on every rank. Gradients equal the dense model's on the
whole batch when ``loss_fn`` is a mean over equally sized micro-batches (cross-entropy
over tokens, as the GPT's). Communication: see :mod:`.runtime`; no gradient all-reduce
inside the pipeline (combine with data parallelism on another mesh dimension for that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import Group
from plait.strategies.pipeline.actions import Schedule, ScheduleError
from plait.strategies.pipeline.runtime import Runtime
from plait.strategies.pipeline.schedules import build
from plait.strategies.pipeline.split import Layer, Partition, Stage, layers_of, partition
from plait.strategies.pipeline.validate import validate
from plait.trace import Tracer


class PipelineParallel(nn.Module):
    """This rank's stages of ``model`` and the schedule that trains them (module docstring).

    ``model``: an ``nn.Sequential`` or a :class:`plait.models.GPT` (cut by ``split``), or a
    list of ``p * chunks`` modules, one per stage (their parameters named ``<i>.<name>``).
    ``schedule``: a name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``,
    ``"zbv"``, ``"dualpipev"``) or a :class:`Schedule` for ``p = group.size``. ``chunks``:
    stages per rank (default: 2 for interleaved, zbv and dualpipev, else 1). ``split``:
    ``"params"``, ``"time"`` (needs ``sample``, one micro-batch of inputs) or the layer
    indices where stages 1.. start.
    ``recompute``: keep only each stage's input between forward and backward.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        *,
        group: Any,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        chunks: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        recompute: bool = False,
        split: str | Sequence[int] = "params",
        sample: torch.Tensor | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(group, Group):
            group = group.group("pp")  # a Mesh
        self.group = group
        p = group.size
        if isinstance(schedule, Schedule):
            if schedule.p != p:
                raise ScheduleError(
                    f"pipeline: the schedule is for p={schedule.p} ranks but group "
                    f"{group.name!r} has {p}"
                )
            validate(schedule)
            sched = schedule
        else:
            if microbatches is None:
                raise ValueError("pipeline: pass microbatches= (micro-batches per step)")
            sched = build(schedule, p=p, m=microbatches, v=chunks)
        self.schedule = sched
        if loss_fn is None:
            from plait.models.gpt import GPT
            from plait.models.gpt import loss as gpt_loss

            if not isinstance(model, GPT):
                raise ValueError(
                    f"pipeline: pass loss_fn=(output, target) -> mean loss for a "
                    f"{type(model).__name__}; only plait.models.GPT has a default"
                )
            loss_fn = gpt_loss
        if isinstance(model, (list, tuple)):  # stages cut by the caller: one per stage
            if len(model) != sched.stages:
                raise ValueError(
                    f"pipeline: {len(model)} stage modules given, but schedule "
                    f"{sched.name!r} with p={p} ranks and {sched.v} chunks runs "
                    f"{sched.stages} stages"
                )
            layers = [Layer(str(i), ((str(i), mod),), mod) for i, mod in enumerate(model)]
            split = list(range(1, len(layers)))
        else:
            assert isinstance(model, nn.Module)
            layers = layers_of(model)
        part = partition(layers, sched.stages, by=split, sample=sample)
        self.partition = Partition(
            part.bounds, part.names, part.params, part.seconds, sched.placement
        )
        rank = group.rank
        mine = sched.stages_of(rank)
        self.stages = nn.ModuleDict(
            {str(s): Stage(layers[a:b], s) for s, (a, b) in enumerate(part.bounds) if s in mine}
        )
        self.runtime = Runtime(
            sched,
            {int(k): v for k, v in self.stages.items()},  # type: ignore[misc]
            group=group,
            loss_fn=loss_fn,
            recompute=recompute,
            tracer=tracer,
            tied=self._tied(layers, part, sched, rank),
        )

    @staticmethod
    def _tied(
        layers: Sequence[Any], part: Partition, sched: Schedule, rank: int
    ) -> list[tuple[nn.Parameter, int]]:
        """Parameters shared by stages on two ranks (a tied embedding and head): this
        rank's copy and the other rank, in one order on both."""
        ranks_of: dict[int, list[int]] = {}
        param_of: dict[int, nn.Parameter] = {}
        for s, (a, b) in enumerate(part.bounds):
            for layer in layers[a:b]:
                for _, module in layer.modules:
                    for prm in module.parameters():
                        r = sched.placement[s]
                        ranks_of.setdefault(id(prm), [])
                        if r not in ranks_of[id(prm)]:
                            ranks_of[id(prm)].append(r)
                        param_of[id(prm)] = prm
        tied = []
        for key, ranks in ranks_of.items():
            if len(ranks) == 1:
                continue
            if len(ranks) > 2:
                raise ValueError(
                    f"pipeline: a parameter of shape {tuple(param_of[key].shape)} is shared by "
                    f"stages on ranks {ranks}; only sharing between two ranks is supported"
                )
            if rank in ranks:
                tied.append((param_of[key], ranks[0] if ranks[1] == rank else ranks[1]))
        return tied

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One forward and backward of the global batch; returns the mean loss on every
        rank. Gradients accumulate into this rank's stages' ``.grad`` (zero them first).
        Collective over the ``pp`` group: every rank passes the same batch."""
        m = self.schedule.m
        if inputs.shape[0] % m:
            raise ValueError(
                f"pipeline: a batch of {inputs.shape[0]} does not split into microbatches={m} "
                f"equal micro-batches; use a batch size that is a multiple of {m}"
            )
        xs = list(inputs.chunk(m))
        ys: list[torch.Tensor | None] = list(targets.chunk(m))
        loss = self.runtime.step(xs, ys)
        last = self.schedule.placement[self.schedule.stages - 1]
        ops.broadcast(loss, last, group=self.group)
        return loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.step(inputs, targets)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the dense model's names."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages.values():
            out.update(stage.state_dict())
        return out

    @property
    def peak_in_flight(self) -> dict[int, int]:
        """Per stage of this rank, the most micro-batches held at once (measured)."""
        return dict(self.runtime.peak_in_flight)


def prepare_pipeline(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    schedule: str | Schedule = "1f1b",
    microbatches: int,
    **options: Any,
) -> tuple[PipelineParallel, torch.optim.Optimizer | None]:
    """``plait.prepare(model, optimizer, strategy="pipeline", mesh=..., schedule=...,
    microbatches=m)``: the :class:`PipelineParallel` on ``mesh.group("pp")`` (or a
    ``Group``) and the optimizer re-created over this rank's stages (same class, same
    hyper-parameters per group)."""
    pipe = PipelineParallel(
        model, group=mesh, schedule=schedule, microbatches=microbatches, **options
    )
    if optimizer is None:
        return pipe, None
    if optimizer.state:
        raise ValueError(
            "strategy 'pipeline' re-creates the optimizer on this rank's stages: pass an "
            "optimizer that has not stepped yet"
        )
    local = {id(p) for p in pipe.parameters()}
    groups = []
    for g in optimizer.param_groups:
        kept = [p for p in g["params"] if id(p) in local]
        if kept:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": kept})
    cls: Any = type(optimizer)
    return pipe, cls(groups)
