"""``load``: restore a checkpoint written by :func:`plait.checkpoint.save`, verified,
at any world size and under any strategy.

Communication (collective: every rank of ``group`` must call ``load``): three small
gathers (arguments, candidate steps, per-candidate verification results); under ZeRO-1/2
(a ``ZeroOptimizer`` passed with its model) one all-gather of the parameters over the
optimizer's group, as after an optimizer step ((W'-1)/W' of the parameter bytes sent per
rank), because each rank read only its own part of them. Every rank raises the same error
when any rank finds a problem, or every rank falls back to the same older checkpoint.

Reads: each rank reads the manifest, the safetensors header of each file holding a tensor
it needs, and of each such tensor only the blocks covering the elements it keeps
(``needs.py``: 1/W' of every parameter and element-wise optimizer tensor under FSDP and
ZeRO-1/2, everything under DDP and plain models), each block verified against its SHA-256
(``blocks.py``). ``Restored.bytes_read`` counts them. Checkpoints of format v2 (a SHA-256
per file only) and ``whole_files=True`` read and verify every needed file whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint import layout, needs, transaction
from plait.checkpoint import rng as rng_streams
from plait.checkpoint.agree import (
    SAME_ARGS,
    CheckpointCorrupt,
    gather_json,
    rank_of,
    require_same,
    resolve,
    size_of,
)
from plait.checkpoint.blocks import RangeReader, Ranges
from plait.checkpoint.writer import finish_pending
from plait.comm.group import Group
from plait.strategies.zero import ZeroOptimizer


@dataclass
class Restored:
    """What :func:`load` restored. ``state``: this rank's ``state`` of the simple form
    (``save(root, state)``); ``restored[key]`` reads it too. ``skipped``: the checkpoints
    refused before this one (``fallback=True``), each with the reason. ``rng_source``:
    how this rank's random streams were set, ``"saved"``, ``"derived"`` or ``"none"`` (see
    :func:`load`); ``rng_restored`` is True for the first two. ``bytes_read``: the bytes
    this rank read from the checkpoint (manifest, headers, tensor blocks, refused
    candidates included); ``checkpoint_bytes``: the size of the loaded checkpoint's files
    and manifest, for comparison."""

    step: int
    path: Path
    world_size: int
    extra: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    rng_restored: bool = False
    skipped: list[str] = field(default_factory=list)
    rng_source: str = rng_streams.NONE
    bytes_read: int = 0
    checkpoint_bytes: int = 0

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
    whole_files: bool = False,
) -> Restored:
    """Load a checkpoint from ``root`` into the given objects; collective over ``group``.

    Any saving strategy and world size loads into any strategy and world size: parameters
    and optimizer state are stored dense and keyed by name (bitwise equal after the load).
    Each rank reads only the parts it keeps (see the module docstring). The sampler
    continues the saved global position split over the current ranks. The simple form's
    per-rank ``state`` needs the saved world size.

    RNG rule (``rng=True``; saved at W, loaded at W'): rank r < W gets saved rank r's torch
    CPU generator and Python ``random`` state (``Restored.rng_source == "saved"``); a rank
    r >= W that the saving run did not have seeds both from a SHA-256 of the step, every
    saved rank's states and r (``"derived"``): two resumes of one checkpoint at the same W'
    draw the same numbers, and ranks draw different ones. Saved ranks r >= W' are dropped.
    CUDA generators and NumPy are not saved (see ``rng.py``).

    ``step``: ``"latest"`` (what ``root/latest`` names, else the newest committed step) or
    an int. Every file read is checked against its SHA-256; a damaged, truncated or missing
    file raises :class:`CheckpointCorrupt` on every rank naming the file, the rank that
    wrote it and the rank that found it. ``fallback=True`` loads the newest older committed
    checkpoint instead (with a warning; ``Restored.skipped`` says what was refused).
    A checkpoint that records a SHA-256 per block is verified block by block as read (a
    flipped bit in a range this rank reads is named by file, tensor and block; bytes no
    rank reads are not checked: :func:`plait.checkpoint.verify` reads everything).
    ``whole_files=True``: read and verify every file holding a tensor this rank needs
    whole (its file SHA-256), as checkpoints written before per-block checksums are read.
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
        gather_json(
            {"call": "load", "root": str(path), "step": step, "whole_files": whole_files}, g
        ),
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
    read = 0
    for candidate in steps:
        directory = path / transaction.step_name(candidate)
        status: dict[str, Any] = {}
        reads = Reads()
        try:
            manifest = transaction.read_manifest(directory)
            reads.count((directory / transaction.MANIFEST).stat().st_size)
            tensors = reads.tensors(
                directory, manifest, rank, world_size, model, optimizer, rng, whole_files
            )
        except CheckpointCorrupt as exc:
            status = {"error": str(exc)}
        except OSError as exc:
            status = {"error": f"reading {directory}: {exc}"}
        read += reads.bytes_read
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
    restored = _apply(
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
    if reads.zero_parameters_sliced:
        _gather_zero_parameters(optimizer)
    restored.bytes_read = read
    restored.checkpoint_bytes = reads.checkpoint_bytes
    return restored


class Reads:
    """What one rank reads of one candidate checkpoint, and how many bytes."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.checkpoint_bytes = 0
        self.zero_parameters_sliced = False

    def count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.checkpoint_bytes += nbytes

    def tensors(
        self,
        directory: Path,
        manifest: dict[str, Any],
        rank: int,
        world_size: int,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        rng: bool,
        whole_files: bool,
    ) -> dict[str, torch.Tensor]:
        """The tensors this rank needs (those it keeps part of: only those parts filled)."""
        files: dict[str, Any] = manifest["files"]
        self.checkpoint_bytes += sum(int(e["bytes"]) for e in files.values())

        def plan(shapes: dict[str, list[int]] | None) -> dict[str, Ranges]:
            return needs.plan(
                manifest,
                shapes,
                rank=rank,
                world_size=world_size,
                model=model,
                optimizer=optimizer,
                rng=rng,
                whole_files=whole_files,
            )

        draft = plan(None)
        names = sorted({manifest["tensors"][k] for k in draft})
        if whole_files or not all("blocks" in files[n] for n in names):
            self.bytes_read += sum(int(files[n]["bytes"]) for n in names)
            everything = transaction.read_files(directory, manifest, names, rank)
            return {k: everything[k] for k in draft}
        reader = RangeReader(directory, manifest, rank)
        shapes: dict[str, list[int]] = {}
        try:
            for name in names:
                shapes.update(reader.shapes(name))
            wanted = plan(shapes)
            by_file: dict[str, dict[str, Ranges]] = {}
            for key, ranges in wanted.items():
                by_file.setdefault(manifest["tensors"][key], {})[key] = ranges
            tensors: dict[str, torch.Tensor] = {}
            for name, keys in sorted(by_file.items()):
                tensors.update(reader.read(name, keys))
        finally:
            self.bytes_read += reader.bytes_read
        self.zero_parameters_sliced = _zero_sliced(model, optimizer, wanted)
        return tensors


def _zero_sliced(
    model: nn.Module | None, optimizer: torch.optim.Optimizer | None, wanted: dict[str, Ranges]
) -> bool:

    return (
        isinstance(optimizer, ZeroOptimizer)
        and model is not None
        and not layout.is_fully_sharded(model)
        and any(k.startswith("model/") and r is not None for k, r in wanted.items())
    )


def _gather_zero_parameters(optimizer: Any) -> None:
    """Each rank read only its ZeRO pieces of the parameters (the rest are zeros): the
    optimizer's own all-gather of the shards (as after a step) makes them whole again.
    Collective on the optimizer's group."""
    optimizer._refresh_shard()
    with torch.no_grad():
        optimizer._gather_parameters()
    optimizer._release_shard()


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
    rng_source = rng_streams.restore(manifest, tensors, rank) if rng else rng_streams.NONE
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
        rng_restored=rng_source != rng_streams.NONE,
        rng_source=rng_source,
        skipped=skipped,
    )
