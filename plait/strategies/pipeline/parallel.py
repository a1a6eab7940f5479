"""``PipelineParallel``: a model cut into stages over a ``pp`` group, trained by a schedule.

::

    mesh = plait.Mesh(pp=4)
    model = LlamaForCausalLM(config)                  # or plait.models.GPT, an nn.Sequential
    pipe, opt = plait.prepare(model, opt, strategy="pipeline", mesh=mesh,
                              schedule="1f1b", microbatches=8)   # opt: this rank's stages only
    for ids, labels in batches:
        opt.zero_grad()
        loss = pipe.step(ids, labels)   # every rank passes the same global batch
                                        # (padded: pipe.step(ids, labels, attention_mask=mask))
        plait.clip_grad_norm_(pipe.parameters(), 1.0)   # the whole model's norm
        opt.step()

Each rank builds the whole model (same seed), keeps the stages the schedule places on it
and drops the rest. What the stages are comes from the model's pipeline plan
(:class:`~.plan.PipelinePlan`: its layers, the per-stage context such as rotary embeddings
and the causal mask, recomputed on each stage, and the model's own loss), found by
:func:`plait.prepare` with the model's family (``plait/models/<family>.py``) and passed as
``plan=``; an ``nn.Sequential`` or a list of stage modules needs none. ``step`` cuts the
batch into ``microbatches`` equal micro-batches, runs this rank's actions (:mod:`.runtime`),
sums tied gradients (a tied embedding and head on the first and last stage) and broadcasts
the loss from the last stage, so it returns the whole batch's loss on every rank.
Gradients equal the dense model's on the whole batch (a mean loss over equally sized
micro-batches, or a plan whose loss counts its items over the whole batch, as Hugging
Face's ``num_items_in_batch``).

Communication on the ``pp`` group: see :mod:`.runtime` for the step's point-to-point
messages; besides them, per step, one all-reduce of ``4 * p`` int64 (the non-finite check,
with ``check_finite``; with its flags on the device, a second of ``p`` int64 on a flagged
step) and one broadcast of the loss from the last stage's rank; at wrap
time, one agreement through the rendezvous store (each rank's schedule, micro-batch count,
chunks, stage cut and model fingerprint: a rank that disagrees is named on every rank
before any message moves, instead of a deadlock). No gradient all-reduce inside the
pipeline (combine with data parallelism on another mesh dimension for that).

fp16 (``plait.prepare(..., mixed_precision="fp16")``, or ``scaler=`` and
``check_finite=None``): the last stage multiplies each micro-batch's loss by the
:class:`~plait.amp.DynamicLossScaler`'s scale; ``scaler.step(optimizer)`` unscales this
rank's gradients and all-reduces its found-inf flag (max) over the world, so every stage
skips the same steps.

Placement (for :func:`plait.clip_grad_norm_`): every parameter a rank keeps is split over
``pp`` (stages add up); a tied parameter held by two ranks is also copied over the pair,
counted once, on the lower pp rank.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from plait.amp import DynamicLossScaler
from plait.comm import ops, tuner
from plait.comm.device import control_device, read_verdict
from plait.comm.group import Group
from plait.renames import accepts_model
from plait.strategies import placement
from plait.strategies.data_parallel.grad_sync import (
    NonFiniteGradientError,
    check_policy,
)
from plait.strategies.pipeline.actions import Schedule, ScheduleError
from plait.strategies.pipeline.agree import agree
from plait.strategies.pipeline.batch_loss import BatchLossHooks, statistics_pass
from plait.strategies.pipeline.batch_loss import totals as batch_totals
from plait.strategies.pipeline.deferred import SplitReport
from plait.strategies.pipeline.finite import (
    Positions,
    fill_on_device,
    fill_on_host,
    first_bad_value,
)
from plait.strategies.pipeline.plan import (
    PipelinePlan,
    fingerprint,
    per_microbatch,
    stage_list_plan,
)
from plait.strategies.pipeline.runtime import Runtime
from plait.strategies.pipeline.schedules import build
from plait.strategies.pipeline.split import Partition, Stage, layers_of, partition
from plait.strategies.pipeline.validate import validate
from plait.strategies.reproducible.pipeline import for_pipeline
from plait.trace import Tracer


@dataclass(frozen=True)
class TiedCopies:
    """The two pp ranks that hold one tied parameter (a tied embedding and head), as a
    replicating "group" for :func:`~plait.strategies.placement.place`: the copies are
    identical after the tied-gradient sum, so only the lower rank's is counted. Used for
    counting only; no collective runs on it."""

    name: str
    ranks: tuple[int, int]
    rank: int
    size: int = 2


class PipelineParallel(nn.Module):
    """This rank's stages of ``model`` and the schedule that trains them (module docstring).

    ``model``: the whole model, cut by its ``plan`` (a :class:`~.plan.PipelinePlan`; not
    needed for an ``nn.Sequential``), or a list of ``p * chunks`` modules, one per stage
    (their parameters named ``<i>.<name>``).
    ``schedule``: a name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``,
    ``"zbv"``, ``"dualpipev"``) or a :class:`Schedule` for ``p = group.size``. ``chunks``:
    stages per rank (default: 2 for interleaved, zbv and dualpipev, else 1). ``split``:
    ``"params"`` (balanced by parameters, the default: the memory per rank the planner models),
    ``"schedule"`` (that cut moved while the schedule's simulated makespan falls: what
    zero-bubble V schedules gain most from), ``"time"`` (needs ``sample``, one micro-batch of
    inputs) or the layer indices where stages 1.. start. ``loss_fn``: ``(output, target) -> mean
    loss`` of a micro-batch; overrides the plan's loss. ``recompute``: keep only each stage's
    input between forward and backward. ``check_finite``: ``"raise"`` (default, as DDP),
    ``"skip"`` (every rank drops the step's gradients) or None (a loss scaler handles
    overflows): a non-finite stage output or gradient is found on every rank after the backward,
    naming the rank, stage, micro-batch and parameter. ``scaler``: a
    :class:`~plait.amp.DynamicLossScaler` (fp16): the last stage multiplies every
    micro-batch's loss by its scale (read once per ``step``), ``step`` returns the unscaled
    loss, and ``scaler.step(optimizer)`` unscales this rank's gradients and skips on every
    rank alike; it needs ``check_finite=None`` (the scaler decides, not the check).
    """

    @accepts_model(method=True)
    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        *,
        group: Any,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        chunks: int | None = None,
        plan: PipelinePlan | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        recompute: bool = False,
        split: str | Sequence[int] = "params",
        sample: torch.Tensor | None = None,
        check_finite: str | None = "raise",
        tracer: Tracer | None = None,
        reproducible: bool = False,
        threads: int | None = 1,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        model = module
        super().__init__()
        if scaler is not None and check_finite is not None:
            raise ValueError(
                f"PipelineParallel: scaler= with check_finite={check_finite!r}; the check would "
                f"raise (or skip alone) on the overflows the scaler is there to skip. Pass "
                f"check_finite=None with a loss scaler"
            )
        self.scaler = scaler
        self._loss_scale = 1.0  # the scaler's scale during a step (1.0 without one)
        if not isinstance(group, Group):
            shape = getattr(group, "shape", {})
            if isinstance(shape, dict) and shape.get("cp", 1) > 1:
                # the stages would run whole sequences on every cp rank, silently
                raise ValueError(
                    f"PipelineParallel: the mesh {group!r} has cp={shape['cp']}; the pipeline "
                    f"alone runs whole sequences: use strategy 'ptdp' on "
                    f"Mesh(pp=..., dp=..., tp=..., cp=...) (the sequence split in every "
                    f"stage), or a mesh without cp"
                )
            group = group.group("pp")  # a Mesh
        self.group = group
        self.check_finite = check_policy(check_finite)
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
        if isinstance(model, (list, tuple)):  # stages cut by the caller: one per stage
            if len(model) != sched.stages:
                raise ValueError(
                    f"pipeline: {len(model)} stage modules given, but schedule "
                    f"{sched.name!r} with p={p} ranks and {sched.v} chunks runs "
                    f"{sched.stages} stages"
                )
            plan = stage_list_plan(model)
            split = list(range(1, len(model)))
        own = getattr(model, "plait_plan", None)
        if plan is None and callable(own):  # a model that carries its own plans
            plan = own("pipeline")
        assert isinstance(model, nn.Module) or plan is not None
        layers = layers_of(cast(nn.Module, model), plan)
        self.plan = plan
        self.plan_name = (plan.name if plan is not None else "") or type(model).__name__
        self._num_items: torch.Tensor | None = None
        self._mean_loss = True
        if loss_fn is None:
            if plan is None or plan.loss is None:
                raise ValueError(
                    f"pipeline: pass loss_fn=(output, target) -> mean loss for a "
                    f"{type(model).__name__}; its plan has no loss"
                )
            loss_fn = self._plan_loss(plan)
        if scaler is not None:
            loss_fn = self._scaled(loss_fn)
        part = partition(
            layers,
            sched.stages,
            by=split,
            sample=sample,
            context=None if plan is None else plan.context,
            schedule=sched,
        )
        self.partition = Partition(
            part.bounds, part.names, part.params, part.seconds, sched.placement
        )
        agree(
            {
                "schedule": sched.name,
                "microbatches": str(sched.m),
                "chunks": str(sched.v),
                "stage cut": str([list(b) for b in part.bounds]),
                "model": fingerprint(layers),
            },
            group,
        )
        rank = group.rank
        mine = sched.stages_of(rank)
        context = None if plan is None else plan.context
        extra = () if plan is None else plan.context_modules
        self.stages = nn.ModuleDict(
            {
                str(s): Stage(layers[a:b], s, context=context, context_modules=extra)
                for s, (a, b) in enumerate(part.bounds)
                if s in mine
            }
        )
        # a loss term over the whole batch (batch_loss.py): hooks on this rank's modules;
        # a caller composing more groups (PTD-P) extends the groups and sets the factors
        self.batch_loss: BatchLossHooks | None = None
        self.batch_loss_groups: list[Group] = [group]
        self.batch_loss_factor = 1.0  # the gradient its shares carry (the loss's factor)
        self.batch_loss_value_factor = 1.0  # its value's factor in the returned loss
        if plan is not None and plan.batch_loss is not None:
            self.batch_loss = BatchLossHooks(plan.batch_loss, rank=group.global_rank)
            self.batch_loss.install(list(self.stages.values()))
        tied = self._tied(layers, part, sched, rank)
        self._place(tied)
        # every parameter of the whole model in forward order, with its stage: names in
        # the non-finite message are the same on every rank
        self._names: list[tuple[str, int]] = []
        # the dense key of a shared parameter's later uses -> its first (a tied head ->
        # the embedding), for readers of a checkpoint that stores it once
        self.aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for s, (a, b) in enumerate(part.bounds):
            for layer in layers[a:b]:
                for dotted, module in layer.modules:
                    for n, prm in module.named_parameters():
                        if id(prm) not in first:
                            first[id(prm)] = f"{dotted}.{n}"
                            self._names.append((f"{dotted}.{n}", s))
                        elif first[id(prm)] != f"{dotted}.{n}":
                            self.aliases[f"{dotted}.{n}"] = first[id(prm)]
        index = {name: i for i, (name, _) in enumerate(self._names)}
        self._indexed = sorted(
            (index[n], prm)
            for stage in self.stages.values()
            for n, prm in stage.named_parameters()
            if n in index
        )
        self.skipped_steps = 0
        self.steps = 0
        self.last_nonfinite: str | None = None
        self.runtime = Runtime(
            sched,
            {int(k): v for k, v in self.stages.items()},  # type: ignore[misc]
            group=group,
            loss_fn=loss_fn,
            mean_loss=self._mean_loss,
            recompute=recompute,
            tracer=tracer,
            tied=tied,
            watch_forward=self.check_finite is not None,
        )
        every = [prm for layer in layers for _, m in layer.modules for prm in m.parameters()]
        if every and all(prm.is_meta for prm in every):
            # a meta model: the other ranks' stages run here (on meta) for their shapes
            self.runtime.shape_stages = {
                s: Stage(layers[a:b], s, context=context, context_modules=extra)
                for s, (a, b) in enumerate(part.bounds)
                if s not in mine
            }
        # check_finite's flags: on the device where a host read stalls it (:mod:`.finite`)
        self.flags_on_device = tuner.is_device_backend(group.backend)
        self._positions = Positions()
        if reproducible:  # each parameter's micro-batch gradients summed on the fixed tree
            self.runtime.microbatches = for_pipeline(sched.m)
            if threads is not None:
                torch.set_num_threads(threads)

    def _plan_loss(
        self, plan: PipelinePlan
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        assert plan.loss is not None
        if plan.reduction == "mean":
            return plan.loss
        self._mean_loss = False
        base = plan.loss

        def items_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return base(y, target, num_items=self._num_items)

        return items_loss

    def _scaled(
        self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``loss_fn`` times this step's loss scale: the backward of every micro-batch starts
        from the scaled loss (a power of two: exact away from overflow and subnormals)."""

        def scaled_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(y, target) * self._loss_scale

        return scaled_loss

    def _place(self, tied: list[tuple[nn.Parameter, int]]) -> None:
        """Split over pp: every parameter this rank keeps; a tied one also copied over the
        pair of ranks holding it (counted on the lower)."""
        pairs = {id(prm): peer for prm, peer in tied}
        me = self.group.rank
        for prm in self.parameters():
            placement.place(prm, shard=(self.group,))
            peer = pairs.get(id(prm))
            if peer is not None:
                ranks = (min(me, peer), max(me, peer))
                pair = TiedCopies(f"{self.group.name}.tied{list(ranks)}", ranks, ranks.index(me))
                placement.place(prm, replicate=(cast(Group, pair),))

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

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, **batch_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """One forward and backward of the global batch; returns the mean loss on every
        rank. Gradients accumulate into this rank's stages' ``.grad`` (zero them first).
        ``batch_inputs``: the plan's per-micro-batch inputs (``attention_mask=``, :mod:`.plan`).
        Collective over the ``pp`` group: every rank passes the same batch."""
        m = self.schedule.m
        extras = per_microbatch(self.plan, batch_inputs, rows=len(inputs), m=m, name=self.plan_name)
        if not self._mean_loss:
            assert self.plan is not None and self.plan.items is not None
            self._num_items = self.plan.items(targets)
            if int(self._num_items) == 0:
                raise ValueError(
                    f"pipeline: the batch has no loss items (every label is ignored) for "
                    f"{self.plan.name or 'the model'}'s loss; its mean is undefined"
                )
        xs = list(inputs.chunk(m))
        ys: list[torch.Tensor | None] = list(targets.chunk(m))
        self._loss_scale = self.scaler.scale_value if self.scaler is not None else 1.0
        hooks = self.batch_loss
        if hooks is not None:
            hooks.reset(next(self.parameters()).device)
            statistics_pass(self.runtime, xs, hooks, extras)
            hooks.totals = batch_totals(hooks, self.batch_loss_groups)
            hooks.factor = self.batch_loss_factor * self._loss_scale
            hooks.mode = "attach"
        try:
            loss = self.runtime.step(xs, ys, extras)
        finally:
            if hooks is not None:
                hooks.mode = "off"
        self.steps += 1
        if hooks is not None:
            hooks.verify(self.group)
        if self.check_finite is not None:
            self._check_finite()
        last = self.schedule.placement[self.schedule.stages - 1]
        ops.broadcast(loss, last, group=self.group)
        if self._loss_scale != 1.0:
            loss = loss / self._loss_scale
        if hooks is not None:
            assert hooks.totals is not None
            term = hooks.spec.value(hooks.totals).detach().to(loss)
            loss = loss + term * self.batch_loss_value_factor
        return loss

    @property
    def flags_on_device(self) -> bool:
        """``check_finite``'s flags kept on the device, read on the host once per step (on
        for device backends; gloo reads per forward and per gradient, cheaper on a CPU)."""
        return self.runtime.flags_on_device

    @flags_on_device.setter
    def flags_on_device(self, on: bool) -> None:
        self.runtime.flags_on_device = on

    def _check_finite(self) -> None:
        """Every rank learns where a non-finite value appeared and raises or skips alike.

        Per rank: the first (stage, micro-batch) whose forward output was not finite from a
        finite input, and the first parameter (forward order) whose gradient is not finite
        (on that path only, also the first parameter whose value is not finite). Collective:
        one all-reduce (sum) of ``4 * p`` int64 over the pp group, every step; with
        ``flags_on_device``, the value column goes in a second all-reduce (``p`` int64) on
        a flagged step only. Host reads: with ``flags_on_device`` one per step (whether
        anything is flagged), else one per watched forward and per gradient as well."""
        p = self.group.size
        where = control_device((prm for _, prm in self._indexed), self.group)
        flags = torch.zeros(p, 4, dtype=torch.int64, device=where)
        row = flags[self.group.rank]
        if self.flags_on_device:
            fill_on_device(row, self.runtime.forward_flags, self._indexed, self._positions)
        else:
            fill_on_host(row, self.runtime.nonfinite_forward, self._indexed)
        if p > 1:
            ops.all_reduce(flags, "sum", group=self.group)
        who = f"pipeline (group {self.group.name!r})"
        if not read_verdict(flags.any(), who=who)[0]:  # the one host read per step
            return
        if self.flags_on_device:  # a flagged step: name the bad values too
            values = torch.zeros(p, dtype=torch.int64, device=where)
            if bool(row[:3].any()):
                values[self.group.rank] = first_bad_value(self._indexed)
            if p > 1:
                ops.all_reduce(values, "sum", group=self.group)
            flags[:, 3] = values
        ranks = self.group.ranks
        found = []
        for r, (fs, fmb, g, v) in enumerate(flags.tolist()):
            who = f"rank {ranks[r]} (pp rank {r})"
            if v:
                name, s = self._names[v - 1]
                found.append(f"{who} holds a non-finite value in parameter {name!r} (stage {s})")
            if fs:
                found.append(
                    f"{who} stage {fs - 1} produced a non-finite output in micro-batch "
                    f"{fmb - 1} from a finite input"
                )
            if g:
                name, s = self._names[g - 1]
                found.append(f"{who} has a non-finite gradient in parameter {name!r} (stage {s})")
        policy = self.check_finite or "raise"
        then = (
            "every rank skipped this step (gradients set to None, so optimizer.step() leaves "
            "the parameters unchanged)"
            if policy == "skip"
            else "every rank raises. Look at the data and that stage's layers, lower the "
            "learning rate or clip gradients; pass check_finite='skip' to skip such steps on "
            "every rank, or check_finite=None when a loss scaler handles overflows"
        )
        message = f"pipeline: step {self.steps}: " + "; ".join(found) + f"; {then}."
        self.last_nonfinite = message
        rows = flags.tolist()
        culprits = [(ranks[r], self._names[row[2] - 1][0]) for r, row in enumerate(rows) if row[2]]
        if policy == "raise":
            raise NonFiniteGradientError(message, culprits)
        self.skipped_steps += 1
        for prm in self.parameters():
            prm.grad = None
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, **batch_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return self.step(inputs, targets, **batch_inputs)

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

    @property
    def split_reports(self) -> dict[int, SplitReport]:
        """Per stage of this rank that a zero-bubble schedule backwards as I + W: the
        modules that split and those that fall back to the fused backward, and why
        (``pipe.split_reports[0].describe()``)."""
        return self.runtime.split_reports


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
    microbatches=m, plan=...)``: the :class:`PipelineParallel` on ``mesh.group("pp")`` (or
    a ``Group``) and the optimizer re-created over this rank's stages: same class, one
    group per original group that keeps a parameter here, every group entry kept (per-group
    ``lr``, ``weight_decay``, ...), the constructor's defaults as the original's."""
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
    if not groups:
        raise ValueError(
            f"strategy 'pipeline': rank {pipe.group.global_rank} keeps no parameter of the "
            f"optimizer; build the optimizer on model.parameters() before plait.prepare"
        )
    cls: Any = type(optimizer)
    taken = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in taken}
    return pipe, cls(groups, **defaults)
