"""The whole optimizer state of an ownership-stepped optimizer, in the plain format.

:func:`full_optimizer_state_dict` gives what the plain optimizer on the one-process model
would return from ``state_dict()`` (indices numbered group after group, in the order of
``plait_ownership.names``), on every rank; :func:`full_optimizer_param_names` the
parameter names of those indices; :func:`load_full_optimizer_state_dict` loads such a dict
(saved under any strategy and world size) into this rank's owned parameters. Names, not
indices, are what travel between layouts (``plait.checkpoint`` keys by them).

Communication (on the ownership group, every rank in the same order; blocks up to the
group's timeout): per parameter, one ``broadcast`` from its owner of a small int64 header
(the JSON description of its state entries) and its bytes, then one ``broadcast`` per
state tensor (Muon: its momentum, ``N`` elements; Adafactor: the row and column
statistics; Shampoo: its preconditioners). Loading does not communicate.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from plait import comm
from plait.comm.group import Group

_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.bool,
        torch.uint8,
    )
}


def _owned(optimizer: torch.optim.Optimizer, who: str) -> tuple[list[Any], Group]:
    slots = getattr(optimizer, "plait_state_slots", None)
    if slots is None:
        raise TypeError(
            f"{who}: this {type(optimizer).__name__} is not stepped by parameter ownership "
            f"(it did not come from plait.prepare with a whole-matrix optimizer)"
        )
    return slots, optimizer.plait_group  # type: ignore[attr-defined]


def _broadcast_bytes(data: bytes | None, src: int, group: Group, device: torch.device) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    comm.broadcast(size, src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if data is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf, src, group=group)
    return bytes(buf.cpu().tolist())


def full_optimizer_param_names(optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each param group, in :func:`full_optimizer_state_dict`'s
    index order. No communication."""
    slots, _ = _owned(optimizer, "full_optimizer_param_names")
    sizes = optimizer.plait_group_sizes  # type: ignore[attr-defined]
    names = [s.name for s, _, _ in slots]
    out, k = [], 0
    for n in sizes:
        out.append(names[k : k + n])
        k += n
    return out


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The plain-format state dict of the whole optimizer, the same on every rank, tensors
    on the CPU (module docstring). Collective over the ownership group."""
    slots, group = _owned(optimizer, "full_optimizer_state_dict")
    device = comm.world().device if group is None else group.device
    state: dict[int, dict[str, Any]] = {}
    for index, (_slot, owner, master) in enumerate(slots):
        entry = optimizer.state.get(master, {}) if master is not None else {}
        described = None
        if group.rank == owner:
            described = json.dumps(
                {
                    k: ["t", list(v.shape), str(v.dtype)]
                    if isinstance(v, torch.Tensor)
                    else ["v", v]
                    for k, v in entry.items()
                }
            ).encode()
        meta = json.loads(_broadcast_bytes(described, owner, group, device).decode())
        out: dict[str, Any] = {}
        for key, (kind, *rest) in meta.items():
            if kind == "v":
                out[key] = rest[0]
                continue
            shape, dtype = rest
            t = (
                entry[key].detach().to(device, copy=True)
                if group.rank == owner
                else torch.empty(shape, dtype=_DTYPES[dtype], device=device)
            )
            comm.broadcast(t, owner, group=group)
            out[key] = t.cpu()
        if out:
            state[index] = out
    groups, k = [], 0
    for g, n in zip(optimizer.param_groups, optimizer.plait_group_sizes, strict=True):  # type: ignore[attr-defined]
        groups.append(
            {**{key: v for key, v in g.items() if key != "params"}, "params": list(range(k, k + n))}
        )
        k += n
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a plain-format state dict (indices as :func:`full_optimizer_state_dict`'s)
    into this rank's owned parameters, and every group's hyper-parameters. No
    communication."""
    slots, _ = _owned(optimizer, "load_full_optimizer_state_dict")
    saved = state["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"load_full_optimizer_state_dict: the state has {len(saved)} param groups, the "
            f"optimizer {len(optimizer.param_groups)}; build it with the same groups"
        )
    position = {id(m): i for i, (_, _, m) in enumerate(slots) if m is not None}
    local_groups, local_state, j = [], {}, 0
    for g, entry in zip(optimizer.param_groups, saved, strict=True):
        ids = []
        for p in g["params"]:
            index = position[id(p)]
            if index in state["state"] or str(index) in state["state"]:
                value = state["state"].get(index, state["state"].get(str(index)))
                local_state[j] = {
                    k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in value.items()
                }
            ids.append(j)
            j += 1
        local_groups.append({**{k: v for k, v in entry.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
