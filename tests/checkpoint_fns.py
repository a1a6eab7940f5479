"""Rank functions for the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch

import plait
from plait import checkpoint
from tests import ddp_fns


def save_and_load(directory: str) -> tuple[bool, list[str]]:
    world = plait.world()
    model = ddp_fns.make_model()
    ddp = plait.DistributedDataParallel(model)
    state = {"rank": torch.tensor([world.rank]), "weights": model.fc1.weight.detach() * world.rank}
    checkpoint.save(directory, state)
    back = checkpoint.load(directory)
    same = torch.equal(back["rank"], state["rank"]) and torch.equal(
        back["weights"], state["weights"]
    )
    return same, sorted(checkpoint.full_state_dict(ddp))


def interrupted_save(directory: str) -> str:
    """Rank 1 dies before writing: no manifest, so the checkpoint must be refused."""
    world = plait.world()
    if world.rank == 0:
        checkpoint.save_atomic({"x": torch.ones(1)}, Path(directory) / "shard-0-of-2.pt")
    try:
        checkpoint.load(directory)
    except FileNotFoundError as exc:
        return str(exc)
    return "loaded"
