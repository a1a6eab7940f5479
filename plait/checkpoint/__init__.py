"""Checkpoints: transactional, verified, and loadable at any world size and strategy.

``save(root, step=N, model=..., optimizer=..., sampler=..., scaler=..., extra=...)``
writes ``root/step-N/`` as a transaction (``transaction.py``): every rank writes its
safetensors file into ``step-N.partial/``, the coordinator writes ``manifest.json`` (a
SHA-256 per file) last, renames the directory and only then points ``root/latest`` at it;
``keep_last`` older steps are kept; the manifest also holds a SHA-256 per 1 MiB block of
every tensor (``blocks.py``). ``load(root, model=..., optimizer=..., ...)`` reads on each
rank only the blocks holding what that rank keeps (``needs.py``: 1/W' of the tensors under
FSDP and ZeRO-1/2, all of them under DDP), verifies each, and refuses a damaged checkpoint
naming the file, rank, tensor and block, or with ``fallback=True`` loads the previous good
one. Ranks must agree on root and step (checked). One job per root (``owner.py``): a
second job saving into a root whose owner still runs is refused naming both jobs.

The content is layout-neutral (``layout.py``): the dense model state and the plain-format
optimizer state keyed by parameter names, so a checkpoint saved by DDP, ZeRO-1/2 or FSDP at
one world size loads into any of them at another. See ``writer.py`` and ``reader.py`` for
the communication and memory contract, and :func:`load` (``rng.py``) for the RNG rule at
another world size (ranks the saving run had continue their streams, new ranks get streams
derived from the checkpoint).

Resuming (``root`` must be on a filesystem every rank sees; a rank that cannot write into
the coordinator's directory fails the save on every rank)::

    try:
        start = checkpoint.load(root, model=model, optimizer=optimizer, sampler=sampler).step
    except FileNotFoundError:  # no committed checkpoint yet
        start = 0
    for step in range(start, steps):
        ...
        if step % every == 0:
            checkpoint.save(root, step=step + 1, model=model, optimizer=optimizer,
                            sampler=sampler)

The simple form ``save(directory, state)`` / ``load(directory)["key"]`` keeps one dict per
rank (same world size to load) with the same transaction and checks. :func:`full_state_dict`
returns the unsharded model state dict from any strategy (its own keys and full shapes,
``full.py``); :func:`verify` checks a committed checkpoint's files from any single process.

Hugging Face-style files (``pretrained.py``): :func:`load_pretrained` reads
``model.safetensors`` (or an index and its shards) into a model prepared under any
strategy, each rank reading only the slices it keeps; :func:`save_pretrained` writes one
from any layout that ``transformers``' ``from_pretrained`` reads. :func:`parameter_counts`
says how many parameter elements the whole model has and how many this rank holds.
"""

from __future__ import annotations

from plait.checkpoint.agree import CheckpointCorrupt, CheckpointError, CheckpointMismatch
from plait.checkpoint.files import save_atomic, write_bytes_atomic
from plait.checkpoint.kept import ParameterCounts, parameter_counts
from plait.checkpoint.layout import full_state_dict
from plait.checkpoint.owner import OwnedByAnotherJob
from plait.checkpoint.pretrained import PretrainedLoad, load_pretrained, save_pretrained
from plait.checkpoint.reader import Restored, load
from plait.checkpoint.transaction import committed_steps, read_latest, verify
from plait.checkpoint.writer import SaveHandle, save

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "OwnedByAnotherJob",
    "ParameterCounts",
    "PretrainedLoad",
    "Restored",
    "SaveHandle",
    "committed_steps",
    "full_state_dict",
    "load",
    "load_pretrained",
    "parameter_counts",
    "read_latest",
    "save",
    "save_atomic",
    "save_pretrained",
    "verify",
    "write_bytes_atomic",
]
