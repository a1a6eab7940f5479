"""PTD-P: tensor (+ sequence) parallelism over ``tp``, pipeline stages over ``pp``, data
parallelism over ``dp``, on one ``Mesh(pp=.., dp=.., tp=..)`` (Narayanan et al. 2021).

::

    mesh = plait.Mesh(pp=2, dp=2, tp=2)                  # 8 ranks; tp adjacent, pp apart
    model = GPT(cfg)
    ptdp = compose(model, torch.optim.Adam(model.parameters(), lr=1e-3), mesh=mesh,
                   schedule="1f1b", microbatches=4, zero=1)
    opt = ptdp.optimizer
    for ids, targets in batches:                         # the same global batch on every rank
        opt.zero_grad()
        loss = ptdp.step(ids, targets)                   # this rank's dp rows, pipelined
        ptdp.clip_grad_norm_(1.0)                        # the dense model's global norm
        opt.step()
    state = ptdp.full_state_dict()                       # the dense GPT's keys, every rank
    ptdp.save(root, step=n)                              # a plait.checkpoint, any layout

Any model with plans (DESIGN decision 7: PTD-P knows no model). A Hugging Face
``LlamaForCausalLM`` (or Mistral, Qwen2, Qwen3, GPT-2) handed over whole::

    model = LlamaForCausalLM(config)                     # same seed on every rank
    ptdp, opt = plait.prepare(model, torch.optim.AdamW(groups), strategy="ptdp",
                              mesh=plait.Mesh(pp=2, dp=1, tp=2), microbatches=4)
    loss = ptdp.step(input_ids, labels)                  # the model's own labels= loss
    loss = ptdp.step(input_ids, labels, attention_mask=mask)   # a padded batch

A padded batch's ``attention_mask`` (a per-micro-batch input of the pipeline plan,
:mod:`plait.strategies.pipeline.plan`) is cut into each replica's rows as the ids are,
then into micro-batches on every stage: no communication.

``plait.prepare`` passes ``plans=plait.models.plans.plan_for`` (the families plait knows);
``compose(model, opt, mesh=..., plans=plan_for)`` is the same. Without ``plans`` the model's
own ``plait_plan(kind)`` is asked (plait's GPT carries one). The *pipeline plan*
(:class:`~plait.strategies.pipeline.PipelinePlan`) gives the layers the stages are cut
from, the per-stage context (rotary embeddings, causal masks, rebuilt on each stage) and the
model's own loss (a mean per micro-batch, or Hugging Face's sum over the items of the whole
global batch: counted here over every dp replica's rows, so ignored labels may fall
unevenly); the *tensor-parallel plan* (:class:`~plait.strategies.tensor.TensorPlan` or a
mapping) the splits, checked against ``tp`` before any group is used. The pipeline plan is
asked again after the tensor-parallel cut, so its layers hold the parallel modules.

Context parallelism (a ``cp`` dimension, ``context="ring"|"ulysses"``): the sequence split
in every stage (:mod:`.context`; plait's GPT and the Hugging Face Llama family, whose
labels ``step`` shifts over the whole sequence before cutting them).

MoE blocks (``GPTConfig(moe=MoEConfig(...))``): ``Mesh(pp=.., dp=.., ep=.., tp=..)``; the
batch is cut over ``dp * ep``, experts split over ``ep`` (:mod:`.experts`). Loss scaling:
``compose(..., scaler=plait.amp.DynamicLossScaler())`` and ``scaler.step(opt)``
(:mod:`.scaling`). Checkpoints: :meth:`PTDP.save` / :meth:`PTDP.load` (:mod:`.state`).

How the parts meet: the dense model (same seed on every rank) is first cut by
:func:`plait.parallelize` over ``mesh.group("tp")`` (its tensor-parallel plan; sequence
parallelism on request), then its layers are grouped into stages by
:class:`~plait.strategies.pipeline.PipelineParallel` over ``mesh.group("pp")`` with the
loss of its pipeline plan (plait's GPT: the vocab-parallel cross-entropy of its
vocabulary-split head; Hugging Face: ``model.loss_function`` on the gathered logits). Each
``step`` gives the pipeline this rank's ``B / dp`` rows of the global batch. The gradients
are then averaged over ``mesh.group("dp")``: with ``zero=0`` by one all-reduce of all this
rank's gradients (flattened) before the optimizer step; with ``zero=1`` (or ``2`` with
``pp=1``, one micro-batch) by :class:`~plait.strategies.zero.ZeroOptimizer` on the dp group
(Megatron's distributed optimizer: a reduce-scatter of the gradients, Adam on this rank's
1/dp of the state, an all-gather of the parameters).

Communication contract, per step, on the groups of this rank:

=====  ====================================================  ==================================
group  forward and backward (every ``step``)                 once per optimizer step
=====  ====================================================  ==================================
tp     the layers' f/g: an all-reduce of b*s*h per block     ``clip_grad_norm_``: one scalar
       each way (SP: all-gather + reduce-scatter instead),   all-reduce
       the vocab-parallel cross-entropy's three small ones
pp     activations and their gradients between neighbour     ``clip_grad_norm_``: one scalar
       stages (b/m*s*h per micro-batch, /tp under SP), the   all-reduce
       tied gradient exchange, the loss broadcast
dp     one all-reduce of the mean loss (a scalar)            zero=0: one all-reduce of this
                                                             rank's gradients; zero=1/2: a
                                                             reduce-scatter of them, then an
                                                             all-gather of the parameters
ep     per MoE layer and micro-batch: an all-gather of 2E    one scalar all-reduce in
       int64 counts, the dispatch and combine all-to-alls    ``clip_grad_norm_``
       (kept rows only) each way (moe/dispatch.py)
dp x   one all-reduce of the mean loss (with ep > 1, instead  with MoE: the non-expert
ep     of dp's)                                              gradients all-reduced here, the
                                                             experts' over dp (one buffer +
                                                             one flag per parameter each)
all    (loss scaling) one scalar all-reduce (max) of the     (see :mod:`.scaling`)
       found-inf flag per group of the mesh
=====  ====================================================  ==================================

Reproducible mode (``reproducible=True``, tp = 1): each replica's pipeline sums its
contiguous block of micro-batches on the fixed tree and ``sync_gradients`` adds the
replicas' sums by a tree-ordered all-reduce over dp, so the parameters are bitwise those of
one process on the same ``dp * microbatches`` micro-batches (:mod:`.reproducible`, which
also names what is refused: tp > 1, ZeRO, MoE, a scaler, a non-mean loss, a tied head on
two stages; then accumulation and ``clip_grad_norm_``).

Gradient accumulation: several ``step`` calls before ``optimizer.step()`` leave the
gradient of the mean loss over the union of their batches (the average is taken, and the
dp all-reduce sent, once, when ``clip_grad_norm_`` or ``optimizer.step()`` first needs
it). Read ``.grad`` after ``sync_gradients()``: before it, a rank holds its own rows' sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.amp import DynamicLossScaler
from plait.comm import ops
from plait.comm.group import Group
from plait.renames import accepts_model
from plait.strategies.compose import gradients, state
from plait.strategies.compose.agreement import check_agreement, describe_plan
from plait.strategies.compose.check import (
    Sizes,
    check_batch,
    check_layout,
    complete_mesh,
    mesh_sizes,
    plan_source,
    resolve_plans,
    shared_between_layers,
)
from plait.strategies.compose.context import (
    average_group,
    check_context,
    cut_sequences,
    replica_group,
)
from plait.strategies.compose.dense import (
    Counted,
    DenseGroup,
    DenseIndex,
    assemble,
    count_params,
    dense_groups,
    skeleton,
    unsliced_parameters,
)
from plait.strategies.compose.experts import (
    MicroBatches,
    expert_owner,
    shard_experts,
    shard_stacked,
)
from plait.strategies.compose.reproducible import check_reproducible
from plait.strategies.compose.scaling import Unscaler, install, scaled_plan
from plait.strategies.context import context_parallel
from plait.strategies.moe.layer import moe_layers
from plait.strategies.pipeline import PipelineParallel
from plait.strategies.pipeline.plan import check_rows, given
from plait.strategies.tensor import parallelize
from plait.strategies.tensor.multi_query import MultiQueryLinear
from plait.strategies.zero import ZeroOptimizer
from plait.strategies.zero.groups import constructor_kwargs


class PTDP:
    """A model trained on a (pp, dp, tp) mesh; build it with :func:`compose`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mesh: Any,
        tp_plan: Any = None,
        plans: Callable[..., Any] | None = None,
        sequence_parallel: bool = False,
        schedule: str = "1f1b",
        microbatches: int = 1,
        chunks: int | None = None,
        zero: int = 0,
        scaler: DynamicLossScaler | None = None,
        tp_mode: str = "1d",
        algorithm: str = "auto",
        check_finite: str | None = "raise",
        reproducible: bool = False,
        context: str = "ring",
        balanced: bool = True,
        positions: str | bool | None = None,
        recompute: bool = False,
    ) -> None:

        mesh = complete_mesh(mesh)  # Mesh(pp=2, tp=2) means dp=1
        _, _, tp, _ = mesh_sizes(mesh.shape)
        # the model's plans (DESIGN 7: ptdp knows no model); the pipeline plan is asked
        # again after the cut below, so that its layers hold the tensor-parallel modules
        tplan, dense_pipeline = resolve_plans(
            model, plans=plans, tp=tp, sequence_parallel=sequence_parallel, tp_plan=tp_plan
        )
        self.sizes: Sizes = check_layout(
            model,
            shape=mesh.shape,
            microbatches=microbatches,
            zero=zero,
            schedule=schedule,
            chunks=chunks,
            sequence_parallel=sequence_parallel,
            custom_plan=tp_plan is not None,
            tp_mode=tp_mode,
            plans=plans,
            tp_plan=tplan,
            pipeline_plan=dense_pipeline,
        )
        self.reproducible = reproducible
        check_context(
            cp=self.sizes.cp,
            zero=zero,
            reproducible=reproducible,
            moe=bool(moe_layers(model)),
            plan=dense_pipeline,
            positions=positions,
            buffers=tuple(n for n, _ in model.named_buffers()),
            name=type(model).__name__,
        )
        self.balanced = balanced
        if reproducible:
            s = self.sizes
            check_reproducible(
                pp=s.pp,
                dp=s.dp,
                tp=s.tp,
                ep=s.ep,
                microbatches=microbatches,
                zero=zero,
                moe=bool(moe_layers(model)),
                scaler=scaler is not None,
                reduction=dense_pipeline.reduction,
                tied=shared_between_layers(list(dense_pipeline.layers)),
            )
        if optimizer.state:
            raise ValueError(
                "ptdp re-creates the optimizer on this rank's shards: pass an optimizer that "
                "has not stepped yet (load a saved state afterwards with PTDP.load_state_dict "
                "or PTDP.load)"
            )
        self.dense_groups: list[DenseGroup] = dense_groups(model, optimizer)
        settings = {
            "mesh": repr(mesh.shape),
            "schedule": schedule,
            "microbatches": microbatches,
            "chunks": chunks,
            "zero": zero,
            "tp_mode": tp_mode,
            "sequence_parallel": sequence_parallel,
            "tp_plan": None if tp_plan is None else describe_plan(tp_plan),
            "pipeline plan": dense_pipeline.structure(),
            "optimizer": f"{type(optimizer).__name__}, parameter groups of "
            f"{[len(g.names) for g in self.dense_groups]} parameters",
            "loss scaling": scaler is not None,
            "algorithm": algorithm,
            "reproducible": reproducible,
            "context": f"{context}, balanced={balanced}" if self.sizes.cp > 1 else None,
            "recompute": recompute,
        }
        check_agreement(model, settings, mesh)
        self.mesh = mesh
        self.algorithm = algorithm
        self.scaler = scaler
        self.tp_group, self.pp_group = mesh.group("tp"), mesh.group("pp")
        self.dp_group = mesh.group("dp")
        self.ep_group: Group | None = mesh.group("ep") if self.sizes.ep > 1 else None
        self.cp_group: Group | None = mesh.group("cp") if self.sizes.cp > 1 else None
        # the batch is cut over dp x ep; the dense gradients average over the same ranks
        self.batch_group: Group = (
            mesh.submesh("dp", "ep").group("dp", "ep") if self.ep_group else self.dp_group
        )
        self.batch_rank = mesh.rank("dp") * self.sizes.ep + (
            mesh.rank("ep") if self.ep_group else 0
        )
        # the ranks averaging dense gradients and the loss: the batch group, and with
        # context parallelism its cp ranks too (other tokens of the same rows; .context)
        self.average_group: Group = (
            average_group(mesh, ep=self.ep_group is not None)
            if self.sizes.cp > 1
            else self.batch_group
        )
        # the ranks holding the same experts (split over ep): dp, and under cp dp x cp
        self.expert_group: Group = (
            replica_group(mesh, ("dp", "cp")) if self.sizes.cp > 1 else self.dp_group
        )
        dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # the dense model's structure on the meta device: what save/load rebuild (state.py)
        self.skeleton = skeleton(model)
        # the dense optimizer's parameter order: its groups one after the other
        self.param_names = [n for g in self.dense_groups for n in g.names]
        # state-dict keys of a shared parameter (a tied head) -> its parameter name
        names = {id(p): n for n, p in model.named_parameters()}
        self.aliases = {
            k: names[id(v)] for k, v in model.state_dict(keep_vars=True).items() if id(v) in names
        }
        self.config: Any = getattr(model, "config", None)
        self.optimizer_class = type(optimizer)
        layers_moe = moe_layers(model)
        experts = shard_experts(model, ep_group=self.ep_group)
        # the model's own sparse blocks (an MoE plan: stacked experts) split over ep
        self.stacked: list[str] = []
        if self.ep_group is not None and not layers_moe:
            own_moe = plan_source(model, plans)("moe")
            assert own_moe is not None  # check_layout refused ep > 1 without one
            ids, self.stacked = shard_stacked(
                model, own_moe, ep_group=self.ep_group, algorithm=algorithm
            )
            experts |= ids
        if self.sizes.tp > 1:
            parallelize(model, self.tp_group, tplan, algorithm=algorithm)
            _refuse_multi_query(model)
        if self.sizes.cp > 1:  # each stage's attention over the cp group (.context)
            # a plan reading position_ids places them itself (step passes the rank's)
            where = False if "position_ids" in dense_pipeline.inputs else positions
            context_parallel(model, mesh=mesh, context=context, balanced=balanced, positions=where)
        # parameters whose shards are no contiguous slice of the dense tensor (state.py)
        self.unsliced = unsliced_parameters(model)
        stages_plan = plan_source(model, plans)("pipeline")
        self.pipe_inputs: tuple[str, ...] = stages_plan.inputs
        self.shifts_labels = stages_plan.shifts_labels
        layers = list(stages_plan.layers)
        self._loss_scale = 1.0
        self._count_items: Any = None  # the plan's loss-item count, over the global batch
        self._num_items: torch.Tensor | None = None
        self.pipe = PipelineParallel(
            model,
            group=self.pp_group,
            schedule=schedule,
            microbatches=microbatches,
            chunks=chunks,
            plan=self._scaled(stages_plan),
            check_finite=None,  # per pp group only; ptdp's scaler and dp replicas decide
            reproducible=reproducible,
            recompute=recompute,
        )
        if self.pipe.batch_loss is not None:
            # a loss term over the whole batch (an MoE load-balancing loss): its statistics
            # summed over the stages, the replicas and, under sequence parallelism, the
            # tensor-parallel ranks' slices of the sequence
            sp_group = [self.tp_group] if sequence_parallel and self.sizes.tp > 1 else []
            self.pipe.batch_loss_groups = [self.pp_group, *sp_group, self.average_group]
        part = self.pipe.partition
        assert part.placement is not None
        self.index = DenseIndex.record(dense, layers, part.bounds, part.placement)
        del dense
        stages = list(self.pipe.stages.values())
        held = {id(m) for stage in stages for m in stage.modules()}
        local_moe = {n: m for n, m in layers_moe.items() if id(m) in held}
        self.moe = (
            MicroBatches(
                local_moe,
                microbatches=microbatches,
                replicas=self.sizes.replicas,
                batch_rank=self.batch_rank,
            )
            if local_moe
            else None
        )
        self.expert_owner: dict[str, int] = {}
        for key in self.index.shapes:
            owner = expert_owner(key, local_moe, self.sizes.ep)
            if owner is not None:
                self.expert_owner[key] = owner
        tied = {id(p): peer for p, peer in self.pipe.runtime.tied}
        self.counted: list[Counted] = count_params(
            stages,
            self.index,
            tp_rank=self.tp_group.rank,
            tied_peers=tied,
            pp_rank=self.pp_group.rank,
            experts=experts,
            ep_rank=self.ep_group.rank if self.ep_group else 0,
        )
        # the optimizer over this rank's shards: one group per dense group (every group
        # entry kept), each shard in its dense parameter's group, in the dense order
        position = {self.aliases.get(c.name, c.name): i for i, c in enumerate(self.counted)}
        self.opt_order: list[int] = []  # optimizer parameter j -> self.counted index
        local_groups = []
        for g in self.dense_groups:
            mine = [position[n] for n in g.names if n in position]
            self.opt_order += mine
            local_groups.append({**g.options, "params": [self.counted[i].param for i in mine]})
        # the constructor takes only some of the defaults (AdamW: not decoupled_weight_decay)
        hyper = constructor_kwargs(type(optimizer), dict(optimizer.defaults))
        self.hyper = hyper
        if zero:
            self.optimizer: torch.optim.Optimizer = ZeroOptimizer(
                local_groups,
                type(optimizer),
                stage=zero,
                group=self.dp_group,
                algorithm=algorithm,
                **hyper,
            )
        else:
            self.optimizer = type(optimizer)(local_groups, **hyper)
        sharded_unscale = self.optimizer.unscale_grads_ if zero else None  # type: ignore[attr-defined]
        self._sharded_unscale = sharded_unscale
        self.optimizer.register_step_pre_hook(lambda *_: self.sync_gradients())
        if check_finite not in ("raise", "skip", None):
            raise ValueError(f"ptdp: check_finite={check_finite!r}; use 'raise', 'skip' or None")
        # with a loss scaler, the scaler decides (every rank skips a step on any inf); under
        # ZeRO each rank holds only its shard after the optimizer's own reduce-scatter
        self.check_finite = check_finite if scaler is None and not zero else None
        if self.check_finite is not None:
            self.optimizer.register_step_pre_hook(lambda *_: self._check_finite())
        self.unscaler = Unscaler(
            self.parameters,
            groups=self.mesh_groups(),
            algorithm=algorithm,
            sync=self.sync_gradients,
            sharded=sharded_unscale,
        )
        install(self.optimizer, self.unscaler)
        self._pending = 0  # steps whose gradients are not yet averaged
        # zero_grad drops the gradients of the pending steps, so it forgets them too (a
        # step taken only to evaluate, then zero_grad, must not scale the next ones by 1/2)
        zero_grad = self.optimizer.zero_grad

        def forget_and_zero(set_to_none: bool = True) -> None:
            self._pending = 0
            self.unscaler.reset()
            zero_grad(set_to_none)

        self.optimizer.zero_grad = forget_and_zero  # type: ignore[method-assign]

    def _scaled(self, plan: Any) -> Any:
        """See :func:`.scaling.scaled_plan`."""
        return scaled_plan(self, plan)

    def _check_finite(self) -> None:
        """See :func:`.gradients.check_finite`."""
        gradients.check_finite(self)

    def mesh_groups(self) -> list[Group]:
        """The groups of this rank, one per mesh dimension (tp, pp, ep, cp, dp)."""
        groups = [self.tp_group, self.pp_group]
        groups += [g for g in (self.ep_group, self.cp_group) if g is not None]
        return groups + [self.dp_group]

    # --- training ------------------------------------------------------------------------
    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, **batch_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward and backward of this rank's dp rows of the global batch ``inputs`` /
        ``targets`` (the same on every rank) through the pipeline (the loss multiplied by
        the scaler's scale, if any); returns the mean loss over the global batch, unscaled,
        on every rank. ``batch_inputs``: per-micro-batch inputs of the pipeline plan (a
        padded batch's ``attention_mask=``), cut into the same rows (no communication).
        Gradients accumulate (zero them with the optimizer). Collective over the whole mesh."""
        check_batch(inputs, targets, self.sizes)
        extras = given(batch_inputs)
        check_rows(extras, inputs.shape[0], where="ptdp.step")
        if self.reproducible and self._pending:
            raise ValueError(
                "ptdp.step (reproducible=True): a second step before optimizer.step(); "
                "accumulating two steps adds two trees one after the other, another order "
                "than one process's single tree. Give one step the whole global batch (raise "
                "microbatches, a power of two) and step the optimizer after each"
            )
        if self.unscaler.found is not None:
            raise RuntimeError(
                "ptdp.step: the gradients were already unscaled for this optimizer step "
                "(clip_grad_norm_ or the scaler); step the optimizer (scaler.step(opt)) or "
                "zero_grad before the next step"
            )
        if self._count_items is not None:
            self._num_items = self._count_items(targets)  # the global batch's loss items
            if int(self._num_items) == 0:
                raise ValueError(
                    "ptdp.step: the global batch has no loss items (every label is ignored); "
                    "its mean loss is undefined"
                )
        rows = inputs.shape[0] // self.sizes.replicas
        d = self.batch_rank
        self._loss_scale = self.scaler.scale_value if self.scaler is not None else 1.0
        if self.moe is not None:
            self.moe.start(pending=self._pending, loss_scale=self._loss_scale)
        # a batch loss term's shares carry the loss's factor (replicas averaged, scale);
        # its value is added once per replica, summed over them below
        self.pipe.batch_loss_factor = self.sizes.averaged * self._loss_scale
        self.pipe.batch_loss_value_factor = self._loss_scale
        try:
            mine = slice(d * rows, (d + 1) * rows)
            x, y = inputs[mine], targets[mine]
            rows_inputs = {k: v[mine] for k, v in extras.items()}
            if self.sizes.cp > 1:  # this rank's part of every sequence (.context)
                x, y, rows_inputs = cut_sequences(
                    x,
                    y,
                    rows_inputs,
                    mesh=self.mesh,
                    balanced=self.balanced,
                    shifts_labels=self.shifts_labels,
                    positions="position_ids" in self.pipe_inputs,
                )
            loss = self.pipe.step(x, y, **rows_inputs).detach()
        finally:
            if self.moe is not None:
                self.moe.finish()
        ops.all_reduce(loss, "sum", group=self.average_group, algorithm=self.algorithm)
        self._pending += 1
        return loss / (self.sizes.averaged * self._loss_scale)

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor, **batch_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return self.step(inputs, targets, **batch_inputs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Make the gradients the dense gradient of the mean loss over every batch since
        the last optimizer step: divided by the number of ``step`` calls, averaged over dp
        (zero=0: one all-reduce of the flattened gradients; with MoE blocks one over
        dp x ep for the dense ones and one over dp for the experts, :mod:`.experts`; under
        ZeRO the optimizer reduce-scatters them itself). Runs by itself before
        ``optimizer.step()`` and in ``clip_grad_norm_``; a no-op when nothing is pending.
        Collective over dp (and dp x ep)."""
        gradients.sync_gradients(self)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the dense model's global norm; return that norm (the
        same on every rank). Each element of the dense gradient is counted once (see
        :mod:`.dense`). Collective over the whole mesh: the gradient sync if pending, then
        one scalar all-reduce over tp and pp (and dp under ZeRO)."""
        return gradients.clip_grad_norm(self, max_norm, norm_type)

    # --- state -----------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stages' shards), each once."""
        return [c.param for c in self.counted]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict (its keys, shapes and order) on every rank.
        Collective over tp (all-gathers) and pp (broadcasts); dp replicas agree."""
        return assemble(
            list(self.pipe.stages.values()),
            self.index,
            pp_group=self.pp_group,
            algorithm=self.algorithm,
            ep_group=self.ep_group,
            expert_owner=self.expert_owner,
            stacked=self.stacked,
        )

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}``: the dense model's state dict and the plain
        optimizer's over its parameters, the same on every rank (:mod:`.state`).
        Collective over the whole mesh."""

        return state.state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Keep this rank's part of a :meth:`state_dict` from any layout (or of a dense
        model's and its optimizer's, from one process). No communication."""

        state.load_state_dict(self, dict(state_dict["model"]), state_dict.get("optimizer"))

    def save(self, root: str | Path, *, step: int, **options: Any) -> Path:
        """A :mod:`plait.checkpoint` of the dense state, loadable into any layout or
        strategy (:func:`.state.save`). Collective over the mesh."""

        return state.save(self, root, step=step, **options)

    def load(self, root: str | Path, **options: Any) -> Any:
        """Load a :mod:`plait.checkpoint` of a dense model and its optimizer, saved by any
        layout or strategy, into this one (:func:`.state.load`). Collective."""

        return state.load(self, root, **options)

    def __repr__(self) -> str:
        s = self.sizes
        return (
            f"PTDP(pp={s.pp}, dp={s.dp}, ep={s.ep}, tp={s.tp}, "
            f"schedule={self.pipe.schedule.name!r}, microbatches={s.microbatches}, "
            f"zero={s.zero}, sequence_parallel={s.sequence_parallel})"
        )


@accepts_model()
def compose(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    mesh: Any,
    tp_plan: Any = None,
    plans: Callable[..., Any] | None = None,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    microbatches: int = 1,
    chunks: int | None = None,
    zero: int = 0,
    scaler: DynamicLossScaler | None = None,
    tp_mode: str = "1d",
    algorithm: str = "auto",
    check_finite: str | None = "raise",
    reproducible: bool = False,
    context: str = "ring",
    balanced: bool = True,
    positions: str | bool | None = None,
    recompute: bool = False,
) -> PTDP:
    """``module`` (built with the same seed on every rank: plait's GPT, a Hugging Face
    causal LM handed over whole, any model with plans) trained on ``mesh``
    (``Mesh(pp=.., dp=.., tp=..)``; a dimension left out has size 1, so ``Mesh(pp=2,
    tp=2)`` is dp=1: :func:`~plait.strategies.compose.check.complete_mesh`) as PTD-P; see
    the module docstring.

    ``plans``: ``(model, kind, **options) -> plan or None``, where the model's
    ``"pipeline"`` and ``"tp"`` plans come from (``plait.models.plans.plan_for``; default:
    the model's own ``plait_plan``). ``tp_plan``: the tensor-parallel plan, instead of the
    model's (with ``sequence_parallel``, mark the sequence regions in it);
    ``schedule``/``microbatches``/``chunks``: the pipeline's (``microbatches`` per dp
    replica per step); ``zero``: 0 (all-reduce over dp), 1 or 2
    (:class:`~plait.strategies.zero.ZeroOptimizer` over dp; 2 only with ``pp=1`` and
    ``microbatches=1``); ``algorithm``: the collectives' algorithm. ``check_finite``:
    ``"raise"`` (default), ``"skip"`` or None: a non-finite gradient on any rank, before the
    optimizer step, stops or skips the step on every rank naming the ranks (not applied with
    a ``scaler``, which skips on inf itself, nor under ZeRO). ``optimizer``: built on every
    parameter of the model, in any number of groups, not stepped; it is re-created on this
    rank's shards as ``.optimizer``: same class and constructor defaults, one group per
    group, each group's entries kept (``lr``, ``weight_decay``, ...). Refuses, naming the
    constraint, what the mesh cannot build (:mod:`.check`). ``reproducible``: bitwise the
    same parameters as one process for every dp x pp layout (tp = 1, zero=0, no MoE, a
    mean loss, one ``step`` per optimizer step; :mod:`.reproducible`). ``context`` /
    ``balanced`` / ``positions``: with a ``cp`` dimension in the mesh, the attention kernel
    (``"ring"`` or ``"ulysses"``), the causal load balancing, and the module embedding
    position ids (plait's GPT: ``"pos"``, which ``prepare`` fills in) (:mod:`.context`).
    ``recompute``: every stage keeps only its input between a micro-batch's forward and
    backward and reruns its forward (with its collectives) before the backward: full
    activation recomputation at stage granularity.
    Collective over the mesh.
    """
    model = module
    return PTDP(
        model,
        optimizer,
        mesh=mesh,
        tp_plan=tp_plan,
        plans=plans,
        sequence_parallel=sequence_parallel,
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
        zero=zero,
        scaler=scaler,
        tp_mode=tp_mode,
        algorithm=algorithm,
        check_finite=check_finite,
        reproducible=reproducible,
        context=context,
        balanced=balanced,
        positions=positions,
        recompute=recompute,
    )


def prepare_ptdp(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, **options: Any
) -> tuple[PTDP, torch.optim.Optimizer]:
    """``plait.prepare(model, optimizer, strategy="ptdp", mesh=..., ...)``: the
    :class:`PTDP` (train with ``.step(x, y)``) and its optimizer."""
    if optimizer is None:
        raise ValueError(
            "strategy 'ptdp' re-creates the optimizer on this rank's shards: pass the "
            "optimizer built on model.parameters()"
        )
    ptdp = compose(model, optimizer, **options)
    return ptdp, ptdp.optimizer


def _refuse_multi_query(model: nn.Module) -> None:
    """PTD-P's parameter accounting (counting, norms, optimizer groups, state) maps each
    parameter to one dense tensor; a multi-query layer's key/value rows (``tail_weight``,
    whole on every tp rank beside the split query rows) have no such map yet."""
    found = [n for n, m in model.named_modules() if isinstance(m, MultiQueryLinear)]
    if found:
        raise NotImplementedError(
            f"ptdp: {found[0]!r} (and {len(found) - 1} more) is a multi-query attention "
            "projection whose single key/value head stays whole on every tp rank; PTD-P does "
            "not account for such parameters yet. Use tp=1 inside ptdp (pp x dp), or "
            "strategy='tp' or 'pipeline' alone, which run this model exactly"
        )
