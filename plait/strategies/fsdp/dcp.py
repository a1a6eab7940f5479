"""DCP state of a ``fully_shard`` model (FSDP, ZeRO-3): its flat shards as chunks.

Rank r holds elements ``[r*k, (r+1)*k)`` of each unit's padded flat buffer; of parameter i
of the unit (elements ``[o_i, o_i + n_i)`` of the buffer) that is its elements
``[max(r*k, o_i) - o_i, min((r+1)*k, o_i + n_i) - o_i)``, stored at the same place in the
shard. :func:`model_state` gives every parameter as
:class:`~plait.strategies.dcp_chunks.ShardChunks` of those elements (views of the shard),
buffers and unsharded parameters whole; :func:`optimizer_state` does the same for the
element-wise state of each shard (``exp_avg``, ``exp_avg_sq``: views), scalars
(``step``) as they are, under every parameter the shard holds. The loaders copy chunks
(or whole tensors) back into the shard-shaped tensors. No communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.strategies.dcp_chunks import ShardChunks, copy_into, fill_flat, shard_chunks
from plait.strategies.fsdp import FSDPModule
from plait.strategies.fsdp.state import _optimizer_order, _units_by_shard
from plait.strategies.fsdp.unit import NAMES_ATTR, SHARD_NAME, ShardedUnit

PARAMS = "params"


def param_range(unit: ShardedUnit, i: int) -> tuple[int, int, int]:
    """Of parameter ``i`` of ``unit``: this rank's elements ``[a, b)`` of its flattening
    (``a == b``: none), and where element ``a`` sits in this rank's shard."""
    lo, hi = unit.shard_range()
    offset = sum(unit.numels[:i])
    a, b = max(lo, offset), min(hi, offset + unit.numels[i])
    if a >= b:
        return 0, 0, 0
    return a - offset, b - offset, a - lo


def param_chunks(unit: ShardedUnit, i: int, flat: torch.Tensor) -> ShardChunks:
    """Parameter ``i``'s part of ``flat`` (this rank's shard, or an element-wise state
    tensor of it) as :class:`ShardChunks` of the parameter's shape (views of ``flat``)."""
    a, b, at = param_range(unit, i)
    return shard_chunks(unit.shapes[i], a, b, flat.detach().reshape(-1)[at : at + b - a])


def model_state(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of ``module`` (a ``fully_shard`` model or unit), keys as before
    sharding under ``prefix``, in ``nn.Module.state_dict``'s order."""
    out: dict[str, torch.Tensor] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if not name.startswith(SHARD_NAME) and p is not None:
                out[prefix + name] = p.detach()
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            unit.wait()
            out[prefix + name] = param_chunks(unit, i, unit.shard)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[prefix + name] = b.detach()
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, prefix)
    return out


def load_model_state(
    module: nn.Module, state: dict[str, Any], *, strict: bool = True, prefix: str = ""
) -> None:
    """Copy ``state`` (chunks from :func:`model_state` filled by ``dcp.load``, or whole
    tensors) into ``module``'s shards, buffers and unsharded parameters. Shapes, and with
    ``strict`` the keys, are checked before anything is copied."""
    template = model_state(module, prefix)
    missing = [k for k in template if k not in state]
    unexpected = [k for k in state if k.startswith(prefix) and k not in template]
    shapes = [
        f"{k}: given {tuple(state[k].shape)}, model {tuple(t.shape)}"
        for k, t in template.items()
        if k in state and tuple(state[k].shape) != tuple(t.shape)
    ]
    if shapes or (strict and (missing or unexpected)):
        raise ValueError(
            f"load_state_dict: the state dict does not match the fully_shard model: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}, other shapes {shapes[:8]}; pass "
            f"a state dict with the one-process model's keys (model.state_dict() filled by "
            f"dcp.load, or the unsharded model's state_dict())"
        )
    if isinstance(module, FSDPModule):
        for unit in module.sharded_units():
            unit.wait()
            unit.reshard()  # a gathered buffer would be stale once the shards change
    with torch.no_grad():
        for key, want in template.items():
            if key not in state:
                continue
            got = state[key]
            if isinstance(want, ShardChunks):
                copy_into(want, got, key)
            elif got is not want:
                want.copy_(got)


# --- optimizer -----------------------------------------------------------------------------
def _is_elementwise(value: Any, unit: ShardedUnit) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == unit.shard_numel == unit.shard.numel()
    )


def optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, dict[str, Any]], list[list[str]]]:
    """``({fqn: {key: value}}, fqns of each param group)``: each shard's state under every
    original parameter it holds (first key of a tied one), element-wise tensors cut."""
    order = _optimizer_order(module, optimizer, "get_optimizer_state_dict")  # type: ignore[arg-type]
    state: dict[str, dict[str, Any]] = {}
    for members in order:
        for key, unit, i in members:
            entry = optimizer.state.get(unit.shard)
            if entry:
                state[key] = {
                    k: param_chunks(unit, i, v) if _is_elementwise(v, unit) else v
                    for k, v in entry.items()
                }
    return state, [[key for key, _, _ in members] for members in order]


def group_fqns(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    order = _optimizer_order(module, optimizer, "set_optimizer_state_dict")  # type: ignore[arg-type]
    return [[key for key, _, _ in members] for members in order]


def load_optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: dict[str, dict[str, Any]],
    hypers: list[dict[str, Any]],
) -> None:
    """Each shard's state: per element-wise key a flat tensor (padding zero) assembled from
    its parameters' chunks or whole tensors; scalars from its first parameter with state;
    each group's hyper-parameters from ``hypers``."""
    order = _optimizer_order(module, optimizer, "set_optimizer_state_dict")  # type: ignore[arg-type]
    units = _units_by_shard(module)  # type: ignore[arg-type]
    local_state: dict[int, dict[str, Any]] = {}
    local_groups = []
    index = 0
    for group, members, hyper in zip(optimizer.param_groups, order, hypers, strict=True):
        indices = []
        for p in group[PARAMS]:
            unit = units[id(p)]
            entry: dict[str, Any] = {}
            for key, u, i in members:
                if u is not unit or key not in saved:
                    continue
                for name, value in saved[key].items():
                    if isinstance(value, ShardChunks) or (
                        isinstance(value, torch.Tensor)
                        and value.dim() > 0
                        and tuple(value.shape) == tuple(unit.shapes[i])
                    ):
                        flat = entry.get(name)
                        if not isinstance(flat, torch.Tensor) or flat.shape != (unit.shard_numel,):
                            flat = torch.zeros(
                                unit.shard_numel, dtype=value.dtype, device=unit.shard.device
                            )
                            entry[name] = flat
                        a, b, at = param_range(unit, i)
                        fill_flat(flat[at : at + b - a], unit.shapes[i], a, b, value, key)
                    elif name not in entry:
                        entry[name] = value.clone() if isinstance(value, torch.Tensor) else value
            if entry:
                local_state[index] = entry
            indices.append(index)
            index += 1
        local_groups.append({**hyper, PARAMS: indices})
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
