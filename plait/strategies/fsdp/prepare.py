"""``prepare_fsdp``: a model sharded by :func:`fully_shard` and its optimizer rebuilt over
the shards (``plait.prepare(strategy="zero3"/"fsdp")``, and ``strategy="cp"`` with
``zero=3``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from plait.strategies.fsdp.state import shard_param_groups
from plait.strategies.fsdp.wrap import fully_shard

Optimizer = torch.optim.Optimizer

# torch.optim optimizers whose update of an element depends on other elements (a norm,
# a matrix factorisation or a line search): over flat 1/n shards they would compute a
# different step, so ZeRO-3/FSDP refuses them.
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon")


def rebuilt_optimizer(
    optimizer: Optimizer, shards: list[list[nn.Parameter]], strategy: str
) -> Optimizer:
    """The same optimizer class, on the shards: one group per original group (``shards[i]``
    holds group i's flat shards), every group entry kept (per-group ``lr``,
    ``weight_decay``, ...); the constructor gets only the defaults its signature names (so
    AdamW's ``decoupled_weight_decay`` and the like are never passed where not taken)."""
    cls = type(optimizer)
    taken = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in taken}
    groups = []
    for i, (group, params) in enumerate(zip(optimizer.param_groups, shards, strict=True)):
        if not params:
            raise ValueError(
                f"strategy {strategy!r}: parameter group {i} of the optimizer holds no "
                f"parameter elements, so it has no shard; drop the empty group"
            )
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return cls(groups, **defaults)


def check_elementwise(optimizer: Optimizer | None, strategy: str) -> None:
    """Refuse an optimizer whose step on flat shards would differ (:data:`NOT_ELEMENTWISE`)
    or that has stepped already (its state could not follow the parameters into shards)."""
    if optimizer is None:
        return
    bases = {c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")}
    refused = sorted(bases & set(NOT_ELEMENTWISE))
    if refused:
        advice = (
            "Use strategy 'ddp' with it"
            if refused[0] == "LBFGS"
            else "Pass it to plait.prepare(model, [it, ...], strategy=...), which steps it "
            "on whole parameters by ownership"
        )
        raise ValueError(
            f"strategy {strategy!r} steps the optimizer on flat 1/n parameter shards, "
            f"which is exact only for element-wise optimizers (SGD, Adam, AdamW, ...); "
            f"{refused[0]} combines elements across a parameter, so its step would "
            f"differ. {advice}"
        )
    if optimizer.state:
        raise ValueError(
            f"strategy {strategy!r} re-creates the optimizer on the parameter shards; pass an "
            f"optimizer that has not stepped yet (load its state after prepare)"
        )


def prepare_fsdp(
    model: nn.Module, optimizer: Optimizer | None, *, strategy: str = "fsdp", **options: Any
) -> tuple[nn.Module, Optimizer | None]:
    """:func:`fully_shard` ``model`` with ``options`` (one flat shard per unit and
    optimizer parameter group, so per-group hyper-parameters apply exactly), then a new
    optimizer of ``optimizer``'s class over the shards (:func:`rebuilt_optimizer`).
    ``strategy`` names the caller in refusals. Collective over the group, as
    :func:`fully_shard`."""
    check_elementwise(optimizer, strategy)
    if optimizer is not None:
        options.setdefault("param_groups", [g["params"] for g in optimizer.param_groups])
    sharded = fully_shard(model, **options)
    if optimizer is not None:
        optimizer = rebuilt_optimizer(optimizer, shard_param_groups(sharded), strategy)
    return sharded, optimizer
