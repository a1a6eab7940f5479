"""The one-process model's state dict (its own keys, full shapes) from any layout.

:func:`full_state_dict` puts back together what the strategies split, in three steps:

1. the rank's part under the dense names: a tensor-parallel or fully sharded model gathers
   its own (``plait_full_state_dict``: all-gathers over ``tp`` or the FSDP group); a
   pipeline's stages are registered under the dense names already;
2. expert parallelism: Hugging Face's stacked experts (``gate_up_proj [E, 2I, d]``) are
   all-gathered along the expert dimension over ``ep``; plait's own MoE layers name each
   expert by its global index, so their experts only need the union of step 3;
3. the union over the groups whose ranks hold *different* tensors (``pp``: stages; ``ep``:
   plait's experts): every key comes from the lowest rank that holds it, broadcast.

Every rank returns the whole state dict. Collective over every group above (every rank
of the model calls it); no communication for a plain, DDP, naive-DP or ZeRO-1/2 model,
whose tensors returned are the live ones. A reproducible-mode runner
(``prepare(..., reproducible=True)``) is looked through: the state of the model it drives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.checkpoint.agree import gather_json
from plait.comm import ops
from plait.comm.group import Group
from plait.strategies.data_parallel.ddp import DistributedDataParallel
from plait.strategies.data_parallel.naive import NaiveDataParallel
from plait.strategies.moe.layer import MoE
from plait.strategies.pipeline.parallel import PipelineParallel
from plait.strategies.placement import placement
from plait.strategies.reproducible import ReproducibleRunner


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP or naive data-parallel wrapper, or inside the
    reproducible-mode runner that drives it (``prepare(..., reproducible=True)`` returns a
    :class:`~plait.strategies.reproducible.ReproducibleRunner` around the strategy's
    module: DDP, a plain model for ZeRO-1/2 and one process, or a ``fully_shard`` model);
    else ``model``."""

    if isinstance(model, ReproducibleRunner):
        model = model.module
    if isinstance(model, (DistributedDataParallel, NaiveDataParallel)):
        return model.module
    return model


def pipeline_of(model: Any) -> Any:
    """``model`` if it is a :class:`~plait.strategies.pipeline.PipelineParallel`, a PTD-P
    layout's pipeline (``compose``'s ``.pipe``), else None."""

    if isinstance(model, PipelineParallel):
        return model
    pipe = getattr(model, "pipe", None) if not isinstance(model, nn.Module) else None
    return pipe if isinstance(pipe, PipelineParallel) else None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict, keys and shapes as in the one-process model, on every
    rank, under any layout (module docstring). Collective where the layout is split."""
    inner = unwrap(model)
    if not isinstance(inner, nn.Module):  # PTD-P (compose): it gathers its own
        return inner.full_state_dict()  # type: ignore[no-any-return]
    pipe = pipeline_of(inner)
    own = getattr(inner, "plait_full_state_dict", None)
    if callable(own):
        state: dict[str, torch.Tensor] = own()
    elif pipe is not None:
        state = {}
        for stage in pipe.stages.values():
            state.update(stage.state_dict())
    else:
        state = inner.state_dict()
    roots = list(pipe.stages.values()) if pipe is not None else [inner]
    for root in roots:
        state.update(_gather_stacked_experts(root))
    ep = getattr(inner, "plait_expert_parallel", None)
    if ep is not None and _has_moe_layers(inner):
        state = union(state, ep.ep_group)
    if pipe is not None:
        state = union(state, pipe.group)
    return state


def _gather_stacked_experts(root: nn.Module) -> dict[str, torch.Tensor]:
    """The whole stacked weights of every expert-parallel container under ``root``:
    one all-gather per weight over its ``ep`` group, along dimension 0."""

    out = {}
    for prefix, box in root.named_modules():
        info = getattr(box, "plait_ep", None)
        if info is None:
            continue
        for name, p in box.named_parameters(recurse=False):
            where = placement(p)
            if where is None or all(g is not info.group for g in where.shard):
                continue  # not split over ep (a parameter of the container kept whole)
            parts = [torch.empty_like(p.detach()) for _ in range(info.group.size)]
            ops.all_gather(parts, p.detach().contiguous(), group=info.group)
            out[f"{prefix}.{name}" if prefix else name] = torch.cat(parts)
    return out


def _has_moe_layers(model: nn.Module) -> bool:

    return any(isinstance(m, MoE) for m in model.modules())


def union(local: dict[str, torch.Tensor], group: Group) -> dict[str, torch.Tensor]:
    """Every rank's tensors on every rank of ``group``: each key from the lowest rank that
    holds it (a copy held by several, such as a tied embedding and head, counted once).

    Collective over ``group``: one :func:`gather_json` of the keys, shapes and dtypes, then
    one broadcast per key from its first holder (the whole model's bytes reach every rank).
    """
    meta = [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in local.items()]
    every = gather_json(meta, group)
    out: dict[str, torch.Tensor] = {}
    for src, entries in enumerate(every):
        for key, shape, dtype in entries:
            if key in out:
                continue
            if src == group.rank:
                t = local[key].detach().contiguous().clone()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype))
            ops.broadcast(t, src, group=group)
            out[key] = t
    return out
