"""The layout-neutral content of a checkpoint: dense model state and optimizer state keyed by
the unwrapped model's parameter names (FQNs), whatever strategy saved or loads it.

- model: ``full_state_dict(model)``, the unsharded state dict (tensor key ``model/<fqn>``);
- optimizer: the plain optimizer's ``state_dict()`` format (ZeroOptimizer's consolidated
  ``state_dict()``, the FSDP helper's ``full_optimizer_state_dict``, or, for a
  whole-matrix optimizer stepped by parameter ownership, the owners' state gathered by
  :func:`plait.strategies.whole_matrix.full_optimizer_state_dict`), with parameter
  indices replaced by FQNs: tensor state ``optimizer/<fqn>/<key>``, other state and the
  param groups' hyper-parameters as JSON;
- anything else (per-rank state, ``extra``) as a JSON tree whose tensor leaves are stored
  as tensors (``{"__tensor__": key}``); tuples come back as tuples.

Loading maps FQNs back to the *target* optimizer's own indices, so the saving and loading
strategies and world sizes are independent. Collective where the strategy's API is:
``model_state`` for a fully sharded model (all-gathers), ``optimizer_state`` for
ZeroOptimizer (all-gathers) and FSDP; the load functions do not communicate for plain,
DDP and ZeRO models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.checkpoint.full import full_state_dict as full
from plait.strategies import fsdp, whole_matrix
from plait.strategies.data_parallel.ddp import DistributedDataParallel
from plait.strategies.data_parallel.naive import NaiveDataParallel
from plait.strategies.fsdp import FSDPModule

TENSOR = "__tensor__"
TUPLE = "__tuple__"


# --- JSON trees with tensor leaves ---------------------------------------------------------
def encode_tree(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON; tensor leaves go into ``tensors`` under ``prefix``-based keys."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().cpu().contiguous().clone()
        return {TENSOR: prefix}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"checkpoint: key {k!r} at {prefix!r} is a {type(k).__name__}; checkpoint "
                    f"state is stored as JSON, so dict keys must be strings"
                )
            out[k] = encode_tree(v, f"{prefix}/{k}", tensors)
        return out
    if isinstance(value, tuple):
        return {TUPLE: [encode_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_tree(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"checkpoint: {prefix!r} is a {type(value).__name__}; checkpoints hold tensors and "
        f"JSON values (dict with str keys, list, tuple, str, int, float, bool, None), never "
        f"pickled objects: convert it (e.g. to its state_dict())"
    )


def decode_tree(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {TENSOR}:
            return tensors[value[TENSOR]]
        if set(value) == {TUPLE}:
            return tuple(decode_tree(v, tensors) for v in value[TUPLE])
        return {k: decode_tree(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tree(v, tensors) for v in value]
    return value


# --- models ----------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP or naive data-parallel wrapper; else ``model``."""

    if isinstance(model, (DistributedDataParallel, NaiveDataParallel)):
        return model.module
    return model


def is_fully_sharded(model: nn.Module) -> bool:

    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict, keys and shapes as in the one-process model, on every
    rank, from any layout: see :mod:`plait.checkpoint.full`. Collective where the layout
    is split; no communication for a plain, DDP or naive-DP model (the tensors returned
    are the live ones)."""

    return full(model)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a dense state dict into ``model`` (every key must match; strict)."""
    if is_fully_sharded(model):
        loader = getattr(fsdp, "load_full_state_dict", None)
        if loader is None:
            raise NotImplementedError(
                "checkpoint.load: loading into a fully_shard model needs "
                "plait.strategies.fsdp.load_full_state_dict, which this plait lacks"
            )
        loader(model, state)
        return
    inner = unwrap(model)
    current = inner.state_dict()
    missing = sorted(set(current) - set(state))
    unexpected = sorted(set(state) - set(current))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in current.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:  # checked before anything is copied
        raise ValueError(
            f"checkpoint.load: the model does not match the checkpoint: missing from the "
            f"checkpoint {missing[:8]}, not in the model {unexpected[:8]}, other shapes "
            f"{shapes[:8]}; build the same model (names as in the unwrapped model) first"
        )
    inner.load_state_dict(state, strict=True)


# --- optimizers ------------------------------------------------------------------------------
def _fsdp_optimizer_api(name: str) -> Any:

    fn = getattr(fsdp, name, None)
    if fn is None:
        raise NotImplementedError(
            f"checkpoint: optimizer state of a fully_shard model needs "
            f"plait.strategies.fsdp.{name}, which this plait lacks"
        )
    return fn


def owned(optimizer: torch.optim.Optimizer) -> bool:
    """A whole-matrix optimizer stepped by parameter ownership (its state on the owners,
    over full-shape tensors that are not the model's parameters): its state is read and
    written in the plain format by name through
    :mod:`plait.strategies.whole_matrix.state`, whatever the model's layout."""
    return getattr(optimizer, "plait_state_slots", None) is not None


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each param group of ``optimizer``, in the order of the plain format's
    indices (``state_dict()`` numbers parameters group after group)."""
    if owned(optimizer):
        return whole_matrix.full_optimizer_param_names(optimizer)
    if is_fully_sharded(model):
        return _fully_sharded_groups(model, optimizer)
    names = {id(p): n for n, p in unwrap(model).named_parameters(remove_duplicate=False)}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"checkpoint: parameter {i} of the optimizer's param group {g} "
                    f"(shape {tuple(p.shape)}) is not a parameter of the model; build the "
                    f"optimizer on the model's parameters"
                )
            fqns.append(names[id(p)])
        groups.append(fqns)
    return groups


def _fully_sharded_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each param group of an optimizer over a ``fully_shard`` model's shards,
    in the order of ``full_optimizer_state_dict``'s indices (the FSDP helper's own rule)."""
    names_fn = _fsdp_optimizer_api("full_optimizer_param_names")
    return names_fn(model, optimizer)  # type: ignore[no-any-return]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The plain-format state dict of the whole (unsharded) optimizer. Collective for
    ZeroOptimizer, fully sharded models and an ownership-stepped optimizer (one broadcast
    per parameter from its owner over the ownership group)."""
    if owned(optimizer):
        return whole_matrix.full_optimizer_state_dict(optimizer)
    if is_fully_sharded(model):
        return _fsdp_optimizer_api("full_optimizer_state_dict")(  # type: ignore[no-any-return]
            model, optimizer
        )
    return optimizer.state_dict()


def encode_optimizer(
    state: dict[str, Any],
    groups: list[list[str]],
    shared: dict[str, torch.Tensor],
    local: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """JSON of a plain-format optimizer state dict; per-parameter tensors into ``shared``
    (the same on every rank), tensor hyper-parameters into ``local``."""
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"checkpoint.save: the optimizer state has {len(saved_groups)} param groups but "
            f"the optimizer has {len(groups)}"
        )
    index_to_name: dict[int, str] = {}
    out_groups = []
    for j, (group, fqns) in enumerate(zip(saved_groups, groups, strict=True)):
        ids = list(group["params"])
        if len(ids) != len(fqns):
            raise ValueError(
                f"checkpoint.save: param group {j} of the optimizer state has {len(ids)} "
                f"parameters but the optimizer's has {len(fqns)}"
            )
        index_to_name.update(zip((int(i) for i in ids), fqns, strict=True))
        hyper = {k: v for k, v in group.items() if k != "params"}
        out_groups.append(
            {"hyper": encode_tree(hyper, f"optimizer/group{j}", local), "params": fqns}
        )
    per_param: dict[str, Any] = {}
    for index, entry in state["state"].items():
        fqn = index_to_name[int(index)]
        values = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tkey = f"optimizer/{fqn}/{key}"
                shared[tkey] = value.detach().cpu().contiguous().clone()
                values[key] = {TENSOR: tkey}
            else:
                values[key] = encode_tree(value, f"optimizer/{fqn}/{key}", local)
        per_param[fqn] = values
    return {"param_groups": out_groups, "state": per_param}


def decode_optimizer(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor], groups: list[list[str]]
) -> dict[str, Any]:
    """A plain-format state dict for an optimizer whose groups hold the FQNs ``groups``."""
    saved = meta["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(
            f"checkpoint.load: the checkpoint's optimizer has {len(saved)} param groups, this "
            f"optimizer {len(groups)}; build the optimizer with the same param groups"
        )
    index = {fqn: i for i, fqn in enumerate(f for fqns in groups for f in fqns)}
    out_groups = []
    for j, (entry, fqns) in enumerate(zip(saved, groups, strict=True)):
        if set(entry["params"]) != set(fqns):
            only_saved = sorted(set(entry["params"]) - set(fqns))[:6]
            only_here = sorted(set(fqns) - set(entry["params"]))[:6]
            raise ValueError(
                f"checkpoint.load: param group {j} differs: only in the checkpoint {only_saved}, "
                f"only in this optimizer {only_here}; build the optimizer over the same "
                f"parameters"
            )
        hyper = decode_tree(entry["hyper"], tensors)
        out_groups.append({**hyper, "params": [index[f] for f in fqns]})
    state = {
        index[fqn]: {k: decode_tree(v, tensors) for k, v in values.items()}
        for fqn, values in meta["state"].items()
        if fqn in index
    }
    return {"state": state, "param_groups": out_groups}


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    if owned(optimizer):  # each rank keeps the state of what it owns; no communication
        whole_matrix.load_full_optimizer_state_dict(optimizer, state)
        return
    if is_fully_sharded(model):
        _fsdp_optimizer_api("load_full_optimizer_state_dict")(model, optimizer, state)
        return
    optimizer.load_state_dict(state)


# --- which rank writes which shared tensor ---------------------------------------------------
def balanced_split(tensors: dict[str, torch.Tensor], world_size: int) -> list[list[str]]:
    """The keys each rank writes: largest tensors first, each to the least-loaded rank
    (ties: the lower rank). Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    owners: list[list[str]] = [[] for _ in range(world_size)]
    order = sorted(tensors, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k))
    for key in order:
        r = min(range(world_size), key=lambda i: (loads[i], i))
        owners[r].append(key)
        loads[r] += tensors[key].numel() * tensors[key].element_size()
    return owners
