"""Which bytes of a checkpoint a rank needs: per stored tensor, the whole of it or only some
element ranges of its flattened values.

The checkpoint stores the dense model and optimizer state (``layout.py``); what a rank
keeps of it depends on the strategy that loads it:

- a ``fully_shard`` model (FSDP, ZeRO-3): of every parameter in a unit, the elements that
  fall in this rank's slice of the unit's padded flat buffer; of every element-wise
  optimizer tensor (``exp_avg``, ``exp_avg_sq``, momentum: same shape as its parameter),
  the same elements. Buffers, unsharded parameters and scalar state (``step``): whole;
- a :class:`~plait.strategies.zero.ZeroOptimizer` (ZeRO-1/2) with its model: of every
  trainable parameter and its element-wise state, this rank's pieces of the ZeRO partition.
  The model is replicated under ZeRO, so :func:`plait.checkpoint.load` then all-gathers the
  parameters over the optimizer's group (see ``reader.py``); buffers and frozen parameters
  are read whole;
- anything else (plain, DDP, naive data parallel): every tensor whole, since every rank
  holds the full model and optimizer state.

So with Adam (a parameter and two moments per element) a rank of W' reads about 1/W' of
the tensor bytes under FSDP and ZeRO-1/2, and all of them under DDP. No communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.checkpoint import layout
from plait.checkpoint.blocks import Ranges
from plait.strategies.fsdp.unit import NAMES_ATTR
from plait.strategies.zero import ZeroOptimizer

#: optimizer state read whole even when it has its parameter's shape
SCALAR_STATE = ("step",)


def whole(manifest: dict[str, Any], keys: list[str]) -> dict[str, Ranges]:
    return {k: None for k in keys if k in manifest["tensors"]}


def param_ranges(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Ranges]:
    """State-dict key of each parameter this rank keeps a part of, with its element ranges
    (only for sharding strategies; empty otherwise)."""
    if layout.is_fully_sharded(model):
        return _fully_sharded_ranges(model)

    if isinstance(optimizer, ZeroOptimizer):
        return _zero_ranges(model, optimizer)
    return {}


def _fully_sharded_ranges(model: nn.Module) -> dict[str, Ranges]:

    out: dict[str, Ranges] = {}
    for prefix, m in model.named_modules():
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            lo, hi = unit.shard_range()
            offset = sum(unit.numels[:i])
            a, b = max(lo, offset), min(hi, offset + unit.numels[i])
            key = f"{prefix}.{name}" if prefix else name
            out[key] = [(a - offset, b - offset)] if a < b else []
    return out


def _zero_ranges(model: nn.Module, optimizer: Any) -> dict[str, Ranges]:
    names: dict[int, list[str]] = {}
    for fqn, p in layout.unwrap(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    if not all(id(p) in names for p in optimizer._params):
        return {}  # an optimizer over other tensors: read everything (load refuses it)
    mine: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(optimizer._params))}
    for piece in optimizer.partition[optimizer.group.rank]:
        mine[piece.param].append((piece.start, piece.stop))
    return {fqn: mine[i] for i, p in enumerate(optimizer._params) for fqn in names[id(p)]}


def plan(
    manifest: dict[str, Any],
    shapes: dict[str, list[int]] | None,
    *,
    rank: int,
    world_size: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    rng: bool,
    whole_files: bool,
) -> dict[str, Ranges]:
    """Every tensor key this rank reads, with its element ranges (None: whole).

    ``shapes``: the stored shape of each tensor (from the files' headers), used to tell
    element-wise optimizer state from scalar state; None reads all optimizer state whole.
    """
    tensors: dict[str, str] = manifest["tensors"]
    saved_world = int(manifest["world_size"])
    wanted: dict[str, Ranges] = {}
    sliced = {} if model is None or whole_files else param_ranges(model, optimizer)
    for key in tensors:
        head, _, rest = key.partition("/")
        if head == "model" and model is not None:
            wanted[key] = sliced.get(rest)
        elif head == "optimizer" and optimizer is not None:
            wanted[key] = _optimizer_ranges(rest, sliced, manifest, shapes)
        elif head in ("extra", "scheduler"):
            wanted[key] = None
        elif saved_world == world_size and key.startswith(f"rank{rank}/"):
            wanted[key] = None
    if rng:
        wanted.update(whole(manifest, rng_keys(saved_world, rank)))
    return wanted


def rng_keys(saved_world: int, rank: int) -> list[str]:
    """The generator states rank ``rank`` reads: its own saved one, or (a rank the saving
    run did not have) every saved one, from which its streams are derived."""
    if rank < saved_world:
        return [f"rng/torch/{rank}"]
    return [f"rng/torch/{r}" for r in range(saved_world)]


def _optimizer_ranges(
    rest: str,
    sliced: dict[str, Ranges],
    manifest: dict[str, Any],
    shapes: dict[str, list[int]] | None,
) -> Ranges:
    """``rest`` is ``<fqn>/<state key>`` (or ``group<j>/...`` for hyper-parameters)."""
    fqn, _, state_key = rest.rpartition("/")
    if shapes is None or fqn not in sliced or state_key in SCALAR_STATE:
        return None
    if shapes.get(f"optimizer/{rest}") != shapes.get(f"model/{fqn}") or not shapes.get(
        f"model/{fqn}"
    ):
        return None
    return sliced[fqn]
