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
  expert ``e``        all-reduce (sum) over the ``dp`` group (the  sum / (p*d)
                      ``d`` ranks holding replicas of ``e``)
  ==================  ===========================================  =========================

  An expert's local gradient already sums the contributions of all ``p`` ranks' tokens (the
  all-to-all backward brought them), so summing over its ``d`` replicas covers every token
  once and dividing by ``p*d`` gives the gradient of the mean loss: the single-process
  gradient. One flat buffer per group and dtype, each followed by one float per parameter
  (1 if this rank has a gradient for it): a parameter no rank has a gradient for keeps
  ``.grad = None`` (so optimizers skip it, as PyTorch DDP does). Bytes per step on the ring:
  ``2 (n-1)/n`` times each buffer;
- at wrap: the non-expert parameters and buffers are broadcast from batch rank 0, the
  experts from dp rank 0 (every rank built the same seeded model; this makes sure).

Meshes with dimensions other than ``ep`` and ``dp`` are refused (composition with tensor and
pipeline parallelism is not done yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group
from plait.strategies.data_parallel import grad_sync
from plait.strategies.moe.layer import moe_layers, update_expert_bias
from plait.strategies.zero.groups import constructor_kwargs

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


def expert_parallel(model: nn.Module, *, mesh: Any, algorithm: str | None = None) -> nn.Module:
    """Split the experts of ``model``'s MoE layers over ``mesh``'s ``ep`` group, keep the rest
    data parallel (module docstring). In place; returns ``model``. Collective over the mesh.

    ``algorithm``: the all-to-all algorithm of every layer (``plait.comm`` names; None keeps
    each layer's own ``algorithm``) and that of the gradient all-reduces (None: ``"auto"``).
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            f"expert_parallel: {type(model).__name__} has no plait.moe.MoE layer; use a data-"
            f"parallel strategy, or build the model with MoE layers (GPTConfig(moe=...))"
        )
    ep_group, dp_group, batch_group = _groups(mesh)
    p, r = ep_group.size, ep_group.rank
    for name, moe in layers.items():
        E = moe.num_experts
        if E % p:
            raise ValueError(
                f"expert_parallel: layer {name!r} has num_experts={E}, not divisible by the "
                f"expert-parallel size ep={p}; choose ep dividing {E} or a multiple of {p} experts"
            )
        if len(moe.experts) != E:
            raise ValueError(f"expert_parallel: layer {name!r} is already expert-parallel")
    for moe in layers.values():
        local = moe.num_experts // p
        keep = [str(e) for e in range(r * local, (r + 1) * local)]
        moe.experts = nn.ModuleDict({k: moe.experts[k] for k in keep})
        moe.expert_group = ep_group
        moe.batch_index = batch_group.rank
        if algorithm is not None:
            moe.algorithm = algorithm
    expert_ids = {id(q) for moe in layers.values() for q in moe.experts.parameters()}
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
    )
    _broadcast(model, info, expert_ids)
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
    n = info.batch_group.size
    _reduce(info.other_params, info.batch_group, n, info.algorithm, "non-expert")
    _reduce(info.expert_params, info.dp_group, n, info.algorithm, "expert")


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
        flags = torch.tensor([q.grad is not None for q in qs], dtype=dtype, device=qs[0].device)
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
        used = flat[-len(qs) :]
        for q, has in zip(qs, used.tolist(), strict=True):
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
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``plait.prepare(model, optimizer, strategy="ep", mesh=Mesh(ep=p, dp=d))``.

    :func:`expert_parallel` in place, then the same optimizer class and hyper-parameters
    over the parameters this rank still holds (one parameter group, not yet stepped); with
    auxiliary-loss-free balancing on, :func:`update_expert_bias` runs after every step
    (an all-reduce of the loads over the batch group).
    """
    if optimizer is not None and (len(optimizer.param_groups) != 1 or optimizer.state):
        raise ValueError(
            "strategy 'ep' re-creates the optimizer over the experts this rank keeps: pass an "
            "optimizer with one parameter group that has not stepped yet"
        )
    expert_parallel(model, mesh=mesh, algorithm=algorithm)
    if optimizer is None:
        return model, None
    # the constructor takes only some of the defaults (AdamW: not decoupled_weight_decay)
    hyper = constructor_kwargs(
        type(optimizer),
        {k: v for k, v in optimizer.param_groups[0].items() if k in optimizer.defaults},
    )
    rebuilt = type(optimizer)(model.parameters(), **hyper)
    if any(m.bias_update_rate > 0 for m in moe_layers(model).values()):
        info: ExpertParallelInfo = model.plait_expert_parallel  # type: ignore[assignment]
        group = info.batch_group

        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            update_expert_bias(model, group=group)

        rebuilt.register_step_post_hook(after_step)
    return model, rebuilt


__all__ = ["ExpertParallelInfo", "expert_parallel", "prepare_ep"]
