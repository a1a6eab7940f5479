"""Checkpoints of a PTD-P layout: the dense model's state and its optimizer's, whatever
the layout, and back into any layout.

:func:`state_dict` returns ``{"model": <the dense model's state dict>, "optimizer": <the
plain optimizer's state dict over the dense model's parameters>}``: exactly what the
model and ``type(opt)(groups)`` trained in one process would hold (the optimizer given to
``compose``: its parameter groups, each group's parameters in its order, indices counted
across the groups one after the other). :func:`load_state_dict` takes such a pair (from
any layout, or from one process) and keeps this rank's part: its stages, its tp slice
(rows or columns, the vocabulary padding zero), its experts (expert modules, or its ep
rank's slice of stacked expert tensors), and under ZeRO its dp range
of the optimizer state. Values are copied, never recomputed: a state saved from one layout
and loaded into another is bitwise equal.

:func:`save` / :func:`load` go through :func:`plait.checkpoint.save` and
:func:`plait.checkpoint.load` with a dense model (the structure ``compose`` recorded on
the meta device, allocated) and a plain optimizer built on every rank from that pair, so
a PTD-P checkpoint is an ordinary plait checkpoint: it loads into one process, DDP, ZeRO
or FSDP, and theirs load here (the dense model is held once per rank while saving or
loading).

Shards that are not one slice of the dense tensor (a transposed linear or a fused
projection split part by part: Hugging Face GPT-2's ``Conv1D`` and ``c_attn``) are cut and
assembled through an index map: the dense flat index of every element a rank holds,
computed with the rule that slices the module's weight
(:func:`plait.checkpoint.kept.kept_one`), so their optimizer statistics are gathered
(one all-gather over tp of the values and one of the indices) and cut exactly as the
weights are.

Communication (:func:`state_dict`): the model as :meth:`PTDP.full_state_dict`; for the
optimizer, under ZeRO its consolidated ``state_dict`` (all-gathers over dp), then per
tensor-parallel parameter one all-gather over tp of each per-element statistic (over ep
along dimension 0 for stacked expert tensors), one
broadcast per (ep rank, dtype) of the experts' statistics over ep, one per (pp rank,
dtype) over pp. :func:`load_state_dict` sends nothing.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait import checkpoint
from plait.checkpoint.kept import kept_one
from plait.strategies.compose.dense import broadcast_stages
from plait.strategies.compose.experts import gather_experts
from plait.strategies.tensor.mappings import all_gather_dim

if TYPE_CHECKING:
    from plait.strategies.compose.ptdp import PTDP


def _split_dim(local: torch.Size, dense: torch.Size) -> int | None:
    """The dimension tensor parallelism cut (None: replicated)."""
    diff = [d for d, (a, b) in enumerate(zip(local, dense, strict=True)) if a != b]
    return diff[0] if diff else None


def _local_slice(dense: torch.Tensor, shape: torch.Size, rank: int) -> torch.Tensor:
    """This tp rank's part of ``dense``: ``shape[d]`` rows along the split dimension
    ``d`` starting at ``rank * shape[d]``, zero past the dense end (vocabulary padding)."""
    d = _split_dim(shape, dense.shape)
    if d is None:
        return dense.clone()
    part = shape[d]
    out = dense.new_zeros(shape)
    lo, hi = rank * part, min((rank + 1) * part, dense.shape[d])
    if hi > lo:
        out.narrow(d, 0, hi - lo).copy_(dense.narrow(d, lo, hi - lo))
    return out


def _statistics(ptdp: PTDP, dtype: torch.dtype) -> dict[str, tuple[bool, torch.Size, torch.dtype]]:
    """The optimizer's state entries for a parameter of ``dtype``: name -> (per element,
    shape when not, dtype). Found by stepping the optimizer class once on a probe."""
    probe = torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype))
    probe.grad = torch.ones_like(probe)
    opt = ptdp.optimizer_class([probe], **ptdp.hyper)
    opt.step()
    out = {}
    for key, value in opt.state[probe].items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"ptdp.state_dict: optimizer state {key!r} is not a tensor")
        per_element = value.shape == probe.shape
        out[key] = (per_element, value.shape, value.dtype if not per_element else dtype)
    return out


def _canonical(ptdp: PTDP, name: str) -> str:
    return ptdp.aliases.get(name, name)


def _held(ptdp: PTDP, name: str, param: torch.Tensor) -> torch.Tensor:
    """For a parameter in :attr:`PTDP.unsliced`: the dense flat index + 1 of every element
    this rank holds, in its shard's layout (0 where the shard holds padding). No
    communication."""
    shape = ptdp.index.shapes[name][0]
    owner, _, attr = name.rpartition(".")
    stage = next(st for st in ptdp.pipe.stages.values() if name in dict(st.named_parameters()))
    rule = kept_one(stage.get_submodule(owner), attr, name, param)
    numbers = torch.arange(1, math.prod(shape) + 1, device=param.device).view(shape)
    return rule.build(lambda index: numbers[index]).to(torch.int64).contiguous()


def _to_dense(ptdp: PTDP, name: str, value: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The dense tensor of an unsliced parameter's per-element statistic ``value``: every tp
    rank's values put at their dense places (collective over tp: two all-gathers)."""
    shape = ptdp.index.shapes[name][0]
    values = all_gather_dim(value.reshape(-1), 0, ptdp.tp_group, ptdp.algorithm)
    places = all_gather_dim(held.reshape(-1), 0, ptdp.tp_group, ptdp.algorithm)
    flat = value.new_zeros(math.prod(shape) + 1)
    flat[places] = values
    return flat[1:].view(shape)


def _from_dense(dense: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``dense`` by its index map (zeros on padding)."""
    flat = torch.cat([dense.new_zeros(1), dense.reshape(-1)])
    return flat[held]


@torch.no_grad()
def optimizer_state_dict(ptdp: PTDP) -> dict[str, Any]:
    """The plain optimizer state dict over the dense model's parameters, its parameter
    groups as the optimizer given to ``compose`` had them (module docstring). Collective
    over the whole mesh."""
    local = ptdp.optimizer.state_dict()
    names = ptdp.param_names
    index = {n: i for i, n in enumerate(names)}
    stepped = bool(local["state"])
    out: dict[str, Any] = {
        "state": {},
        "param_groups": [
            {
                **{k: v for k, v in mine.items() if k != "params"},
                "params": [index[n] for n in dense.names],
            }
            for mine, dense in zip(local["param_groups"], ptdp.dense_groups, strict=True)
        ],
    }
    if not stepped:
        return out
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    owner: dict[str, int] = {}
    kinds = {n: _statistics(ptdp, ptdp.index.shapes[n][1]) for n in names}
    for n in names:
        for stat, (per_element, shape, dtype) in kinds[n].items():
            key = f"{n}/{stat}"
            shapes[key] = (ptdp.index.shapes[n][0] if per_element else shape, dtype)
            owner[key] = ptdp.index.owner[n]
    mine: dict[str, torch.Tensor] = {}
    for j, i in enumerate(ptdp.opt_order):
        c = ptdp.counted[i]
        n = _canonical(ptdp, c.name)
        entry = local["state"].get(j)
        if entry is None:
            raise ValueError(
                f"ptdp.state_dict: parameter {n!r} has no optimizer state while others do "
                f"(it never had a gradient); step it once or leave it out of the model"
            )
        dense_shape = ptdp.index.shapes[n][0]
        d = _split_dim(c.param.shape, dense_shape)
        # split over tp, or (stacked experts) over ep along dimension 0
        over = ptdp.ep_group if n in ptdp.stacked else ptdp.tp_group
        held = _held(ptdp, c.name, c.param) if c.name in ptdp.unsliced else None
        for stat, (per_element, _, _) in kinds[n].items():
            value = entry[stat]
            if per_element and held is not None:
                value = _to_dense(ptdp, c.name, value, held)
            elif per_element and d is not None:
                assert over is not None
                value = all_gather_dim(value, d, over, ptdp.algorithm)
                value = value.narrow(d, 0, dense_shape[d])
            mine[f"{n}/{stat}"] = value.detach().clone()
    if ptdp.ep_group is not None:
        experts = {k: v for k, v in shapes.items() if k.split("/", 1)[0] in ptdp.expert_owner}
        whose = {k: ptdp.expert_owner[k.split("/", 1)[0]] for k in experts}
        gather_experts(mine, experts, whose, ep_group=ptdp.ep_group, algorithm=ptdp.algorithm)
    full = broadcast_stages(mine, shapes, owner, pp_group=ptdp.pp_group, algorithm=ptdp.algorithm)
    for i, n in enumerate(names):
        out["state"][i] = {stat: full[f"{n}/{stat}"] for stat in kinds[n]}
    return out


def state_dict(ptdp: PTDP) -> dict[str, Any]:
    """``{"model": dense state dict, "optimizer": dense optimizer state dict}``, the same
    on every rank. Collective over the whole mesh."""
    return {"model": ptdp.full_state_dict(), "optimizer": optimizer_state_dict(ptdp)}


@torch.no_grad()
def load_state_dict(
    ptdp: PTDP, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None = None
) -> None:
    """Keep this rank's part of a dense ``model`` state dict and (optionally) a dense
    ``optimizer`` state dict (module docstring). No communication (ZeRO keeps its range)."""
    missing = [k for k in ptdp.index.shapes if k not in model]
    if missing:
        raise ValueError(f"ptdp.load_state_dict: the model state lacks {missing[:5]}")
    rank = ptdp.tp_group.rank
    wrong = [
        f"{k} has shape {tuple(model[k].shape)}, the model {tuple(shape)}"
        for k, (shape, *_) in ptdp.index.shapes.items()
        if tuple(model[k].shape) != tuple(shape)
    ]
    if wrong:  # a slice of the wrong tensor would truncate or pad it silently
        raise ValueError(
            f"ptdp.load_state_dict: the state does not fit this model: {'; '.join(wrong[:5])}"
            f"{f' (and {len(wrong) - 5} more)' if len(wrong) > 5 else ''}; load a state of "
            f"the same configuration (vocabulary, width, layers)"
        )
    ep_rank = ptdp.ep_group.rank if ptdp.ep_group is not None else 0

    def rank_of(name: str) -> int:  # whose slice: the tp rank's, a stacked expert's ep rank
        return ep_rank if name in ptdp.stacked else rank

    def cut(name: str, dense: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if name in held:
            return _from_dense(dense, held[name])
        return _local_slice(dense, shape, rank_of(name))

    held = {c.name: _held(ptdp, c.name, c.param) for c in ptdp.counted if c.name in ptdp.unsliced}
    for c in ptdp.counted:
        c.param.copy_(cut(c.name, model[c.name].to(c.param.dtype), c.param.shape))
    for stage in ptdp.pipe.stages.values():
        persistent = set(stage.state_dict())  # not a rotary embedding's inv_freq
        for name, buf in stage.named_buffers():
            if name not in persistent:
                continue
            if buf.shape != model[name].shape:
                raise ValueError(
                    f"ptdp.load_state_dict: buffer {name} has shape {tuple(model[name].shape)}, "
                    f"the model {tuple(buf.shape)}"
                )
            buf.copy_(model[name])
    if optimizer is None:
        return
    names = ptdp.param_names
    index = {n: i for i, n in enumerate(names)}
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    for j, i in enumerate(ptdp.opt_order):
        c = ptdp.counted[i]
        entry = optimizer["state"].get(index[_canonical(ptdp, c.name)])
        if entry is None:
            continue
        local["state"][j] = {
            stat: cut(c.name, v, c.param.shape)
            if isinstance(v, torch.Tensor)
            and v.shape == ptdp.index.shapes[c.name][0]
            and v.dim() > 0
            else v.clone()
            if isinstance(v, torch.Tensor)
            else v
            for stat, v in entry.items()
        }
    if len(optimizer["param_groups"]) != len(ptdp.dense_groups):
        raise ValueError(
            f"ptdp.load_state_dict: the optimizer state has {len(optimizer['param_groups'])} "
            f"parameter groups, this optimizer {len(ptdp.dense_groups)}; load a state saved "
            f"with the same groups"
        )
    start = 0
    for group, mine in zip(optimizer["param_groups"], ptdp.optimizer.param_groups, strict=True):
        count = len(mine["params"])
        local["param_groups"].append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(start, start + count)),
            }
        )
        start += count
    ptdp.optimizer.load_state_dict(local)


def _dense_pair(ptdp: PTDP) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A dense model (the structure recorded before the cut, its tensors allocated, not
    initialised: the state is loaded into it) and a plain optimizer on it with the groups
    of the one given to ``compose``."""
    model = copy.deepcopy(ptdp.skeleton).to_empty(device=_device(ptdp))
    params = dict(model.named_parameters())
    groups = [{**g.options, "params": [params[n] for n in g.names]} for g in ptdp.dense_groups]
    return model, ptdp.optimizer_class(groups, **ptdp.hyper)


def _device(ptdp: PTDP) -> torch.device:
    first = next(iter(ptdp.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def save(ptdp: PTDP, root: str | Path, *, step: int, **options: Any) -> Path:
    """:func:`plait.checkpoint.save` of this layout's dense state (``options``: its other
    arguments, e.g. ``scaler=``, ``keep_last=``); the committed directory. Collective
    over the mesh and the checkpoint's group."""

    state = state_dict(ptdp)
    model, opt = _dense_pair(ptdp)
    model.load_state_dict(state["model"])
    if state["optimizer"]["state"]:
        opt.load_state_dict(state["optimizer"])
    return checkpoint.save(root, step=step, model=model, optimizer=opt, **options).wait()


def load(ptdp: PTDP, root: str | Path, **options: Any) -> Any:
    """:func:`plait.checkpoint.load` into a dense GPT and a plain optimizer, then
    :func:`load_state_dict` into this layout; what ``load`` returned. Collective over the
    checkpoint's group (the load itself sends nothing for a plain model)."""

    model, opt = _dense_pair(ptdp)
    restored = checkpoint.load(root, model=model, optimizer=opt, **options)
    load_state_dict(ptdp, model.state_dict(), opt.state_dict() if opt.state else None)
    return restored
