"""Durable files: fsync of files and directories, atomic replacement, checksums.

A file that must appear whole is written to a temporary name in the same directory,
flushed to disk, and renamed over its final name (``os.replace`` is atomic on one
filesystem); the directory is then fsynced so the rename itself survives a crash. Files
inside a checkpoint being written (``step-<N>.partial/``) need no rename of their own: the
whole directory is renamed when complete (see ``transaction.py``).

No communication.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHUNK = 1 << 20  # bytes per write() call


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def write_durable(
    path: Path, data: bytes, *, after_first_chunk: Callable[[], None] | None = None
) -> str:
    """Write ``data`` to ``path`` (created or truncated) and fsync it; return its SHA-256.

    ``after_first_chunk`` runs once the first chunk is written (fault-injection point:
    a process killed there leaves a torn file). Errors (``ENOSPC``...) propagate; the
    caller decides what becomes of the torn file.
    """
    view = memoryview(data)
    with open(path, "wb") as f:
        for start in range(0, max(len(view), 1), CHUNK):
            f.write(view[start : start + CHUNK])
            if start == 0 and after_first_chunk is not None:
                f.flush()
                after_first_chunk()
        f.flush()
        os.fsync(f.fileno())
    return sha256_bytes(view)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``, atomically and durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically (used by the parameter server's own
    snapshots; training checkpoints use :func:`plait.checkpoint.save`, without pickle)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes_atomic(path, buffer.getvalue())
