"""``load``: restore a checkpoint written by :func:`plait.checkpoint.save`, verified,
at any world size and under any strategy.

Communication (collective: every rank of ``group`` must call ``load``): three small
gathers (arguments, candidate steps, per-candidate verification results). Every rank reads
and verifies, whole, every file holding a tensor it needs (with the dense layout: the model
and optimizer files of all ranks), so each rank reads about the whole checkpoint; sharded
strategies then keep their part. No tensor is communicated. Every rank raises the same
error when any rank finds a problem, or every rank falls back to the same older checkpoint.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint import layout, transaction
from plait.checkpoint.agree import (
    SAME_ARGS,
    CheckpointCorrupt,
    gather_json,
    rank_of,
    require_same,
    resolve,
    size_of,
)
from plait.checkpoint.writer import finish_pending
from plait.comm.group import Group


@dataclass
class Restored:
    """What :func:`load` restored. ``state``: this rank's ``state`` of the simple form
    (``save(root, state)``); ``restored[key]`` reads it too. ``skipped``: the checkpoints
    refused before this one (``fallback=True``), each with the reason."""

    step: int
    path: Path
    world_size: int
    extra: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    rng_restored: bool = False
    skipped: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.state[key]

    def __contains__(self, key: object) -> bool:
        return key in self.state

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    def keys(self) -> Any:
        return self.state.keys()

    def items(self) -> Any:
        return self.state.items()


def load(
    root: str | Path,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scaler: Any = None,
    scheduler: Any = None,
    step: int | str = "latest",
    fallback: bool = False,
    group: Group | None = None,
    rng: bool = True,
) -> Restored:
    """Load a checkpoint from ``root`` into the given objects; collective over ``group``.

    Any saving strategy and world size loads into any strategy and world size: parameters
    and optimizer state are stored dense and keyed by name (bitwise equal after the load).
    The sampler continues the saved global position split over the current ranks. RNG
    rule: each rank's torch CPU generator and Python ``random`` state are restored only
    when the world size is the saved one (rank r gets rank r's); at another world size
    they are left alone (``Restored.rng_restored`` is False), since per-rank streams have
    no meaning there. The simple form's per-rank ``state`` needs the saved world size.

    ``step``: ``"latest"`` (what ``root/latest`` names, else the newest committed step) or
    an int. Every file read is checked against its SHA-256; a damaged, truncated or missing
    file raises :class:`CheckpointCorrupt` on every rank naming the file, the rank that
    wrote it and the rank that found it. ``fallback=True`` loads the newest older committed
    checkpoint instead (with a warning; ``Restored.skipped`` says what was refused).
    """
    finish_pending()
    g = resolve(group)
    rank, world_size = rank_of(g), size_of(g)
    path = Path(root).resolve()
    if not (step == "latest" or (isinstance(step, int) and not isinstance(step, bool))):
        raise ValueError(f"checkpoint.load: step must be 'latest' or an int, got {step!r}")
    require_same(
        "checkpoint.load",
        "the call, checkpoint root and step",
        gather_json({"call": "load", "root": str(path), "step": step}, g),
        hint=SAME_ARGS,
    )
    listing = None
    if rank == 0:
        listing = {
            "steps": transaction.candidates(path, step),
            "uncommitted": transaction.uncommitted(path),
        }
    listing = gather_json(listing, g)[0]
    steps = listing["steps"] if fallback else listing["steps"][:1]
    if not steps:
        raise FileNotFoundError(
            f"checkpoint.load: {path} holds no committed checkpoint (a step-<N>/ directory "
            f"with manifest.json); uncommitted: {listing['uncommitted']}"
        )
    skipped: list[str] = []
    for candidate in steps:
        directory = path / transaction.step_name(candidate)
        status: dict[str, Any] = {}
        try:
            manifest = transaction.read_manifest(directory)
            tensors = transaction.read_files(
                directory,
                manifest,
                _files_needed(manifest, rank, world_size, model, optimizer, rng),
                rank,
            )
        except CheckpointCorrupt as exc:
            status = {"error": str(exc)}
        except OSError as exc:
            status = {"error": f"reading {directory}: {exc}"}
        statuses = gather_json(status, g)
        if not any(s.get("error") for s in statuses):
            break
        reasons = "; ".join(
            f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s.get("error")
        )
        message = f"checkpoint.load: {directory} is refused: {reasons}"
        if not fallback:
            raise CheckpointCorrupt(
                message + ". Pass fallback=True to load the previous good checkpoint"
            )
        skipped.append(message)
        warnings.warn(message + "; trying an older checkpoint", stacklevel=2)
    else:
        raise CheckpointCorrupt(
            f"checkpoint.load: no good checkpoint under {path}: " + " | ".join(skipped)
        )
    return _apply(
        manifest,
        tensors,
        directory,
        skipped,
        rank,
        world_size,
        model,
        optimizer,
        sampler,
        scaler,
        scheduler,
        rng,
    )


def _files_needed(
    manifest: dict[str, Any],
    rank: int,
    world_size: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    rng: bool,
) -> list[str]:
    files: dict[str, str] = manifest["tensors"]
    same_world = manifest["world_size"] == world_size
    wanted = []
    for key in files:
        head = key.split("/", 1)[0]
        if head == "model" and model is not None:
            wanted.append(key)
        elif head in ("optimizer", "extra", "scheduler"):
            if head != "optimizer" or optimizer is not None:
                wanted.append(key)
        elif same_world and (
            key.startswith(f"rank{rank}/") or (rng and key == f"rng/torch/{rank}")
        ):
            wanted.append(key)
    return sorted({files[k] for k in wanted})


def _apply(
    manifest: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    directory: Path,
    skipped: list[str],
    rank: int,
    world_size: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    sampler: Any,
    scaler: Any,
    scheduler: Any,
    rng: bool,
) -> Restored:
    where = f"checkpoint.load of {directory}"
    for name, obj, key in (
        ("model", model, "model"),
        ("optimizer", optimizer, "optimizer"),
        ("sampler", sampler, "sampler"),
        ("scaler", scaler, "scaler"),
        ("scheduler", scheduler, "scheduler"),
    ):
        if obj is not None and key not in manifest:
            raise ValueError(
                f"{where}: a {name} was passed but the checkpoint holds no {name} state"
            )
    if optimizer is not None and model is None:
        raise ValueError(f"{where}: pass model= with optimizer= (its state is keyed by name)")
    saved_world = manifest["world_size"]
    same_world = saved_world == world_size
    opt_state = None
    if optimizer is not None:  # validated before the model is touched
        assert model is not None
        groups = layout.optimizer_groups(model, optimizer)
        opt_state = layout.decode_optimizer(manifest["optimizer"], tensors, groups)
    if model is not None:
        layout.load_model_state(model, {k: tensors[f"model/{k}"] for k in manifest["model"]})
    if optimizer is not None and opt_state is not None:
        assert model is not None
        layout.load_optimizer_state(model, optimizer, opt_state)
    if sampler is not None:
        sampler.load_state_dict(manifest["sampler"])
    if scaler is not None:
        scaler.load_state_dict(manifest["scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(layout.decode_tree(manifest["scheduler"], tensors))
    mine = manifest["ranks"][rank] if same_world else {}
    rng_restored = False
    if rng and same_world and f"rng/torch/{rank}" in tensors:
        torch.set_rng_state(tensors[f"rng/torch/{rank}"])
        random.setstate(layout.decode_tree(mine["python_random"], {}))
        rng_restored = True
    state: dict[str, Any] = {}
    if "state" in mine:
        state = layout.decode_tree(mine["state"], tensors)
    elif any("state" in r for r in manifest["ranks"]) and model is None and optimizer is None:
        raise ValueError(
            f"{where}: it holds per-rank state saved by {saved_world} ranks, but this group "
            f"has {world_size}; per-rank state only loads at the world size that saved it "
            f"(save model/optimizer state instead to change the world size)"
        )
    extra = layout.decode_tree(manifest["extra"], tensors) if "extra" in manifest else None
    return Restored(
        step=int(manifest["step"]),
        path=directory,
        world_size=saved_world,
        extra=extra,
        state=state,
        rng_restored=rng_restored,
        skipped=skipped,
    )
