"""Expert parallelism: the experts of every MoE layer split over the mesh's ``ep`` group,
everything else data parallel.

``expert_parallel(model, mesh=Mesh(ep=p, dp=d))`` (in place, collective over the mesh):

- every :class:`~plait.strategies.moe.MoE` keeps experts ``r*E/p .. (r+1)*E/p - 1`` on ep
  rank ``r`` (``E % p == 0`` or it refuses, naming both), and routes through the ep group
  (dispatch and combine all-to-alls, see :mod:`~plait.strategies.moe.dispatch`);
- the ``p * d`` ranks of the mesh each train on their own slice of the global batch: batch
  slice ``b = dp_rank * p + ep_rank`` (:attr:`ExpertParallelInfo.batch_rank`), which also
  seeds the MoE draws of its groups, so the run equals one process on the global batch;
- gradients, at the end of every backward (one callback; the loop is the plain
  ``loss.backward(); optimizer.step()``):

  ==================  ===========================================  =========================
  parameters          collective                                   result
  ==================  ===========================================  =========================
  non-expert          all-reduce (sum) over all ``p*d`` ranks      sum / (p*d): the average
  expert ``e``        all-reduce (sum) over the ``dp`` group (the  sum / d of (local / p)
                      ``d`` ranks holding replicas of ``e``)
  ==================  ===========================================  =========================

  An expert's local gradient already sums the contributions of all ``p`` ranks' tokens (the
  all-to-all backward brought them); a gradient hook scales each new contribution by
  ``1/p`` as it arrives, so averaging over its ``d`` replicas covers every token once and
  gives the gradient of the mean loss: the single-process gradient. Both reductions are
  averages over identical copies, so a gradient reduced in an earlier backward passes
  through unchanged: gradient accumulation (several ``backward`` calls, each on ``loss /
  micro_steps``, one ``step``) equals one process accumulating over the same micro-batches
  (micro-batch ``m`` of the global batch = every rank's ``m``-th; the load-balancing
  losses are functions of a whole micro-batch, so they are not those of the whole step's
  batch, in one process either). One flat buffer per
  group and dtype, each followed by one float per parameter
  (1 if this rank has a gradient for it): a parameter no rank has a gradient for keeps
  ``.grad = None`` (so optimizers skip it, as PyTorch DDP does). Bytes per step on the ring:
  ``2 (n-1)/n`` times each buffer, per backward;
- placement (:mod:`plait.strategies.placement`): experts are split over ``ep`` and copied
  over ``dp``, every other parameter copied over the ``p*d`` ranks, so
  ``plait.clip_grad_norm_(model.parameters(), max_norm)`` returns the global norm;
- non-finite gradients (``check_finite="raise"``, the default; ``"skip"``; None): after
  every backward's reductions, one all-reduce of ``p*d + 1`` int64 over the batch group;
  every rank raises (or skips) together, naming each rank whose own gradient held inf or
  NaN and its parameter;
- a model's own MoE blocks (``plan=`` a :class:`~plait.strategies.moe.plan.MoEPlan`:
  Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE): their stacked expert weights are sliced the
  same way and their router decides (:mod:`~plait.strategies.moe.stacked`);
- at wrap: every rank's list of parameters (names, shapes, dtypes) is compared over the
  ``p*d`` ranks (:func:`~plait.strategies.consistency.verify_same_parameters`, refused
  naming the first difference), then the non-expert parameters and buffers are broadcast
  from batch rank 0, the experts from dp rank 0 (every rank built the same seeded model;
  this makes sure).

Meshes with dimensions other than ``ep`` and ``dp`` are refused (composition with tensor and
pipeline parallelism is not done yet).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.device import control_device, host_list, read_verdict
from plait.comm.group import Group
from plait.renames import accepts_model
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.data_parallel import grad_sync
from plait.strategies.moe import stacked
from plait.strategies.moe.layer import moe_layers, update_expert_bias
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.placement import place

WHO = "expert_parallel"


@dataclass
class ExpertParallelInfo:
    """What :func:`expert_parallel` set up (``model.plait_expert_parallel``)."""

    ep_group: Group
    dp_group: Group | None
    batch_group: Group
    batch_rank: int
    expert_params: list[nn.Parameter]
    other_params: list[nn.Parameter]
    algorithm: str
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    check_finite: str | None = "raise"
    names: dict[int, str] = field(default_factory=dict)
    backwards: int = 0
    queued: bool = False

    @property
    def batch_size(self) -> int:
        """How many slices the global batch is split into (``p * d``)."""
        return self.batch_group.size


def _groups(mesh: Any) -> tuple[Group, Group | None, Group]:
    names = set(mesh.names)
    if "ep" not in names:
        raise ValueError(f"expert_parallel needs a mesh with an 'ep' dimension, got {mesh!r}")
    other = names - {"ep", "dp"}
    if other:
        raise ValueError(
            f"expert_parallel: mesh {mesh!r} has dimensions {sorted(other)}; expert "
            f"parallelism composes with 'dp' only so far: use Mesh(ep=..., dp=...)"
        )
    ep = mesh.group("ep")
    if "dp" not in names:
        return ep, None, ep
    dp = mesh.group("dp")
    sub = mesh.submesh("dp", "ep")
    return ep, dp, sub.group(*sub.names)


@accepts_model()
def expert_parallel(
    module: nn.Module,
    *,
    mesh: Any,
    algorithm: str | None = None,
    plan: MoEPlan | None = None,
    check_finite: str | None = "raise",
) -> nn.Module:
    """Split the experts of ``model``'s MoE layers over ``mesh``'s ``ep`` group, keep the rest
    data parallel (module docstring). In place; returns ``model``. Collective over the mesh.

    The MoE blocks are plait's own :class:`~plait.strategies.moe.MoE` layers, or, with
    ``plan`` (a :class:`~plait.strategies.moe.plan.MoEPlan`, what ``plait.prepare`` finds
    for Hugging Face Mixtral and Qwen-MoE), the model's own blocks with stacked experts
    (:mod:`~plait.strategies.moe.stacked`: the model's router decides, plait dispatches).
    ``algorithm``: the all-to-all algorithm of every layer (``plait.comm`` names; None keeps
    each layer's own ``algorithm``) and that of the gradient all-reduces (None: ``"auto"``).
    ``check_finite``: after every backward's reductions, ``"raise"``
    (:class:`~plait.strategies.data_parallel.grad_sync.NonFiniteGradientError` on every rank,
    naming each rank whose own gradient held inf or NaN and its parameter), ``"skip"``
    (every rank warns and sets the gradients to None, so ``optimizer.step()`` leaves the
    parameters unchanged) or None (no check: a loss scaler handles overflows). Costs one
    all-reduce of ``p*d + 1`` int64 per backward.
    """
    model = module
    check_finite = grad_sync.check_policy(check_finite)
    ep_group, dp_group, batch_group = _groups(mesh)
    p, r = ep_group.size, ep_group.rank
    layers = moe_layers(model)
    if not layers and plan is None:
        raise ValueError(
            f"expert_parallel: {type(model).__name__} has no plait.moe.MoE layer and no MoE "
            f"plan; use a data-parallel strategy, build the model with MoE layers "
            f"(GPTConfig(moe=...)), or pass plan=MoEPlan(experts=..., stacked=..., "
            f"run_expert=...) describing its own MoE blocks"
        )
    for name, moe in layers.items():
        E = moe.num_experts
        if E % p:
            raise ValueError(
                f"expert_parallel: layer {name!r} has num_experts={E}, not divisible by the "
                f"expert-parallel size ep={p}; choose ep dividing {E} or a multiple of {p} experts"
            )
        if len(moe.experts) != E:
            raise ValueError(f"expert_parallel: layer {name!r} is already expert-parallel")
    # every rank must hold the same model before anything is sliced or broadcast
    verify_same_parameters(model.named_parameters(), batch_group, who=WHO)
    replaced: dict[int, nn.Parameter] = {}
    expert_ids: set[int] = set()
    for moe in layers.values():
        local = moe.num_experts // p
        keep = [str(e) for e in range(r * local, (r + 1) * local)]
        moe.experts = nn.ModuleDict({k: moe.experts[k] for k in keep})
        moe.expert_group = ep_group
        moe.batch_index = batch_group.rank
        if algorithm is not None:
            moe.algorithm = algorithm
        expert_ids |= {id(q) for q in moe.experts.parameters()}
    if plan is not None:
        replaced = stacked.split(model, plan, group=ep_group, algorithm=algorithm or "auto")
        expert_ids |= {id(q) for q in replaced.values()}
        stacked.gather_router_logits(model, plan, group=batch_group, algorithm=algorithm or "auto")
    params = [q for q in model.parameters() if q.requires_grad]
    experts = [q for q in params if id(q) in expert_ids]
    others = [q for q in params if id(q) not in expert_ids]
    info = ExpertParallelInfo(
        ep_group=ep_group,
        dp_group=dp_group,
        batch_group=batch_group,
        batch_rank=batch_group.rank,
        expert_params=experts,
        other_params=others,
        algorithm=algorithm or "auto",
        replaced=replaced,
        check_finite=check_finite,
        names={id(q): n for n, q in model.named_parameters()},
    )
    _broadcast(model, info, expert_ids)
    for q in model.parameters():
        if id(q) in expert_ids:
            place(q, shard=(ep_group,), replicate=(dp_group,))
        else:
            place(q, replicate=(batch_group,))
    for q in experts:
        # an expert's gradient sums the tokens of all p ranks of its ep group: 1/p of it
        # here makes the reduction over its dp replicas an average (see _reduce_all)
        if p > 1:
            q.register_hook(lambda g, p=p: g / p)
    for q in params:
        q.register_post_accumulate_grad_hook(lambda _, info=info: _queue(info))
    object.__setattr__(model, "plait_expert_parallel", info)
    return model


def _broadcast(model: nn.Module, info: ExpertParallelInfo, expert_ids: set[int]) -> None:
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in expert_ids:
                if info.dp_group is not None:
                    comm.broadcast(t.data, 0, group=info.dp_group)
            elif info.batch_group.size > 1:
                comm.broadcast(t.data, 0, group=info.batch_group)


def _queue(info: ExpertParallelInfo) -> None:
    if not info.queued:
        info.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _reduce_all(info))


def _reduce_all(info: ExpertParallelInfo) -> None:
    info.queued = False
    info.backwards += 1
    ordered = [*info.other_params, *info.expert_params]
    before = None
    if info.check_finite is not None:  # this rank's own gradients, on the device
        where = control_device((q.grad for q in ordered if q.grad is not None), info.batch_group)
        before = grad_sync.first_nonfinite_flag([q.grad for q in ordered], device=where)
    # Both reductions are averages over the ranks holding copies, so they leave an
    # already-reduced gradient unchanged: accumulating micro-steps (reduced after every
    # backward, the new local part added on top) sums to the one-process gradient.
    _reduce(
        info.other_params, info.batch_group, info.batch_group.size, info.algorithm, "non-expert"
    )
    d = 1 if info.dp_group is None else info.dp_group.size
    _reduce(info.expert_params, info.dp_group, d, info.algorithm, "expert")
    if before is not None:
        _check_finite(info, ordered, before)


def _check_finite(
    info: ExpertParallelInfo, ordered: list[nn.Parameter], before: torch.Tensor
) -> None:
    """Every rank of the batch group raises (or skips) together when any rank's own gradient,
    or any reduced gradient, holds inf or NaN. Collective: one all-reduce (sum) of ``p*d + 1``
    int64 over the batch group: each rank's first non-finite parameter (+1) in its slot,
    and a count of ranks whose reduced gradients are not finite. The flags are found on the
    device (``before``: this rank's own gradients, before the reductions); the agreed row is
    read on the host once per step (:func:`plait.comm.device.read_verdict`, refused by name
    on meta), the names only on a flagged step."""
    group = info.batch_group
    after = grad_sync.first_nonfinite_flag([q.grad for q in ordered], device=before.device)
    flags = torch.zeros(group.size + 1, dtype=torch.int64, device=before.device)
    flags[group.rank] = before
    flags[-1] = (after > 0).to(torch.int64)
    if group.size > 1:
        comm.all_reduce(flags, "sum", group=group)
    agreed = read_verdict(flags, who=WHO)  # the one host read per step
    if not any(agreed):
        return
    dense = len(info.other_params)
    culprits = []
    for r, v in enumerate(agreed[:-1]):
        if v > 0:
            i = v - 1
            name = (
                info.names.get(id(ordered[i]), str(i))
                if i < dense
                else (
                    f"expert parameter #{i - dense} of that rank (here: "
                    f"{info.names.get(id(ordered[i]), str(i))})"
                )
            )
            culprits.append((group.ranks[r], name))
    at = int(after) - 1  # read on a flagged step only
    first_after = "" if at < 0 else info.names.get(id(ordered[at]), str(at))
    policy = info.check_finite or "raise"
    message = grad_sync.nonfinite_message(WHO, info.backwards, culprits, first_after, policy)
    if policy == "skip":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        for q in ordered:
            q.grad = None
        return
    raise grad_sync.NonFiniteGradientError(message, culprits)


def _reduce(
    params: Sequence[nn.Parameter], group: Group | None, divide: int, algorithm: str, what: str
) -> None:
    """Sum the gradients of ``params`` over ``group`` (flat, one buffer per dtype, a has-grad
    flag per parameter at its end) and divide by ``divide``."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for q in params:
        by_dtype.setdefault(q.dtype, []).append(q)
    for dtype, qs in by_dtype.items():
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in qs]
        local = [float(q.grad is not None) for q in qs]
        flags = torch.tensor(local, dtype=dtype, device=qs[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), flags])
        if group is not None and group.size > 1:
            seq = group.seq + 1
            try:
                comm.all_reduce(flat, group=group, algorithm=algorithm)
            except Exception as exc:
                raise grad_sync.collective_failure(
                    exc, who=WHO, what=f"the {what} gradient all-reduce", group=group, seq=seq
                ) from exc
        flat.div_(divide)
        offset = 0
        # which parameters some rank had a gradient for: read on the host (a GPU waits here)
        used = host_list(flat[-len(qs) :], local)
        for q, has in zip(qs, used, strict=True):
            n = q.numel()
            if has > 0:
                q.grad = flat[offset : offset + n].view_as(q).clone()
            offset += n


def prepare_ep(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: Any,
    algorithm: str | None = None,
    plan: MoEPlan | None = None,
    check_finite: str | None = "raise",
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``plait.prepare(model, optimizer, strategy="ep", mesh=Mesh(ep=p, dp=d))``.

    :func:`expert_parallel` in place (with ``plan`` for a model's own MoE blocks), then the
    same optimizer class over the parameters this rank still holds: one group per original
    group, every group entry kept (per-group ``lr``, ``weight_decay``, ...), a sliced
    stacked expert weight in the group of the weight it was cut from; the optimizer must
    not have stepped yet. With auxiliary-loss-free balancing on, :func:`update_expert_bias`
    runs after every step (an all-reduce of the loads over the batch group).
    """
    if optimizer is not None and optimizer.state:
        raise ValueError(
            "strategy 'ep' re-creates the optimizer over the experts this rank keeps: pass an "
            "optimizer that has not stepped yet (load its state after prepare)"
        )
    expert_parallel(model, mesh=mesh, algorithm=algorithm, plan=plan, check_finite=check_finite)
    if optimizer is None:
        return model, None
    info: ExpertParallelInfo = model.plait_expert_parallel  # type: ignore[assignment]
    held = {id(q) for q in model.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [info.replaced.get(id(q), q) for q in group["params"]]
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [q for q in params if id(q) in held],
            }
        )
    cls = type(optimizer)
    taken = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in taken}
    rebuilt = cls(groups, **defaults)
    if any(m.bias_update_rate > 0 for m in moe_layers(model).values()):
        batch = info.batch_group

        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            update_expert_bias(model, group=batch)

        rebuilt.register_step_post_hook(after_step)
    return model, rebuilt


__all__ = ["ExpertParallelInfo", "expert_parallel", "prepare_ep"]
