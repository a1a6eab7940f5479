"""MoE blocks inside PTD-P: experts split over the mesh's ``ep`` dimension, carved out of
data parallelism (as Megatron and DeepSpeed do).

On ``Mesh(pp=.., dp=.., ep=.., tp=..)`` the global batch is cut into ``dp * ep`` slices
(the *batch group*, ``mesh.submesh("dp", "ep")``, rank ``dp_rank * ep + ep_rank``). Every
MoE layer keeps experts ``r*E/ep .. (r+1)*E/ep - 1`` on ep rank ``r`` and routes through
``mesh.group("ep")`` (the layer's dispatch and combine all-to-alls; see
:mod:`plait.strategies.moe.dispatch`). Experts are replicated over ``tp`` (each tp rank
runs the same tokens through them: the MoE input is replicated there) and live on the
pipeline stage of their block.

=====================  ===============================  =======================================
parameters             gradient averaged over           counted in the global norm on
=====================  ===============================  =======================================
dense (not experts)    the batch group (dp x ep)        ep rank 0 (replicas over ep)
expert ``e``           ``mesh.group("dp")`` (the ranks  every ep rank (each holds other
                       holding a replica of ``e``)      experts); the sum also runs over ep
=====================  ===============================  =======================================

An expert's local gradient already sums every batch slice's tokens routed to it (the
all-to-all backward brought them), so the sum over its ``dp`` replicas divided by
``dp * ep`` is the gradient of the mean loss: the one-process gradient.

One process, the same steps: :class:`MicroBatches` sets, before each MoE layer's forward
of micro-batch ``j``, the layer's ``batch_index`` (so its second-expert draws are those of
the global rows it sees) and its draw counter (one call per optimizer step, as one process
calling the model once on the union of the accumulated batches; the pipeline's no-grad
shape probe is not counted), and weighs the
auxiliary losses by ``loss_scale / microbatches`` (the layer attaches a gradient of 1 to
its auxiliary loss, while the pipeline divides each micro-batch's loss by ``m`` and a loss
scaler multiplies it). The GShard auxiliary loss and the z-loss are means over groups and
tokens, so the micro-batches' and replicas' terms average to the global batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.device import host_list
from plait.comm.group import Group
from plait.strategies.moe import stacked
from plait.strategies.moe.layer import MoE, moe_layers
from plait.strategies.moe.plan import MoEPlan
from plait.strategies.tensor.mappings import all_gather_dim


def shard_experts(model: nn.Module, *, ep_group: Group | None) -> set[int]:
    """Keep this ep rank's experts in every MoE layer of ``model`` (in place) and route
    through ``ep_group``; the ids of every expert parameter this rank still holds. No
    communication (every rank built the same seeded model)."""
    p = 1 if ep_group is None else ep_group.size
    r = 0 if ep_group is None else ep_group.rank
    for moe in moe_layers(model).values():
        local = moe.num_experts // p
        if p > 1:
            keep = [str(e) for e in range(r * local, (r + 1) * local)]
            moe.experts = nn.ModuleDict({k: moe.experts[k] for k in keep})
            moe.expert_group = ep_group
    return {id(q) for moe in moe_layers(model).values() for q in moe.experts.parameters()}


def shard_stacked(
    model: nn.Module, plan: MoEPlan, *, ep_group: Group, algorithm: str
) -> tuple[set[int], list[str]]:
    """The model's own sparse blocks (Hugging Face Mixtral, Qwen-MoE: experts stacked in
    one tensor per weight, :mod:`plait.strategies.moe.stacked`): keep this ep rank's
    ``E/ep`` experts of every container (slices of dimension 0) and route through
    ``ep_group``. Returns the ids of the expert parameters and the dense names of the
    stacked tensors. No communication."""
    names = [f"{n}.{w}" for n in stacked.containers(model, plan) for w in plan.stacked]
    replaced = stacked.split(model, plan, group=ep_group, algorithm=algorithm)
    return {id(p) for p in replaced.values()}, names


@torch.no_grad()
def gather_stacked(
    local: dict[str, torch.Tensor], keys: Sequence[str], *, ep_group: Group, algorithm: str
) -> None:
    """Replace each stacked expert tensor of ``keys`` held in ``local`` by the whole
    tensor (every ep rank's experts, concatenated along dimension 0 in ep-rank order).
    Collective over ``ep_group``: one all-gather per tensor; every ep rank of a stage holds
    the same keys."""
    for key in keys:
        if key in local:
            local[key] = all_gather_dim(local[key].detach(), 0, ep_group, algorithm)


def expert_owner(key: str, layers: dict[str, MoE], ep: int) -> int | None:
    """The ep rank that holds dense state key ``key`` (``<layer>.experts.<e>.<...>``), or
    None when ``key`` is not an expert's."""
    for name, moe in layers.items():
        prefix = f"{name}.experts."
        if key.startswith(prefix):
            e = int(key[len(prefix) :].split(".", 1)[0])
            return e // (moe.num_experts // ep)
    return None


def gather_experts(
    local: dict[str, torch.Tensor],
    wanted: dict[str, tuple[torch.Size, torch.dtype]],
    owner: dict[str, int],
    *,
    ep_group: Group,
    algorithm: str,
) -> None:
    """Fill ``local`` (in place) with the tensors of ``wanted`` held by the other ep ranks.
    ``owner``: key -> ep rank. Collective over ``ep_group``: one broadcast per (ep rank,
    dtype) of its experts' tensors, flattened; every ep rank passes the same keys."""
    # received tensors land where this rank's own live (NCCL carries CUDA tensors only)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    for src in range(ep_group.size):
        keys = [k for k in wanted if owner[k] == src]
        for dtype in sorted({wanted[k][1] for k in keys}, key=str):
            mine = [k for k in keys if wanted[k][1] == dtype]
            numels = [int(torch.Size(wanted[k][0]).numel()) for k in mine]
            if src == ep_group.rank:
                flat = torch.cat([local[k].detach().reshape(-1).to(dtype) for k in mine])
            else:
                flat = torch.empty(sum(numels), dtype=dtype, device=device)
            ops.broadcast(flat, src, group=ep_group, algorithm=algorithm)
            for k, part in zip(mine, flat.split(numels), strict=True):
                local[k] = part.view(wanted[k][0]).clone()


@dataclass
class MicroBatches:
    """Per-micro-batch settings of every MoE layer of this rank's stages (module
    docstring). :meth:`start` before each ``PTDP.step``; forward pre-hooks do the rest."""

    layers: dict[str, MoE]
    microbatches: int
    replicas: int
    batch_rank: int
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    draw_base: dict[str, int] = field(default_factory=dict)
    slice_base: int = 0
    factor: float = 1.0

    def __post_init__(self) -> None:
        for name, moe in self.layers.items():
            self.weights[name] = (moe.aux_loss_weight, moe.z_loss_weight)
            moe.register_forward_pre_hook(self._hook(name))

    def start(self, *, pending: int, loss_scale: float) -> None:
        """A ``PTDP.step`` begins: ``pending`` steps since the last optimizer step."""
        self.slice_base = (pending * self.replicas + self.batch_rank) * self.microbatches
        self.factor = loss_scale / self.microbatches
        for name, moe in self.layers.items():
            self.calls[name] = 0
            if pending == 0:
                self.draw_base[name] = moe.draw_counter()

    def _hook(self, name: str) -> Any:
        def before_forward(moe: nn.Module, args: Sequence[Any]) -> None:
            if not moe.training or name not in self.calls:
                return
            assert isinstance(moe, MoE)
            moe.draw_calls.fill_(self.draw_base[name])
            if not torch.is_grad_enabled():
                return  # the pipeline's shape probe (zeros, no autograd): not a micro-batch
            j = self.calls[name]
            self.calls[name] = j + 1
            moe.batch_index = self.slice_base + j
            aux, z = self.weights[name]
            moe.aux_loss_weight = aux * self.factor
            moe.z_loss_weight = z * self.factor

        return before_forward

    def finish(self) -> None:
        """Give every layer back its configured loss weights (outside ``PTDP.step``)."""
        for name, moe in self.layers.items():
            moe.aux_loss_weight, moe.z_loss_weight = self.weights[name]


def average(params: Sequence[nn.Parameter], group: Group, *, divide: int, algorithm: str) -> None:
    """Sum the gradients of ``params`` over ``group`` and divide by ``divide``, in place.

    One flat buffer per dtype, followed by one has-gradient flag per parameter: a
    parameter no rank of ``group`` has a gradient for keeps ``.grad = None`` (an expert
    that no token reached), one that some ranks lack is summed from the others. Collective
    over ``group`` (skipped when it has one rank): one all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for q in params:
        by_dtype.setdefault(q.dtype, []).append(q)
    for dtype, qs in by_dtype.items():
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in qs]
        local = [float(q.grad is not None) for q in qs]
        flags = torch.tensor(local, dtype=dtype, device=qs[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), flags])
        if group.size > 1:
            ops.all_reduce(flat, "sum", group=group, algorithm=algorithm)
        flat[: -len(qs)].div_(divide)
        offset = 0
        # which parameters some rank had a gradient for: read on the host (a GPU waits here)
        agreed = host_list(flat[-len(qs) :], local)
        for q, has in zip(qs, agreed, strict=True):
            n = q.numel()
            if has > 0:
                if q.grad is None:
                    q.grad = flat[offset : offset + n].view_as(q).clone()
                else:
                    q.grad.copy_(flat[offset : offset + n].view_as(q))
            offset += n
