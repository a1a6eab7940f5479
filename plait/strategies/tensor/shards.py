"""A parallelized model's shards: which parameters are split (per-head parameters sliced,
:func:`place_parameters` recording every parameter's placement), ties kept between modules
split alike (:func:`retie`), and the dense state dict put back together
(:func:`full_state_dict`: each parallel layer's shards all-gathered over its group)."""

from __future__ import annotations

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.placement import place
from plait.strategies.tensor import mappings as M
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    HeadSelectLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.layers_nd import ND_LAYERS
from plait.strategies.tensor.multi_query import MultiQueryLinear
from plait.strategies.tensor.plan import AttentionHeads

PARALLEL_LAYERS = (
    MultiQueryLinear,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    HeadSelectLinear,
    *ND_LAYERS,
)

# (layer type, parameter name) whose elements differ across the group's ranks
_SPLIT = {
    (ColumnParallelLinear, "weight"),
    (ColumnParallelLinear, "bias"),
    (RowParallelLinear, "weight"),
    (VocabParallelEmbedding, "weight"),
    (MultiQueryLinear, "weight"),
    (MultiQueryLinear, "bias"),
}


def split_head_params(module: nn.Module, heads: AttentionHeads, group: Group) -> None:
    """This rank's entries of the attention's per-head parameters (``head_params``): a
    slice of dimension 0, noted on the module for :func:`full_state_dict`."""
    if not heads.head_params or hasattr(module, "plait_head_params"):
        return
    for name in heads.head_params:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or p.dim() < 1 or p.shape[0] != heads.heads:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(
                f"attention {heads.modules!r}: head_params {name!r} must be a parameter with "
                f"one entry per query head ({heads.heads}) on dimension 0; got {got}"
            )
        part = heads.heads // group.size
        rows = slice(group.rank * part, (group.rank + 1) * part)
        setattr(module, name, nn.Parameter(p.detach()[rows].clone(), p.requires_grad))
    object.__setattr__(module, "plait_head_params", (heads.head_params, group))


def place_parameters(model: nn.Module, group: Group) -> None:
    """Record every parameter's placement: slices of a split weight shard over ``group``,
    everything else (LayerNorms, row-parallel biases, whole key/value projections,
    modules the plan leaves alone) is a copy on every rank, replicated over it."""
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            split = any(isinstance(module, cls) and pname == n for cls, n in _SPLIT)
            split = split or pname in getattr(module, "plait_head_params", ((), None))[0]
            place(p, shard=(group,) if split else (), replicate=() if split else (group,))


def retie(
    before: dict[str, nn.Module], replaced: dict[str, nn.Module], owners: dict[int, list[str]]
) -> None:
    """Parameters the dense model shared stay shared if every sharer was split alike."""
    for paths in owners.values():
        if len(paths) < 2:
            continue
        mods = [p.rpartition(".") for p in paths]
        news = [replaced.get(m) for m, _, _ in mods]
        if all(n is None for n in news):
            continue
        if any(n is None for n in news):
            raise ValueError(
                f"parameters {paths} are one shared tensor, but the plan splits only some of "
                f"their modules; give them all the same style (e.g. 'vocab' for a tied head)"
            )
        first = getattr(news[0], mods[0][2])
        for n, (m, _, attr) in zip(news[1:], mods[1:], strict=True):
            mine = getattr(n, attr)
            starts = (getattr(news[0], "start", None), getattr(n, "start", None))
            if mine.shape != first.shape or starts[0] != starts[1]:
                raise ValueError(
                    f"{paths[0]} and {m}.{attr} are tied but split differently "
                    f"({tuple(first.shape)} vs {tuple(mine.shape)}); give them the same style"
                )
            setattr(n, attr, first)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense model's state dict (keys and shapes) on every rank: each parallel layer's
    shards all-gathered over its group, in module order. Collective. A model also sharded
    by ``fully_shard`` (``strategy="cp"`` with tp and ``zero=3``) is first put together over
    its FSDP group (:func:`~plait.strategies.fsdp.full_state_dict`), its units gathered
    while the tp shards are, then freed again."""
    from plait.strategies.fsdp.module import FSDPModule  # deferred: fsdp is optional here

    if not isinstance(model, FSDPModule):
        return _gather_tp(model, model.state_dict())
    from plait.strategies.fsdp.state import (
        full_state_dict as fsdp_full_state_dict,
    )  # deferred: as above

    state = fsdp_full_state_dict(model)
    model.unshard()
    try:
        return _gather_tp(model, state)
    finally:
        model.reshard()


def _gather_tp(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, module in model.named_modules():
        names, group = getattr(module, "plait_head_params", ((), None))
        for pname in names:  # per-head parameters: every rank's heads, in rank order
            assert isinstance(group, Group)
            key = f"{name}.{pname}" if name else pname
            state[key] = M.all_gather_dim(getattr(module, pname).detach(), 0, group, "auto")
        if isinstance(module, PARALLEL_LAYERS):
            prefix = f"{name}." if name else ""
            for key, value in module.full_state().items():
                state[prefix + key] = value
            for key in getattr(module, "local_only", ()):
                state.pop(prefix + key, None)
    return state
