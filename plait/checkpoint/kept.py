"""What part of each of the model's full tensors a rank keeps, under any layout.

For every tensor a rank holds (parameters and persistent buffers), :func:`kept` says which
tensor of the one-process model it is part of (the model's own key), that tensor's full
shape, and how to build the rank's values from slices of the full one:

=========================  ==================================================================
layout                     the rank keeps
=========================  ==================================================================
plain, DDP, ZeRO-1/2       every tensor whole
tensor parallel (1D)       column-parallel: its rows of the output dimension (each fused part
                           on its own; a padded vocabulary's tail as zeros); row-parallel: its
                           columns of the input dimension; a vocabulary-split embedding: its
                           rows; ``Style(transposed=True)`` (GPT-2's ``Conv1D``): the same
                           elements of the ``[in, out]`` weight; a key/value projection kept
                           whole (``HeadSelectLinear``) and everything else: whole
pipeline                   the tensors of its stages, whole (under the dense names)
expert parallel            its experts' rows ``first .. first + local`` of each stacked weight
                           (Hugging Face ``gate_up_proj``/``down_proj``); plait's own MoE
                           layers name their experts by global index: whole
PTD-P (``compose``)        its pipeline's stages, each module as above (tensor-parallel
                           layers, stacked experts split over ep)
=========================  ==================================================================

A fully sharded model (FSDP, ZeRO-3) keeps flat element ranges instead: see
``plait.checkpoint.needs``. No communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from plait.checkpoint import agree
from plait.checkpoint.full import pipeline_of, unwrap
from plait.comm.group import Group
from plait.strategies.data_parallel.ddp import DistributedDataParallel
from plait.strategies.fsdp import FSDPModule
from plait.strategies.fsdp.state import _slots
from plait.strategies.placement import placement
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.tensor.layers_nd import ND_LAYERS

#: ``read(index)``: the elements ``index`` (one slice per leading dimension) of a full tensor
Read = Callable[[tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True)
class Kept:
    """One tensor a rank holds: part of the model's full tensor ``key`` of ``full_shape``;
    ``build(read)`` returns the rank's values from slices of the full tensor."""

    key: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    build: Callable[[Read], torch.Tensor]


def describe(model: nn.Module) -> str:
    """The layout in words, for messages: ``tensor parallel over tp(2)``, ..."""

    inner = unwrap(model)
    parts = []
    if isinstance(model, DistributedDataParallel):
        parts.append("DDP")
    mesh = getattr(inner, "mesh", None) if not isinstance(inner, nn.Module) else None
    if mesh is not None:
        parts.append(f"PTD-P on {dict(mesh.shape)}")
    pipe = pipeline_of(inner)
    if pipe is not None:
        g = pipe.group
        stages = list(map(int, pipe.stages))
        parts.append(f"pipeline over pp({g.size}), stages {stages} on this rank")
    tp = getattr(inner, "plait_tensor_parallel", None)
    if tp is not None:
        g = tp.group
        parts.append(f"tensor parallel over tp({g.size})")
    ep = getattr(inner, "plait_expert_parallel", None)
    if ep is not None:
        g = ep.ep_group
        parts.append(f"expert parallel over ep({g.size})")
    if isinstance(inner, FSDPModule):
        units = inner.sharded_units()
        size = units[0].config.size if units else 1
        parts.append(f"fully sharded over {size} ranks")
    return ", ".join(parts) or "whole on every rank (plain, DDP or ZeRO-1/2)"


def kept(model: nn.Module) -> list[Kept]:
    """Every tensor this rank holds, with its key in the one-process model (a tied
    parameter once per key, as ``state_dict`` lists it). No communication."""

    inner = unwrap(model)
    if isinstance(inner, FSDPModule):
        raise ValueError("kept: a fully sharded model keeps flat ranges (checkpoint.needs)")
    pipe = pipeline_of(inner)  # a pipeline, or a PTD-P layout's
    roots = list(pipe.stages.values()) if pipe is not None else [inner]
    out = []
    for root in roots:
        for prefix, module in root.named_modules(remove_duplicate=False):
            if isinstance(module, ND_LAYERS):
                raise NotImplementedError(
                    f"{prefix!r} is a {type(module).__name__} (2D/2.5D/3D tensor "
                    f"parallelism): loading slices into it is not supported yet; load into "
                    f"the dense model before plait.prepare"
                )
            named = list(module._parameters.items()) + [
                (n, b)
                for n, b in module._buffers.items()
                if n not in module._non_persistent_buffers_set
            ]
            for name, t in named:
                if t is not None:
                    key = f"{prefix}.{name}" if prefix else name
                    out.append(kept_one(module, name, key, t))
    return out


def _whole(key: str, t: torch.Tensor) -> Kept:
    return Kept(key, t, tuple(t.shape), lambda read: read(()))


def _rows(read: Read, lo: int, hi: int, n: int, dim: int) -> torch.Tensor:
    """Rows ``lo .. hi`` of dimension ``dim`` (0 or 1) of a tensor with ``n`` of them there,
    zeros past ``n`` (a padded vocabulary's tail)."""
    stop = min(hi, n)
    got = read((slice(None),) * dim + (slice(min(lo, stop), stop),))
    short = (hi - lo) - got.shape[dim]
    if short > 0:
        pad = list(got.shape)
        pad[dim] = short
        got = torch.cat([got, got.new_zeros(pad)], dim)
    return got


def kept_one(module: nn.Module, name: str, key: str, t: torch.Tensor) -> Kept:
    """The :class:`Kept` entry of tensor ``name`` of ``module`` (key ``key``): which part of
    the full tensor this rank holds, by the module's kind (module docstring)."""

    if isinstance(module, ColumnParallelLinear):
        k, r = module.blocks, module.group.rank
        out, width = module.out_features, module.part // k
        flip = name == "weight" and module.transposed
        matrix = (module.in_features, out) if flip else (out, module.in_features)
        full = (out,) if name == "bias" else matrix
        dim = 1 if flip else 0

        def column(read: Read) -> torch.Tensor:
            step = out // k
            parts = [
                _rows(read, b * step + r * width, b * step + (r + 1) * width, (b + 1) * step, dim)
                for b in range(k)
            ]
            whole = torch.cat(parts, dim)
            return whole.t() if flip else whole

        return Kept(key, t, full, column)
    if isinstance(module, RowParallelLinear) and name == "weight":
        r, width, flip = module.group.rank, module.part, module.transposed
        full = (
            (module.in_features, module.out_features)
            if flip
            else (module.out_features, module.in_features)
        )

        def row(read: Read) -> torch.Tensor:
            got = _rows(read, r * width, (r + 1) * width, module.in_features, 0 if flip else 1)
            return got.t() if flip else got

        return Kept(key, t, full, row)
    if isinstance(module, VocabParallelEmbedding):
        lo, hi, n = module.start, module.start + module.part, module.num_embeddings
        return Kept(key, t, (n, module.embedding_dim), lambda read: _rows(read, lo, hi, n, 0))
    info = getattr(module, "plait_ep", None)  # expert parallelism's record of its slicing
    if info is not None and name in info.stacked:
        a, b = info.first, info.first + info.local
        full = (info.num_experts, *t.shape[1:])
        return Kept(key, t, full, lambda read: read((slice(a, b),)))
    return _whole(key, t)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter elements under a layout, each saying what it counts.

    ``model``: the one-process model's (tied parameters once), what ``num_parameters()``
    returns on the unsplit model; ``this_rank``: the elements of the parameters this rank
    holds (its shards, stages or experts; FSDP's flat shards with their padding), what
    ``num_parameters()`` or ``sum(p.numel() for p in model.parameters())`` returns on the
    prepared model; ``layout``: the layout in words."""

    model: int
    this_rank: int
    layout: str


def parameter_counts(model: nn.Module, *, group: Group | None = None) -> ParameterCounts:
    """:class:`ParameterCounts` of ``model`` under any layout. Collective over ``group``
    (every rank of the model; default the world): one ``gather_json`` of this rank's
    parameter keys and their full sizes."""

    inner = unwrap(model)
    sizes: dict[str, int] = {}
    if isinstance(inner, FSDPModule):
        seen_slots: set[tuple[int, int]] = set()
        for key, unit, i in _slots(inner):
            if (id(unit), i) not in seen_slots:
                seen_slots.add((id(unit), i))
                sizes[key] = unit.numels[i]
    else:
        seen: set[int] = set()
        for k in kept(model):
            if not isinstance(k.tensor, nn.Parameter) or id(k.tensor) in seen:
                continue
            seen.add(id(k.tensor))
            where = placement(k.tensor)
            tied_elsewhere = where is not None and any(
                type(g).__name__ == "TiedCopies" and g.rank != 0 for g in where.replicate
            )
            if not tied_elsewhere:  # a tied head on the later stage: counted on the earlier
                sizes[k.key] = math.prod(k.full_shape)
    every: dict[str, int] = {}
    for part in agree.gather_json(sizes, agree.resolve(group)):
        every.update(part)
    mine = sum(p.numel() for p in inner.parameters())
    return ParameterCounts(sum(every.values()), mine, describe(model))
