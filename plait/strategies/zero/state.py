"""ZeroOptimizer's state dicts: consolidated (the plain optimizer's format) and sharded.

Consolidated: ``{"state": {id: {key: value}}, "param_groups": [{..., "params": [ids]}]}``
with ids counted over every param group in order, as ``torch.optim.Optimizer`` numbers
them, frozen parameters included (they have no state). A per-element state entry (Adam's
``exp_avg``) of group g is all-gathered over group g's flat range; scalar entries
(``step``) are shared by the group's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from plait import comm
from plait.strategies.zero.partition import blocks_of

if TYPE_CHECKING:
    from plait.strategies.zero.optimizer import ZeroOptimizer


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _elementwise(key: str, value: Any, shard: torch.Tensor) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == shard.shape


def _trainable_ids(opt: ZeroOptimizer) -> list[list[tuple[int, int]]]:
    """Per group: (state-dict id, index among the trainable parameters) of its trainable
    parameters."""
    result, pid, index = [], 0, 0
    for params in opt._layout.all_params:
        members = []
        for p in params:
            if p.requires_grad:
                members.append((pid, index))
                index += 1
            pid += 1
        result.append(members)
    return result


def consolidated_state_dict(opt: ZeroOptimizer) -> dict[str, Any]:
    """See :meth:`ZeroOptimizer.state_dict` (collective on ``opt.group``)."""
    opt._sync_hyperparameters()
    state: dict[int, dict[str, Any]] = {}
    groups = []
    pid = 0
    members = _trainable_ids(opt)
    for g, (mine, shard) in enumerate(zip(opt.param_groups, opt.shards, strict=True)):
        count = len(mine["params"])
        groups.append({**_hyper(mine), "params": list(range(pid, pid + count))})
        pid += count
        local = opt.optim.state.get(shard, {})
        lo, hi = opt.group_bounds[g], opt.group_bounds[g + 1]
        for key, value in local.items():
            if _elementwise(key, value, shard):
                full = value.new_empty(hi - lo)
                blocks = [full[a - lo : b - lo] for a, b in blocks_of(lo, hi, opt.bounds)]
                comm.all_gather(blocks, value.detach(), group=opt.group, algorithm=opt.algorithm)
            for sid, index in members[g]:
                p = opt._params[index]
                if _elementwise(key, value, shard):
                    start = opt._offsets[index] - lo
                    entry = full[start : start + p.numel()].view_as(p).clone()
                else:
                    entry = value.clone() if isinstance(value, torch.Tensor) else value
                state.setdefault(sid, {})[key] = entry
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_consolidated_state_dict(opt: ZeroOptimizer, state_dict: dict[str, Any]) -> None:
    """See :meth:`ZeroOptimizer.load_state_dict` (no communication)."""
    groups = state_dict["param_groups"]
    want = [len(g["params"]) for g in opt.param_groups]
    got = [len(g["params"]) for g in groups]
    if want != got:
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: this optimizer has param groups of {want} "
            f"parameters, the state dict has groups of {got}; load a state saved from the "
            f"same param groups"
        )
    saved = state_dict["state"]
    members = _trainable_ids(opt)
    local_state: dict[int, dict[str, Any]] = {}
    local_groups = []
    for g, group in enumerate(groups):
        ids = group["params"]
        position = {sid: k for k, sid in enumerate(range(sum(got[:g]), sum(got[: g + 1])))}
        entries = [
            saved.get(ids[position[sid]], saved.get(str(ids[position[sid]])))
            for sid, _ in members[g]
        ]
        if any(e is not None for e in entries):
            missing = [sid for (sid, _), e in zip(members[g], entries, strict=True) if e is None]
            if missing:
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: parameters {missing[:8]} of param group "
                    f"{g} have no state while others of the group do; ZeroOptimizer keeps one "
                    f"state per group shard, so every parameter of the group needs one (train "
                    f"them all for a step first)"
                )
            local: dict[str, Any] = {}
            for key in entries[0]:
                local[key] = _local_value(opt, g, key, [e[key] for e in entries])
            local_state[g] = local
        hyper = _hyper(group)
        opt.param_groups[g].update(hyper)
        local_groups.append({**hyper, "params": [g]})
    opt.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    opt._refresh_shard()


def _local_value(opt: ZeroOptimizer, g: int, key: str, values: list[Any]) -> Any:
    """This rank's slice of group g's per-parameter state entry, or the shared scalar."""
    start, stop = opt._layout.group_starts[g], opt._layout.group_starts[g + 1]
    params = opt._params[start:stop]
    shard = opt.shards[g]
    if key != "step" and all(
        isinstance(v, torch.Tensor) and v.shape == p.shape
        for v, p in zip(values, params, strict=True)
    ):
        pieces = [
            values[piece.param - start].reshape(-1)[piece.start : piece.stop]
            for piece in opt.partition[opt.group.rank]
            if start <= piece.param < stop
        ]
        flat = torch.cat(pieces) if pieces else values[0].new_empty(0).reshape(-1)
        return flat.to(shard.dtype).clone()
    first = values[0]
    for i, v in enumerate(values[1:], start=1):
        same = (
            torch.equal(v, first)
            if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor)
            else v == first
        )
        if not same:
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: state {key!r} of parameter "
                f"{opt._names[start + i]!r} ({v!r}) differs from that of "
                f"{opt._names[start]!r} ({first!r}) in param group {g}; ZeroOptimizer keeps "
                f"one value of it per group shard"
            )
    return first.clone() if isinstance(first, torch.Tensor) else first


def sharded_state_dict(opt: ZeroOptimizer) -> dict[str, Any]:
    """See :meth:`ZeroOptimizer.sharded_state_dict` (no communication)."""
    opt._sync_hyperparameters()
    return {
        "world_size": opt.group.size,
        "rank": opt.group.rank,
        "numels": list(opt._numels),
        "group_starts": list(opt._layout.group_starts),
        "partition": [[tuple(p) for p in pieces] for pieces in opt.partition],
        "optimizer": opt.optim.state_dict(),
    }


def load_sharded_state_dict(opt: ZeroOptimizer, state_dict: dict[str, Any]) -> None:
    """See :meth:`ZeroOptimizer.load_sharded_state_dict` (no communication)."""
    mine = [[tuple(p) for p in pieces] for pieces in opt.partition]
    saved = [[tuple(p) for p in pieces] for pieces in state_dict["partition"]]
    starts = list(state_dict.get("group_starts", [0, len(state_dict["numels"])]))
    if (
        state_dict["world_size"] != opt.group.size
        or state_dict["rank"] != opt.group.rank
        or list(state_dict["numels"]) != opt._numels
        or starts != list(opt._layout.group_starts)
        or saved != mine
    ):
        raise ValueError(
            f"ZeroOptimizer.load_sharded_state_dict: the shard was saved by rank "
            f"{state_dict['rank']} of {state_dict['world_size']} over parameters of "
            f"{len(state_dict['numels'])} sizes in groups starting at {starts}; this is rank "
            f"{opt.group.rank} of {opt.group.size} over {len(opt._numels)} in groups starting "
            f"at {list(opt._layout.group_starts)}. Load on the same layout, or use "
            f"state_dict()/load_state_dict() (consolidated) to change it"
        )
    opt.optim.load_state_dict(state_dict["optimizer"])
    for mine_group, local in zip(opt.param_groups, opt.optim.param_groups, strict=True):
        mine_group.update(_hyper(local))
    opt._refresh_shard()
