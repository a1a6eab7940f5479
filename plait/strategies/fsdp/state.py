"""Whole-model views of a sharded model: full state dicts, full optimizer state, init.

- :func:`full_state_dict`: collective (one all-gather per unit on the group).
- :func:`load_full_state_dict`: no communication; each rank copies its slice.
- :func:`full_optimizer_state_dict`: collective (one all-gather per unit and per
  element-wise state tensor); the plain optimizer's ``state_dict()`` format, as it would
  be on the unsharded model.
- :func:`load_full_optimizer_state_dict`: no communication.
- :func:`materialize`: no communication (every rank runs the same init, same seed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.strategies.fsdp.module import FSDPModule, refuse_offloaded_meta
from plait.strategies.fsdp.unit import NAMES_ATTR, SHARD_NAME, UNITS_ATTR, ShardedUnit


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of ``module``, keys as before sharding, on every rank.

    Parameters come back in their master dtype, on the CPU. Collective: all-gathers every
    unit in ``module``'s subtree (blocks on the group); every rank must call it.
    """
    gathered: dict[int, list[torch.Tensor]] = {}

    def params_of(unit: ShardedUnit) -> list[torch.Tensor]:
        if id(unit) not in gathered:
            cfg = unit.config
            shard = unit.shard.detach().to(cfg.compute_device)
            flat = torch.empty(unit.padded, dtype=shard.dtype, device=cfg.compute_device)
            if cfg.group is None:
                flat.copy_(shard)
            else:
                comm.all_gather(flat, shard, group=cfg.group, algorithm=cfg.algorithm)
            pieces = flat.split([*unit.numels, unit.padded - unit.numel])
            gathered[id(unit)] = [
                piece.view(shape).cpu().clone()
                for piece, shape in zip(pieces, unit.shapes, strict=False)
            ]
        return gathered[id(unit)]

    out: dict[str, torch.Tensor] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if not name.startswith(SHARD_NAME) and p is not None:
                out[prefix + name] = p.detach().cpu().clone()
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            out[prefix + name] = params_of(unit)[i]
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[prefix + name] = b.detach().cpu().clone()
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return out


def _gather_flat(unit: ShardedUnit, shard: torch.Tensor) -> torch.Tensor:
    """The padded flat tensor whose rank-r slice is rank r's ``shard`` (collective)."""
    cfg = unit.config
    local = shard.detach().to(cfg.compute_device).reshape(-1)
    flat = torch.empty(unit.padded, dtype=local.dtype, device=cfg.compute_device)
    if cfg.group is None:
        flat.copy_(local)
    else:
        comm.all_gather(flat, local, group=cfg.group, algorithm=cfg.algorithm)
    return flat


def _sharded(module: nn.Module, who: str) -> FSDPModule:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{who}: {type(module).__name__} is not a fully_shard model")
    return module


def _slots(module: nn.Module) -> list[tuple[str, ShardedUnit, int]]:
    """(state-dict key, unit, index) of every original parameter, in named_modules order
    (tied parameters once per key)."""
    out = []
    for prefix, m in module.named_modules():
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            out.append((f"{prefix}.{name}" if prefix else name, unit, i))
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a whole (unsharded) state dict, keys as before sharding, into a sharded model.

    Strict: missing or unexpected keys and other shapes raise ``ValueError`` before
    anything is copied. Each rank copies its slice of every unit out of the full tensors
    (cast to the shard's dtype and device) and the buffers; any gathered full parameters
    are freed. No communication (every rank must pass the same ``state_dict``).
    """
    module = _sharded(module, "load_full_state_dict")
    slots = _slots(module)
    want: dict[str, tuple[int, ...]] = {k: tuple(u.shapes[i]) for k, u, i in slots}
    buffers = {
        (f"{prefix}.{name}" if prefix else name): b
        for prefix, m in module.named_modules()
        for name, b in m._buffers.items()
        if b is not None and name not in m._non_persistent_buffers_set
    }
    want.update({k: tuple(b.shape) for k, b in buffers.items()})
    missing = [k for k in want if k not in state_dict]
    unexpected = [k for k in state_dict if k not in want]
    shapes = [
        f"{k}: given {tuple(state_dict[k].shape)}, model {shape}"
        for k, shape in want.items()
        if k in state_dict and tuple(state_dict[k].shape) != shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"load_full_state_dict: the state dict does not match the model: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}, other shapes {shapes[:8]}; pass "
            f"the unsharded model's state_dict() (or full_state_dict of a sharded one)"
        )
    by_unit: dict[int, tuple[ShardedUnit, list[torch.Tensor | None]]] = {}
    first_key: dict[tuple[int, int], str] = {}
    for key, unit, i in slots:
        entry = by_unit.setdefault(id(unit), (unit, [None] * len(unit.params)))
        tensor = entry[1][i]
        if tensor is None:
            entry[1][i] = state_dict[key]
            first_key[(id(unit), i)] = key
        elif not torch.equal(tensor, state_dict[key]):  # a tied parameter's second key
            raise ValueError(
                f"load_full_state_dict: {first_key[(id(unit), i)]!r} and {key!r} are one tied "
                f"parameter in this model but differ in the state dict; pass a state dict of "
                f"the tied model (or untie the model before sharding)"
            )
    with torch.no_grad():
        for unit, tensors in by_unit.values():
            unit.wait()
            unit.reshard()
            full = [t.detach().to("cpu", unit.shard.dtype) for t in tensors if t is not None]
            unit.shard.copy_(unit.local_slice(full).to(unit.shard.device))
        for key, b in buffers.items():
            b.copy_(state_dict[key])


def shard_param_groups(module: nn.Module) -> list[list[nn.Parameter]]:
    """The shards of each parameter group given to ``fully_shard(param_groups=...)``, in
    group order (shards of units without parameters left out). No communication."""
    module = _sharded(module, "shard_param_groups")
    state = module.__dict__[UNITS_ATTR][0].state
    count = len(state.plain_groups) if state is not None and state.plain_groups else 0
    groups: list[list[nn.Parameter]] = [[] for _ in range(count)]
    for unit in module.sharded_units():
        if unit.numel and unit.group_index is not None:
            groups[unit.group_index].append(unit.shard)
    return groups


def _optimizer_order(
    module: FSDPModule, optimizer: torch.optim.Optimizer, who: str
) -> list[list[tuple[str, ShardedUnit, int]]]:
    """Per optimizer param group, the original parameters (key, unit, index) whose shards
    it holds, in the plain optimizer's order: prepare's recorded order if the groups were
    given to fully_shard, else the unsharded model's ``parameters()`` order."""
    units = _units_by_shard(module)
    first: dict[tuple[int, int], tuple[str, ShardedUnit]] = {}
    for key, unit, i in _slots(module):
        first.setdefault((id(unit), i), (key, unit))
    state = module.__dict__[UNITS_ATTR][0].state
    recorded = state.plain_groups if state is not None else None
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in units:
                raise ValueError(
                    f"{who}: parameter group {g} of the optimizer holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a shard of this model; build the optimizer "
                    f"on the fully_shard model's parameters()"
                )
        held = {id(units[id(p)]) for p in group["params"]}
        default = [(key, unit, i) for (uid, i), (key, unit) in first.items() if uid in held]
        if recorded is not None and g < len(recorded):
            ordered = [(first[(id(u), i)][0], u, i) for u, i in recorded[g]]
            if {(id(u), i) for _, u, i in ordered} == {(id(u), i) for _, u, i in default}:
                default = ordered
        out.append(default)
    return out


def _units_by_shard(module: FSDPModule) -> dict[int, ShardedUnit]:
    """id of each shard parameter to its unit (units with parameter elements)."""
    return {id(u.shard): u for u in module.sharded_units() if u.numel}


def full_optimizer_param_names(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[str]]:
    """The state-dict keys of each param group, in the order of
    :func:`full_optimizer_state_dict`'s parameter indices. No communication."""
    module = _sharded(module, "full_optimizer_param_names")
    order = _optimizer_order(module, optimizer, "full_optimizer_param_names")
    return [[key for key, _, _ in group] for group in order]


def _is_elementwise(value: Any, unit: ShardedUnit) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and (value.numel() == unit.shard_numel and unit.shard.numel() == unit.shard_numel)
    )


def full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state as the plain optimizer on the unsharded model would hold it:
    ``{"state": {index: {key: value}}, "param_groups": [{..., "params": [indices]}]}``,
    indices numbered group after group in the plain optimizer's parameter order (see
    :func:`full_optimizer_param_names`). Element-wise state (``exp_avg``, momentum) is
    all-gathered and cut per parameter; scalars (``step``) are copied. Tensors on the CPU.

    Collective: one all-gather per unit and element-wise state key, on the group; every
    rank must call it and gets the same result.
    """
    module = _sharded(module, "full_optimizer_state_dict")
    order = _optimizer_order(module, optimizer, "full_optimizer_state_dict")
    units = _units_by_shard(module)
    cut: dict[int, dict[str, list[torch.Tensor] | Any]] = {}  # unit id -> key -> pieces
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = units[id(p)]
            entry: dict[str, Any] = {}
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if _is_elementwise(value, unit):
                    flat = _gather_flat(unit, value)
                    entry[key] = [t.detach().cpu().clone() for t in unit.pieces(flat)]
                elif isinstance(value, torch.Tensor):
                    entry[key] = value.detach().cpu().clone()
                else:
                    entry[key] = value
            cut[id(unit)] = entry
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, members in zip(optimizer.param_groups, order, strict=True):
        indices = []
        for _, unit, i in members:
            entry = cut.get(id(unit), {})
            if entry:
                state[index] = {
                    k: (
                        v[i]
                        if isinstance(v, list)
                        else (v.clone() if isinstance(v, torch.Tensor) else v)
                    )
                    for k, v in entry.items()
                }
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a plain-format optimizer state dict (as :func:`full_optimizer_state_dict`
    returns, from any world size) into ``optimizer`` over this model's shards: each rank
    keeps its slice of every element-wise tensor. Groups and their sizes must match
    (``ValueError`` otherwise). A parameter with no state in a unit whose other parameters
    have some gets zeros. No communication.
    """
    module = _sharded(module, "load_full_optimizer_state_dict")
    order = _optimizer_order(module, optimizer, "load_full_optimizer_state_dict")
    units = _units_by_shard(module)
    saved_groups = state["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    mine = [len(g) for g in order]
    if sizes != mine:
        raise ValueError(
            f"load_full_optimizer_state_dict: the state has param groups of {sizes} "
            f"parameters, this optimizer {mine}; build the optimizer with the same groups"
        )
    saved_state = state["state"]
    sharded_state: dict[int, dict[str, Any]] = {}
    sharded_groups = []
    own_index = 0
    for group, members, saved in zip(optimizer.param_groups, order, saved_groups, strict=True):
        plain_of = {(id(u), i): saved["params"][k] for k, (_, u, i) in enumerate(members)}
        indices = []
        for p in group["params"]:
            unit = units[id(p)]
            entries = [
                saved_state.get(plain_of.get((id(unit), i)), {}) for i in range(len(unit.params))
            ]
            present = [e for e in entries if e]
            if present:
                out: dict[str, Any] = {}
                for key, value in present[0].items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.dim() > 0
                        and any(
                            tuple(value.shape) == tuple(unit.shapes[i])
                            for i, e in enumerate(entries)
                            if e
                        )
                    ):
                        full = [
                            e[key].detach().cpu()
                            if e
                            else torch.zeros(unit.shapes[i], dtype=value.dtype)
                            for i, e in enumerate(entries)
                        ]
                        out[key] = unit.local_slice(full)
                    else:
                        out[key] = value.clone() if isinstance(value, torch.Tensor) else value
                sharded_state[own_index] = out
            indices.append(own_index)
            own_index += 1
        sharded_groups.append(
            {**{k: v for k, v in saved.items() if k != "params"}, "params": indices}
        )
    optimizer.load_state_dict({"state": sharded_state, "param_groups": sharded_groups})


def materialize(
    module: nn.Module, init_fn: Callable[[nn.Module], None] | None = None, *, device: Any = "cpu"
) -> None:
    """Initialize a model sharded on the meta device: allocate its shards on ``device``
    (``to_empty``), build each unit's full parameters locally, run ``init_fn(module)``
    (default: ``reset_parameters()`` of every submodule that has one) on them, and keep
    this rank's slice. Every rank must seed its generator alike; then the result equals
    the same init on the unsharded model. No communication.
    """
    module = _sharded(module, "materialize")
    refuse_offloaded_meta(module, "materialize")
    if any(u.shard.is_meta for u in module.sharded_units() if u.numel):
        module.to_empty(device=device)
    units = module.sharded_units()
    with torch.no_grad():
        for unit in units:
            if not unit.numel:
                continue
            unit.full_data = torch.zeros(
                unit.padded, dtype=unit.shard.dtype, device=unit.shard.device
            )
            unit.full = unit.full_data.data
            if unit.requires_grad:
                unit.full.requires_grad_(True)
                unit.full.register_post_accumulate_grad_hook(unit._grad_ready)
            unit.install_views()
        if init_fn is None:
            for m in module.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
        else:
            init_fn(module)
        for unit in units:
            unit.write_back()
            unit.reshard()
