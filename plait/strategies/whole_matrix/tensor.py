"""Tensor-parallel parameters as ownership slots: which dimension each is cut along.

Under 1D tensor parallelism a column-parallel weight holds rows ``[r·part, (r+1)·part)``
of the dense one (dimension 0), a row-parallel weight columns (dimension 1), a
vocabulary-parallel embedding rows; a column-parallel bias is cut like its weight. A
parameter no parallel layer cut (a norm's weight, a row-parallel bias) is whole on every
rank with the same gradient (tensor parallelism sums it over the group where sequence
parallelism splits its inputs): every rank steps it (:class:`KeptSlot`). Layouts that do
not map to one contiguous cut (a padded vocabulary or output, fused ``blocks``, a
transposed weight, a multi-query tail, the 2D/2.5D/3D modes) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from plait.comm.group import Group
from plait.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.strategies.whole_matrix.owners import KeptSlot, SlicedSlot, Slot


def _cut(module: nn.Module, leaf: str) -> tuple[int, int] | None:
    """(dimension, dense size) of ``module``'s parameter ``leaf`` if a parallel layer cut
    it; None if it is whole; raises for a layout that is not one contiguous cut."""
    n: int = module.group.size  # type: ignore[assignment]
    if isinstance(module, ColumnParallelLinear):
        if module.blocks != 1 or module.transposed or int(module.part) * n != module.out_features:
            raise ValueError(_refused(module, "fused, transposed or padded outputs"))
        return 0, module.out_features
    if isinstance(module, RowParallelLinear):
        if leaf != "weight":
            return None
        if module.transposed:
            raise ValueError(_refused(module, "a transposed weight"))
        return 1, module.in_features
    if isinstance(module, VocabParallelEmbedding):
        if int(module.part) * n != module.num_embeddings:
            raise ValueError(_refused(module, "a padded vocabulary"))
        return 0, module.num_embeddings
    raise ValueError(_refused(module, "a layout other than one contiguous cut"))


def _refused(module: nn.Module, what: str) -> str:
    return (
        f"strategy 'tp': a whole-matrix optimizer holds a parameter of {type(module).__name__} "
        f"with {what}, which plait cannot reassemble into the dense matrix yet; keep that "
        f"layer's parameters in an element-wise optimizer (e.g. AdamW)"
    )


def tensor_slots(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    roots: Sequence[nn.Module] = (),
    names: Mapping[int, str] | None = None,
) -> tuple[list[list[Slot]], Group]:
    """One slot per parameter of each of ``optimizer``'s groups (the parallelized
    parameters of ``model``, or of the modules ``roots`` when only those hold this rank's
    parameters: a pipeline's stages, whose parameters ``names`` names by ``id``), and the
    tensor-parallel group."""
    info: Any = getattr(model, "plait_tensor_parallel", None)
    if info is None:
        raise ValueError("strategy 'tp': the model was not parallelized")
    group: Group = info.group
    where: dict[int, tuple[str, nn.Module, str]] = {}
    for root in roots or [model]:
        for name, p in root.named_parameters():
            path, _, leaf = name.rpartition(".")
            full = (names or {}).get(id(p), name)
            where.setdefault(id(p), (full, root.get_submodule(path) if path else root, leaf))
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    slots: list[list[Slot]] = []
    for g in optimizer.param_groups:
        out: list[Slot] = []
        for p in g["params"]:
            name, module, leaf = where[id(p)]
            layered = isinstance(module, parallel) or hasattr(module, "dense_names")
            cut = _cut(module, leaf) if layered else None
            if cut is None:
                out.append(KeptSlot(name, p))
                continue
            dim, dense = cut
            sizes = [dense // group.size] * group.size
            out.append(SlicedSlot(name, p, dim=dim, sizes=sizes, rank=group.rank))
        slots.append(out)
    return slots, group
