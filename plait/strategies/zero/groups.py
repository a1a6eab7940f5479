"""What ZeroOptimizer is given: param groups, their hyper-parameters and names.

Accepts what a torch optimizer accepts (tensors, ``(name, tensor)`` pairs, or group dicts
holding either) and rebuilds a torch optimizer's groups for another parameter list.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# keys of a torch param group that are not hyper-parameters of the optimizer
NOT_HYPER = ("params", "param_names")


@dataclass
class ParamGroups:
    """The given groups. ``all_params[g]``: group g's parameters as given (frozen ones
    too, so state-dict ids match the plain optimizer's); ``hyper[g]``: the keys given in
    its dict; ``trainable``: the parameters that require grad, in group order, with
    ``group_starts[g]`` the index of group g's first (``group_starts[-1]``: their count)."""

    all_params: list[list[torch.Tensor]]
    hyper: list[dict[str, Any]]
    names: dict[int, str]  # id(param) -> name
    trainable: list[nn.Parameter] = field(default_factory=list)
    group_starts: list[int] = field(default_factory=list)
    # trainable indices in the model's registration order (flat order without a module)
    model_order: list[int] = field(default_factory=list)

    def name_of(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), "?")

    @property
    def trainable_names(self) -> list[str]:
        return [self.name_of(p) for p in self.trainable]

    def checked_names(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every trainable parameter, prefixed by its group when
        there are several, for the wrap-time check."""
        several = len(self.all_params) > 1
        out: list[tuple[str, torch.Tensor]] = []
        for g in range(len(self.all_params)):
            for p in self.trainable[self.group_starts[g] : self.group_starts[g + 1]]:
                name = self.name_of(p)
                out.append((f"param_groups[{g}].{name}" if several else name, p))
        return out


def parse_param_groups(params: Iterable[Any], module: nn.Module | None) -> ParamGroups:
    """Split ``params`` into groups; name every parameter (from ``(name, tensor)`` pairs,
    else from ``module``, else ``param_groups[g][i]``); check the trainable ones share one
    dtype and device."""
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer: got an empty parameter list")
    raw = items if isinstance(items[0], dict) else [{"params": items}]
    module_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    all_params: list[list[torch.Tensor]] = []
    hyper: list[dict[str, Any]] = []
    names: dict[int, str] = {}
    for g, group in enumerate(raw):
        if not isinstance(group, dict):
            raise TypeError(
                "ZeroOptimizer: mix of param-group dicts and tensors; pass one or the other"
            )
        given = group["params"]
        given = [given] if isinstance(given, torch.Tensor) else list(given)
        tensors = []
        for i, item in enumerate(given):
            if isinstance(item, tuple):
                name, item = item
            else:
                name = module_names.get(id(item), f"param_groups[{g}][{i}]")
            if not isinstance(item, torch.Tensor):
                raise TypeError(
                    f"ZeroOptimizer: param group {g} holds a {type(item).__name__}, not a tensor"
                )
            names.setdefault(id(item), name)
            tensors.append(item)
        all_params.append(tensors)
        hyper.append({k: v for k, v in group.items() if k not in NOT_HYPER})
    layout = ParamGroups(all_params, hyper, names)
    for tensors in all_params:
        layout.group_starts.append(len(layout.trainable))
        layout.trainable.extend(p for p in tensors if p.requires_grad)  # type: ignore[misc]
    layout.group_starts.append(len(layout.trainable))
    trainable = layout.trainable
    position = {id(p): k for k, p in enumerate(module.parameters())} if module is not None else {}
    layout.model_order = sorted(
        range(len(trainable)), key=lambda i: (position.get(id(trainable[i]), len(position)), i)
    )
    if not trainable:
        raise ValueError("ZeroOptimizer: no trainable parameters (requires_grad=True) given")
    dtypes = sorted({str(p.dtype) for p in trainable})
    if len(dtypes) > 1:
        raise TypeError(
            f"ZeroOptimizer: the parameters have dtypes {dtypes}; ZeRO lays them out in one "
            f"flat buffer, so they must share one dtype: cast the model (model.to(dtype)) "
            f"or leave the odd parameters out of the optimizer"
        )
    devices = sorted({str(p.device) for p in trainable})
    if len(devices) > 1:
        raise ValueError(
            f"ZeroOptimizer: the parameters are on devices {devices}; put them on one device"
        )
    return layout


def constructor_kwargs(
    optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> dict[str, Any]:
    """The entries of ``defaults`` that ``optimizer_class(params, **kwargs)`` accepts.

    A torch optimizer's ``defaults`` may hold keys its constructor does not take (AdamW's
    ``decoupled_weight_decay``); they are dropped here and reach the optimizer through
    every param group instead, which holds all of them (see ``groups_of``)."""
    try:
        signature = inspect.signature(optimizer_class.__init__)
    except (TypeError, ValueError):
        return dict(defaults)
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters and k != "params"}


def groups_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer``'s param groups as constructor input: each with its parameters and
    every hyper-parameter it holds (so a group entry the constructor does not take as a
    keyword, e.g. AdamW's ``decoupled_weight_decay``, is kept as it was)."""
    return [
        {k: (list(v) if k == "params" else v) for k, v in g.items() if k != "param_names"}
        for g in optimizer.param_groups
    ]


# torch.optim optimizers whose update of an element depends on other elements of the same
# parameter (a matrix factorisation, an orthogonalisation, a line search): on a flat 1/n
# shard they would compute another step without any error, so ZeroOptimizer refuses them.
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon")


def check_elementwise(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """Raise ``ValueError`` if ``optimizer_class`` is a torch optimizer known not to be
    element-wise (a third-party one cannot be recognised: ZeRO needs element-wise
    updates, as SGD, Adam, AdamW, RMSprop and Adagrad are)."""
    bases = {c.__name__ for c in optimizer_class.__mro__ if c.__module__.startswith("torch.optim")}
    refused = sorted(bases & set(NOT_ELEMENTWISE))
    if refused:
        advice = (
            "Use strategy 'ddp' with it"
            if refused[0] == "LBFGS"
            else "Pass it to plait.prepare(model, [it, ...], strategy=...), which steps it "
            "on whole parameters by ownership"
        )
        raise ValueError(
            f"ZeroOptimizer: ZeRO-1/2 steps {optimizer_class.__name__} on flat 1/n shards of "
            f"the parameters, which is exact only for element-wise optimizers (SGD, Adam, "
            f"AdamW, RMSprop, Adagrad, ...); {refused[0]} combines elements across a "
            f"parameter, so its step would differ. {advice}"
        )
