"""The directory protocol that makes a checkpoint a transaction.

Layout under a checkpoint *root*::

    root/
      step-40/               a committed checkpoint: never modified after its rename
        manifest.json        written last; lists every file with its writer rank, size, SHA-256,
                             its header's SHA-256 and a SHA-256 per block of every tensor
        part-0-of-2.safetensors, part-1-of-2.safetensors
      step-50/
      step-60.partial/       a save under way, or one that died: never selected by a load
      latest                 "step-50": the last committed step (atomically replaced)

A save writes into ``step-<N>.partial/`` (every file fsynced), then the coordinator (group
rank 0) writes ``manifest.json`` into it, fsyncs the directory, renames it to ``step-<N>``
(atomic), fsyncs the root, and only then replaces ``latest``. A crash at any point leaves
either the previous state or the new checkpoint, complete. Saving a step that exists
already moves the old directory to ``step-<N>.replaced`` just before the rename and removes
it afterwards. ``keep_last`` prunes the oldest committed steps after the commit.

A committed directory is one named ``step-<N>`` holding ``manifest.json``. The manifest
carries its own SHA-256 (``checksum``, over its other fields), so a damaged manifest is
refused too. Nothing here communicates; ``writer.py`` and ``reader.py`` run it on
the right ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.agree import CheckpointCorrupt
from plait.checkpoint.blocks import BLOCK_BYTES, describe
from plait.checkpoint.files import fsync_dir, sha256_bytes, write_bytes_atomic, write_durable

FORMAT = "plait-checkpoint-v3"
#: formats ``load`` reads: v2 has a SHA-256 per file only (its files are read whole)
FORMATS = ("plait-checkpoint-v2", FORMAT)
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")

#: Fault injection for tests: called with ``"write"`` on every rank after the first chunk
#: of its file is written, and ``"rename"`` on the coordinator between writing the
#: manifest and the rename. None in normal use.
FAULT_HOOK: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(name)


def step_name(step: int) -> str:
    return f"step-{step}"


def part_name(rank: int, world_size: int) -> str:
    return f"part-{rank}-of-{world_size}.safetensors"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.partial"


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, newest (largest) first."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = STEP_RE.match(entry.name)
        if m and (entry / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def uncommitted(root: Path) -> list[str]:
    """Names of directories under ``root`` that look like checkpoints but are not committed."""
    if not root.is_dir():
        return []
    names = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and entry.name.startswith("step-"):
            if not (STEP_RE.match(entry.name) and (entry / MANIFEST).is_file()):
                names.append(entry.name)
    return names


def read_latest(root: Path) -> int | None:
    """The step ``latest`` names, if that checkpoint is committed; else None."""
    try:
        text = (root / LATEST).read_text().strip()
    except OSError:
        return None
    m = STEP_RE.match(text)
    if m is None or not (root / text / MANIFEST).is_file():
        return None
    return int(m.group(1))


def candidates(root: Path, step: int | str) -> list[int]:
    """The step to load, then the older committed ones (the fallbacks), newest first.

    ``"latest"``: the step ``latest`` names, else the newest committed one. An explicit
    step that is not committed is still listed first (its load fails and names why).
    """
    steps = committed_steps(root)
    if step == "latest":
        first = read_latest(root)
        if first is None:
            return steps
    else:
        first = int(step)
    return [first, *[s for s in steps if s < first]]


# --- the manifest ------------------------------------------------------------------------
def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def manifest_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps({**body, "checksum": _digest(body)}, indent=1, sort_keys=True).encode()


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"{path} is missing: {directory.name} is not a committed checkpoint"
        ) from None
    try:
        manifest = json.loads(text)
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        ok = manifest.get("checksum") == _digest(body)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointCorrupt(
            f"{path} (written by rank 0) is damaged: it is not valid JSON or does not match "
            f"its own checksum"
        )
    if manifest.get("format") not in FORMATS:
        raise CheckpointCorrupt(
            f"{path}: unknown checkpoint format {manifest.get('format')!r}; this plait reads "
            f"{list(FORMATS)}"
        )
    return body


def read_files(
    directory: Path, manifest: dict[str, Any], names: list[str], reader: int
) -> dict[str, torch.Tensor]:
    """The tensors of files ``names`` of a committed checkpoint, each verified against the
    size and SHA-256 in the manifest; :class:`CheckpointCorrupt` names the first bad file,
    the rank that wrote it and the rank ``reader`` that found it."""
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        entry = manifest["files"][name]
        path = directory / name
        who = f"{path} (written by rank {entry['rank']}, read by rank {reader})"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{who} is missing") from None
        if len(data) != entry["bytes"]:
            raise CheckpointCorrupt(
                f"{who} has {len(data)} bytes, the manifest says {entry['bytes']}: truncated "
                f"or overwritten"
            )
        if sha256_bytes(data) != entry["sha256"]:
            raise CheckpointCorrupt(f"{who} does not match its SHA-256 in the manifest")
        tensors.update(_safetensors().load(data))
    return tensors


def _safetensors() -> Any:
    """``safetensors.torch``, imported when a checkpoint is read or written: importing plait
    needs torch only (a lent GPU machine has nothing else)."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "plait.checkpoint writes and reads safetensors files: pip install safetensors"
        ) from exc
    return safetensors.torch


# --- writing and committing ----------------------------------------------------------------
def prepare(root: Path, step: int) -> Path:
    """Coordinator: create ``step-<N>.partial/`` afresh, removing stale partial saves. A
    ``step-<N>.replaced/`` left by a crash in the middle of replacing step N is renamed
    back when no ``step-<N>/`` took its place (it is the only copy), else removed."""
    root.mkdir(parents=True, exist_ok=True)
    for name in uncommitted(root):
        if name.endswith(".replaced"):
            original = root / name.removesuffix(".replaced")
            if not original.exists() and (root / name / MANIFEST).is_file():
                os.rename(root / name, original)
            else:
                shutil.rmtree(root / name, ignore_errors=True)
        elif name.endswith(".partial"):
            shutil.rmtree(root / name, ignore_errors=True)
    partial = partial_dir(root, step)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    fsync_dir(root)
    return partial


def write_part(
    partial: Path,
    rank: int,
    world_size: int,
    tensors: dict[str, torch.Tensor],
    *,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, Any]:
    """Write this rank's file into the partial directory; its name, size and SHA-256, its
    header's size and SHA-256, and the SHA-256 of every ``block_bytes`` block of every
    tensor (``blocks.describe``)."""
    data = _safetensors().save(tensors)
    name = part_name(rank, world_size)
    sha = write_durable(partial / name, data, after_first_chunk=lambda: fault_point("write"))
    return {"file": name, "bytes": len(data), "sha256": sha, **describe(data, block_bytes)}


def commit(root: Path, step: int, body: dict[str, Any], *, keep_last: int | None) -> Path:
    """Coordinator: manifest last, atomic rename, then ``latest``, then pruning."""
    partial = partial_dir(root, step)
    write_durable(partial / MANIFEST, manifest_bytes(body))
    fsync_dir(partial)
    fault_point("rename")
    final = root / step_name(step)
    replaced = root / f"{step_name(step)}.replaced"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(partial, final)
    fsync_dir(root)
    write_bytes_atomic(root / LATEST, f"{step_name(step)}\n".encode())
    shutil.rmtree(replaced, ignore_errors=True)
    if keep_last is not None:
        for old in committed_steps(root)[keep_last:]:
            if old != step:
                shutil.rmtree(root / step_name(old), ignore_errors=True)
    return final


def abort(root: Path, step: int) -> None:
    """Coordinator: remove a partial save (best effort; a leftover is never selected)."""
    shutil.rmtree(partial_dir(root, step), ignore_errors=True)


def verify(root: str | Path, step: int | str = "latest") -> list[str]:
    """Check one committed checkpoint under ``root`` (its manifest checksum, then every
    file's size and SHA-256); the problems found, empty if it is intact. Reads every file
    whole. No communication: any single process may call it. A directory written by
    ``torch.distributed.checkpoint`` (holding ``.metadata``) is checked for completeness
    instead (``dcp_verify.py``: DCP stores no checksums)."""
    path = Path(root)
    from plait.checkpoint import dcp_verify  # deferred: it imports torch's DCP

    if dcp_verify.is_dcp(path):
        return dcp_verify.verify_dcp(path)
    steps = candidates(path, step)
    if not steps:
        return [f"{path} holds no committed checkpoint"]
    directory = path / step_name(steps[0])
    try:
        manifest = read_manifest(directory)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    problems = []
    for name in sorted(manifest["files"]):
        try:
            read_files(directory, manifest, [name], reader=-1)
        except CheckpointCorrupt as exc:
            problems.append(str(exc).replace(", read by rank -1", ""))
    return problems
