"""``save``: training state as a transactional, verified, reshardable checkpoint.

What is stored (see ``layout.py`` and ``transaction.py``): the dense model state and the
plain-format optimizer state keyed by parameter names, split over the ranks' files by
bytes (largest first to the least-loaded rank); sampler, loss-scaler and LR-scheduler state
and ``extra`` (rank 0's) as JSON in the manifest; per rank, the torch CPU generator state
(a byte tensor), Python's ``random`` state (JSON) and the simple form's ``state``. Tensors
are safetensors, everything else JSON: nothing is pickled. The manifest holds each file's
SHA-256 and, per tensor, a SHA-256 per block of at most ``block_bytes`` (``blocks.py``), so
a load can read and verify only the ranges it needs.

Communication (collective: every rank of ``group`` must call ``save`` and ``wait``):
:func:`~plait.checkpoint.agree.gather_json` (two small all-gathers) to agree on the call,
root and step; the strategy's own collectives to build the full state (all-gathers for
ZeroOptimizer's and fully sharded state); one gather to agree the partial directory exists
and the layout and sampler/scaler/scheduler states match; one gather of the write results;
one of the commit result. Bytes: each rank holds the whole dense model and optimizer state
in CPU memory while saving and writes about 1/n of it.

Every rank raises the same error when any rank fails (a dead rank makes the others raise
the group's ``CollectiveError``); a failed save leaves the previous checkpoints intact.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint import layout, owner, transaction
from plait.checkpoint import rng as rng_streams
from plait.checkpoint.agree import (
    SAME_ARGS,
    CheckpointError,
    gather_json,
    raise_failures,
    rank_of,
    require_same,
    resolve,
    size_of,
)
from plait.checkpoint.blocks import BLOCK_BYTES, MIN_BLOCK_BYTES
from plait.comm.group import Group


class SaveHandle:
    """A save under way. :meth:`wait` finishes it (collective: every rank must call it,
    or the next ``save``/``load`` does); it raises what went wrong on any rank."""

    def __init__(self, job: _SaveJob, thread: threading.Thread | None) -> None:
        self._job = job
        self._thread = thread
        self._result: Path | None = None
        self._error: BaseException | None = None

    @property
    def path(self) -> Path:
        return self._job.root / transaction.step_name(self._job.step)

    def done(self) -> bool:
        """True once this rank's file is written (the commit still needs :meth:`wait`)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Finish the save: agree with the other ranks and commit. Returns the committed
        directory. Collective. Raises :class:`CheckpointError` if any rank failed."""
        global _pending
        if _pending is self:
            _pending = None
        if self._error is not None:
            raise self._error
        if self._result is None:
            if self._thread is not None:
                self._thread.join()
            try:
                self._result = self._job.finish()
            except BaseException as exc:
                self._error = exc
                raise
        return self._result


_pending: SaveHandle | None = None


def finish_pending() -> None:
    """Finish this process's asynchronous save still under way, if any. Collective."""
    if _pending is not None:
        _pending.wait()


@atexit.register
def _warn_uncommitted() -> None:
    if _pending is not None:
        warnings.warn(
            f"plait.checkpoint: the asynchronous save of {_pending.path} was never committed "
            f"(call handle.wait() on every rank before exiting); it stays uncommitted and "
            f"is never loaded",
            stacklevel=1,
        )


@dataclass
class _SaveJob:
    root: Path
    step: int
    group: Group | None
    partial: Path
    tensors: dict[str, torch.Tensor]
    body: dict[str, Any]
    keep_last: int | None
    block_bytes: int = BLOCK_BYTES
    written: dict[str, Any] | None = None

    def write(self) -> None:
        rank = rank_of(self.group)
        try:
            self.written = transaction.write_part(
                self.partial, rank, size_of(self.group), self.tensors, block_bytes=self.block_bytes
            )
        except Exception as exc:  # reported to every rank by finish()
            self.written = {"error": f"writing {self.partial}: {type(exc).__name__}: {exc}"}
        except BaseException as exc:  # SystemExit/KeyboardInterrupt in a writer thread
            self.written = {"error": f"writing {self.partial}: {type(exc).__name__}: {exc}"}
            raise
        finally:
            self.tensors = {}

    def finish(self) -> Path:
        g, rank = self.group, rank_of(self.group)
        assert self.written is not None
        statuses = gather_json(self.written, g)
        if any(s.get("error") for s in statuses):
            if rank == 0:
                transaction.abort(self.root, self.step)
            raise_failures(
                f"checkpoint.save of {transaction.step_name(self.step)} under {self.root}",
                statuses,
                kind=CheckpointError,
            )
        status: dict[str, Any] = {}
        if rank == 0:
            body = dict(self.body)
            body["files"] = {
                s["file"]: {"rank": r, **{k: v for k, v in s.items() if k != "file"}}
                for r, s in enumerate(statuses)
            }
            try:
                transaction.commit(self.root, self.step, body, keep_last=self.keep_last)
            except Exception as exc:
                transaction.abort(self.root, self.step)
                status = {"error": f"committing: {type(exc).__name__}: {exc}"}
        raise_failures(
            f"checkpoint.save of {transaction.step_name(self.step)} under {self.root}",
            gather_json(status, g),
            kind=CheckpointError,
        )
        return self.root / transaction.step_name(self.step)


def save(
    root: str | Path,
    state: dict[str, Any] | None = None,
    *,
    step: int | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scaler: Any = None,
    scheduler: Any = None,
    extra: Any = None,
    group: Group | None = None,
    keep_last: int | None = 3,
    rng: bool = True,
    async_: bool = False,
    block_bytes: int = BLOCK_BYTES,
) -> SaveHandle:
    """Save a checkpoint as ``root/step-<step>/``, atomically; collective over ``group``.

    ``model``: plain, DDP, naive-DP, ZeRO (the model itself) or ``fully_shard`` model;
    its dense state dict is saved. ``optimizer``: its state, keyed by the model's parameter
    names (needs ``model``); a ZeroOptimizer's consolidated state. ``sampler``/``scaler``:
    objects with a JSON-able ``state_dict()`` (e.g. ``plait.DistributedSampler``,
    ``plait.amp.DynamicLossScaler``); every rank must hold the same state. ``scheduler``:
    an LR scheduler (its ``state_dict()``, a JSON tree; the same on every rank). ``extra``: a
    JSON tree (tensor leaves allowed) from rank 0. ``state`` (the simple form,
    ``save(directory, state)``): this rank's own dict of tensors and JSON values, loaded
    back only by the same rank at the same world size; ``step`` defaults to 0 then.
    ``keep_last``: committed checkpoints kept (None: all). ``rng``: save each rank's torch
    CPU generator and Python ``random`` states. ``block_bytes``: the size of the blocks
    checksummed one by one (SHA-256 each, in the manifest), the unit in which a load that
    needs part of a tensor reads and verifies it: smaller blocks read less around each
    slice and make the manifest larger (64 hex digits per block). Default 1 MiB; a tensor
    under 64 such blocks gets finer ones (about 64, not under 16 KiB: ``blocks.block_size``).

    ``async_=True``: the state is captured (copied) now, the file written by a background
    thread; the returned handle's ``wait()`` (or the next save/load) commits it. Without
    it, the save is committed when ``save`` returns. Raises :class:`CheckpointMismatch`
    when ranks pass different roots or steps, :class:`CheckpointError` naming the ranks
    when writing or committing fails on any of them (on every rank; the partial save is
    removed and never loaded).
    """
    global _pending
    finish_pending()
    g = resolve(group)
    rank, world_size = rank_of(g), size_of(g)
    if step is None:
        if state is None:
            raise TypeError("checkpoint.save: pass step=<int> (the training step being saved)")
        step = 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint.save: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(
            f"checkpoint.save: keep_last must be an int >= 1 or None, got {keep_last!r}"
        )
    if not isinstance(block_bytes, int) or block_bytes < MIN_BLOCK_BYTES:
        raise ValueError(
            f"checkpoint.save: block_bytes must be an int >= {MIN_BLOCK_BYTES}, got {block_bytes!r}"
        )
    if optimizer is not None and model is None:
        raise ValueError(
            "checkpoint.save: optimizer state is keyed by the model's parameter names; pass "
            "model= too"
        )
    path = Path(root).resolve()
    require_same(
        "checkpoint.save",
        "the call, checkpoint root and step",
        gather_json({"call": "save", "root": str(path), "step": step}, g),
        hint=SAME_ARGS,
    )

    # the strategies' collectives first, in the same order on every rank
    full = layout.full_state_dict(model) if model is not None else None
    plain = None
    if optimizer is not None and model is not None:
        plain = layout.optimizer_state(model, optimizer)
    # then only local work: a failure is reported to every rank by the next gather
    failure: Exception | None = None
    try:
        body, tensors, prepared = _capture(
            step,
            rank,
            world_size,
            model,
            optimizer,
            full,
            plain,
            sampler,
            scaler,
            scheduler,
            extra,
            state,
            rng,
        )
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            owner.claim(path)  # before anything in the root is touched
            try:
                transaction.prepare(path, step)
            except OSError as exc:
                prepared["error"] = f"creating {transaction.partial_dir(path, step)}: {exc}"
    except Exception as exc:
        failure = exc
        prepared = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = gather_json(prepared, g)
    if failure is not None:
        raise failure
    raise_failures("checkpoint.save", everyone, kind=CheckpointError)
    for what, hint in (
        ("layout", "every rank must save the same model and optimizer (names, shapes, dtypes)"),
        ("sampler", "the ranks' samplers are at different positions: step them in lockstep"),
        ("scaler", "the ranks' loss scalers differ: give them the same group"),
        ("scheduler", "the ranks' LR schedulers differ: step them in lockstep"),
    ):
        require_same(
            f"checkpoint.save: {what}",
            f"the {what} state",
            [e["agreed"][what] for e in everyone],
            hint=hint,
        )
    files = dict(body.pop("tensors"))
    for r, e in enumerate(everyone):
        files.update({k: transaction.part_name(r, world_size) for k in e["local"]})
    body["tensors"] = files
    body["ranks"] = [e["mine"] for e in everyone]

    job = _SaveJob(
        path, step, g, transaction.partial_dir(path, step), tensors, body, keep_last, block_bytes
    )
    if not async_:
        job.write()
        handle = SaveHandle(job, None)
        handle.wait()
        return handle
    thread = threading.Thread(target=job.write, name=f"plait-save-step-{step}", daemon=True)
    thread.start()
    handle = SaveHandle(job, thread)
    _pending = handle
    return handle


def _capture(
    step: int,
    rank: int,
    world_size: int,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    full: dict[str, torch.Tensor] | None,
    plain: dict[str, Any] | None,
    sampler: Any,
    scaler: Any,
    scheduler: Any,
    extra: Any,
    state: dict[str, Any] | None,
    rng: bool,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """The manifest body, this rank's tensors (copies) and what it tells the others."""
    shared: dict[str, torch.Tensor] = {}
    local: dict[str, torch.Tensor] = {}
    body: dict[str, Any] = {"format": transaction.FORMAT, "step": step, "world_size": world_size}
    if full is not None:
        body["model"] = list(full)
        for key, value in full.items():
            shared[f"model/{key}"] = value.detach().cpu().contiguous().clone()
    if optimizer is not None and plain is not None:
        assert model is not None
        groups = layout.optimizer_groups(model, optimizer)
        body["optimizer"] = layout.encode_optimizer(
            plain, groups, shared, local if rank == 0 else {}
        )
        body["optimizer_class"] = type(optimizer).__name__
    if extra is not None:
        body["extra"] = layout.encode_tree(extra, "extra", local if rank == 0 else {})
    mine: dict[str, Any] = {}
    if rng:
        local[f"rng/torch/{rank}"] = torch.get_rng_state()
        mine["python_random"] = rng_streams.python_state()
    if state is not None:
        mine["state"] = layout.encode_tree(state, f"rank{rank}", local)
    agreed = {
        "layout": hashlib.sha256(
            json.dumps(
                [[k, list(t.shape), str(t.dtype)] for k, t in sorted(shared.items())]
            ).encode()
        ).hexdigest(),
        "sampler": sampler.state_dict() if sampler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "scheduler": None,
    }
    if scheduler is not None:
        agreed["scheduler"] = layout.encode_tree(
            scheduler.state_dict(), "scheduler", local if rank == 0 else {}
        )
        body["scheduler"] = agreed["scheduler"]
    if sampler is not None:
        body["sampler"] = agreed["sampler"]
    if scaler is not None:
        body["scaler"] = agreed["scaler"]
    owners = layout.balanced_split(shared, world_size)
    body["tensors"] = {
        k: transaction.part_name(r, world_size) for r, keys in enumerate(owners) for k in keys
    }
    tensors = {k: shared[k] for k in owners[rank]}
    tensors.update(local)
    return body, tensors, {"agreed": agreed, "mine": mine, "local": sorted(local)}
