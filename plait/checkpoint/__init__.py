"""Checkpoints: whole state dicts from any strategy, sharded save and load, atomic files.

- :func:`full_state_dict` returns the unsharded model state dict, with the keys of the
  unwrapped model, from a plain, DDP, naive-DP or fully sharded model (every rank gets it;
  for sharded models this all-gathers every parameter).
- :func:`save` writes one file per rank (``shard-<rank>-of-<n>.pt``) and, once every rank's
  file is on disk (a barrier), rank 0 writes ``manifest.json``; :func:`load` refuses a
  directory without a manifest, so a save that died half-way is never loaded.
- Every file is written atomically (``files.py``).

Resharding a checkpoint to another world size is not implemented yet: :func:`load`
says so when the sizes differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.checkpoint.files import save_atomic, write_bytes_atomic
from plait.comm.group import Group

MANIFEST = "manifest.json"


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict, keys as in the unwrapped model, on every rank."""
    from plait.strategies import DistributedDataParallel, NaiveDataParallel

    if isinstance(model, (DistributedDataParallel, NaiveDataParallel)):
        return model.module.state_dict()
    full = getattr(model, "plait_full_state_dict", None)
    if callable(full):
        return full()  # type: ignore[no-any-return]
    return model.state_dict()


def _shard_name(rank: int, world: int) -> str:
    return f"shard-{rank}-of-{world}.pt"


def save(directory: str | Path, state: dict[str, Any], *, group: Group | None = None) -> None:
    """Write this rank's ``state`` under ``directory``; every rank of ``group`` must call it.

    Blocks on the other ranks (one barrier) before the manifest is written.
    """
    g = group if group is not None else comm.world()
    path = Path(directory)
    save_atomic(state, path / _shard_name(g.rank, g.size))
    comm.barrier(group=g)
    if g.rank == 0:
        manifest = {
            "format": "plait-sharded-v1",
            "world_size": g.size,
            "shards": [_shard_name(r, g.size) for r in range(g.size)],
        }
        write_bytes_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    comm.barrier(group=g)


def load(directory: str | Path, *, group: Group | None = None) -> dict[str, Any]:
    """Read this rank's shard of a checkpoint written by :func:`save`."""
    g = group if group is not None else comm.world()
    path = Path(directory)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"{path} has no {MANIFEST}: it is not a complete plait checkpoint (a save that "
            f"did not finish leaves no manifest). Load an earlier checkpoint"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != "plait-sharded-v1":
        raise ValueError(f"{manifest_path}: unknown checkpoint format {manifest.get('format')!r}")
    if manifest["world_size"] != g.size:
        raise ValueError(
            f"{path} was saved by {manifest['world_size']} ranks but this group has {g.size}; "
            f"resharding across world sizes is not implemented yet: load it with "
            f"{manifest['world_size']} ranks, or save a full_state_dict instead"
        )
    return torch.load(path / manifest["shards"][g.rank], weights_only=True)  # type: ignore[no-any-return]


__all__ = ["full_state_dict", "load", "save", "save_atomic", "write_bytes_atomic"]
