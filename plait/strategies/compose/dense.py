"""The dense model seen from one rank of a PTD-P mesh: whose parameter is which, and the
global gradient norm and state dict assembled from every group.

A parameter of the dense GPT lives, on a (pp, dp, tp) mesh, on the ranks of one pipeline
stage (or two: a tied embedding and head on the first and last stage), split over ``tp``
or replicated over it, and replicated over ``dp`` (or, for the gradient under ZeRO, a
contiguous range of it on each dp rank). :class:`DenseIndex`, recorded from the dense
model before it is cut, lets every rank count each element of the dense gradient exactly
once:

=================================  ===============================================
where a parameter lives             counted on
=================================  ===============================================
split over tp (local shape differs  every tp rank (the shards are disjoint)
from the dense shape)
replicated over tp (LayerNorm, a    tp rank 0 only
row-parallel bias, SP params)
tied across two pipeline ranks      the lower pp rank only
replicated over ep (not an expert)  ep rank 0 only (an expert: every ep rank, the sum
                                    also runs over ep; :mod:`.experts`)
replicated over dp (plain DP)       every dp rank, but the sum runs over tp and pp only
ZeRO-1/2 over dp                    the dp rank whose shard holds the range (the sum
                                    also runs over dp)
=================================  ===============================================

Communication: :func:`global_grad_norm` all-reduces one scalar over tp, then pp (then ep
with experts, dp under ZeRO); :func:`assemble` all-gathers each tensor-parallel layer over
tp (``full_state``), broadcasts the experts over ep (one flat tensor per ep rank and dtype)
and each stage's dense tensors over pp (:func:`broadcast_stages`, one flat tensor per
(stage rank, dtype)): the dense model's bytes cross the pp group once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.device import control_device
from plait.comm.group import Group
from plait.strategies.compose.experts import gather_experts, gather_stacked
from plait.strategies.pipeline.split import Layer
from plait.strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear
from plait.strategies.tensor.parallelize import full_state_dict as tp_full_state


@dataclass(frozen=True)
class DenseIndex:
    """The dense state dict's keys, shapes, dtypes, and the pp rank that holds each."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    owner: dict[str, int]  # key -> pp group rank of the stage that holds it

    @staticmethod
    def record(
        dense: dict[str, torch.Tensor],
        layers: Sequence[Layer],
        bounds: Sequence[tuple[int, int]],
        placement: Sequence[int],
    ) -> DenseIndex:
        """``dense``: the dense model's state dict (before it is cut); ``layers``, the
        partition's ``bounds`` and the schedule's ``placement``: where each layer runs."""
        prefixes: list[tuple[str, int]] = []
        for s, (a, b) in enumerate(bounds):
            for layer in layers[a:b]:
                prefixes += [(f"{name}.", placement[s]) for name, _ in layer.modules]
        owner = {}
        for key in dense:
            hits = [rank for prefix, rank in prefixes if key.startswith(prefix)]
            if not hits:
                raise ValueError(f"ptdp: dense key {key!r} belongs to no pipeline stage")
            owner[key] = hits[0]
        shapes = {k: (v.shape, v.dtype) for k, v in dense.items()}
        return DenseIndex(shapes, owner)


@dataclass(frozen=True)
class Counted:
    """One local parameter, its dense name, and whether this rank counts it in norms."""

    name: str
    param: nn.Parameter
    split: bool  # over tp
    counted: bool
    expert: bool = False  # an expert's (split over ep)


def count_params(
    stages: Sequence[nn.Module],
    index: DenseIndex,
    *,
    tp_rank: int,
    tied_peers: dict[int, int],
    pp_rank: int,
    experts: set[int] | None = None,
    ep_rank: int = 0,
) -> list[Counted]:
    """This rank's parameters (each once, in stage order) with their counting rule
    (module docstring). ``tied_peers``: id(param) -> the other pp rank that holds it;
    ``experts``: the ids of the expert parameters (split over ep)."""
    experts = experts or set()
    out: list[Counted] = []
    seen: set[int] = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            expert = id(p) in experts
            # a stacked expert tensor holds E/ep experts: split over ep, replicated over tp
            split = p.shape != index.shapes[name][0] and not expert
            counted = split or tp_rank == 0
            peer = tied_peers.get(id(p))
            if peer is not None and peer < pp_rank:
                counted = False
            if not expert and ep_rank != 0:
                counted = False
            out.append(Counted(name, p, split, counted, expert))
    return out


def _power(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    if g.numel() == 0:
        return torch.zeros((), dtype=g.dtype, device=g.device)
    if math.isinf(norm_type):
        return g.abs().max()
    return torch.linalg.vector_norm(g, norm_type).pow(norm_type)


def global_grad_norm(
    local_terms: list[torch.Tensor],
    norm_type: float,
    *,
    groups: Sequence[Group],
    algorithm: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Combine this rank's ``|g|^p`` terms (or maxima for ``inf``) over ``groups``; the
    p-th root of the total. Collective: one scalar all-reduce per group."""
    infinite = math.isinf(norm_type)
    where = control_device(local_terms, next(iter(groups), None))
    total = torch.zeros((), dtype=dtype, device=where)
    for t in local_terms:
        total = torch.maximum(total, t.to(dtype)) if infinite else total + t.to(dtype)
    for g in groups:
        ops.all_reduce(total, "max" if infinite else "sum", group=g, algorithm=algorithm)
    return total if infinite else total.pow(1.0 / norm_type)


def norm_terms(counted: Sequence[Counted], norm_type: float) -> list[torch.Tensor]:
    """``|g|^p`` of every parameter this rank counts (plain data parallelism: ``.grad``
    holds the averaged gradient)."""
    return [
        _power(c.param.grad.detach(), norm_type)
        for c in counted
        if c.counted and c.param.grad is not None
    ]


def shard_terms(
    counted: Sequence[Counted],
    pieces: Sequence[tuple[int, int, int]],
    flat: torch.Tensor,
    norm_type: float,
) -> list[torch.Tensor]:
    """``|g|^p`` of the ranges of a ZeRO gradient shard ``flat`` this rank counts;
    ``pieces``: (parameter index, start, stop) in the shard's order."""
    out, offset = [], 0
    for param, start, stop in pieces:
        n = stop - start
        if counted[param].counted:
            out.append(_power(flat[offset : offset + n], norm_type))
        offset += n
    return out


def assemble(
    stages: Sequence[nn.Module],
    index: DenseIndex,
    *,
    pp_group: Group,
    algorithm: str,
    ep_group: Group | None = None,
    expert_owner: dict[str, int] | None = None,
    stacked: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """The dense model's state dict, keys in the dense order, on every rank.

    Collective over the tp group (each tensor-parallel layer's ``full_state``), the ep
    group when ``ep_group`` is given (``expert_owner``: key -> ep rank of every expert
    tensor of this rank's stages; ``stacked``: the dense names of stacked expert tensors,
    each all-gathered along dimension 0) and the pp
    group (one broadcast per stage rank and dtype)."""

    local: dict[str, torch.Tensor] = {}
    for stage in stages:
        local.update(tp_full_state(stage))
    if ep_group is not None and expert_owner:
        wanted = {k: index.shapes[k] for k in expert_owner}
        gather_experts(local, wanted, expert_owner, ep_group=ep_group, algorithm=algorithm)
    if ep_group is not None and stacked:
        gather_stacked(local, stacked, ep_group=ep_group, algorithm=algorithm)
    return broadcast_stages(
        local, index.shapes, index.owner, pp_group=pp_group, algorithm=algorithm
    )


def broadcast_stages(
    local: dict[str, torch.Tensor],
    shapes: dict[str, tuple[torch.Size, torch.dtype]],
    owner: dict[str, int],
    *,
    pp_group: Group,
    algorithm: str,
) -> dict[str, torch.Tensor]:
    """Every key of ``shapes`` on every rank: each pp rank broadcasts the tensors it owns
    (``owner``: key -> pp rank) from ``local``, one flat tensor per dtype. Keys in the order
    of ``shapes``. Collective over ``pp_group``."""
    out: dict[str, torch.Tensor] = {}
    # received tensors land where this rank's own live (NCCL carries CUDA tensors only)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    for src in range(pp_group.size):
        keys = [k for k in shapes if owner[k] == src]
        for dtype in sorted({shapes[k][1] for k in keys}, key=str):
            mine = [k for k in keys if shapes[k][1] == dtype]
            numels = [math.prod(shapes[k][0]) for k in mine]
            if src == pp_group.rank:
                missing = [k for k in mine if k not in local]
                if missing:
                    raise RuntimeError(
                        f"ptdp: pp rank {src} should hold {missing} but its stages do not"
                    )
                flat = torch.cat([local[k].detach().reshape(-1).to(dtype) for k in mine])
            else:
                flat = torch.empty(sum(numels), dtype=dtype, device=device)
            ops.broadcast(flat, src, group=pp_group, algorithm=algorithm)
            for k, part in zip(mine, flat.split(numels), strict=True):
                out[k] = part.view(shapes[k][0]).clone()
    return {k: out[k] for k in shapes}


@dataclass(frozen=True)
class DenseGroup:
    """One parameter group of the dense model's optimizer: its entries (``lr``,
    ``weight_decay``, ...) and its parameters' names, in the group's order."""

    options: dict[str, Any]
    names: tuple[str, ...]


def dense_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[DenseGroup]:
    """``optimizer``'s parameter groups by parameter name (a shared parameter under its
    first name). Refuses, before anything is cut, a tensor that is not the model's and a
    parameter no group holds (PTD-P steps every parameter it keeps)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, held = [], set()
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"ptdp: parameter group {i} of the optimizer holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the {type(model).__name__}; "
                    f"build the optimizer on model.parameters() (or its named groups)"
                )
        group_names = tuple(names[id(p)] for p in group["params"])
        held |= set(group_names)
        out.append(DenseGroup({k: v for k, v in group.items() if k != "params"}, group_names))
    missing = [n for n in names.values() if n not in held]
    if missing:
        raise ValueError(
            f"ptdp: the optimizer holds no group for {missing[:3]}"
            f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}; build it on "
            f"every parameter of the model: PTD-P re-creates it on each rank's shards and "
            f"steps every parameter a rank keeps (one to keep fixed can sit in a group with "
            f"lr=0)"
        )
    return out


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s structure with every parameter and buffer on the meta device
    (no memory): the dense model :mod:`.state` fills (``to_empty`` then ``load_state_dict``)
    to save or load an ordinary checkpoint. Shared parameters stay shared. No
    communication."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def unsliced_parameters(model: nn.Module) -> list[str]:
    """Parameters of a tensor-parallel ``model`` whose shard on a rank is not one contiguous
    slice of the dense tensor: a linear stored transposed (``Style(transposed=True)``,
    GPT-2's ``Conv1D``) or a fused projection split part by part (``Style(blocks=k)``).
    The same list on every rank (read from the whole model before the pipeline cut)."""

    out = []
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear) and (
            module.transposed or getattr(module, "blocks", 1) > 1
        ):
            out += [f"{name}.{n}" for n, _ in module.named_parameters(recurse=False)]
    return out
