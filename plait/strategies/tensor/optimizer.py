"""The optimizer over a parallelized model's shards: :func:`group_of_names` reads, before
parallelizing, which parameter group each dense parameter is in; :func:`rebuild_optimizer`
builds the same optimizer class over the shards with every group's hyper-parameters.
Shared by 1D and 2D/2.5D/3D tensor parallelism and the whole-matrix optimizers."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from plait.strategies.zero.groups import constructor_kwargs


def group_of_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """Parameter name (every name a shared parameter has) -> its optimizer group's index,
    read before the model is parallelized. Refuses an optimizer that has stepped (its
    state is per dense parameter) or that holds a tensor that is not the model's."""
    if optimizer.state:
        raise ValueError(
            "tensor parallelism re-creates the optimizer on the parameter shards: pass an "
            "optimizer that has not stepped yet (load its state after prepare)"
        )
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out: dict[str, int] = {}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"tensor parallelism: parameter group {i} of the optimizer holds a tensor "
                    f"of shape {tuple(p.shape)} that is not a parameter of the "
                    f"{type(model).__name__}; build the optimizer on model.parameters()"
                )
            for n in names[id(p)]:
                out[n] = i
    return out


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    groups: Mapping[str, int] | None = None,
) -> torch.optim.Optimizer:
    """The same optimizer class over the parallelized parameters: one group per original
    group, every group entry kept (per-group ``lr``, ``weight_decay``, ...), each new
    parameter in the group its dense parameter was in (``groups``: name -> group index,
    from :func:`group_of_names` before parallelizing; None: every parameter in the one
    group of ``optimizer``). Parameters the optimizer did not hold stay out of it."""
    if groups is None:
        if len(optimizer.param_groups) != 1:
            raise ValueError(
                "rebuild_optimizer: an optimizer with several parameter groups needs "
                "groups= (group_of_names(optimizer, model) before parallelizing)"
            )
        groups = {n: 0 for n, _ in model.named_parameters(remove_duplicate=False)}
    params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        # a parallel layer's own parameter stands for part of a dense one (its whole tail)
        owner = model.get_submodule(path) if path else model
        dense = getattr(owner, "dense_names", {}).get(leaf)
        key = name if dense is None else (f"{path}.{dense}" if path else dense)
        if key in groups:
            params[groups[key]].append(p)
    cls = type(optimizer)
    # the constructor takes only some of the defaults (AdamW: not decoupled_weight_decay);
    # every group keeps all its entries
    defaults = constructor_kwargs(cls, dict(optimizer.defaults))
    rebuilt = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": ps}
        for g, ps in zip(optimizer.param_groups, params, strict=True)
    ]
    return cls(rebuilt, **defaults)
