"""DCP chunks of tensor- and expert-parallel layers: which rectangle of the one-process
tensor each local tensor (or each block of it) is.

The rules are those of ``plait/checkpoint/kept.py`` (which ``load_pretrained`` uses),
written as offsets instead of reads:

==========================  ==================================================================
layer (tensor)              this rank's chunks (global offsets, local part)
==========================  ==================================================================
``ColumnParallelLinear``    per fused block b of k: rows ``b*out/k + r*w ..`` (w = part/k) of
weight, bias                the ``[out, in]`` weight and of the bias, from local rows
                            ``b*w ..``; a padded vocabulary's tail rows are not stored;
                            ``transposed`` (GPT-2's ``Conv1D``, full ``[in, out]``): the same
                            as columns, the local block transposed (a view)
``RowParallelLinear``       columns ``r*part ..`` of the ``[out, in]`` weight (rows of the
weight                      ``[in, out]`` one when ``transposed``); the bias whole
``VocabParallelEmbedding``  rows ``start ..`` (the padded tail not stored)
stacked experts (ep)        experts ``first .. first + local`` (dimension 0)
==========================  ==================================================================

Everything else is whole (replicated: DCP writes one copy). The same function cuts an
element-wise optimizer state tensor of the parameter's local shape. No communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.strategies.dcp_chunks import Chunk, ShardChunks, copy_into
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

#: (global offsets, sizes, local view) of one rectangle
Block = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


def split_chunks(module: nn.Module, name: str, t: torch.Tensor) -> ShardChunks | None:
    """``t`` (tensor ``name`` of ``module``, or a state tensor of its shape) as chunks of
    the one-process tensor, or None when the rank holds it whole."""
    t = t.detach()
    if isinstance(module, ColumnParallelLinear):
        k, r = module.blocks, module.group.rank
        width, step, n_in = module.part // k, module.out_features // k, module.in_features
        flip = name == "weight" and module.transposed
        full: tuple[int, ...] = (module.out_features,)
        if name == "weight":
            full = (n_in, module.out_features) if flip else (module.out_features, n_in)
        blocks: list[Block] = []
        for b in range(k):
            lo = b * step + r * width
            valid = max(0, min(lo + width, (b + 1) * step) - lo)
            rows = t[b * width : b * width + valid]
            if flip:
                blocks.append(((0, lo), (n_in, valid), rows.t()))
            else:
                blocks.append(((lo,) + (0,) * (t.dim() - 1), tuple(rows.shape), rows))
        return _chunks(full, blocks, t)
    if isinstance(module, RowParallelLinear) and name == "weight":
        lo, n_out, n_in = module.group.rank * module.part, module.out_features, module.in_features
        valid = max(0, min(lo + module.part, n_in) - lo)
        cols = t[:, :valid]
        if module.transposed:
            return _chunks((n_in, n_out), [((lo, 0), (valid, n_out), cols.t())], t)
        return _chunks((n_out, n_in), [((0, lo), (n_out, valid), cols)], t)
    if isinstance(module, VocabParallelEmbedding):
        lo, n = module.start, module.num_embeddings
        valid = max(0, min(lo + module.part, n) - lo)
        full = (n, module.embedding_dim)
        return _chunks(full, [((lo, 0), (valid, module.embedding_dim), t[:valid])], t)
    info = getattr(module, "plait_ep", None)  # expert parallelism's record of its slicing
    if info is not None and name in info.stacked:
        full = (info.num_experts, *t.shape[1:])
        offsets = (info.first,) + (0,) * (t.dim() - 1)
        return _chunks(full, [(offsets, tuple(t.shape), t)], t)
    return None


def _chunks(full: Sequence[int], blocks: list[Block], t: torch.Tensor) -> ShardChunks:
    kept = [(o, s, v) for o, s, v in blocks if all(s)]  # a padded tail holds no elements
    chunks = [Chunk(tuple(o), tuple(s), 0, 0) for o, s, _ in kept]
    return ShardChunks(full, chunks, [v for _, _, v in kept], dtype=t.dtype, device=t.device)


# --- the model and optimizer of a module layout (plain, DDP, pipeline, tensor, expert) ----
def named_tensors(roots: list[nn.Module]) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(key, module, name, tensor) of every parameter and persistent buffer of ``roots``,
    in ``state_dict`` order (a tied or shared tensor once per key)."""
    out = []
    for root in roots:
        for prefix, m in root.named_modules(remove_duplicate=False):
            named = list(m._parameters.items()) + [
                (n, b) for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set
            ]
            for name, t in named:
                if t is not None:
                    out.append((f"{prefix}.{name}" if prefix else name, m, name, t))
    return out


def model_state(roots: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every tensor of ``roots`` under its key: split ones as chunks, the rest whole (all
    views of the live tensors)."""
    out: dict[str, torch.Tensor] = {}
    for key, m, name, t in named_tensors(roots):
        chunks = split_chunks(m, name, t)
        out[key] = t.detach() if chunks is None else chunks
    return out


def load_model_state(roots: list[nn.Module], state: dict[str, Any], *, strict: bool) -> None:
    """Copy ``state`` (chunks or whole tensors, the model's own keys) into ``roots``'s
    tensors; keys (with ``strict``) and shapes checked before anything is copied."""
    template = model_state(roots)
    missing = [k for k in template if k not in state]
    unexpected = [k for k in state if k not in template]
    shapes = [
        f"{k}: given {tuple(state[k].shape)}, model {tuple(t.shape)}"
        for k, t in template.items()
        if k in state and tuple(state[k].shape) != tuple(t.shape)
    ]
    if shapes or (strict and (missing or unexpected)):
        raise ValueError(
            f"set_model_state_dict: the state dict does not match this rank's model: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}, other shapes {shapes[:8]}; pass "
            f"get_model_state_dict(model) filled by dcp.load, or the one-process state dict"
        )
    with torch.no_grad():
        for key, want in template.items():
            if key not in state:
                continue
            if isinstance(want, ShardChunks):
                copy_into(want, state[key], key)
            elif state[key] is not want:
                want.copy_(state[key])


def param_slots(
    roots: list[nn.Module], optimizer: torch.optim.Optimizer, who: str
) -> list[list[tuple[str, nn.Module, str, torch.Tensor]]]:
    """Per param group, (key, module, name, parameter) of each parameter it holds."""
    where: dict[int, tuple[str, nn.Module, str, torch.Tensor]] = {}
    for key, m, name, t in named_tensors(roots):
        if isinstance(t, nn.Parameter):
            where.setdefault(id(t), (key, m, name, t))
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        slots = []
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError(
                    f"plait.checkpoint.dcp.{who}: param group {g} of the optimizer holds a "
                    f"tensor of shape {tuple(p.shape)} that is not a parameter of this rank's "
                    f"model; build the optimizer on the model's parameters()"
                )
            slots.append(where[id(p)])
        groups.append(slots)
    return groups


def _elementwise(key: str, value: Any, p: torch.Tensor) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape


def _cut(m: nn.Module, name: str, key: str, value: Any, p: torch.Tensor) -> Any:
    chunks = split_chunks(m, name, value) if _elementwise(key, value, p) else None
    return value if chunks is None else chunks


def optimizer_state(
    roots: list[nn.Module], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, dict[str, Any]], list[list[str]]]:
    """``({fqn: {key: value}}, fqns of each param group)``; element-wise state of a split
    parameter as chunks (views), the rest as it is."""
    slots = param_slots(roots, optimizer, "get_optimizer_state_dict")
    state: dict[str, dict[str, Any]] = {}
    for group in slots:
        for key, m, name, p in group:
            entry = optimizer.state.get(p)
            if entry:
                state[key] = {k: _cut(m, name, k, v, p) for k, v in entry.items()}
    return state, [[key for key, _, _, _ in group] for group in slots]


def load_optimizer_state(
    roots: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    saved: dict[str, dict[str, Any]],
    hypers: list[dict[str, Any]],
) -> None:
    """The plain optimizer state dict of this rank's parameters, element-wise tensors cut
    from chunks or whole tensors into the local shape (a padded tail zero)."""
    slots = param_slots(roots, optimizer, "set_optimizer_state_dict")
    plain_state: dict[int, dict[str, Any]] = {}
    plain_groups = []
    index = 0
    for group, hyper in zip(slots, hypers, strict=True):
        indices = []
        for key, m, name, p in group:
            entry = {}
            for k, v in saved.get(key, {}).items():
                if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0:
                    local = torch.zeros_like(p, dtype=v.dtype)
                    view = split_chunks(m, name, local)
                    if view is not None:
                        copy_into(view, v, f"{key} {k}")
                        entry[k] = local
                        continue
                entry[k] = v
            if entry:
                plain_state[index] = entry
            indices.append(index)
            index += 1
        plain_groups.append({**hyper, "params": indices})
    optimizer.load_state_dict({"state": plain_state, "param_groups": plain_groups})
